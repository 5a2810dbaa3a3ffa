"""A PyTorch worker of an elastic job (test_torch_elastic.py runs it under kungfu-run -w): a
small MLP regression trained with kungfu.torch.ElasticTrainer.fit over kf.ElasticData.

    _w_torch_elastic.py OUT [--schedule 3,2] [--gap 3] [--kill RANK@STEP] [--epochs 3]

--schedule: sizes rank 0 asks for (kf.resize from a policy), each once the previous one is in
place and `gap` steps have run at it. --kill: the worker of that rank (in the first cluster)
kills itself (SIGKILL) in that step, after its backward, before the gradients are averaged.
Every worker writes OUT/<host_port>.jsonl: a row per step it trained (step, epoch, rank, size,
pid, time, the samples it trained on, a digest of its weights after the step) and a last row
{"done": ...} with its recoveries.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import numpy as np
import torch

import kungfu as kf
import kungfu.torch as kft

SAMPLES, FEATURES = 240, 6


class Schedule(kf.BasePolicy):
    """Rank 0 asks for the next size once the last one asked for is in place and `gap` steps
    ran at it. `waiting`: a size was asked for and is not in place yet (the steps then slow
    down, so that training does not end before a joiner is ready)."""

    def __init__(self, sizes, gap):
        self.sizes, self.gap = list(sizes), gap
        self.size_seen, self.since, self.target = None, 0, None

    @property
    def waiting(self):
        return self.target is not None and self.size_seen != self.target

    def after_step(self, state):
        if state.cluster_size != self.size_seen:
            self.size_seen, self.since = state.cluster_size, 0
        self.since += 1
        if self.sizes and self.since >= self.gap and not self.waiting:
            self.target = self.sizes.pop(0)
            if state.rank == 0:
                kf.resize(self.target)


class Records:
    """OUT/<host_port>.jsonl, opened at the first record (by then a warm spare has its
    address)."""

    def __init__(self, directory):
        self.directory, self.file = directory, None

    def write(self, text):
        if self.file is None:
            me = os.environ.get("KUNGFU_SELF_SPEC", "single").replace(":", "_")
            self.file = open(os.path.join(self.directory, f"{me}.jsonl"), "a")
        self.file.write(text)
        self.file.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--schedule", default="")
    p.add_argument("--gap", type=int, default=3)
    p.add_argument("--kill", default="")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype(np.float32)
    torch.manual_seed(os.getpid())  # differs per worker: the trainer starts them equal
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = kft.optimizers.SynchronousSGDOptimizer(opt, model.named_parameters())
    data = kft.ElasticData(x, y, batch_size=8, seed=2, record=True)
    sizes = [int(s) for s in args.schedule.split(",") if s]
    schedule = Schedule(sizes, args.gap)
    trainer = kft.ElasticTrainer(model, opt, schedule, data=data)
    kill_rank, kill_step = (int(v) for v in args.kill.split("@")) if args.kill else (-1, -1)
    first_rank = None
    out = Records(args.out)

    def digest():
        return hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                       for t in model.state_dict().values())).hexdigest()[:16]

    def train_step(xb, yb, w):
        nonlocal first_rank
        s = trainer.state
        if first_rank is None:
            first_rank = s.rank if s.step == 0 else -1  # a joiner has no rank of the first cluster
        opt.zero_grad()
        err = model(torch.from_numpy(xb)) - torch.from_numpy(yb)
        loss = (torch.from_numpy(w)[:, None] * err ** 2).mean()
        loss.backward()
        if first_rank == kill_rank and s.step + 1 == kill_step:
            out.write(json.dumps({"fault": 9, "step": s.step + 1}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        time.sleep(0.2 if schedule.waiting else 0.01)
        out.write(json.dumps({
            "step": s.step + 1, "epoch": s.epoch, "rank": s.rank, "size": s.cluster_size,
            "pid": os.getpid(), "t": time.time(), "served": data.served[-1].tolist(),
            "digest": digest(), "loss": loss.item()}) + "\n")
        return loss

    trainer.fit(train_step, epochs=args.epochs)
    out.write(json.dumps({"done": True, "step": trainer.state.step, "epoch": trainer.state.epoch,
                          "size": kf.size(), "digest": digest(),
                          "recoveries": trainer.recoveries, "logs": trainer.logs}) + "\n")


if __name__ == "__main__":
    main()
