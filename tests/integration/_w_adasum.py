"""Worker body for test_adasum.py: every rank's Adasum of inputs the test computes too."""
from __future__ import annotations

import numpy as np

import kungfu as kf
from _w_kungfu_names import error_of


def grads_of(r: int) -> list:
    """Worker r's gradients: two tensors of different dtypes and shapes."""
    rng = np.random.default_rng(10 + r)
    return [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5)]


def tf_grads_of(r: int) -> list:
    """Worker r's gradients of the two variables in _w_tf_optim's op="adasum" step."""
    rng = np.random.default_rng(20 + r)
    return [rng.standard_normal(4).astype(np.float32),
            rng.standard_normal((2, 2)).astype(np.float32)]


def run() -> dict:
    r, n = kf.rank(), kf.size()
    unit = np.zeros(n, np.float64)
    unit[r] = r + 1.0  # orthogonal across ranks
    same = np.linspace(-1, 2, 6)
    half = (np.arange(4, dtype=np.float16) + r)  # float16 in, float16 out
    return {
        "grads": kf.adasum(grads_of(r), name="g"),
        "orthogonal": kf.adasum(unit, name="o"),
        "same": kf.adasum(same, name="s"),
        "zero": kf.adasum(np.zeros(3) if r else np.ones(3), name="z"),
        "half": kf.adasum(half, name="h"),
        "integer": error_of(lambda: kf.adasum(np.arange(3))),
        "after": kf.allreduce(np.ones(2)),  # the cluster's collectives still pair up
    }
