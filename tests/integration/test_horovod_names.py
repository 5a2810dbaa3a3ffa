"""The Horovod names users reach for, with real workers at np 2: DistributedGradientTape,
kf.Optimizer(..., backward_passes_per_step=k), LearningRateScheduleCallback, and mixed
precision (Keras's LossScaleOptimizer around kf.Optimizer or inside it) when one worker's
gradients overflow first."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import _w_horovod_names as W  # noqa: E402
from _w_in_turn import in_turn  # noqa: E402
from conftest import REPO_ROOT as REPO, free_port_range  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "KUNGFU_OP_TIMEOUT": "30s"}


def test_distributed_gradient_tape(spawn):
    outs = spawn(2, W.tape_checks, env=ENV, timeout=120)
    for o in outs:
        expected = [np.array(e) for e in o["expected"]]
        # gradient() is the average of every worker's local gradients, wrapped before or after
        # recording, eager or traced, in the structure of the sources.
        for got, want in zip(o["after"], expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(o["traced"], expected[0], rtol=1e-5, atol=1e-6)
        assert o["unused"] is True
        np.testing.assert_allclose(o["fp16"], expected[0], rtol=1e-2, atol=1e-3)
        assert o["sparse_kind"] == ["EagerTensor", "IndexedSlices"]
        assert o["sparse_equal"] is True
        compression, not_a_tape = o["bad"]
        assert compression[0] == "ValueError" and "compression" in compression[1]
        assert not_a_tape == ["TypeError", "DistributedGradientTape wraps a tf.GradientTape, "
                                           "got str"]
    assert outs[0]["expected"] == outs[1]["expected"]
    assert outs[0]["digest"] == outs[1]["digest"]


def test_backward_passes_per_step_and_schedule(spawn):
    outs = spawn(2, W.accumulation_checks, env=ENV, timeout=120)
    for o in outs:
        # Before the k-th pass nothing is applied and nothing is sent.
        assert all(o["before_update"]) and np.isnan(o["wait_before"])
        # k passes of batch b: one step, the weights of one step on the k*b batch.
        assert o["iterations"] == 1 and not np.isnan(o["wait_after"])
        assert o["moved"] > 1e-3
        assert o["diff"] < 1e-6, o["diff"]
        # average_aggregated_gradients=False (Horovod's): k times the learning rate's step
        assert o["summed diff"] < 1e-6 and o["summed vs mean"] > 1e-3, o
        for (kind, message), k in zip(o["bad"], ("0", "-1", "1.5")):
            assert kind == "ValueError"
            assert message == f"backward_passes_per_step must be a positive integer, got {k}"
        assert o["schedule_lr"] == pytest.approx(0.05)  # 0.1 * 0.5 ** (2 - 1) in epoch 2
    assert outs[0]["digest"] == outs[1]["digest"]
    assert outs[0]["schedule_digest"] == outs[1]["schedule_digest"]


ORDERS = ["compile", "inner", "sma"]


@pytest.fixture(scope="module")
def mixed_precision(session_spawn):
    """The three wrappings one after the other in one spawn (each sets the same mixed_float16
    policy and builds its own model): {order: [rank 0's result, rank 1's]}."""
    calls = [("_w_horovod_names:mixed_precision_checks", (order,)) for order in ORDERS]
    ranks = session_spawn(2, in_turn, calls, env=ENV, timeout=240)
    return {order: [results[i] for results in ranks] for i, order in enumerate(ORDERS)}


@pytest.mark.parametrize("order", ORDERS)
def test_mixed_precision_overflow_on_one_rank(mixed_precision, order):
    """Rank 1's inputs are 51 times rank 0's: its gradients overflow first. Every rank skips the
    same steps (the optimizer's step count after each batch is the same) and the loss scale
    follows the same path; under sync-sgd the weights stay equal (sma keeps local steps, so its
    weights differ by design); nothing waits for the op deadline."""
    outs = mixed_precision[order]
    assert [o["wrapper"] for o in outs] == ["LossScaleOptimizer"] * 2
    applied = outs[0]["applied"]
    assert len(applied) == 16 and 0 < applied[-1] < 16, applied  # some steps were skipped
    for o in outs[1:]:
        assert o["applied"] == applied
        assert o["scale"] == outs[0]["scale"]
        if order != "sma":
            assert o["digest"] == outs[0]["digest"]


def test_builtin_config_port_auto(tmp_path):
    """kungfu-run -w -builtin-config-port auto: the store on a port the system gave, named in
    the launcher's output, and an elastic job of 2 workers that uses it."""
    script = tmp_path / "job.py"
    script.write_text("import os, kungfu as kf\n"
                      "print('rank', kf.rank(), 'of', kf.size(), "
                      "os.environ['KUNGFU_CONFIG_SERVER'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "kungfu.cmd", "-w", "-np", "2", "-H", "127.0.0.1:2",
                        "-port-range", free_port_range(2), "-builtin-config-port", "auto",
                        "-timeout", "60s", sys.executable, str(script)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=90, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    urls = re.findall(r"config store at (http://127\.0\.0\.1:(\d+))", r.stdout + r.stderr)
    assert urls and int(urls[0][1]) > 0, r.stdout + r.stderr
    for rank in range(2):
        assert f"rank {rank} of 2 {urls[0][0]}" in r.stdout, r.stdout


def test_workers_that_accumulate_different_numbers_of_passes_fail_at_once(spawn):
    """backward_passes_per_step 2 on rank 0 and 3 on rank 1 averaged different windows under
    one name (a silent wrong result); now every worker fails, naming both counts."""
    outs = spawn(2, W.accumulation_disagreement, env={**ENV, "KUNGFU_OP_TIMEOUT": "60s"},
                 timeout=150)
    for o in outs:
        assert o["error"] is not None, o
        assert "every-2-passes" in o["error"] and "every-3-passes" in o["error"], o["error"]
        assert o["seconds"] < 30
