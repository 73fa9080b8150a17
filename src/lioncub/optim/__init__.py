"""Optimizers: :class:`Lion` (single-process / global) and :class:`LionCub` (distributed vote)."""

from lioncub.optim.lion import Lion

__all__ = ["Lion"]
