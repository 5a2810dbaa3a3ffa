"""Horovod's PyTorch MNIST example (examples/pytorch/pytorch_mnist.py) in kungfu.torch's names.

    kungfu-run -np 2 python examples/torch_mnist.py --epochs 3
    python examples/torch_mnist.py                  # a single worker

The program keeps the shape of Horovod's: the same flags, the same network (two 5x5
convolutions, 320 -> 50 -> 10), a DistributedSampler per rank, rank 0's parameters and optimizer
state broadcast before training, the optimizer wrapped for synchronous SGD (optionally with
fp16 compression, a gradient predivide factor, or AMP on a GPU), and the test metrics averaged
over the ranks. Each kungfu call is marked with the Horovod call it stands for. The one change
that is not a name: nothing is downloaded, so MNIST is stood in for by scikit-learn's digits,
8x8 images scaled up to MNIST's 28x28 (1,347 training and 450 test images).

Rank 0 prints the test accuracy after each epoch; every rank prints a digest of its final
weights, the same on every rank when the workers stayed in step.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kungfu.torch as kf  # import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_digits import weights_digest  # noqa: E402  (the digest torch_digits.py prints)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by the size")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU with a GPU present")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10, help="batches between loss lines")
    p.add_argument("--fp16-allreduce", action="store_true", help="average gradients as float16")
    p.add_argument("--use-mixed-precision", action="store_true", help="AMP (needs a GPU)")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    p.add_argument("--use-adasum", action="store_true",
                   help="combine the gradients by Adasum instead of averaging them")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with 1 when the last test accuracy is below this")
    return p.parse_args()


class Net(nn.Module):
    """The network of Horovod's example, for 1x28x28 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_as_mnist(train: bool) -> torch.utils.data.TensorDataset:
    """scikit-learn's digits at MNIST's size and normalisation: each 8x8 pixel becomes 3x3,
    padded by 2 to 28x28, scaled to [0, 1], then MNIST's mean and deviation."""
    digits = load_digits()
    images = np.pad(np.kron(digits.images / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    images = ((images - 0.1307) / 0.3081).astype(np.float32)[:, None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    x, y = (x_train, y_train) if train else (x_test, y_test)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())


def main():
    args = parse_args()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if args.use_mixed_precision and not cuda:
        raise SystemExit("--use-mixed-precision needs a GPU")
    # hvd.init(): nothing to do, the first collective connects
    torch.manual_seed(args.seed)
    if cuda:
        torch.cuda.set_device(0)  # torch.cuda.set_device(hvd.local_rank()): one GPU per worker
    torch.set_num_threads(1)

    rank, size = kf.rank(), kf.size()  # hvd.rank(), hvd.size()
    train_set, test_set = digits_as_mnist(True), digits_as_mnist(False)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=size, rank=rank)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_set, num_replicas=size, rank=rank)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net().cuda() if cuda else Net()
    lr_scaler = 1 if args.use_adasum else size  # Adasum sums where the gradients differ
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)
    kf.broadcast_parameters(model.state_dict(), root=0)  # hvd.broadcast_parameters(.., root_rank=0)
    kf.broadcast_optimizer_state(optimizer, root=0)  # hvd.broadcast_optimizer_state(.., root_rank=0)
    compression = kf.Compression.fp16 if args.fp16_allreduce else kf.Compression.none
    optimizer = kf.optimizers.SynchronousSGDOptimizer(  # hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op="adasum" if args.use_adasum else "avg",  # op=hvd.Adasum if .. else hvd.Average
        gradient_predivide_factor=args.gradient_predivide_factor)
    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision else None

    def train_epoch(epoch: int) -> None:
        model.train()
        train_sampler.set_epoch(epoch)
        for batch, (data, target) in enumerate(train_loader):
            if cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            if scaler is None:
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
            else:  # Horovod's AMP recipe, unchanged
                with torch.autocast("cuda"):
                    loss = F.nll_loss(model(data), target)
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            if batch % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch * len(data)}/{len(train_sampler)}]"
                      f"\tLoss: {loss.item():.6f}", flush=True)

    def metric_average(value: float, name: str) -> float:
        # hvd.allreduce(tensor, name=name), which averages by default
        return kf.all_reduce_fn(torch.tensor(value), op="avg", name=name).item()

    def test() -> float:
        model.eval()
        loss_sum, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                loss_sum += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(1).eq(target).float().sum().item()
        loss = metric_average(loss_sum / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if rank == 0:
            print(f"Test set: Average loss: {loss:.4f}, Accuracy: {100 * accuracy:.2f}%",
                  flush=True)
        return accuracy

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        accuracy = test()
    print(f"rank {rank}: final weights digest {weights_digest(model)}", flush=True)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"FAILED: test accuracy {accuracy:.4f} < {args.min_accuracy}")


if __name__ == "__main__":
    main()
