"""The learning-rate schedule of ``oomb train``: linear warm-up, then cosine decay to a floor, or constant."""

from __future__ import annotations

import math

__all__ = ["lr_at", "warmup_steps"]

COSINE_FLOOR = 0.1
"""The cosine schedule ends at this fraction of the peak learning rate unless told another
(:attr:`oomb.config.TrainConfig.min_lr_factor`)."""


def warmup_steps(steps: int, warmup: int | None) -> int:
    """The warm-up length in steps: ``warmup`` when given, else 10% of ``steps`` (rounded down)."""
    return warmup if warmup is not None else steps // 10


def lr_at(step: int, *, lr: float, steps: int, warmup: int, schedule: str = "cosine",
          floor: float = COSINE_FLOOR) -> float:
    """The learning rate of optimizer step ``step`` (counted from 1) of ``steps``.

    Linear warm-up to ``lr`` over ``warmup`` steps (step ``s <= warmup`` runs at ``lr * s / warmup``; without
    warm-up the first step runs at the full ``lr``), then ``schedule``: ``"cosine"`` decays from ``lr`` at the
    first step after warm-up to ``floor * lr`` at the last step; ``"constant"`` stays at ``lr``.
    """
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    span = max(1, steps - warmup - 1)
    progress = min(1.0, (step - warmup - 1) / span)
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
