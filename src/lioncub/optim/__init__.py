"""Optimizers: :class:`Lion` (single process / global) and :class:`LionCub` (workers vote)."""

from lioncub.optim.config import PRESETS, VoteConfig, make_vote, resolve_variant
from lioncub.optim.lion import Lion
from lioncub.optim.lioncub import LionCub, ReplicaDivergenceError

__all__ = [
    "PRESETS",
    "Lion",
    "LionCub",
    "ReplicaDivergenceError",
    "VoteConfig",
    "make_vote",
    "resolve_variant",
]
