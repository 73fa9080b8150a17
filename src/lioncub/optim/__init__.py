"""Optimizers: :class:`Lion` (single process / global) and :class:`LionCub` (the workers vote).

Modules, each importing only those above it in this list:

* :mod:`~lioncub.optim.callers` — where the optimizer's warnings point (the caller's line);
* :mod:`~lioncub.optim.config` — :class:`VoteConfig`, the presets, the lane-capacity limits (no torch);
* :mod:`~lioncub.optim.lion` — Lion's step and :class:`Lion`;
* :mod:`~lioncub.optim.sync` — :class:`MomentumSync`: which momenta are averaged over the ranks, and when;
* :mod:`~lioncub.optim.diagnostics` — match/flip, ties, momentum spread of a vote;
* :mod:`~lioncub.optim.topology` — who votes with whom: ``LionCub``'s one ``process_group`` argument
  (:func:`~lioncub.optim.topology.who_votes`, :class:`VoteMesh`), the ``("node", "local")`` mesh of a
  vote laid over nodes;
* :mod:`~lioncub.optim.shards` — the part of the model a rank votes on: its local shards of FSDP2's
  parameters, or its share of whole tensors (DDP inside a mesh's shard dimension);
* :mod:`~lioncub.optim.replicas` — identical replicas: the same parameters, rank 0's values, checksums;
* :mod:`~lioncub.optim.step_check` — :class:`Checks`, the ranks' agreement before a step, its errors;
* :mod:`~lioncub.optim.factory` — :func:`make_vote`: the vote of a configuration;
* :mod:`~lioncub.optim.engine` — the buckets and the walk of a step over them (:class:`StepEngine`);
* :mod:`~lioncub.optim.layout` — which parameters a step votes on, in which buckets;
* :mod:`~lioncub.optim.accounting` — :meth:`LionCub.comm_stats`;
* :mod:`~lioncub.optim.context` — :class:`StepContext`: the parts a step's round, policy and rules take;
* :mod:`~lioncub.optim.round` — :class:`VoteRound`: contribute, check, post, apply, book (over all buckets
  or some);
* :mod:`~lioncub.optim.policies` — how a step runs: one process, a vote every step; the window protocol;
* :mod:`~lioncub.optim.outer` — the outer rules of local steps (vote, dsm, diloco), :data:`OUTER_RULES`;
* :mod:`~lioncub.optim.windows` — a local-steps window across a save;
* :mod:`~lioncub.optim.local_steps` — :class:`LocalSteps` and its policy, the window;
* :mod:`~lioncub.optim.modes` — the step policy of each mode (:data:`STEP_MODES`);
* :mod:`~lioncub.optim.state_dict` — per-rank state, consolidation for one-rank saves;
* :mod:`~lioncub.optim.shard_state` — the state on shards as ``torch.distributed.checkpoint`` saves it;
* :mod:`~lioncub.optim.amp` — a GradScaler whose overflow decision every rank shares;
* :mod:`~lioncub.optim.ddp` — DDP hooks that keep or count the gradient allreduce;
* :mod:`~lioncub.optim.overlap` — the vote as a DDP communication hook;
* :mod:`~lioncub.optim.lioncub` — :class:`LionCub` (its module docstring describes the step).

Names are imported lazily, so ``lioncub.optim.config`` (and the torch-free cost model above it) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy names below, for type checkers (tests/test_typing.py: the two lists agree)
    from lioncub.optim.config import PRESETS as PRESETS
    from lioncub.optim.config import VoteConfig as VoteConfig
    from lioncub.optim.config import resolve_variant as resolve_variant
    from lioncub.optim.context import StepContext as StepContext
    from lioncub.optim.factory import make_vote as make_vote
    from lioncub.optim.lion import Lion as Lion
    from lioncub.optim.lioncub import LionCub as LionCub
    from lioncub.optim.lioncub import ReplicaDivergenceError as ReplicaDivergenceError
    from lioncub.optim.local_steps import LocalSteps as LocalSteps
    from lioncub.optim.round import VoteRound as VoteRound
    from lioncub.optim.step_check import Checks as Checks
    from lioncub.optim.step_check import GradientChangedError as GradientChangedError
    from lioncub.optim.step_check import NonFiniteGradientError as NonFiniteGradientError
    from lioncub.optim.step_check import StepMismatchError as StepMismatchError
    from lioncub.optim.sync import MomentumSync as MomentumSync
    from lioncub.optim.topology import VoteMesh as VoteMesh

_EXPORTS = {
    "PRESETS": "lioncub.optim.config",
    "VoteConfig": "lioncub.optim.config",
    "resolve_variant": "lioncub.optim.config",
    "Lion": "lioncub.optim.lion",
    "MomentumSync": "lioncub.optim.sync",
    "make_vote": "lioncub.optim.factory",
    "Checks": "lioncub.optim.step_check",
    "NonFiniteGradientError": "lioncub.optim.step_check",
    "StepMismatchError": "lioncub.optim.step_check",
    "GradientChangedError": "lioncub.optim.step_check",
    "LionCub": "lioncub.optim.lioncub",
    "LocalSteps": "lioncub.optim.local_steps",
    "StepContext": "lioncub.optim.context",
    "VoteRound": "lioncub.optim.round",
    "ReplicaDivergenceError": "lioncub.optim.lioncub",
    "VoteMesh": "lioncub.optim.topology",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lioncub.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
