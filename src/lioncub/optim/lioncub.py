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

Steps 2 to 5 are one vote round (:class:`~lioncub.optim.round.VoteRound`), which walks the vote's
protocol (:mod:`lioncub.collectives.protocol`) bucket by bucket through
:class:`~lioncub.optim.engine.StepEngine`; how a step uses the round is a policy the optimizer composes
(:mod:`lioncub.optim.policies`: one process, a vote every step; :mod:`lioncub.optim.local_steps`: H local
steps and an outer rule). With :meth:`LionCub.overlap_with` (a DDP model) steps 2 and 4
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

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lioncub.collectives import Comm
from lioncub.optim import topology
from lioncub.optim.accounting import Accounting
from lioncub.optim.arguments import check_group, check_local_steps, check_options, vote_config
from lioncub.optim.config import VoteConfig
from lioncub.optim.context import StepContext
from lioncub.optim.engine import StepEngine
from lioncub.optim.factory import make_vote
from lioncub.optim.layout import ParamLayout, named_parameters
from lioncub.optim.lion import LeanOptimizer, check_lion_hyperparameters
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.modes import STEP_MODES, PolicyOptions, step_mode
from lioncub.optim.overlap import OverlapHook, overlap_group
from lioncub.optim.policies import EveryStep
from lioncub.optim.replicas import (
    ReplicaDivergenceError,
    ReplicaMismatchError,
    check_replicas,
    check_same_parameters,
    parameter_checksum,
)
from lioncub.optim.round import InitialValues, VoteRound
from lioncub.optim.shard_state import from_checkpoint, is_checkpoint_form, state_keys, to_checkpoint
from lioncub.optim.shards import ShardView, ShareView, check_shard_options, part_view, refuse_unsharded_mesh
from lioncub.optim.state_dict import StateOwner, consolidated_entry, gather_states, restore_meta, state_meta
from lioncub.optim.step_check import (
    NONFINITE_MODES,
    Checks,
    GradientChangedError,
    NonFiniteGradientError,
    StepMismatchError,
)
from lioncub.optim.sync import MomentumSync, select_parameters
from lioncub.optim.topology import VoteMesh
from lioncub.optim.windows import check_group_sizes

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


class LionCub(LeanOptimizer):
    """Distributed Lion / Lion Cub: each rank keeps its own momentum and the ranks vote on the update.

    Args:
        params: parameters or param groups (the same, in the same order, on every rank; on one device).
        lr: with ``betas``, ``weight_decay`` and ``maximize``, as :class:`~lioncub.optim.lion.Lion` (per param
            group).
        variant: how the ranks vote — a preset of :data:`lioncub.optim.config.PRESETS` (``"32bit"``,
            ``"16bit"``, ``"1bit"``, ``"4bit"``, ``"8bit"`` (default), ``"8bit-sign"``, ``"dlion-mavo"``,
            ``"dlion-avg"``) or a :class:`~lioncub.optim.config.VoteConfig`, e.g.
            ``resolve_variant("8bit", quantizer="l0")``; the cost model's choice for a network is
            :func:`lioncub.planning.auto.auto_variant`.
        process_group: who votes with whom, and on which part of the model (one argument, resolved by
            :func:`lioncub.optim.topology.who_votes`; docs/shards.md, "How to say it"):
            ``None`` (default) — the default process group; refused (``RuntimeError`` naming
            ``init_process_group``) under a launcher (``$WORLD_SIZE`` > 1, ``$RANK`` set) with no default
            group initialised; ``"local"`` — this process alone, every step :class:`~lioncub.optim.lion.
            Lion`'s; a ``ProcessGroup`` — its ranks vote (the flat case; a
            :class:`~lioncub.collectives.GroupComm`, whose members change, is one:
            :mod:`lioncub.integrations.torchft`); a ``DeviceMesh`` with a replicate dimension, and
            optionally a shard dimension — ``("replicate",)``: flat over it; ``("replicate", "shard")``:
            each rank votes with its ``"replicate"`` group on its part of the model, with FSDP2's
            parameters (``DTensor`` s placed ``Shard(0)`` by ``fully_shard(module, mesh=mesh["shard"])``)
            its local shards, bit for bit the unsharded vote (:mod:`lioncub.optim.shards`), with plain
            parameters (DDP inside the shard dimension) its share of whole tensors, broadcast to its
            ``"shard"`` group after each step; ``("node", "local")``: the replicate dimension laid over
            nodes, for a ``variant`` whose ``topology`` is not ``"flat"`` (default for those: built from
            torchrun's ``$LOCAL_WORLD_SIZE``, :mod:`lioncub.optim.topology`). A hand-built
            :class:`~lioncub.collectives.Comm` is deprecated (pass its process group).
        local_steps: how often — :class:`~lioncub.optim.local_steps.LocalSteps`: H local Lion steps per
            rank, then one outer step on the pseudo-gradients (a vote every H steps); an int H is
            ``LocalSteps(h=H)``, a dict its fields; ``None`` (default): a vote every step.
        model: the module whose parameters these are: names them (``"io"`` sync, name patterns, errors).
        bucket_mb: bucket size cap in MiB of parameter bytes. It and the three below tune the step, with
            defaults that rarely need a change.
        momentum_sync: average some momenta over the ranks at some steps: a
            :class:`~lioncub.optim.sync.MomentumSync`, or its ``params`` alone — ``"none"`` (default),
            ``"all"``, ``"io"`` or parameter-name patterns / param-group names — every 10 steps.
        checks: :class:`Checks`: initial broadcast, replica checksums, NaN/Inf handling.
        diagnostics_every: every k steps :mod:`lioncub.optim.diagnostics` into :attr:`last_diagnostics`,
            with extra collectives on those steps; 0: off.

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
        process_group: dist.ProcessGroup | DeviceMesh | VoteMesh | str | Comm | None = None,
        local_steps: LocalSteps | int | Mapping[str, Any] | None = None,
        model: torch.nn.Module | None = None,
        maximize: bool = False,
        bucket_mb: float = 25.0,
        momentum_sync: MomentumSync | str | Sequence[str] = "none",
        checks: Checks = Checks(),
        diagnostics_every: int = 0,
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
        self.momentum_sync = (
            momentum_sync if isinstance(momentum_sync, MomentumSync) else MomentumSync(momentum_sync)
        )
        self.diagnostics_every = diagnostics_every
        self.bucket_mb = bucket_mb
        self._global_step = 0
        levels = self._vote_groups(config, process_group, _device_of(self.param_groups))
        #: one process (no process group, or a group of one): every step is :class:`~lioncub.optim.Lion`'s
        #: (unless built under :func:`lioncub.collectives.base.exchange_when_alone`)
        self.single_process = self.comm.alone
        if self.single_process:
            _log.info("LionCub: one process (world size 1): no vote, every step is lioncub.Lion's step")
            config, levels = dataclasses.replace(config, topology="flat"), None  # nothing is laid over nodes
        named = named_parameters(self.param_groups, model)
        if not self.single_process and self.comm.fixed_members:  # a GroupComm: no quorum yet
            check_same_parameters(self.comm, named, self.param_groups)
        #: the contributions, votes and apply of the step (:mod:`lioncub.optim.engine`)
        self.engine = self._engine(config, levels)
        names = {id(p): n for n, p in named} if self.shards is None else self.shards.names(named)
        #: which parameters a step votes on, in which buckets (:mod:`lioncub.optim.layout`)
        self.layout = ParamLayout(bucket_mb, names, None if self.shards is None else self.shards.weight)
        self._overlap: OverlapHook | None = None
        #: the GradScaler's scale this step was handed (``None``: none), part of the settings compared
        self.applied_scale: torch.Tensor | None = None
        self._refresh_layout()
        self._consolidated: list[dict[str, Any] | None] | None = None
        self._ready = True
        self.accounting = Accounting(self.comm, () if levels is None else levels)
        #: the parts the round, the policy and the outer rule work with (:mod:`lioncub.optim.context`)
        self.ctx = StepContext(
            self._view, self.comm, self.engine, self.layout, self.accounting, checks, bucket_mb
        )
        initial = InitialValues(self.comm) if checks.broadcast_init and not self.single_process else None
        #: the vote round the step policy runs (:mod:`lioncub.optim.round`)
        self.round = VoteRound(
            self.ctx, initial, grad_scale=lambda: self.applied_scale,
            compare_gradients=config.transport != "dense",
        )  # fmt: skip
        chosen = self._select_sync(named, model)
        #: names of the parameters whose momenta are synchronized (see :mod:`lioncub.optim.sync`)
        self.sync_names = [n for n, _ in chosen]
        synced = [p if self.shards is None else self.shards.alias(p) for _, p in chosen]
        options = PolicyOptions(self.local_steps, self.momentum_sync, synced, diagnostics_every)
        #: how a step runs (:mod:`lioncub.optim.policies`), and its window (local steps; else none),
        #: picked by the mode (:mod:`lioncub.optim.modes`)
        self.policy, self.window = STEP_MODES[step_mode(self.single_process, self.local_steps)](
            self.ctx, self.round, options
        )
        self._give_initial(initial)

    # -- construction --------------------------------------------------------------------------------

    def _vote_groups(
        self,
        config: VoteConfig,
        process_group: dist.ProcessGroup | DeviceMesh | VoteMesh | str | Comm | None,
        device: torch.device,
    ) -> tuple[Comm, Comm] | None:
        """Set :attr:`shards` / :attr:`shares`, the view the parts work on and :attr:`comm` for
        ``process_group`` (resolved by :func:`lioncub.optim.topology.who_votes`); returns the (intra-node,
        inter-node) groups of a topology other than flat."""
        sharded = refuse_unsharded_mesh(self, process_group)
        who = topology.who_votes(process_group, config.topology, sharded=sharded)
        view = part_view(self, who, device)
        #: on FSDP2's parameters, what the parts see of them (:mod:`lioncub.optim.shards`); else ``None``
        self.shards: ShardView | None = view if isinstance(view, ShardView) else None
        #: with DDP inside a mesh's shard dimension, this rank's share of whole tensors; else ``None``
        self.shares: ShareView | None = view if isinstance(view, ShareView) else None
        if view is not None:
            check_shard_options(config, self.diagnostics_every, who.part)
        #: the param groups and state the parts work on: this optimizer's, or its view of its part
        self._view: ShardView | ShareView | LionCub = self if view is None else view
        #: this rank's view of the group the votes travel on (:class:`lioncub.collectives.Comm`)
        self.comm, levels = topology.vote_groups(config, who, device, self.checks.broadcast_init)
        return levels

    def _give_initial(self, initial: InitialValues | None) -> None:
        """Rank 0's values to every rank (``Checks.broadcast_init``; with DDP inside a mesh's shard
        dimension each share's replica-0 values, then to the rest of its replica); on shards the momenta
        from construction (:meth:`_allocate_shard_state`)."""
        if initial is not None:
            initial.give(self._view.param_groups, self.layout)
            if self.shares is not None and self.shares.after_step:
                self.shares.broadcast()
        self._allocate_shard_state()

    def _allocate_shard_state(self) -> None:
        """On shards, the momenta from construction (zeros, as their first step would make them): DCP's
        ``get_state_dict``/``set_state_dict`` step an optimizer whose state is empty once, with zero
        gradients and ``lr=0`` (to create Adam's), which here would be a vote and a step counted."""
        if self.shards is not None:
            for p in self.layout.params():
                self.engine.state.momentum(p)

    def _engine(self, config: VoteConfig, levels: tuple[Comm, Comm] | None) -> StepEngine:
        """The step engine of the vote of ``config`` (on shards: :meth:`ShardView.vote`'s)."""
        vote = make_vote(self.comm, config, levels, every_step=self.local_steps is None)
        if self.shards is not None:
            vote = self.shards.vote(vote, config, self.shards.pieces_of(lambda: self.layout.buckets))
        return StepEngine(vote, self._view)

    def _select_sync(
        self, named: list[tuple[str, torch.Tensor]], model: torch.nn.Module | None
    ) -> list[tuple[str, torch.Tensor]]:
        spec = self.momentum_sync.params
        chosen = select_parameters(spec, named, self.param_groups, model)
        if self.shares is not None:
            chosen = [(n, p) for n, p in chosen if self.shares.owns(p)]
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
        return chosen

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters join the vote from the next ``step()`` on (every rank must
        add the same parameters, in the same order: the next step's check compares the ranks), which also
        copies rank 0's values of them to every rank (``Checks.broadcast_init``)."""
        super().add_param_group(param_group)
        if self._ready:
            try:
                check_group(self.param_groups[-1], len(self.param_groups) - 1)
                part = self.shards or self.shares
                if part is not None:
                    part.refresh(grads=False)  # shards: refuses what is not a shard of the mesh
            except (ValueError, TypeError):
                self.param_groups.pop()
                raise

    def _refresh_layout(self) -> None:
        """Rebuild the buckets when the parameters that require grad changed (``requires_grad_``,
        :meth:`add_param_group`); the layout hash travels in every step's check, so ranks that changed
        differently are named instead of voting on different layouts."""
        if not self.layout.changed(self._view.param_groups):
            return
        if self.layout.built and self._overlap is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: LionCub: the trainable parameters changed (requires_grad_ or "
                "add_param_group) after overlap_with(): DDP's buckets are fixed; freeze or add parameters "
                "before wrapping the model in DDP and calling overlap_with, or use the plain step"
            )
        self.layout.rebuild(self._view.param_groups)
        self.engine.state.refresh()

    def restore_layout(self, members: set[int]) -> None:
        """The layout of the parameters whose ``id`` is in ``members`` (a loaded local-steps window's)."""
        self.layout.rebuild(self._view.param_groups, members)
        self.engine.state.refresh()

    # -- the step ------------------------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
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
        part = self.shards or self.shares  # the part of the model this rank votes on (None: all of it)
        if part is not None:  # the param groups; on shards the aliases and their gradients of this backward
            part.refresh()
        if not self.single_process:  # a model moved after LionCub was built: named, not a kernel's error
            self.layout.check_device(self.comm.device, self.comm.rank)
        self.window.before_step()
        overflow = self._unscale()
        if part is not None:  # a replica's shards (shares) skip together
            overflow = part.agree_skip(overflow)
        if self.window.rebuilds_layout(self._global_step):
            self._refresh_layout()
        self._global_step += 1
        self.comm.step = self._global_step
        try:
            self.policy.step(overflow)
        finally:
            if part is not None:
                part.release()
        if self.shares is not None and self.shares.after_step:  # each share's update to its replica
            self.shares.broadcast()
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
        self.applied_scale = scale
        if scale is not None:
            groups = self.param_groups if self.shares is not None else self._view.param_groups  # shares: all
            grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        return found_inf is not None and bool(found_inf.item() > 0)

    # -- state -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (momenta, step, variant, rank, world size; :mod:`lioncub.optim.state_dict`).
        After :meth:`consolidate_state_dict` on the rank it gathered to, ``sd["lioncub"]["ranks"]`` also
        holds every rank's own state dict (index = rank; its own entry ``None``: the top level), until the
        next ``step()``. In a job of several processes an unconsolidated state holds this rank's momenta
        only (``sd["lioncub"]["consolidated"]`` is False): every rank saves its own, or all consolidate
        before one rank saves; another rank refuses to load it, naming that. On shards (FSDP2): the form
        ``torch.distributed.checkpoint`` saves, each state tensor a ``DTensor`` of the whole mesh
        (:mod:`lioncub.optim.shard_state`; docs/shards.md, "Checkpoints")."""
        if self.shards is not None:
            return to_checkpoint(self._own_state_dict(), self.shards, self._state_keys())
        sd = self._own_state_dict()
        if self.shares is not None:  # whose share's momenta these are
            sd["lioncub"]["share"] = [self.shares.shard_rank, self.shares.shards]
        if self._consolidated is not None:
            sd["lioncub"]["consolidated"] = True
            sd["lioncub"]["ranks"] = self._consolidated
        return sd

    def _own_state_dict(self) -> dict[str, Any]:
        with self._as_share():
            sd: dict[str, Any] = super().state_dict()
            sd["lioncub"] = state_meta(self._owner(), self._global_step, self._engines()[-1].vote)
            self.policy.save(sd)
        return sd

    @contextlib.contextmanager
    def _as_share(self) -> Iterator[None]:
        """With DDP inside a mesh's shard dimension: within, :attr:`param_groups` are those of this rank's
        share (:class:`~lioncub.optim.shards.ShareView`), so that the state dict saved and loaded is the
        one of an optimizer of that share alone (its parameters indexed 0…k−1, as the local-steps window's
        record counts them); on exit the full groups take the hyperparameters a load gave the share's."""
        if self.shares is None:
            yield
            return
        full = self.param_groups
        self.shares.refresh(grads=False)
        self.param_groups = self.shares.param_groups
        try:
            yield
        finally:
            for group, share in zip(full, self.param_groups, strict=True):
                group.update({k: v for k, v in share.items() if k != "params"})
            self.param_groups = full

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's :meth:`state_dict` on rank ``to`` (a rank of the optimizer's group), so that
        a framework that saves the optimizer from one rank only keeps every rank's momenta (the convention
        of ``torch.distributed.optim.ZeroRedundancyOptimizer``; Lightning calls it before saving).
        Collective: every rank calls it. Costs ``N`` times one rank's state in ``to``'s host memory and
        file (the states travel and stay on the CPU; :meth:`load_state_dict` moves them to the
        parameters' device)."""
        if self.shards is not None:
            raise ValueError(
                "consolidate_state_dict: the parameters are FSDP2's shards; save the optimizer with "
                "torch.distributed.checkpoint (get_state_dict, dcp.save: every rank writes its own "
                "momenta; docs/shards.md, 'Checkpoints')"
            )
        if self.shares is not None:
            raise ValueError(
                "consolidate_state_dict: each rank of a mesh's shard dimension holds the momenta of its "
                "share of the model only; every rank saves its own state_dict (docs/shards.md, 'DDP inside')"
            )
        self._consolidated = None
        self._consolidated = gather_states(
            self.comm, lambda: self._own_state_dict(), to, alone=self.single_process
        )

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_world_size_change: bool = False) -> None:
        """Load this rank's state: from a consolidated state dict (:meth:`consolidate_state_dict`) the
        entry of this rank, else a state dict this rank wrote. Refuses a state whose update rule differs
        (another preset, quantizer, width, ...; ``flat`` and ``hierarchical`` are the same update), another
        world size, or another rank's state, unless ``allow_world_size_change`` (the documented conversions
        of ``lioncub train --convert-momenta``: the momenta are then taken as given — from a consolidated
        state dict, rank r takes entry ``r mod K`` of the K saved); with local steps, one that cannot
        continue its window (:mod:`lioncub.optim.windows`). On shards: a state dict of
        :meth:`state_dict` (as ``set_state_dict`` hands it after ``dcp.load``), on the same number of
        replicas; the number of shards may differ."""
        if is_checkpoint_form(state_dict):
            if self.shards is None:
                raise ValueError(
                    "load_state_dict: this optimizer state was saved by LionCub on FSDP2's shards (the "
                    "momenta of every replica as DTensors of its mesh) and this optimizer's parameters are "
                    "plain tensors: load it into LionCub over the sharded model (process_group=the mesh)"
                )
            local = None if self.local_steps is None else self.local_steps.describe()
            state_dict = from_checkpoint(state_dict, self.shards, self._state_keys(), self.comm.rank, local)
        elif self.shards is not None and "lioncub" not in state_dict:
            raise ValueError(
                "load_state_dict: this optimizer state lacks LionCub's record (param_groups[0]['lioncub']: "
                "the step, the variant, which state each parameter holds). get_state_dict/set_state_dict "
                "with StateDictOptions(flatten_optimizer_state_dict=True) drop it (they keep the state keys "
                "a new optimizer holds only): save and load LionCub on shards with the default options"
            )
        sd = dict(state_dict)
        meta = sd.pop("lioncub", None)
        self._check_share(meta)
        if meta is not None and "ranks" in meta:
            entry = consolidated_entry(meta, sd, self.comm, allow_world_size_change)
            self.load_state_dict(entry, allow_world_size_change=True)
            return
        with self._as_share():
            check_group_sizes(sd.get("param_groups", []), self.param_groups, (meta or {}).get("window"))
            checked = None
            if meta is not None:
                step = restore_meta(self._owner(), meta, self._engines(), allow_world_size_change)
                self._global_step = step
                checked = self.policy.check_load(sd, meta)
            super().load_state_dict(sd)
        self._consolidated = None
        part = self.shards or self.shares
        if part is not None:  # the loaded param groups
            part.refresh(grads=False)
        self.policy.load(meta or {}, checked)

    def _check_share(self, meta: dict[str, Any] | None) -> None:
        """Refuse a state of another share of whole tensors (DDP inside a mesh's shard dimension), or of
        one share into an optimizer of the whole model and back: its momenta would land on other tensors."""
        saved = None if meta is None else meta.get("share")
        mine = None if self.shares is None else [self.shares.shard_rank, self.shares.shards]
        if saved is not None and saved != mine:
            whose = "the whole model" if mine is None else f"share {mine[0]} of {mine[1]}"
            raise ValueError(
                f"load_state_dict: this optimizer state holds the momenta of share {saved[0]} of {saved[1]} "
                f"(shard rank {saved[0]} of a mesh's shard dimension of {saved[1]} ranks) and this optimizer "
                f"votes on {whose}: load the state that shard rank saved"
            )
        if mine is not None and meta is not None and saved is None and "ranks" not in meta:
            raise ValueError(
                "load_state_dict: this optimizer state holds the momenta of the whole model and this "
                f"optimizer votes on share {mine[0]} of {mine[1]} (DDP inside a mesh's shard dimension): "
                "load a state it saved on the same mesh"
            )

    @contextlib.contextmanager
    def shared_parameters(self) -> Iterator[bool]:
        """Within: the parameters hold what the ranks share — with local steps, in the middle of a window,
        θ of the last outer step instead of this rank's replica (kept aside and put back on exit); else the
        parameters as they are, the same on every rank. Yields whether a window was in progress. Evaluate,
        pick or save a model here, so that every rank scores and writes the same one. Not collective."""
        shown = self.window.show_shared()
        try:
            yield shown
        finally:
            if shown:
                self.window.hide_shared()

    def show_shared_parameters(self) -> bool:
        """:meth:`shared_parameters` until the next ``step()``, which puts each rank's replica back first
        (for a framework that saves or evaluates with no hook after it); ``state_dict()`` meanwhile saves
        the replicas. Returns whether a window was in progress."""
        return self.window.show_shared()

    def shared_values(self) -> dict[int, torch.Tensor]:
        """``id(p)`` → the value the ranks share, for each parameter that holds another one now (this
        rank's replica, in a local-steps window's middle: θ of the last outer step); ``{}`` elsewhere. For
        a framework that has the model's state dict in hand: replace those entries (do not modify them)."""
        return self.window.shared_values()

    def hide_shared_parameters(self) -> None:
        """Put back each rank's replica after :meth:`show_shared_parameters` (else the next step does)."""
        self.window.hide_shared()

    def restore_replicas(self) -> None:
        """With local steps, after a state saved in a window's middle was loaded: write this rank's replicas
        back into the parameters that changed since (a model state loaded after the optimizer's, one file
        for every rank). Until the next ``step()`` the first call of any ``nn.Module`` does it by itself;
        call this where the parameters are used outside a module call. Not collective; nothing to do
        otherwise."""
        self.window.restore_replicas()

    def continue_at(self, step: int) -> None:
        """Continue a run at optimizer ``step`` without its optimizer state (a model-only checkpoint): the
        step count (the 1-bit tie phase, the windows' place) is set, the momenta start at zero; with local
        steps a window in progress restarts from the parameters as they are and ends where it would have
        (the next multiple of H)."""
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"continue_at(step={step!r}): step must be an int >= 0")
        self._global_step = step
        self.window.restart_at(step)

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
        if self.shards is not None:
            raise ValueError(
                "overlap_with: the parameters are FSDP2's shards and overlap_with hooks DDP's buckets; on "
                "shards the votes run in step() (call step() without overlap_with)"
            )
        if self.shares is not None:
            raise ValueError(
                "overlap_with: with DDP inside a mesh's shard dimension each rank votes on its share after "
                "the backward, DDP averaging the gradients in its own hook; call step() without overlap_with"
            )
        if self.local_steps is not None:
            raise ValueError(
                "overlap_with: with local_steps there is no vote in the backward (the ranks vote every "
                f"{self.local_steps.h} steps, in step()); use skip_gradient_allreduce(model)"
            )
        if self.single_process or not isinstance(self.policy, EveryStep):
            _log.info("LionCub.overlap_with: one process, no vote to overlap: the plain step runs")
            return None
        if self._overlap is not None:
            raise RuntimeError("overlap_with: this optimizer already overlaps its votes with a model")
        if self.config.topology != "flat":
            raise ValueError(
                f"overlap_with: topology={self.config.topology!r} votes run after the backward (the overlap "
                "hook votes flat); use the plain step, or topology='flat'"
            )
        self.layout.check_device(self.comm.device, self.comm.rank)
        comm = overlap_group(model, self.comm, process_group)
        ordered = sorted(self.layout.order, key=self.layout.order.__getitem__)
        self._overlap = OverlapHook(
            model,
            StepEngine(make_vote(comm, self.config), self),
            next_step=lambda: self._global_step + 1,
            diagnostics_every=self.diagnostics_every,
            names={i: self.layout.names[i] for i in ordered},
        )
        self.policy.hook = self._overlap
        self.round.overlapped_traffic = self._overlap.take_traffic
        return self._overlap

    # -- checks, accounting ----------------------------------------------------------------------------

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
        construction (its ``steps``: the steps taken since construction, also after a ``load_state_dict``).
        With a ``topology`` other than flat, ``intra_node_bytes_sent/recv`` and ``inter_node_bytes_sent/recv``
        split the vote's bytes by level (the step check travels on the flat group and is in ``bytes_sent``
        only)."""
        return self.accounting.stats()

    # -- properties ------------------------------------------------------------------------------------

    def _owner(self) -> StateOwner:
        """What a saved state records of this optimizer, and a loaded one must match."""
        return StateOwner(self.variant, self.config, self.comm, self.local_steps)

    def _state_keys(self) -> tuple[str, ...]:
        """The per-parameter state keys of a checkpoint on shards (:func:`~lioncub.optim.shard_state.
        state_keys`)."""
        return state_keys(self.local_steps)

    def _engines(self) -> list[StepEngine]:
        """The plain step's engine, then the overlap hook's (whose stochastic quantizer draws when
        overlapping)."""
        return [self.engine] + ([self._overlap.engine] if self._overlap is not None else [])

    @property
    def bucket_numels(self) -> list[int]:
        """Elements per bucket, in the order the buckets are voted on."""
        return [b.numel for b in self.layout.buckets]

    @property
    def last_diagnostics(self) -> tuple[int, dict[str, dict[str, float]]] | None:
        """The diagnostics of the last step that computed them: ``(step, {name: {...}, "overall":
        {...}})``, or ``None``."""
        return self.policy.last_diagnostics

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
