"""The vote round: one vote over the ranks, from the contributions to the applied update, over the buckets
of an optimizer's layout (:class:`VoteRound`). The step policies call it (:mod:`lioncub.optim.policies`,
:mod:`lioncub.optim.local_steps`), so does an outer rule (:mod:`lioncub.optim.outer`), and so can anything
that votes with a :class:`~lioncub.optim.LionCub`'s parts (a fault-tolerant replica group, say): the
round knows no policy.

A round, on every rank alike:

1. :meth:`VoteRound.contribute` — each bucket's contribution from the gradients in ``p.grad`` and a
   :class:`~lioncub.collectives.ParamState` (the optimizer's momenta and hyperparameters, or an outer
   rule's);
2. :meth:`VoteRound.check` — the ranks' agreement (:mod:`lioncub.optim.step_check`): step numbers,
   layouts, settings, non-finite contributions; a failed check skips the round on every rank;
3. :meth:`VoteRound.apply` — rank 0's values for parameters that joined (:class:`InitialValues`), then each
   vote posted and applied (:meth:`~lioncub.optim.engine.StepEngine.apply`); or :meth:`VoteRound.means`,
   the decoded updates for a rule that applies them itself (DiLoCo's Nesterov step);
4. :meth:`VoteRound.finish` — the round booked in :meth:`~lioncub.optim.LionCub.comm_stats`.

:meth:`VoteRound.run` is 1–3 with the vote's own apply. Every phase takes ``buckets``, a subset of the
layout's buckets (default: all of them): a shard of the parameters, or a fragment synchronised on its own
schedule, runs its own rounds over its buckets (``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lioncub.collectives import Ballot, Comm, CommCounter, ParamState
from lioncub.optim.context import StepContext
from lioncub.optim.engine import Bucket, StepTimes
from lioncub.optim.layout import ParamLayout
from lioncub.optim.replicas import broadcast_parameters
from lioncub.optim.step_check import (
    GradientChangedError,
    NonFiniteGradientError,
    StepCheck,
    StepMismatchError,
    check_step,
    grad_checksum,
    step_settings,
    warn_identical_gradients,
)

__all__ = ["InitialValues", "RoundResult", "VoteRound"]

_log = logging.getLogger("lioncub")


class InitialValues:
    """Which parameters already hold rank 0's values (``Checks.broadcast_init``), and the broadcast that
    gives them to the others: at construction every parameter of the groups, later each that joins the
    layout (``add_param_group``, unfrozen). Collective."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.given: set[int] = set()

    def give(self, param_groups: list[dict[str, Any]], layout: ParamLayout) -> None:
        """Rank 0's values to every rank for the layout's parameters that have not had them yet (at the
        first call also those of the groups outside it: frozen now, unfrozen later)."""
        if not self.given:
            frozen = [p for g in param_groups for p in g["params"] if not p.requires_grad]
            if frozen:
                broadcast_parameters(self.comm, [frozen])
                self.given.update(id(p) for p in frozen)
        new = [[p for p in b.params if id(p) not in self.given] for b in layout.buckets]
        if any(new):
            broadcast_parameters(self.comm, [ps for ps in new if ps])
            self.given.update(id(p) for ps in new for p in ps)


@dataclass
class RoundResult:
    """What a round did: ``untouched`` (``id`` of the parameters no rank had a gradient for, left alone);
    ``updates``: copies of the flat updates when asked for (diagnostics)."""

    ballots: list[Ballot]
    untouched: frozenset[int] = frozenset()
    updates: list[torch.Tensor] = field(default_factory=list)


class VoteRound:
    """One vote over the ranks with an optimizer's parts (see the module docstring).

    Args:
        ctx: the optimizer's parts: its ``param_groups`` (the settings the ranks compare), step number,
            engine, layout, accounting and checks (:class:`~lioncub.optim.context.StepContext`).
        initial: :class:`InitialValues` (``None``: no broadcast of joining parameters).
        grad_scale: the GradScaler's scale handed to the step (``None`` when none), part of the settings.
        compare_gradients: compare the gradients' checksums in the first round (the votes: identical
            gradients mean DDP averaged them; not the dense variants, which average them by design).
    """

    def __init__(
        self,
        ctx: StepContext,
        initial: InitialValues | None,
        grad_scale: Callable[[], torch.Tensor | None],
        compare_gradients: bool = True,
    ) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.comm: Comm = ctx.comm
        self.layout: ParamLayout = ctx.layout
        self.accounting = ctx.accounting
        self.checks = ctx.checks
        self.initial = initial
        self._grad_scale = grad_scale
        self._unscaled = False
        self._compared = False
        self._compare = compare_gradients
        #: where posted ballots' traffic of another group is taken from (the overlap hook), at booking
        self.overlapped_traffic: Callable[[], tuple[float, float, int]] | None = None

    @property
    def gradients_compared(self) -> bool:
        """The one-time "already averaged?" comparison of the gradients has run (the first round, or the
        first inner step of local steps), or is not to run (:meth:`skip_gradient_comparison`)."""
        return self._compared

    def skip_gradient_comparison(self) -> None:
        """No round compares the gradients from now on: the comparison ran elsewhere (a local-steps
        window's first inner step), or would run alone (a replica group that joins later)."""
        self._compared = True

    @contextlib.contextmanager
    def unscaled(self) -> Iterator[None]:
        """Within: the rounds compare no GradScaler scale among the settings (an outer step's Δ is not
        scaled: the ranks' scales may differ)."""
        self._unscaled = True
        try:
            yield
        finally:
            self._unscaled = False

    def _buckets(self, buckets: Sequence[Bucket] | None) -> Sequence[Bucket]:
        return self.layout.buckets if buckets is None else buckets

    def _params(self, buckets: Sequence[Bucket] | None) -> list[torch.Tensor]:
        return self.layout.params() if buckets is None else [p for b in buckets for p in b.params]

    # -- the phases ----------------------------------------------------------------------------------

    def contribute(
        self,
        vote_step: int,
        times: StepTimes,
        state: ParamState | None = None,
        keep_copy: bool = False,
        buckets: Sequence[Bucket] | None = None,
    ) -> list[Ballot]:
        """Every bucket's contribution (of ``buckets``; default: the layout's) for the vote of
        ``vote_step`` (its tie phase)."""
        t0 = self.engine.clock.mark()
        ballots = [
            self.engine.contribute(
                b, [p.grad for p in b.params], step=vote_step, keep_copy=keep_copy, state=state
            )
            for b in self._buckets(buckets)
        ]
        self.engine.clock.book(times, "direction", t0)
        return ballots

    def check(
        self,
        ballots: Sequence[Ballot],
        *,
        overflow: bool = False,
        changed: Sequence[str] = (),
        posted: bool = False,
        buckets: Sequence[Bucket] | None = None,
    ) -> StepCheck:
        """:func:`~lioncub.optim.step_check.check_step` on the optimizer's group (and, the first time, the
        gradients' checksum: identical gradients on every rank are warned about); ballots already
        ``posted`` (overlap) are waited for before a failed check drops them or raises, so none stays in
        flight. ``changed``: parameters whose gradients changed after an overlapped backward; ``buckets``:
        those of the ballots (default: the layout's)."""
        params = self._params(buckets)
        checksum = None
        if self._compare and not self._compared:
            checksum = grad_checksum([p.grad for p in params if p.grad is not None])
        try:
            check = check_step(
                self.comm,
                [b.peak for b in ballots],
                step=self.ctx.global_step,
                layout=self.layout.hash,
                missing_grads=sum(p.grad is None for p in params),
                overflow=overflow,
                changed=changed,
                grad_checksum=checksum,
                nonfinite=self.checks.nonfinite,
                settings=step_settings(None if self._unscaled else self._grad_scale(), self.ctx.param_groups),
            )
        except (NonFiniteGradientError, StepMismatchError, GradientChangedError):
            if posted:
                self.engine.discard(ballots)
            raise
        if checksum is not None:
            self._compared = True
            if check.identical_grads and self.comm.rank == 0:
                warn_identical_gradients(
                    "every rank votes on the same gradient (global Lion plus a pointless vote, and the "
                    "allreduce's bytes)"
                )
        if not check.ok:
            _log.warning(
                "step %d skipped on every rank: non-finite gradients (NaN or Inf) or a GradScaler overflow "
                "on rank(s) %s",
                self.ctx.global_step,
                check.bad_ranks,
            )
            if posted:
                self.engine.discard(ballots)
        return check

    def untouched(self, check: StepCheck, buckets: Sequence[Bucket] | None = None) -> frozenset[int]:
        """``id`` of the parameters (of ``buckets``; default: the layout's) whose gradient is ``None`` on
        every rank (one allreduce of one int32 per parameter tensor, on rounds where the check says some
        rank lacks a gradient); then rank 0's values for parameters that joined (the ranks agree on the
        layout now)."""
        none: frozenset[int] = frozenset()
        if check.missing_grads:
            params = self._params(buckets)
            have = torch.tensor(
                [p.grad is not None for p in params], dtype=torch.int32, device=self.comm.device
            )
            self.comm.all_reduce(have, "missing-gradient check").wait()
            none = frozenset(id(p) for p, n in zip(params, have.tolist(), strict=True) if n == 0)
        if self.initial is not None:
            self.initial.give(self.ctx.param_groups, self.layout)
        return none

    def post(self, ballots: Sequence[Ballot], vote_step: int, times: StepTimes) -> None:
        """Encode and post every ballot's vote."""
        t0 = self.engine.clock.mark()
        for ballot in ballots:
            self.engine.post(ballot, vote_step)
        self.engine.clock.book(times, "encode", t0)

    def apply(
        self,
        ballots: list[Ballot],
        untouched: frozenset[int],
        times: StepTimes,
        state: ParamState | None = None,
        keep_updates: bool = False,
    ) -> RoundResult:
        """Each posted vote waited for and applied by the vote itself (``untouched`` left alone)."""
        updates = self.engine.apply(
            ballots, times, keep_updates=keep_updates, untouched=untouched, state=state
        )
        return RoundResult(ballots, untouched, updates)

    def means(self, ballots: Sequence[Ballot], times: StepTimes) -> list[torch.Tensor]:
        """Each posted vote waited for, decoded (flat): for a rule that applies the update itself."""
        return self.engine.means(ballots, times)

    def finish(self, before: CommCounter, times: StepTimes, *, skipped: bool) -> None:
        """Book the round (and what it posted on another group) in the accounting."""
        overlapped = self.overlapped_traffic() if self.overlapped_traffic is not None else (0.0, 0.0, 0)
        self.accounting.finish_step(before, times, skipped=skipped, overlapped=overlapped)

    # -- all of it ------------------------------------------------------------------------------------

    def run(
        self,
        vote_step: int,
        times: StepTimes,
        *,
        state: ParamState | None = None,
        overflow: bool = False,
        keep_copies: bool = False,
        posted: tuple[list[Ballot], Sequence[str]] | None = None,
        buckets: Sequence[Bucket] | None = None,
    ) -> RoundResult | None:
        """Contribute (unless ``posted``: ballots the overlap hook contributed and posted during the
        backward, with the gradients changed since), check, post and apply; ``None`` when the check skips
        the round. ``keep_copies``: keep the contributions and updates (diagnostics); ``buckets``: the
        round's (default: the layout's). Not booked: the caller books the round with :meth:`finish` once
        its own work (momentum sync) is done."""
        if posted is None:
            ballots = self.contribute(vote_step, times, state, keep_copies, buckets)
            check = self.check(ballots, overflow=overflow, buckets=buckets)
        else:
            ballots = posted[0]
            check = self.check(ballots, overflow=overflow, changed=posted[1], posted=True, buckets=buckets)
        if not check.ok:
            return None
        untouched = self.untouched(check, buckets)
        if posted is None:
            self.post(ballots, vote_step, times)
        return self.apply(ballots, untouched, times, state, keep_copies)
