"""Horovod's compressors (Compression.none, Compression.fp16) for both bindings: strings, as
the optimizers take them ("none", "fp16"), that also compress and decompress one tensor as
Horovod's do. A binding gives fp16 its two casts (kungfu/tensorflow/optimizers,
kungfu/torch/optimizers)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple


class NoCompression(str):
    """compression="none": compress(t) -> (t, None), decompress(t, ctx) -> t."""

    def __new__(cls):
        return super().__new__(cls, "none")

    @staticmethod
    def compress(tensor) -> Tuple[Any, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compression(str):
    """compression="fp16": a floating-point tensor goes as float16 and comes back in its dtype;
    other dtypes pass as they are. to_half(t) -> (t as float16, its dtype), or (t, None) for a
    tensor that is not floating point; cast(t, dtype) -> t in dtype."""

    def __new__(cls, to_half: Callable[[Any], Tuple[Any, Optional[Any]]],
                cast: Callable[[Any, Any], Any]):
        self = super().__new__(cls, "fp16")
        self._to_half, self._cast = to_half, cast
        return self

    def compress(self, tensor):
        return self._to_half(tensor)

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else self._cast(tensor, ctx)

    def __reduce__(self):  # copied or pickled: the plain string, which the optimizers take
        return str, (str(self),)
