"""Learning-rate scaling rules for a change of the global batch."""
from __future__ import annotations

import math

from kungfu.elastic import check_batch_size, check_learning_rate


def linear_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Linear scaling rule (Goyal et al.): lr grows in proportion to the global batch."""
    return check_learning_rate(base_lr) * check_batch_size(batch) / check_batch_size(base_batch)


def sqrt_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Square-root scaling rule: lr grows with the square root of the global batch."""
    return check_learning_rate(base_lr) * math.sqrt(
        check_batch_size(batch) / check_batch_size(base_batch))

