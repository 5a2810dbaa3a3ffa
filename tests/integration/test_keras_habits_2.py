"""Keras habits under kf.Hook, round 2: a custom train_step as the Keras guide writes it,
BackupAndRestore, CSVLogger and TensorBoard writing once, and the progress bar after a resume
(issue 25). Real processes; worker bodies in _w_keras_2.py."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

import _w_keras_2 as w  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture(scope="module")
def guide_step(session_spawn):
    return session_spawn(2, w.guide_train_step, env=ENV, timeout=150)


def test_the_batch_size_of_a_guide_train_step_is_its_data(guide_step):
    # The guide's step counts its loss once per step: the batch is read from the data.
    for r in guide_step:
        assert r["local_batch"] == 32
        assert r["global_batch"] == [64.0] * len(r["global_batch"])


def test_the_metrics_of_a_guide_train_step_are_combined(guide_step):
    # Rank 1's labels are noise: from its own loss ReduceLROnPlateau would decide otherwise.
    r0, r1 = guide_step
    assert r0["loss"] == r1["loss"]
    assert r0["lr"] == r1["lr"] and r0["weights"] == r1["weights"]
