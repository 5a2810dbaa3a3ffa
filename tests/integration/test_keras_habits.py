"""Keras as users write it: callbacks that decide from metrics decide the same on every worker,
and model.evaluate combines the workers' shards exactly (kungfu/tensorflow/callbacks.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

import _w_keras as w  # noqa: E402
from _w_in_turn import in_turn  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _in_turn(session_spawn, name: str, variants: list, timeout: float = 240) -> dict:
    """Body `name` of _w_keras.py with each of `variants` (its arguments), one after the other
    in one spawn of 2 workers: {variant: [rank 0's result, rank 1's]}."""
    calls = [(f"_w_keras:{name}", args) for args in variants]
    ranks = session_spawn(2, in_turn, calls, env=ENV, timeout=timeout)
    return {args: [results[i] for results in ranks] for i, args in enumerate(variants)}


@pytest.fixture(scope="module")
def deciding(session_spawn):
    return _in_turn(session_spawn, "deciding_callbacks", [(True,), (False,)])


@pytest.fixture(scope="module")
def gns_boards(session_spawn, tmp_path_factory):
    folders = {hook_first: str(tmp_path_factory.mktemp("board")) for hook_first in (True, False)}
    runs = _in_turn(session_spawn, "tensorboard_gns", [(folders[h], h) for h in (True, False)])
    return {h: runs[(folders[h], h)] for h in (True, False)}


# Both orders of the Keras callbacks' list run in one spawn, one after the other (each with
# its own model and kf.Hook), so the fixtures above start TensorFlow once for both.
@pytest.mark.parametrize("hook_first", [True, False], ids=["hook-first", "hook-last"])
def test_deciding_callbacks_agree_and_evaluate_is_over_every_shard(deciding, hook_first):
    r0, r1 = deciding[(hook_first,)]
    # The same epoch metrics on both workers, so the same decisions.
    assert r0["plateau_loss"] == r1["plateau_loss"]
    assert r0["lr"] == r1["lr"] == pytest.approx(0.01)  # the combined loss improved each epoch
    assert r0["early_epochs"] == r1["early_epochs"] == 5, (r0["early_loss"], r1["early_loss"])
    assert r0["weights"] == r1["weights"]
    # After fit evaluate is each worker's own; with kf.combine_metrics, model.evaluate on each
    # worker's own shard gives the result over both shards, on both.
    assert r0["alone"]["loss"] < r0["evaluate"]["loss"] < r1["alone"]["loss"]
    assert r0["evaluate"] == r1["evaluate"]
    for key in ("loss", "mae"):
        assert r0["evaluate"][key] == pytest.approx(r0["expected"][key], rel=1e-5), key


@pytest.fixture(scope="module")
def writers(session_spawn, tmp_path_factory):
    """one_writer under kf.Hook, then with BroadcastGlobalVariablesCallback (each in a folder
    of its own), in one spawn: {hook: [rank 0's result, rank 1's]}."""
    folders = {hook: str(tmp_path_factory.mktemp("writer")) for hook in (True, False)}
    runs = _in_turn(session_spawn, "one_writer", [(folders[h], h) for h in (True, False)])
    return {h: runs[(folders[h], h)] for h in (True, False)}


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "broadcast-callback"])
def test_workers_start_equal_print_once_and_checkpoint_once(writers, hook):
    """A model built at its first batch starts from rank 0's weights (kf.Hook by itself, or
    BroadcastGlobalVariablesCallback); under kf.Hook the progress bar and ModelCheckpoint's
    files come from rank 0 only, while training (and after it, the next fit without a Hook
    prints and writes on every worker again)."""
    r0, r1 = writers[hook]
    assert r0["weights"] == r1["weights"]
    assert "Epoch 2/2" in r0["printed"]
    assert r0["files"] == ["e1.weights.h5", "e2.weights.h5"]  # no temporary file left
    if hook:
        assert r1["printed"] == "" and r1["files"] == []
        assert "step" in r1["after"]  # its progress output is back after fit
    else:  # without a Hook every worker prints and writes, as in plain Keras
        assert "Epoch 2/2" in r1["printed"] and r1["files"] == r0["files"]


def test_kf_shard_gives_every_worker_the_same_number_of_steps(spawn):
    # 101 samples on 3 workers, batches of 11: x[rank::3] would give 34, 34 and 33 samples,
    # so 4, 4 and 3 steps (the first two would wait for the third at every epoch's end).
    results = spawn(3, w.sharded_fit, 101, 11, env=ENV, timeout=150)
    for r in results:
        assert len(r["arrays"]) == len(r["dataset"]) == 33
        assert r["steps"][1:] == [("batch", b) for b in range(3)]
    for key in ("arrays", "dataset"):
        assert sorted(sum((r[key] for r in results), [])) == list(range(99)), key
    assert len({r["weights"] for r in results}) == 1


@pytest.mark.parametrize("hook_first", [True, False], ids=["hook-first", "hook-last"])
def test_the_gradient_noise_scale_reaches_tensorboard_in_either_order(gns_boards, hook_first):
    import math

    r0, r1 = gns_boards[hook_first]
    for r in (r0, r1):
        assert r["batch"] == 16  # learned from the first batch
        gns = r["scalars"].get("epoch_gns")
        assert gns is not None and len(gns) == 3, sorted(r["scalars"])
        assert all(math.isfinite(v) for v in gns)
        assert gns == pytest.approx(r["history"], rel=1e-6)  # what History saw, too
    assert r0["scalars"]["epoch_gns"] == r1["scalars"]["epoch_gns"]
    # The cluster's numbers too: size, global batch, and the epoch's mean step time,
    # samples/s and allreduce bandwidth (each step reduces the 5 float32 gradients, whatever
    # the strategy's own traffic: at least the gradients' bytes per step).
    for r in (r0, r1):
        sc = r["scalars"]
        assert sc["epoch_cluster_size"] == [2.0] * 3, sorted(sc)
        assert sc["epoch_global_batch_size"] == [32.0] * 3
        for key in ("epoch_step_time", "epoch_samples_per_sec", "epoch_allreduce_bytes_per_sec"):
            assert len(sc[key]) == 3 and all(v > 0 for v in sc[key]), (key, sc[key])
        for t, rate in zip(sc["epoch_step_time"], sc["epoch_samples_per_sec"]):
            assert rate == pytest.approx(32 / t, rel=0.5)  # both from the same steps
        for t, bw in zip(sc["epoch_step_time"], sc["epoch_allreduce_bytes_per_sec"]):
            assert bw * t >= 4 * r["params"]


def test_a_worker_a_shrink_left_out_keeps_its_rank(spawn):
    """Code after training that runs on rank 0 only must not run on a left-out worker too."""
    r0, r1 = spawn(2, w.detached_identity, env=ENV, timeout=60)
    assert r0 == {"rank": 0, "size": 1, "detached": False}
    assert r1 == {"rank": 1, "size": 2, "detached": True}


def test_learning_rate_warmup_goes_from_lr_over_size_to_lr(spawn):
    r0, r1 = spawn(2, w.warmup, 0.4, 2, env=ENV, timeout=90)
    assert r0 == r1
    # 4 steps an epoch: step s (from 0) of the warmup trains at 0.4 (1/2 + 1/2 * (s + 1) / 8), as
    # Horovod's callback: the last warmup step at the full 0.4 (it came one step late), then 0.4.
    expected = [0.4 * (0.5 + 0.5 * (s + 1) / 8) for s in range(8)] + [0.4] * 4
    assert expected[7] == 0.4
    assert r0 == pytest.approx(expected, rel=1e-6)


def test_kf_load_model_resumes_distributed_and_a_plain_reload_is_warned_of(spawn, tmp_path):
    """A model saved with kf.Optimizer reloads with its plain optimizer (it saves as the one it
    wraps): keras.models.load_model then trains each worker alone, and fit says so;
    kf.load_model distributes the optimizer again, with its saved state."""
    # Both in one spawn, one after the other: plain Keras' load first.
    calls = [("_w_keras:resume_from_saved", (str(tmp_path / loader), loader))
             for loader in ("keras", "kf")]
    plain, ours = zip(*spawn(2, in_turn, calls, env=ENV, timeout=240))
    plain, ours = list(plain), list(ours)
    for r in plain + ours:
        assert r["iterations"] == 4  # one epoch of 64 samples in batches of 16, then saved
        assert r["slots"] == r["saved_slots"]  # the saved Adam state, kept by the wrapping
    assert not any(r["distributed"] for r in plain)
    for r in plain:
        assert len(r["warnings"]) == 1 and "each worker trains on its own" in r["warnings"][0]
        assert "kf.load_model" in r["warnings"][0]
    assert plain[0]["weights"] != plain[1]["weights"]  # what the warning is about
    assert all(r["distributed"] for r in ours)
    assert [r["warnings"] for r in ours] == [[], []]
    assert ours[0]["weights"] == ours[1]["weights"]


def test_no_warning_for_a_model_that_averages_in_its_own_train_step(spawn):
    r0, r1 = spawn(2, w.own_train_step_no_warning, env=ENV, timeout=150)
    assert r0["warnings"] == r1["warnings"] == []
    assert r0["weights"] == r1["weights"]
