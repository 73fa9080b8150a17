"""How a :class:`~lioncub.optim.LionCub` steps, by mode: :data:`STEP_MODES` builds each mode's step policy
(:mod:`lioncub.optim.policies`, :mod:`lioncub.optim.local_steps`) and its window from the optimizer's parts.
A new way to step is a policy and an entry here (and the mode's condition in :func:`step_mode`); the
optimizer is not edited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lioncub.optim.context import StepContext
from lioncub.optim.local_steps import LocalSteps, LocalWindow
from lioncub.optim.policies import EveryStep, LionSteps, NoWindow, StepPolicy, Window
from lioncub.optim.round import VoteRound
from lioncub.optim.sync import MomentumSync

__all__ = ["STEP_MODES", "PolicyOptions", "step_mode"]


@dataclass(frozen=True)
class PolicyOptions:
    """The optimizer's settings a policy may take: local steps (``None``: a vote every step), momentum
    sync and its parameters, the diagnostics' period."""

    local_steps: LocalSteps | None
    momentum_sync: MomentumSync
    sync_params: Sequence[torch.Tensor]
    diagnostics_every: int


def _one_process(ctx: StepContext, rnd: VoteRound, options: PolicyOptions) -> tuple[StepPolicy, Window]:
    return LionSteps(ctx), NoWindow()


def _every_step(ctx: StepContext, rnd: VoteRound, options: PolicyOptions) -> tuple[StepPolicy, Window]:
    policy = EveryStep(ctx, rnd, options.momentum_sync, options.sync_params, options.diagnostics_every)
    return policy, NoWindow()


def _local_steps(ctx: StepContext, rnd: VoteRound, options: PolicyOptions) -> tuple[StepPolicy, Window]:
    if options.local_steps is None:
        raise ValueError("the local-steps mode needs LocalSteps")
    window = LocalWindow(ctx, rnd, options.local_steps)
    return window, window


#: mode → (the step policy, its window) from the optimizer's parts, round and options
STEP_MODES: dict[str, Callable[[StepContext, VoteRound, PolicyOptions], tuple[StepPolicy, Window]]] = {
    "one-process": _one_process,
    "every-step": _every_step,
    "local-steps": _local_steps,
}


def step_mode(single_process: bool, local_steps: LocalSteps | None) -> str:
    """The mode of :data:`STEP_MODES`: one process, Lion's steps; local steps, windows and their outer rule;
    else a vote every step."""
    if single_process:
        return "one-process"
    return "every-step" if local_steps is None else "local-steps"
