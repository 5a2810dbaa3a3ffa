"""Data-parallel PyTorch training with kungfu.torch: a small MLP on scikit-learn's digits.

    kungfu-run -np 2 python examples/torch_digits.py     # 2 workers on this host
    python examples/torch_digits.py                        # a single worker

The digits data set (1,797 8x8 images of the digits 0-9) ships inside scikit-learn, so nothing
is downloaded. Every worker:

  * splits the same data the same way into training and held-out test sets (fixed seed),
  * trains on its own shard of the training set (samples rank, rank + size, ...),
  * starts from rank 0's initial weights (`broadcast_parameters`): the workers seed their
    initialisation differently on purpose, and the broadcast makes them agree,
  * wraps its optimizer in `SynchronousSGDOptimizer`: each gradient is averaged over the workers
    as soon as backward has made it, and step() waits for the averages before it applies them.

Rank 0 prints the test accuracy; every rank prints a digest of its final weights, the same on
every rank when the workers stayed in step.
"""
from __future__ import annotations

import argparse
import hashlib

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kungfu.torch as kf


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args()


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    args = parse_args()
    rank, size = kf.rank(), kf.size()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    x_shard = torch.from_numpy(x_train[rank::size])
    y_shard = torch.from_numpy(y_train[rank::size]).long()

    torch.manual_seed(rank)  # differs per rank: broadcast_parameters makes the workers agree
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    kf.broadcast_parameters(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = kf.optimizers.SynchronousSGDOptimizer(optimizer, model.named_parameters())

    # Every worker takes the same number of steps per epoch (the smallest shard's), so that the
    # collectives of every step pair up.
    steps = int(kf.all_reduce_fn(torch.tensor(len(x_shard) // args.batch_size), "min"))
    order = torch.Generator().manual_seed(1000 + rank)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_shard), generator=order)
        for s in range(steps):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_shard[idx]), y_shard[idx])
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)

    print(f"rank {rank}: final weights digest {weights_digest(model)}", flush=True)
    if rank == 0:
        with torch.no_grad():
            predicted = model(torch.from_numpy(x_test)).argmax(1).numpy()
        accuracy = float((predicted == y_test).mean())
        print(f"rank 0: test accuracy {accuracy:.4f} ({len(x_test)} held-out samples, "
              f"{size} workers)", flush=True)


if __name__ == "__main__":
    main()
