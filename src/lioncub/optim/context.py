"""What the parts of a :class:`~lioncub.optim.LionCub` step work with (:class:`StepContext`): the optimizer's
parts (its group, engine, layout, accounting, checks) and a typed view of what changes under them
(:class:`OptimizerView`: the step count, the param groups, the per-parameter state). The round
(:mod:`lioncub.optim.round`), the step policies (:mod:`lioncub.optim.policies`,
:mod:`lioncub.optim.local_steps`) and the outer rules (:mod:`lioncub.optim.outer`) take one, never the
optimizer itself; none of them assigns into another's parts.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lioncub.collectives import Comm
from lioncub.optim.accounting import Accounting
from lioncub.optim.engine import StepEngine
from lioncub.optim.layout import ParamLayout
from lioncub.optim.step_check import Checks

__all__ = ["OptimizerView", "StepContext"]


class OptimizerView(Protocol):
    """What the parts read of the optimizer that changes under them (read at every use: ``load_state_dict``
    replaces ``param_groups`` and ``state``)."""

    @property
    def global_step(self) -> int: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[torch.Tensor, Any]: ...


@dataclass(frozen=True)
class StepContext:
    """The parts a step's round, policy and rules work with (:class:`~lioncub.optim.LionCub` builds one).

    Args:
        optimizer: the step count, param groups and per-parameter state (:class:`OptimizerView`).
        comm: the optimizer's group (the step check, flat votes, momentum sync).
        engine, layout, accounting: :mod:`lioncub.optim.engine`, :mod:`~lioncub.optim.layout`,
            :mod:`~lioncub.optim.accounting`.
        checks: the optimizer's :class:`~lioncub.optim.step_check.Checks`.
        bucket_mb: the bucket size cap (momentum sync stages its buckets by it).
    """

    optimizer: OptimizerView
    comm: Comm
    engine: StepEngine
    layout: ParamLayout
    accounting: Accounting
    checks: Checks
    bucket_mb: float

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, this one included once ``step()`` counted it."""
        return self.optimizer.global_step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> MutableMapping[torch.Tensor, Any]:
        """Each parameter's state (its momenta, anchors, replicas)."""
        return self.optimizer.state
