"""The learning-rate schedule every training stage uses: linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def warmup_cosine(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """The rate at `step`: lr * (step + 1) / warmup during warm-up, then cosine from lr to min_lr_ratio * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
