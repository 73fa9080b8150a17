"""Where a warning of the optimizer points: the caller's line, not lioncub's (:func:`caller_stacklevel`)."""

from __future__ import annotations

import os
import sys

import torch

import lioncub.collectives as collectives

__all__ = ["caller_stacklevel"]

#: frames in these directories are the optimizer's (and torch's wrappers around ``step``: ``no_grad``,
#: the optimizer's hooks, ``GradScaler.step``), not the caller's
_INTERNAL = tuple(
    os.path.join(os.path.dirname(os.path.abspath(path)), "")
    for path in (__file__, collectives.__file__ or "", torch.__file__ or "")
)


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn(..., stacklevel=caller_stacklevel())`` that names the first
    frame outside :mod:`lioncub.optim`, :mod:`lioncub.collectives` and torch: the line that called
    ``step()``, ``LionCub(...)`` or ``load_state_dict`` (the user's, or lioncub's own training loop's)."""
    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level
