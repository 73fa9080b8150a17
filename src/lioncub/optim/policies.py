"""How a :class:`~lioncub.optim.LionCub` step runs, one small class per way (the optimizer composes one):

* :class:`LionSteps` — one process: Lion's step with the non-finite check (nothing to agree on);
* :class:`EveryStep` — a vote every step (:class:`~lioncub.optim.round.VoteRound`), with momentum sync,
  replica checks and diagnostics as configured, and the ballots the overlap hook posted during the backward
  when overlapping (:meth:`LionCub.overlap_with`);
* :class:`~lioncub.optim.local_steps.LocalWindow` — H local steps on each rank, then an outer rule
  (:mod:`lioncub.optim.outer`).

A policy takes the optimizer's parts (:class:`~lioncub.optim.context.StepContext`, the round) and keeps its
own state; what a saved state needs from it, it adds (:meth:`StepPolicy.save`) and takes back
(:meth:`StepPolicy.load`). A policy that holds each rank's own parameters between votes (a window) is
also a :class:`Window`: the optimizer asks it where it shows, hides or restarts them; the others have
:class:`NoWindow`. The optimizer's mode picks them (:data:`lioncub.optim.modes.STEP_MODES`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lioncub.collectives import Comm, flat_views
from lioncub.ops.quantize import max_abs
from lioncub.optim import diagnostics
from lioncub.optim.context import StepContext
from lioncub.optim.engine import StepTimes
from lioncub.optim.lion import default_foreach, update_group_
from lioncub.optim.overlap import OverlapHook
from lioncub.optim.replicas import check_replicas, parameter_checksum
from lioncub.optim.round import RoundResult, VoteRound
from lioncub.optim.step_check import check_step
from lioncub.optim.sync import MomentumSync, synchronize

__all__ = ["EveryStep", "LionSteps", "NoWindow", "StepPolicy", "Window", "lion_step"]

_log = logging.getLogger("lioncub")

#: a step's diagnostics: ``(step, {name: {...}, "overall": {...}})``
Diagnostics = tuple[int, dict[str, dict[str, float]]]


class StepPolicy:
    """How a step runs, and what it carries across a save (nothing, by default)."""

    #: the diagnostics of the last step that computed them (:attr:`LionCub.last_diagnostics`)
    last_diagnostics: Diagnostics | None = None

    def step(self, overflow: bool) -> None:
        """One optimizer step (``overflow``: a GradScaler found Inf/NaN on this rank)."""
        raise NotImplementedError

    def save(self, sd: dict[str, Any]) -> None:
        """Add what this policy needs to continue to a state dict this rank is writing."""

    def check_load(self, sd: dict[str, Any], meta: dict[str, Any]) -> Any:
        """Refuse a state this policy cannot continue, before anything is loaded; returns what
        :meth:`load` needs."""
        return None

    def load(self, meta: dict[str, Any], checked: Any) -> None:
        """Take back what :meth:`save` added, after the optimizer's own state is loaded."""


class Window(Protocol):
    """What a policy that holds each rank's own parameters between votes adds (a local-steps window)."""

    def rebuilds_layout(self, steps_taken: int) -> bool:
        """Whether the layout follows ``requires_grad`` again before the next step (after ``steps_taken``
        steps)."""
        ...

    def before_step(self) -> None:
        """At the start of ``step()``, before anything else."""
        ...

    def show_shared(self) -> bool:
        """Put the ranks' common parameters in place where each rank holds its own (kept aside until
        :meth:`hide_shared` or the next step); whether it did."""
        ...

    def hide_shared(self) -> None:
        """Put back what :meth:`show_shared` kept aside."""
        ...

    def shared_values(self) -> dict[int, torch.Tensor]:
        """``id(p)`` → the ranks' common value of each parameter that holds another one now."""
        ...

    def restart_at(self, step: int) -> None:
        """The optimizer continues at ``step`` without a saved state (a model-only checkpoint)."""
        ...

    def restore_replicas(self) -> None:
        """Put a loaded state's replicas back into the parameters overwritten since the load."""
        ...


class NoWindow:
    """A :class:`Window` of a policy without one: the layout follows ``requires_grad`` at every step, and
    the parameters are the ranks' common ones."""

    def rebuilds_layout(self, steps_taken: int) -> bool:
        return True

    def before_step(self) -> None:
        pass

    def show_shared(self) -> bool:
        return False

    def hide_shared(self) -> None:
        pass

    def shared_values(self) -> dict[int, torch.Tensor]:
        return {}

    def restart_at(self, step: int) -> None:
        pass

    def restore_replicas(self) -> None:
        pass


def lion_step(
    ctx: StepContext, overflow: bool, *, here: Comm, window: set[int] | None = None, decay: bool = True
) -> bool:
    """:class:`~lioncub.optim.Lion`'s step on this rank (the same functions, bit for bit) over the
    parameters with a gradient (``window``: only those whose ``id`` it holds), with the non-finite check of
    ``ctx.checks`` (``"raise"``: on ``here``, the group whose ranks decide together) and a
    GradScaler's ``overflow``; ``decay=False``: no weight decay (an inner step of local steps). Returns
    whether it skipped."""
    groups = [
        [p for p in g["params"] if p.grad is not None and (window is None or id(p) in window)]
        for g in ctx.param_groups
    ]
    grads = [p.grad for params in groups for p in params]
    if grads and default_foreach(grads) and grads[0].device.type != "cpu":
        peaks = [t.float() for t in torch._foreach_norm(grads, float("inf"))]
    else:  # on CPU the inf norm (foreach or not) is ~11x slower than aminmax, the same values
        peaks = [max_abs(g).float() for g in grads]
    step = ctx.global_step
    if ctx.checks.nonfinite == "raise":  # raises NonFiniteGradientError on NaN/Inf
        check_step(here, peaks, step=step, layout=0, missing_grads=0, nonfinite="raise")
    if overflow or bool(peaks and not torch.isfinite(torch.stack(peaks)).all()):
        where = f"rank {ctx.comm.rank}: local " if window is not None else ""
        _log.warning("%sstep %d skipped: non-finite gradients (NaN or Inf)", where, step)
        return True
    for group, params in zip(ctx.param_groups, groups, strict=True):
        if params:
            momenta = [ctx.engine.state.momentum(p) for p in params]
            hyper = group if decay else {**group, "weight_decay": 0.0}
            update_group_(hyper, params, [p.grad for p in params], momenta)
    return False


class LionSteps(StepPolicy):
    """One process: every step is :class:`~lioncub.optim.Lion`'s (the accounting counts skipped steps)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def step(self, overflow: bool) -> None:
        skipped = lion_step(self.ctx, overflow, here=self.ctx.comm)
        self.ctx.accounting.count_skip(skipped)

    @torch.no_grad()
    def load(self, meta: dict[str, Any], checked: Any) -> None:
        """A state saved in a local-steps window's middle (by several ranks) holds this rank's replica:
        one process continues from it (its steps are Lion's, no window)."""
        ctx = self.ctx
        for group in ctx.param_groups:
            for p in group["params"]:
                replica = ctx.state.get(p, {}).pop("replica", None)
                if replica is not None:
                    p.copy_(replica)


class EveryStep(StepPolicy):
    """A vote every step: the round, then momentum sync (when due), the replica check (when due), the
    booking, and the diagnostics (when due: after the booking, their collectives are not the step's).

    Args:
        ctx: the optimizer's parts; ``rnd``: the round it runs.
        momentum_sync: which momenta are averaged, and when; ``sync_params``: those parameters.
        diagnostics_every: every k steps :mod:`lioncub.optim.diagnostics` (0: never).
    """

    def __init__(
        self,
        ctx: StepContext,
        rnd: VoteRound,
        momentum_sync: MomentumSync,
        sync_params: Sequence[torch.Tensor],
        diagnostics_every: int,
    ) -> None:
        self.ctx, self.round = ctx, rnd
        self.momentum_sync = momentum_sync
        self.sync_params = list(sync_params)
        self.diagnostics_every = diagnostics_every
        #: the overlap hook whose posted ballots the round takes (:meth:`LionCub.overlap_with`)
        self.hook: OverlapHook | None = None

    def step(self, overflow: bool) -> None:
        ctx, rnd = self.ctx, self.round
        step, times = ctx.global_step, StepTimes()
        before = ctx.accounting.snapshot()
        diagnose = bool(self.diagnostics_every) and step % self.diagnostics_every == 0
        posted = None
        if self.hook is not None:
            ballots = self.hook.collect(step, times)
            posted = None if ballots is None else (ballots, self.hook.changed_gradients())
        result = rnd.run(step, times, overflow=overflow, keep_copies=diagnose, posted=posted)
        if result is None:  # skipped: nothing is applied on any rank
            rnd.finish(before, times, skipped=True)
            return
        if self.sync_params and self.momentum_sync.due(step):
            t0 = ctx.engine.clock.mark()
            trained = [
                p for p in self.sync_params if id(p) not in result.untouched and id(p) in ctx.layout.order
            ]
            momenta = [ctx.engine.state.momentum(p) for p in trained]
            synchronize(ctx.comm, momenta, self.momentum_sync.dtype, bucket_mb=ctx.bucket_mb)
            ctx.engine.clock.book(times, "sync", t0)
        if ctx.checks.replica_check_every and step % ctx.checks.replica_check_every == 0:
            check_replicas(ctx.comm, parameter_checksum(ctx.layout.params(), ctx.comm.device), step)
        rnd.finish(before, times, skipped=False)
        if diagnose:
            self.last_diagnostics = (step, self._diagnose(result))

    def _diagnose(self, result: RoundResult) -> dict[str, dict[str, float]]:
        """:func:`lioncub.optim.diagnostics.collect` per parameter tensor, in the optimizer's parameter
        order (whatever the buckets were: the overlapped path's diagnostics are those of the plain step)."""
        ctx = self.ctx
        params = [p for b in result.ballots for p in b.params]
        directions = [
            c for b in result.ballots if b.direction is not None for c in flat_views(b.direction, b.params)
        ]
        votes = [
            u for b, up in zip(result.ballots, result.updates, strict=True) for u in flat_views(up, b.params)
        ]
        order = sorted(range(len(params)), key=lambda i: ctx.layout.order[id(params[i])])
        return diagnostics.collect(
            ctx.comm,
            [ctx.layout.names[id(params[i])] for i in order],
            [directions[i].reshape(-1) for i in order],
            [votes[i].reshape(-1) for i in order],
            [ctx.engine.state.momentum(params[i]) for i in order],
        )
