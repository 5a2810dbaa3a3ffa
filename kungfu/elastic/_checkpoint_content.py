"""What a checkpoint file holds (kungfu/elastic/_checkpoint.py has the file around it): arrays and
metadata in formats that load without running code.

The content is a numpy .npz archive (np.savez, uncompressed), read back with np.load(...,
allow_pickle=False): an array of Python objects cannot be in it. Its member "meta" is a JSON
document (UTF-8 bytes as a uint8 array); "a0", "a1", ... are the arrays, in order, each stored
as numpy writes its own dtypes, or as its raw bytes (uintN of its item size) for a dtype numpy
does not know by itself (bfloat16), which "dtypes" in the JSON names.

The metadata may hold what a policy's state_dict holds (kf.BasePolicy: numbers, strings, None,
bytes, numpy arrays and scalars, and lists, tuples, sets and dicts of them). JSON has lists,
dicts with string keys, numbers, strings, true/false/null; the rest is written as a one-key
object that says what it is (tagged below), and a dict whose keys are not all strings, or that
has a key starting with "$", is written as a list of pairs ("$dict"), so that no user dict is
taken for a tag. An array inside the metadata is stored as one of the arrays ("$array": its
index). Anything else cannot be stored: CheckpointError naming it.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import zipfile
from typing import Any, List, Optional, Tuple

import numpy as np

from kungfu.elastic._checkpoint import CheckpointError
from kungfu.elastic._state import TrainingState


def _storable(a: np.ndarray) -> Tuple[np.ndarray, str]:
    """(what np.savez writes for `a`, its dtype's name)."""
    a = np.asarray(a, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    if a.dtype.hasobject:
        raise CheckpointError(f"kungfu: an array of Python objects ({a.dtype}) cannot be stored "
                              "in a checkpoint")
    if type(a.dtype).__module__.startswith("numpy") and a.dtype.kind in "biufc":
        return a, a.dtype.name
    return a.view(f"u{a.dtype.itemsize}"), a.dtype.name  # bfloat16 and the like: as bytes


def _loaded(a: np.ndarray, name: str) -> np.ndarray:
    if a.dtype.name == name:
        return a
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise CheckpointError(f"kungfu: the checkpoint holds an array of dtype {name}, which "
                              "numpy does not know here (import the package that defines it, "
                              "e.g. ml_dtypes for bfloat16)") from None
    return a.view(dtype)


class _Encoder:
    """Plain data to JSON values; its arrays are collected in `arrays`."""

    def __init__(self, arrays: List[np.ndarray]):
        self.arrays = arrays

    def __call__(self, v: Any, where: str) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        if isinstance(v, np.ndarray):
            self.arrays.append(v)
            return {"$array": len(self.arrays) - 1}
        if isinstance(v, np.generic):
            return {"$scalar": [v.dtype.name, v.item()]}
        if isinstance(v, bytes):
            return {"$bytes": base64.b64encode(v).decode()}
        for base in (int, float, str):  # a subclass (an IntEnum, ...): its plain value
            if isinstance(v, base):
                return base(v)
        if isinstance(v, list):
            return [self(x, f"{where}[{i}]") for i, x in enumerate(v)]
        for kind, tag in ((tuple, "$tuple"), (frozenset, "$frozenset"), (set, "$set")):
            if isinstance(v, kind):
                return {tag: [self(x, where) for x in v]}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self(x, f"{where}[{k!r}]") for k, x in v.items()}
            return {"$dict": [[self(k, where), self(x, f"{where}[{k!r}]")] for k, x in v.items()]}
        raise CheckpointError(f"kungfu: {where} holds a {type(v).__name__}, which a checkpoint "
                              "cannot store (plain data only: numbers, strings, None, bytes, "
                              "numpy arrays, and lists, tuples, sets and dicts of them)")


def _decode(v: Any, arrays: List[np.ndarray]) -> Any:
    if isinstance(v, list):
        return [_decode(x, arrays) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        (tag, x), = v.items()
        if tag == "$array":
            return arrays[x]
        if tag == "$scalar":
            return np.dtype(x[0]).type(x[1])
        if tag == "$bytes":
            return base64.b64decode(x)
        if tag == "$dict":
            return {_decode(k, arrays): _decode(y, arrays) for k, y in x}
        kinds = {"$tuple": tuple, "$set": set, "$frozenset": frozenset}
        if tag in kinds:
            return kinds[tag](_decode(y, arrays) for y in x)
    return {k: _decode(x, arrays) for k, x in v.items()}


def pack(meta: dict, arrays: List[np.ndarray]) -> bytes:
    """The content of a checkpoint: `arrays` and the plain data `meta` (module doc)."""
    arrays = list(arrays)
    count = len(arrays)
    doc = {"meta": _Encoder(arrays)(meta, "the checkpoint's state"), "count": count}
    stored, doc["dtypes"] = zip(*(_storable(a) for a in arrays)) if arrays else ((), ())
    members = {f"a{i}": a for i, a in enumerate(stored)}
    members["meta"] = np.frombuffer(json.dumps(doc, allow_nan=True).encode(), np.uint8)
    out = io.BytesIO()
    np.savez(out, **members)
    return out.getvalue()


def unpack(content: bytes) -> Tuple[dict, List[np.ndarray]]:
    """(meta, arrays) of a checkpoint's content; CheckpointError if it is not one."""
    try:
        with np.load(io.BytesIO(content), allow_pickle=False) as z:
            doc = json.loads(z["meta"].tobytes().decode())
            dtypes = doc["dtypes"]
            arrays = [_loaded(z[f"a{i}"], dtypes[i]) for i in range(len(dtypes))]
        meta = _decode(doc["meta"], arrays)
        return meta, arrays[:doc["count"]]
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"kungfu: the checkpoint's content is not what kungfu writes "
                              f"({type(e).__name__}: {e})") from None


def pack_commit(arrays: List[np.ndarray], variables: list, state: TrainingState, policies: list,
                data: Optional[tuple], data_spec: Optional[dict],
                epochs_total: Optional[int]) -> bytes:
    """A commit as a checkpoint's content: the variables' arrays and description ((name, shape,
    dtype) each), the trainer's and policies' state, the data position (epoch, offset, batch
    size, last length) and what the data was (ElasticData.describe), the job's epochs."""
    return pack({"variables": variables,
                 "state": {f.name: getattr(state, f.name) for f in dataclasses.fields(state)},
                 "policies": policies, "data": None if data is None else list(data),
                 "data_spec": data_spec, "epochs_total": epochs_total}, arrays)


def unpack_commit(content: bytes) -> dict:
    """pack_commit's content as a dict of its arguments (CheckpointError: not one)."""
    meta, arrays = unpack(content)
    try:
        fields = meta["state"]
        state = TrainingState(**{f.name: fields[f.name] for f in dataclasses.fields(TrainingState)
                                 if f.name in fields})
        return {"arrays": arrays, "state": state, "policies": list(meta["policies"]),
                "variables": [(n, tuple(shape), d) for n, shape, d in meta["variables"]],
                "data": None if meta["data"] is None else tuple(meta["data"]),
                "data_spec": meta["data_spec"], "epochs_total": meta["epochs_total"]}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"kungfu: the checkpoint's content is not a commit of kungfu's "
                              f"({type(e).__name__}: {e})") from None
