"""The argument checks every layer shares. Each answers one question about a value (``bool`` is never a
number here, though Python says it is an ``int``); the caller raises with its own option name and allowed
values, or uses :func:`check_int` / :func:`check_number`, which raise
``ValueError`` naming them. Imports nothing of lioncub and not torch.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

__all__ = ["check_int", "check_number", "is_int", "is_number"]


def is_int(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """``value`` is an ``int`` (not a ``bool``) within ``[low, high]`` (``None``: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def is_number(
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> TypeGuard[float]:
    """``value`` is an ``int`` or ``float`` (not a ``bool``, not NaN), finite unless ``finite=False``, and
    within the bounds given (``ge``: ≥, ``gt``: >, ``le``: ≤, ``lt``: <)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    if finite and not math.isfinite(value):
        return False
    return (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )


def check_int(option: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` if :func:`is_int`, else ``ValueError`` ``"{option}={value!r} must be an int >= low …"``."""
    if not is_int(value, low, high):
        bounds = " and ".join(
            b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b
        )
        raise ValueError(f"{option}={value!r} must be an int{' ' + bounds if bounds else ''}")
    return value


def check_number(
    option: str,
    value: Any,
    what: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` if :func:`is_number` with these bounds, else ``ValueError`` ``"{option}={value!r} must be
    {what}"`` (``what`` states the allowed values, e.g. ``"a finite number > 0"``)."""
    if not is_number(value, ge=ge, gt=gt, le=le, lt=lt, finite=finite):
        raise ValueError(f"{option}={value!r} must be {what}")
    return value
