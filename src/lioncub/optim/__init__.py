"""Optimizers: :class:`Lion` (single process / global) and :class:`LionCub` (the workers vote).

Modules, each importing only those above it in this list:

* :mod:`~lioncub.optim.config` — :class:`VoteConfig`, the presets, the lane-capacity limits (no torch);
* :mod:`~lioncub.optim.lion` — Lion's formulas and :class:`Lion`;
* :mod:`~lioncub.optim.sync` — :class:`MomentumSync`: which momenta are averaged over the ranks, and when;
* :mod:`~lioncub.optim.diagnostics` — match/flip, ties, momentum spread of a vote;
* :mod:`~lioncub.optim.voting` — :class:`Voting`: flat buckets' contributions, the votes, the apply;
* :mod:`~lioncub.optim.ddp` — DDP hooks that keep or count the gradient allreduce;
* :mod:`~lioncub.optim.overlap` — the vote as a DDP communication hook;
* :mod:`~lioncub.optim.lioncub` — :class:`LionCub`.

Names are imported lazily, so ``lioncub.optim.config`` (and the torch-free cost model above it) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PRESETS": "lioncub.optim.config",
    "VoteConfig": "lioncub.optim.config",
    "resolve_variant": "lioncub.optim.config",
    "Lion": "lioncub.optim.lion",
    "MomentumSync": "lioncub.optim.sync",
    "make_vote": "lioncub.optim.voting",
    "Checks": "lioncub.optim.lioncub",
    "LionCub": "lioncub.optim.lioncub",
    "ReplicaDivergenceError": "lioncub.optim.lioncub",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lioncub.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
