"""The learning-rate schedule of a training run: :func:`lr_factor`, a linear warm-up, then a cosine."""

from __future__ import annotations

import math

__all__ = ["lr_factor"]


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of every group's peak lr at optimizer step ``step`` (1-based, ``1 <= step <= steps``).

    The peak is at step ``p = max(warmup, 1)``: the last warm-up step, or the first step without warm-up.

    * ``step <= warmup``: linear warm-up, ``step / warmup`` (``1/warmup, 2/warmup, ..., 1``);
    * ``step >= p``: a cosine from 1 at step ``p`` down to ``min_ratio`` at step ``steps``::

          progress = (step - p) / max(1, steps - p)            # 0 at p, 1 at steps
          factor = min_ratio + (1 - min_ratio) * (1 + cos(pi * min(1, progress))) / 2

    So without warm-up the first step trains at the peak lr and only the last one at ``min_ratio`` (a
    single step, ``steps == 1``, is at the peak); with warm-up the cosine starts from its last step. A pure
    function of the step: a resumed run gets the same lr bit for bit.
    """
    if step <= warmup:
        return step / warmup
    peak = max(warmup, 1)
    progress = (step - peak) / max(1, steps - peak)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
