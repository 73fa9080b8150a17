"""Optimizers: :class:`Lion` (single process / global) and :class:`LionCub` (workers vote)."""

from lioncub.optim.auto import AUTO_ENV, AutoChoice, choose_variant
from lioncub.optim.config import PRESETS, VoteConfig, make_vote, resolve_variant
from lioncub.optim.lion import Lion
from lioncub.optim.lioncub import LionCub, ReplicaDivergenceError

__all__ = [
    "AUTO_ENV",
    "PRESETS",
    "AutoChoice",
    "Lion",
    "LionCub",
    "ReplicaDivergenceError",
    "VoteConfig",
    "choose_variant",
    "make_vote",
    "resolve_variant",
]
