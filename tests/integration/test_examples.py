"""The example training scripts, run under the launcher as a user would run them.

Each example trains the digits CNN on 2 workers (`python -m kungfu.cmd -np 2 ...`) for a few
epochs. The tests check the held-out test accuracy rank 0 prints and that every rank ends with
the same weights: the workers seed their initial weights differently, so equal final weights need
both the initial broadcast and the gradient averaging to work.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port_range  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
EXAMPLES = REPO / "examples"

# Checked without importing TensorFlow here (the examples run in their own processes).
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("tensorflow", "keras", "sklearn")),
    reason="the examples need tensorflow, keras and scikit-learn")

DIGEST = re.compile(r"\[(\d+)\] rank (\d+): final weights digest ([0-9a-f]{16})")
ACCURACY = re.compile(r"\[0\] test accuracy: ([0-9.]+) ")


def run_example(script: str, np_: int, *args: str, timeout: float = 80) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [PY, "-m", "kungfu.cmd", "-np", str(np_), "-port-range", free_port_range(np_),
           "-timeout", f"{int(timeout) - 5}s", PY, str(EXAMPLES / script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                       timeout=timeout, check=False)
    assert r.returncode == 0, (
        f"{cmd} exited with {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def check_output(out: str, np_: int, min_accuracy: float) -> None:
    digests = {}
    for prefix, rank, digest in DIGEST.findall(out):
        assert prefix == rank, f"rank {rank} printed under the prefix of rank {prefix}"
        digests[int(rank)] = digest
    assert sorted(digests) == list(range(np_)), f"not every rank printed a digest:\n{out}"
    assert len(set(digests.values())) == 1, f"final weights differ between ranks: {digests}"
    found = ACCURACY.findall(out)
    assert len(found) == 1, f"rank 0 should print the test accuracy once:\n{out}"
    accuracy = float(found[0])
    assert min_accuracy < accuracy <= 1.0, f"test accuracy {accuracy} <= {min_accuracy}\n{out}"


@pytest.mark.timeout(90)
def test_keras_digits_two_workers():
    out = run_example("keras_digits.py", 2, "--epochs", "6", "--min-accuracy", "0.9")
    check_output(out, 2, 0.9)
    # 1437 training samples: 718 per worker, 23 steps of at most 32 per epoch.
    assert "workers: 2, training samples: 1437 (718 per worker)" in out


@pytest.mark.timeout(90)
def test_gradient_tape_two_workers():
    out = run_example("gradient_tape.py", 2, "--epochs", "6", "--optimizer", "adam")
    check_output(out, 2, 0.9)
    losses = [float(x) for x in re.findall(r"\[0\] epoch \d+/6: loss ([0-9.]+) \(23 steps\)", out)]
    assert len(losses) == 6, out
    assert losses[-1] < losses[0] / 2, f"the loss should fall: {losses}"


@pytest.mark.timeout(90)
def test_min_accuracy_fails_the_run():
    """--min-accuracy turns a poor result into a failing exit code (one worker, no launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    r = subprocess.run([PY, str(EXAMPLES / "keras_digits.py"), "--epochs", "1", "--lr", "0",
                        "--min-accuracy", "0.95"], capture_output=True, text=True, env=env,
                       cwd=str(REPO), timeout=80, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "workers: 1," in r.stdout
    assert "FAILED: test accuracy" in r.stderr


@pytest.mark.timeout(120)
def test_adaptive_batch_two_workers():
    out = run_example("adaptive_batch.py", 2, "--epochs", "6", "--min-accuracy", "0.9")
    decisions = re.findall(r"\[0\] epoch \d+: gns [0-9.]+ > global batch (\d+): local batch -> "
                           r"(\d+)", out)
    assert decisions, out  # the noise scale grows past the small initial batch
    for global_batch, local in decisions:  # each decision doubles the batch
        assert int(local) == int(global_batch)  # 2 workers: new local = 2 x old local
    finals = re.findall(r"rank (\d): decisions (\d+), final local batch (\d+), weights (\w+)", out)
    assert len(finals) == 2 and finals[0][1:] == finals[1][1:], out
    assert int(finals[0][2]) == 8 * 2 ** len(decisions)
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9
