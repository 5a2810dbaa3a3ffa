"""The durable checkpoint's checks with real workers (numpy loops: tests/integration/
_w_checkpoint.py): what another job's checkpoint, a forged one and an unkeyed resume meet on
every worker. (The file format alone: tests/unit/test_membership.py; resuming Keras models:
test_keras_habits_2.py.)"""
from __future__ import annotations

import pytest

import _w_checkpoint

KEY = "4c1e9a7b2d5f8e0a3b6c9d2e5f8a1b4c"


@pytest.mark.timeout(120)
def test_every_worker_refuses_other_data_a_forged_file_and_a_missing_key(spawn, tmp_path):
    results = spawn(2, _w_checkpoint.checks, str(tmp_path), KEY, timeout=90)
    ckpt = tmp_path / "made" / "by" / "kungfu" / "job.ckpt"
    first = results[0]
    for rank, out in enumerate(results):
        # The folder was made; 5 steps of 2 x 4 samples: 40 samples into epoch 0.
        assert out["written"] == first["written"] and out["written"] != [0.0] * 4, (rank, out)
        assert out["resumed"] == [5, 40, first["written"]], (rank, out)
        assert out["other data"].startswith(
            f"kungfu: the checkpoint {ckpt} was written for other data: 160 samples of "
            "float32[4] (arrays, in order); this job's data is 32 samples of float32[4] (arrays, "
            "in order). Its position (epoch 0, 40 samples into it) is not one of this data's"), \
            (rank, out["other data"])
        assert out["forged"].startswith(
            f"kungfu: the checkpoint {ckpt} is not signed, and an authenticity key is set"), \
            (rank, out["forged"])
        assert out["no key"].startswith(
            f"kungfu: the checkpoint {ckpt} is signed with an authenticity key, and none is "
            "set"), (rank, out["no key"])
