"""kungfu.torch in real processes (the spawn fixture): collectives against numpy, parameter
broadcast, the synchronous optimizers against one process trained on the whole batch, a model
that differs between workers, and examples/torch_digits.py under the launcher."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="kungfu.torch needs torch (pip install kungfu[torch])")

import _w_torch as w  # noqa: E402

NP_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_numpy(spawn, n):
    results = spawn(n, w.collectives)
    for dtype in w.DTYPES:
        stacked = np.stack([w.inputs(r, dtype) for r in range(n)])
        for op in w.OPS:
            want = NP_REDUCE[op](stacked, axis=0)
            for r in range(n):
                np.testing.assert_array_equal(results[r][dtype, op], want, f"{dtype} {op}")
                np.testing.assert_array_equal(results[r][dtype, op, "in place"], want)
    f32 = np.stack([w.inputs(r, "float32") for r in range(n)])
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got["transposed fn"], f32.sum(0).T)
        np.testing.assert_array_equal(got["transposed base"], f32.sum(0))
        values, same_object, requires_grad = got["param"]
        np.testing.assert_array_equal(
            values, np.stack([w.inputs(q, "float64") for q in range(n)]).mean(0))
        assert same_object and requires_grad
        np.testing.assert_array_equal(
            got["async"][0], np.stack([w.inputs(q, "int64") for q in range(n)]).max(0))
        assert got["async"][1]
        np.testing.assert_array_equal(got["gather"], f32)  # stacked on a new leading dim
        np.testing.assert_array_equal(got["broadcast"], w.inputs(n - 1, "int32"))
        assert got["complex"].startswith("InvalidArgumentError") and "complex64" in got["complex"]


def test_broadcast_parameters_copies_roots_state_dict(spawn):
    (before0, after0), (before1, after1) = spawn(2, w.broadcast_state)
    assert not np.array_equal(before0["0.weight"], before1["0.weight"])
    assert not np.array_equal(before0["1.running_mean"], before1["1.running_mean"])
    for after in (after0, after1):
        assert after.keys() == before0.keys()
        for k in before0:
            np.testing.assert_array_equal(after[k], before0[k], k)


# Bucket sizes: 80 bytes, buckets of several parameters and of one (in backward order; the
# MLP's float64 b2, w2, b1, w1 are 8, 64, 64 and 320 bytes: [b2, w2], [b1], [w1]; partial_grads'
# [c.bias, c.weight, b.bias], [b.weight, a.bias, a.weight], which mix parameters used
# everywhere, on one worker and nowhere); the default (one bucket for all).
BUCKETS = [80, None]


@pytest.mark.parametrize("n,bucket_bytes", [(2, 80), (3, None)])
def test_synchronous_sgd_matches_one_process_on_the_whole_batch(spawn, n, bucket_bytes):
    steps, momentum = 5, 0.9
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    ranks = spawn(n, w.train, "sgd", steps, momentum, kwargs=options)
    reference = w.train_reference(n, steps, momentum)
    initial = [p.detach().numpy() for p in w.mlp(seed=0).parameters()]
    for params in ranks:
        for got, first, want, ref in zip(params, ranks[0], reference, initial):
            assert got.tobytes() == first.tobytes()  # bit-identical on every rank
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
            assert not np.allclose(got, ref)  # it did train


def test_synchronous_averaging_with_plain_sgd_matches_one_process(spawn):
    # Without momentum, averaging the weights after each local step equals averaging gradients.
    ranks = spawn(2, w.train, "sma", 4, 0.0)
    reference = w.train_reference(2, 4, 0.0)
    for params in ranks:
        for got, first, want in zip(params, ranks[0], reference):
            assert got.tobytes() == first.tobytes()
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_pair_averaging_pulls_the_models_together(spawn):
    # lr 0: only the averaging moves the weights. Every value stays a mean of the workers'
    # initial values (inside their range), and the spread between the workers shrinks.
    n, steps = 3, 12
    results = spawn(n, w.pair_averaging, 0.0, steps)
    for i in range(len(results[0][0])):
        start = np.stack([res[0][i] for res in results])
        end = np.stack([res[1][i] for res in results])
        assert (end >= start.min(0) - 1e-12).all() and (end <= start.max(0) + 1e-12).all()
        assert np.ptp(end, axis=0).max() < 0.1 * np.ptp(start, axis=0).max(), i


def test_pair_averaging_trains(spawn):
    # Asynchronous: which saved model a worker fetches depends on timing, so the losses differ
    # from run to run; each worker's loss must fall well below its untrained model's.
    results = spawn(2, w.pair_averaging, 0.1, 30)
    for _, _, losses in results:
        assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_gradients_missing_on_some_workers(spawn, bucket_bytes):
    results = spawn(3, w.partial_grads, bucket_bytes)
    for got in results:
        # a's gradient: each rank's x = (r + 1) * ones, averaged over the 3 ranks
        np.testing.assert_array_equal(got["a"], np.full((2, 2), 2.0))
        # b had a gradient on rank 0 only: the others count as zeros in the average
        np.testing.assert_array_equal(got["b"], results[0]["b local"] / 3)
        # c had none anywhere: it keeps None and is not stepped (weight decay would move it)
        assert got["c grad"] is None and not got["c changed"]


@pytest.mark.parametrize("where", ["optimizer", "broadcast"])
def test_a_worker_with_another_model_fails_clearly(spawn, where):
    for message in spawn(2, w.mismatched_model, where):
        assert message.startswith("InvalidArgumentError"), message
        assert "rank 0: 2 tensors" in message and "rank 1: 4 tensors" in message, message


def _run_example(script: str, *args: str) -> str:
    """examples/<script> under the launcher at np 2, as a user runs it; the output of both
    ranks, after checking that they end with the same weights."""
    pytest.importorskip("sklearn", reason=f"examples/{script} needs scikit-learn")
    from conftest import REPO_ROOT, free_port_range

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "kungfu.cmd", "-np", "2", "-port-range", free_port_range(2),
           "-timeout", "100s", sys.executable, os.path.join(REPO_ROOT, "examples", script),
           *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=110,
                       check=False)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    digests = dict(re.findall(r"rank (\d+): final weights digest ([0-9a-f]{16})", r.stdout))
    assert sorted(digests) == ["0", "1"], r.stdout[-3000:]
    assert len(set(digests.values())) == 1, digests
    return r.stdout


def test_torch_digits_example_two_workers():
    out = _run_example("torch_digits.py", "--epochs", "3")
    accuracy = re.search(r"rank 0: test accuracy ([0-9.]+)", out)
    assert accuracy and float(accuracy.group(1)) > 0.85, out[-3000:]


def test_horovods_mnist_example_in_kungfus_names():
    """examples/torch_mnist.py, Horovod's pytorch_mnist.py in kungfu's names, with its
    --fp16-allreduce and --gradient-predivide-factor flags."""
    out = _run_example("torch_mnist.py", "--epochs", "2", "--lr", "0.05", "--fp16-allreduce",
                       "--gradient-predivide-factor", "2")
    accuracy = [float(a) for a in re.findall(r"\[0\] Test set: .* Accuracy: ([0-9.]+)%", out)]
    assert len(accuracy) == 2 and accuracy[-1] > 60, out[-3000:]
    # each rank trains on its DistributedSampler half: 674 of the 1,347 training images
    assert re.search(r"\[1\] Train Epoch: 2 \[0/674\]", out), out[-3000:]
