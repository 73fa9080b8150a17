r"""``LionCub``: Lion for data-parallel training where the workers vote on the update.

What happens in one ``step()`` on rank i of N (the one description of the step; the modules it names
point back here):

1. **Buckets.** The parameters that require grad are grouped, in ``param_groups`` order, into dtype- and
   device-homogeneous buckets of at most ``bucket_mb`` MiB (:mod:`lioncub.optim.layout`); each bucket's
   contributions are written into one flat buffer and travel in one vote, so a step issues a few
   collectives, not one per tensor. Each bucket's backend (fused C kernels, Triton, torch) is chosen when
   the buckets are built.
2. **Contribution.** For every parameter, ``c_i = β1·m_i + (1−β1)·g_i`` from this rank's *local*
   gradient ``g_i`` and this rank's own momentum ``m_i`` (never communicated). The ``"32bit"`` /
   ``"16bit"`` presets contribute the gradient instead and run global Lion (``m`` identical on all
   ranks), exactly as DDP + :class:`~lioncub.optim.lion.Lion`.
3. **Check.** One all-gather of a few int32 per rank (:mod:`lioncub.optim.step_check`): the ranks agree
   on the step number and the parameter layout, and a step with NaN/Inf on any rank is skipped (or
   raises) on every rank before anything is sent.
4. **Vote, overlapped.** Every bucket's vote is posted (quantize, pack, the asynchronous collective)
   before the first one is awaited, so the encoding of bucket b+1 overlaps the communication of bucket
   b. The vote (:mod:`lioncub.collectives`) returns the same update ``u`` on every rank: ``{−1, 0, +1}``
   for majority votes, the mean of the signs for D-Lion Avg.
5. **Apply.** ``p ← p·(1 − lr·wd) − lr·u`` with each parameter's own group ``lr`` and ``weight_decay``
   read at every step (LR schedulers work), then ``m_i ← β2·m_i + (1−β2)·g_i``.

Steps 2, 4 and 5 are the vote's protocol (:mod:`lioncub.collectives.protocol`), walked bucket by bucket by
:class:`~lioncub.optim.engine.StepEngine`. With :meth:`LionCub.overlap_with` (a DDP model) steps 2 and 4
run during the backward pass instead, per DDP gradient bucket as backward produces it
(:mod:`lioncub.optim.overlap`), and ``step()`` checks, waits for the votes and applies them; the result is
bit for bit the same.

The tie rule of the 1-bit vote alternates with the optimizer step (+1 on odd steps, −1 on even steps);
the step counter is part of the state dict, so resuming keeps the phase. A parameter whose gradient is
``None`` counts as a zero gradient, so that every rank keeps voting on the same layout.

Deviations from the authors' research code, on purpose: learning rate and weight decay come from the
param groups at every step (of the authors' classes, only the 1-bit one and their 4-bit L1 variant read
lr and weight decay from the constructor; their plain 4-bit vote reads the param groups, as here); the
1-bit result is not masked where this rank's ``c`` is exactly zero (that mask makes replicas diverge when
workers disagree); the 4-bit vote is ``sign(2·count − N)`` (correct for odd N); the world size comes from
the process group, never from launcher variables.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lioncub.collectives import Ballot, Comm, CommCounter, ParamState, flat_views
from lioncub.ops.quantize import max_abs
from lioncub.optim import diagnostics, topology
from lioncub.optim.accounting import Accounting
from lioncub.optim.arguments import check_group, check_local_steps, check_options, vote_config
from lioncub.optim.config import VoteConfig
from lioncub.optim.engine import StepEngine, StepTimes
from lioncub.optim.factory import make_vote
from lioncub.optim.layout import ParamLayout, named_parameters
from lioncub.optim.lion import LeanOptimizer, check_lion_hyperparameters, default_foreach, update_group_
from lioncub.optim.local_steps import LocalSteps, WindowedSteps
from lioncub.optim.overlap import OverlapHook, overlap_group
from lioncub.optim.replicas import (
    ReplicaDivergenceError,
    ReplicaMismatchError,
    broadcast_parameters,
    check_replicas,
    check_same_parameters,
    parameter_checksum,
)
from lioncub.optim.state_dict import PerRankState
from lioncub.optim.step_check import (
    NONFINITE_MODES,
    Checks,
    GradientChangedError,
    NonFiniteGradientError,
    StepCheck,
    StepMismatchError,
    check_step,
    grad_checksum,
    step_settings,
    warn_identical_gradients,
)
from lioncub.optim.sync import MomentumSync, select_parameters, synchronize

__all__ = [
    "NONFINITE_MODES",
    "Checks",
    "GradientChangedError",
    "LionCub",
    "NonFiniteGradientError",
    "ReplicaDivergenceError",
    "ReplicaMismatchError",
    "StepMismatchError",
]

_log = logging.getLogger("lioncub")


class LionCub(PerRankState, WindowedSteps, LeanOptimizer):
    """Distributed Lion / Lion Cub: each rank keeps its own momentum and the ranks vote on the update.

    Args:
        params: parameters or param groups (the same, in the same order, on every rank).
        lr, betas, weight_decay: as :class:`~lioncub.optim.lion.Lion` (per param group).
        variant: a preset of :data:`lioncub.optim.config.PRESETS` — ``"32bit"``, ``"16bit"``, ``"1bit"``,
            ``"4bit"``, ``"8bit"`` (default), ``"8bit-sign"``, ``"dlion-mavo"``, ``"dlion-avg"`` — or a
            :class:`~lioncub.optim.config.VoteConfig`, e.g. ``resolve_variant("8bit", quantizer="l0")``.
            The cost model's choice for a network is :func:`lioncub.planning.auto.auto_variant`.
        process_group: the data-parallel group (default: the default group); for a ``variant`` whose
            ``topology`` is not ``"flat"``, a ``DeviceMesh`` with dims ``("node", "local")``
            (:mod:`lioncub.optim.topology`; default: built from torchrun's ``$LOCAL_WORLD_SIZE``).
        bucket_mb: bucket size cap in MiB of parameter bytes.
        momentum_sync: average some momenta over the ranks at some steps: a
            :class:`~lioncub.optim.sync.MomentumSync`, or its ``params`` alone (``"none"`` (default),
            ``"all"``, ``"io"`` or a list of parameter-name patterns / param-group names) with the paper's
            schedule (every 10 steps).
        model: the module whose parameters these are: names them (``"io"`` sync, name patterns, errors).
        checks: :class:`Checks` (initial broadcast, replica checksums, NaN/Inf handling).
        diagnostics_every: every k steps compute :mod:`lioncub.optim.diagnostics` (match/flip against the
            full-precision vote, tie rate, momentum spread, update shape) into :attr:`last_diagnostics`;
            this costs extra collectives on those steps only (not counted in :meth:`comm_stats`). 0: off.
        maximize: maximise instead of minimise.
        local_steps: :class:`~lioncub.optim.local_steps.LocalSteps`: H local Lion steps per rank, then one
            outer step on the pseudo-gradients (a vote every H steps); an int H is ``LocalSteps(h=H)``, a
            dict its fields; ``None`` (default): a vote every step.

    At construction every rank checks that all ranks hold the same parameter list (names, shapes, dtypes,
    order: one hash all-gathered) and raises :class:`ReplicaMismatchError` naming the first difference.
    """

    #: ``torch.amp.GradScaler.step`` always calls :meth:`step`, with ``grad_scale`` and ``found_inf`` set
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        variant: str | VoteConfig = "8bit",
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        momentum_sync: MomentumSync | str | Sequence[str] = "none",
        model: torch.nn.Module | None = None,
        checks: Checks = Checks(),
        diagnostics_every: int = 0,
        maximize: bool = False,
        local_steps: LocalSteps | int | Mapping[str, Any] | None = None,
    ) -> None:
        config, self.variant = vote_config(variant)
        check_options(config, self.variant, bucket_mb, model, checks, diagnostics_every)
        #: H local steps per outer step (:mod:`lioncub.optim.local_steps`), or ``None``: a vote every step
        self.local_steps = check_local_steps(
            local_steps, config, self.variant, momentum_sync, diagnostics_every
        )
        self._ready = False  # add_param_group: the base constructor calls it before the rest exists
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))
        for index, group in enumerate(self.param_groups):
            check_group(group, index)
        self.config: VoteConfig = config
        self.checks = checks
        if not isinstance(momentum_sync, MomentumSync):
            momentum_sync = MomentumSync(momentum_sync)
        self.momentum_sync = momentum_sync
        self.diagnostics_every = diagnostics_every
        self.bucket_mb = bucket_mb
        device = _device_of(self.param_groups)
        group, levels = _groups(config, process_group, device)
        if group is False:
            self.comm = Comm.single(device)
        else:
            self.comm = Comm(group, device=device, exchange=config.exchange)  # type: ignore[arg-type]
        #: one process (no process group, or a group of one): every step is :class:`~lioncub.optim.Lion`'s
        #: (unless built under :func:`lioncub.collectives.base.exchange_when_alone`)
        self.single_process = self.comm.alone
        if self.single_process:
            _log.info("LionCub: one process (world size 1): no vote, every step is lioncub.Lion's step")
            config, levels = dataclasses.replace(config, topology="flat"), None  # nothing is laid over nodes
        named = named_parameters(self.param_groups, model)
        if not self.single_process:
            check_same_parameters(self.comm, named, self.param_groups)
        #: the contributions, votes and apply of the step (:mod:`lioncub.optim.engine`)
        self.engine = StepEngine(make_vote(self.comm, config, levels), self)
        self._global_step = 0
        self.layout = ParamLayout(bucket_mb, {id(p): n for n, p in named})
        self._broadcast: set[int] = set()  # parameters rank 0's values were copied to (broadcast_init)
        self._overlap: OverlapHook | None = None
        self._grad_scale: torch.Tensor | None = None  # the GradScaler's scale handed to this step
        self._refresh_layout()
        # the one-time "already averaged?" check of the first step (local steps: of the first inner step)
        self._grads_compared = False
        self._consolidated: list[dict[str, Any]] | None = None
        self._pending_replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # load_state_dict's
        self.window_decay: list[float] = []  # local steps: the window's weight decay per param group
        self._ready = True
        self.accounting = Accounting(self.comm, () if levels is None else levels)
        #: names of the parameters whose momenta are synchronized (see :mod:`lioncub.optim.sync`)
        self.sync_names, self._sync_params = self._select_sync(named, model)
        #: the diagnostics of the last step that computed them: ``(step, {name: {...}, "overall": {...}})``
        self.last_diagnostics: tuple[int, dict[str, dict[str, float]]] | None = None
        if checks.broadcast_init and not self.single_process:
            self._broadcast_new()

    # -- construction --------------------------------------------------------------------------------

    def _select_sync(
        self, named: list[tuple[str, torch.Tensor]], model: torch.nn.Module | None
    ) -> tuple[list[str], list[torch.Tensor]]:
        spec = self.momentum_sync.params
        chosen = select_parameters(spec, named, self.param_groups, model)
        if chosen and self.config.transport == "dense":
            raise ValueError(
                f"momentum_sync={spec!r}: variant={self.variant!r} keeps one global momentum already; "
                "momentum sync applies to the voting variants"
            )
        if chosen and self.comm.rank == 0:
            _log.info(
                "momentum sync %r %s: %d tensors, %d elements: %s",
                spec,
                self.momentum_sync.describe(),
                len(chosen),
                sum(p.numel() for _, p in chosen),
                ", ".join(n for n, _ in chosen),
            )
        return [n for n, _ in chosen], [p for _, p in chosen]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters join the vote from the next ``step()`` on (every rank must
        add the same parameters, in the same order: the next step's check compares the ranks), which also
        copies rank 0's values of them to every rank (``Checks.broadcast_init``)."""
        super().add_param_group(param_group)
        if self._ready:
            try:
                check_group(self.param_groups[-1], len(self.param_groups) - 1)
            except (ValueError, TypeError):
                self.param_groups.pop()
                raise

    def _refresh_layout(self) -> None:
        """Rebuild the buckets when the parameters that require grad changed (``requires_grad_``,
        :meth:`add_param_group`); the layout hash travels in every step's check, so ranks that changed
        differently are named instead of voting on different layouts."""
        if not self.layout.changed(self.param_groups):
            return
        if self.layout.built and self._overlap is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: LionCub: the trainable parameters changed (requires_grad_ or "
                "add_param_group) after overlap_with(): DDP's buckets are fixed; freeze or add parameters "
                "before wrapping the model in DDP and calling overlap_with, or use the plain step"
            )
        self.layout.rebuild(self.param_groups)
        self.engine.state.refresh()

    def _broadcast_new(self) -> None:
        """Copy rank 0's values to every rank for the optimized parameters that have not had them yet
        (at construction, and those that join later: add_param_group, unfrozen). Collective."""
        if not self._broadcast:  # construction: every parameter, also those frozen now (unfrozen later)
            frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
            if frozen:
                broadcast_parameters(self.comm, [frozen])
                self._broadcast.update(id(p) for p in frozen)
        new = [[p for p in b.params if id(p) not in self._broadcast] for b in self.layout.buckets]
        if any(new):
            broadcast_parameters(self.comm, [ps for ps in new if ps])
            self._broadcast.update(id(p) for ps in new for p in ps)

    # -- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step (collective: every rank of the group must call it).

        Parameters whose gradient is ``None`` on every rank are not touched (no update, no decay, no
        momentum change); where only some ranks have one, the others vote with a zero gradient. Under a
        ``torch.amp.GradScaler`` (``scaler.step(opt)``) the gradients are unscaled here and an overflow on
        any rank skips the step on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            check_lion_hyperparameters(group)
            if not isinstance(group["maximize"], bool):
                check_group(group, index)  # names it
        self._consolidated = None
        self.put_back_replicas()  # a window's replicas of a loaded state, whatever was loaded after it
        overflow = self._unscale()
        if self.local_steps is None or self._global_step % self.local_steps.h == 0:
            self._refresh_layout()  # local steps: at window starts only (the window's layout is fixed)
        self._global_step += 1
        self.comm.step = self._global_step
        if self.single_process:
            self._lion_step(overflow)
        elif self.local_steps is not None:
            self._local_step(overflow)
        else:
            self._vote_step(overflow)
        return loss

    def _unscale(self) -> bool:
        """Under a GradScaler: unscale the gradients in place; returns whether it found an overflow."""
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if (scale is not None or found_inf is not None) and self._overlap is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: LionCub: a GradScaler (fp16) with overlap_with(): the votes "
                "started during the backward on scaled gradients. Use bf16 autocast (no scaler), or the "
                "plain step (lioncub.optim.ddp.skip_gradient_allreduce(model) instead of overlap_with)"
            )
        self._grad_scale = scale
        if scale is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        return found_inf is not None and bool(found_inf.item() > 0)

    def _vote_step(
        self,
        overflow: bool,
        state: ParamState | None = None,
        vote_step: int | None = None,
        before: CommCounter | None = None,
        times: StepTimes | None = None,
    ) -> frozenset[int] | None:
        """One vote over the ranks, applied: ``p.grad`` as the gradients, ``state``'s momenta and
        hyperparameters (the optimizer's by default), ``vote_step`` as the vote's step (its tie phase; the
        optimizer step by default), booked as one step from ``before`` with ``times`` (from now by
        default). Returns ``None`` when it was skipped, else the ``id`` of the parameters it left untouched
        (no gradient on any rank)."""
        step = self._global_step
        vote_step = step if vote_step is None else vote_step
        before = self.accounting.snapshot() if before is None else before
        times = StepTimes() if times is None else times
        diagnose = bool(self.diagnostics_every) and step % self.diagnostics_every == 0
        ballots = self._overlap.collect(step, times) if self._overlap is not None else None
        posted = ballots is not None  # overlapped: contributed and posted during the backward
        if ballots is None:
            t0 = self.engine.clock()
            grads = {"step": vote_step, "keep_copy": diagnose, "state": state}
            ballots = [
                self.engine.contribute(b, [p.grad for p in b.params], **grads) for b in self.layout.buckets
            ]
            times.direction += self.engine.clock() - t0
        check = self._check_step(ballots, posted, overflow)
        if not check.ok:  # skipped: nothing is applied on any rank
            self._finish_step(before, times, skipped=True)
            return None
        untouched = self._without_gradient() if check.missing_grads else frozenset()
        if self.checks.broadcast_init:  # parameters that joined since the last step (the ranks agree)
            self._broadcast_new()
        if not posted:
            t0 = self.engine.clock()
            for ballot in ballots:
                self.engine.post(ballot, vote_step)
            times.encode += self.engine.clock() - t0
        updates = self.engine.apply(ballots, times, keep_updates=diagnose, untouched=untouched, state=state)
        if self._sync_params and self.momentum_sync.due(step):
            t0 = self.engine.clock()
            self._sync_momenta(untouched)
            times.sync += self.engine.clock() - t0
        if self.checks.replica_check_every and vote_step % self.checks.replica_check_every == 0:
            self.check_replicas()
        self._finish_step(before, times, skipped=False)
        if diagnose:  # after the accounting: its collectives are not the step's
            self.last_diagnostics = (step, self._diagnose(ballots, updates))
        return untouched

    def _finish_step(self, before: Any, times: StepTimes, *, skipped: bool) -> None:
        overlapped = self._overlap.take_traffic() if self._overlap is not None else (0.0, 0.0, 0)
        self.accounting.finish_step(before, times, skipped=skipped, overlapped=overlapped)

    def _lion_step(self, overflow: bool, local: bool = False) -> bool:
        """:class:`~lioncub.optim.Lion`'s step on this rank (the same functions, bit for bit), with the
        non-finite check of :class:`Checks` (``nonfinite``) and a GradScaler's overflow: one process, or
        (``local``) an inner step of local steps, decided by this rank alone. Returns whether it skipped."""
        window = {id(p) for p in self.layout.params()} if local else None  # the window's parameters
        groups = [[p for p in g["params"] if p.grad is not None and (local is False or id(p) in window)]
                  for g in self.param_groups]  # fmt: skip
        grads = [p.grad for params in groups for p in params]
        if grads and default_foreach(grads) and grads[0].device.type != "cpu":
            peaks = [t.float() for t in torch._foreach_norm(grads, float("inf"))]
        else:  # on CPU the inf norm (foreach or not) is ~11x slower than aminmax, the same values
            peaks = [max_abs(g).float() for g in grads]
        if self.checks.nonfinite == "raise":  # raises NonFiniteGradientError on NaN/Inf
            here = Comm.single() if local else self.comm
            check_step(here, peaks, step=self._global_step, layout=0, missing_grads=0, nonfinite="raise")
        skip = overflow or bool(peaks and not torch.isfinite(torch.stack(peaks)).all())
        if not local:
            self.accounting.count_skip(skip)
        if skip:
            where = f"rank {self.comm.rank}: local " if local else ""
            _log.warning("%sstep %d skipped: non-finite gradients (NaN or Inf)", where, self._global_step)
            return True
        for group, params in zip(self.param_groups, groups, strict=True):
            if params:
                momenta = [self.engine.state.momentum(p) for p in params]
                # an inner step decays nothing: the window's decay is applied at its outer step
                hyper = {**group, "weight_decay": 0.0} if local else group
                update_group_(hyper, params, [p.grad for p in params], momenta)
        return False

    def _check_step(self, ballots: Sequence[Ballot], posted: bool, overflow: bool) -> StepCheck:
        """:func:`lioncub.optim.step_check.check_step` on the optimizer's group (step numbers, layouts,
        NaN/Inf, gradients changed after an overlapped backward, the first step's "already averaged?"
        check); votes already posted (overlap) are waited for before the step is dropped or raises, so none
        stays in flight."""
        params = self.layout.params()
        checksum = None
        if not self._grads_compared and self.config.transport != "dense":
            checksum = grad_checksum([p.grad for p in params if p.grad is not None])
        changed = self._overlap.changed_gradients() if posted and self._overlap is not None else []
        try:
            check = check_step(
                self.comm,
                [b.peak for b in ballots],
                step=self._global_step,
                layout=self.layout.hash,
                missing_grads=sum(p.grad is None for p in params),
                overflow=overflow,
                changed=changed,
                grad_checksum=checksum,
                nonfinite=self.checks.nonfinite,
                settings=step_settings(self._grad_scale, self.param_groups),
            )
        except (NonFiniteGradientError, StepMismatchError, GradientChangedError):
            if posted:
                self.engine.discard(ballots)
            raise
        if checksum is not None:
            self._grads_compared = True
            if check.identical_grads and self.comm.rank == 0:
                warn_identical_gradients(
                    "every rank votes on the same gradient (global Lion plus a pointless vote, and the "
                    "allreduce's bytes)"
                )
        if not check.ok:
            _log.warning(
                "step %d skipped on every rank: non-finite gradients (NaN or Inf) or a GradScaler overflow "
                "on rank(s) %s",
                self._global_step,
                check.bad_ranks,
            )
            if posted:
                self.engine.discard(ballots)
        return check

    def _without_gradient(self) -> frozenset[int]:
        """``id`` of the optimized parameters whose gradient is ``None`` on every rank (one allreduce of
        one int32 per parameter tensor; only on steps where some rank lacks a gradient)."""
        params = self.layout.params()
        have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(have, "missing-gradient check").wait()
        return frozenset(id(p) for p, n in zip(params, have.tolist(), strict=True) if n == 0)

    def _sync_momenta(self, untouched: frozenset[int]) -> None:
        """Average the chosen momenta over the ranks (:func:`lioncub.optim.sync.synchronize`), of the
        parameters being trained (those frozen or without a gradient on every rank keep theirs)."""
        trained = [p for p in self._sync_params if id(p) not in untouched and id(p) in self.layout.order]
        synchronize(self.comm, [self.engine.state.momentum(p) for p in trained], self.momentum_sync.dtype)

    # -- overlap ---------------------------------------------------------------------------------------

    def overlap_with(
        self, model: torch.nn.parallel.DistributedDataParallel, process_group: dist.ProcessGroup | None = None
    ) -> OverlapHook | None:
        """Start each bucket's vote during the backward pass of ``model`` (a
        :class:`~torch.nn.parallel.DistributedDataParallel` wrapping the optimized parameters): registers
        the communication hook of :mod:`lioncub.optim.overlap` (instead of
        :func:`lioncub.optim.ddp.skip_gradient_allreduce`); :meth:`step` then waits for the votes and
        applies them. Results are bitwise those of the step without overlap. Collective: every rank calls
        it (it creates ``process_group``, the group the votes travel on, if not given). Returns the hook
        (``None`` on one process, where there is no vote to overlap)."""
        if self.local_steps is not None:
            raise ValueError(
                "overlap_with: with local_steps there is no vote in the backward (the ranks vote every "
                f"{self.local_steps.h} steps, in step()); use skip_gradient_allreduce(model)"
            )
        if self.single_process:
            _log.info("LionCub.overlap_with: one process, no vote to overlap: the plain step runs")
            return None
        if self._overlap is not None:
            raise RuntimeError("overlap_with: this optimizer already overlaps its votes with a model")
        if self.config.topology != "flat":
            raise ValueError(
                f"overlap_with: topology={self.config.topology!r} votes run after the backward (the overlap "
                "hook votes flat); use the plain step, or topology='flat'"
            )
        comm = overlap_group(model, self.comm, process_group)
        ordered = sorted(self.layout.order, key=self.layout.order.__getitem__)
        self._overlap = OverlapHook(
            model,
            StepEngine(make_vote(comm, self.config), self),
            next_step=lambda: self._global_step + 1,
            diagnostics_every=self.diagnostics_every,
            names={i: self.layout.names[i] for i in ordered},
        )
        return self._overlap

    # -- diagnostics, accounting -----------------------------------------------------------------------

    def _diagnose(
        self, ballots: Sequence[Ballot], updates: list[torch.Tensor]
    ) -> dict[str, dict[str, float]]:
        """:func:`lioncub.optim.diagnostics.collect` per parameter tensor, in the optimizer's parameter
        order (whatever the buckets were: the overlapped path's diagnostics are those of the plain step)."""
        params = [p for b in ballots for p in b.params]
        directions = [c for b in ballots for c in flat_views(b.direction, b.params)]  # type: ignore[arg-type]
        votes = [u for b, update in zip(ballots, updates, strict=True) for u in flat_views(update, b.params)]
        order = sorted(range(len(params)), key=lambda i: self.layout.order[id(params[i])])
        return diagnostics.collect(
            self.comm,
            [self.layout.names[id(params[i])] for i in order],
            [directions[i].reshape(-1) for i in order],
            [votes[i].reshape(-1) for i in order],
            [self.engine.state.momentum(params[i]) for i in order],
        )

    def parameter_checksum(self) -> torch.Tensor:
        """int64 ``[2]``: :func:`lioncub.optim.replicas.parameter_checksum` of the optimized parameters."""
        return parameter_checksum(self.layout.params(), self.comm.device)

    def check_replicas(self) -> None:
        """Compare parameter checksums across ranks; raise :class:`ReplicaDivergenceError` on a mismatch."""
        check_replicas(self.comm, self.parameter_checksum(), self._global_step)

    def comm_stats(self) -> dict[str, dict[str, float | int]]:
        """Bytes sent/received by this rank, collectives issued, and the step's time split (seconds:
        ``direction_s``, ``encode_s``, ``exchange_s``, ``apply_s``, ``sync_s`` (momentum sync),
        ``overlapped_s`` (with :meth:`overlap_with`: the contributions, quantize/pack and between-phase
        work done during the backward; ``exchange_s`` is then what the step still waited for) and
        ``communication_s`` = encode + exchange + sync), for the ``"last"`` step and the ``"total"`` since
        construction. With a ``topology`` other than flat, ``intra_node_bytes_sent/recv`` and
        ``inter_node_bytes_sent/recv`` split the vote's bytes by level (the step check travels on the flat
        group and is in ``bytes_sent`` only)."""
        return self.accounting.stats(self._global_step)

    # -- properties ------------------------------------------------------------------------------------

    def _engines(self) -> list[StepEngine]:
        """The plain step's engine, then the overlap hook's (whose stochastic quantizer draws when
        overlapping)."""
        return [self.engine] + ([self._overlap.engine] if self._overlap is not None else [])

    @property
    def bucket_numels(self) -> list[int]:
        """Elements per bucket, in the order the buckets are voted on."""
        return [b.numel for b in self.layout.buckets]

    @property
    def overlap_hook(self) -> OverlapHook | None:
        """The DDP communication hook of :meth:`overlap_with` (``None`` when not overlapping)."""
        return self._overlap

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (drives the 1-bit tie rule)."""
        return self._global_step


def _device_of(param_groups: list[dict[str, Any]]) -> torch.device:
    """The one device of the parameters (the votes' buffers and collectives live there); ``ValueError``
    naming the devices when they are several."""
    devices = sorted({p.device for g in param_groups for p in g["params"]}, key=str)
    if len(devices) > 1:
        raise ValueError(
            f"LionCub: the parameters are on several devices ({', '.join(map(str, devices))}); the votes of "
            "one optimizer run on one device: give each device's parameters an optimizer of their own"
        )
    return devices[0] if devices else torch.device("cpu")


def _groups(
    config: VoteConfig, process_group: Any, device: torch.device
) -> tuple[dist.ProcessGroup | bool | None, tuple[Comm, Comm] | None]:
    """(the flat group — ``False`` when there is no process group at all —, the (intra-node, inter-node)
    groups, on ``device``, of a topology other than flat) for the ``process_group`` argument."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return False, None
    if config.topology == "flat":
        if topology.is_mesh(process_group):
            raise ValueError(
                "process_group: a DeviceMesh is for a topology other than 'flat' (VoteConfig.topology)"
            )
        return process_group, None
    mesh = process_group if topology.is_mesh(process_group) else None
    if mesh is None and process_group is not None:
        raise ValueError(
            f"topology={config.topology!r}: process_group must be a DeviceMesh with dims "
            f"{topology.MESH_DIMS} (or None: built from torchrun's $LOCAL_WORLD_SIZE)"
        )
    mesh = mesh or topology.mesh_from_environment(config.topology, device)
    flat, intra, inter = topology.node_groups(mesh, config.exchange, device)
    return flat, (intra, inter)
