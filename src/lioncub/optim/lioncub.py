r"""``LionCub``: Lion for data-parallel training where the workers vote on the update.

Design note (what happens in one ``step()`` on rank i of N):

1. **Local direction.** For every parameter, ``c_i = β1·m_i + (1−β1)·g_i`` from this rank's *local*
   gradient ``g_i`` and this rank's own momentum ``m_i`` (never communicated). The ``"32bit"`` /
   ``"16bit"`` presets instead allreduce the gradient first and run global Lion (``m`` identical on all
   ranks), exactly as DDP + :class:`~lioncub.optim.lion.Lion`.
2. **Buckets.** Parameters are grouped, in ``param_groups`` order, into dtype- and device-homogeneous
   buckets of at most ``bucket_mb`` MiB; each bucket's directions are written into one flat buffer and
   travel in one vote, so a step issues a few collectives, not one per tensor.
3. **Vote, overlapped.** Every bucket's vote is started (quantize, pack, post the asynchronous
   collective) before the first one is awaited, so the quantize/pack of bucket b+1 overlaps the
   communication of bucket b. The vote algorithm (:mod:`lioncub.collectives`) returns the same update
   ``u`` on every rank: ``{−1, 0, +1}`` for majority votes, the mean of the signs for D-Lion Avg.
4. **Apply.** ``p ← p·(1 − lr·wd) − lr·u`` with each parameter's own group ``lr`` and
   ``weight_decay`` read at every step (LR schedulers work), then ``m_i ← β2·m_i + (1−β2)·g_i``.

With :meth:`LionCub.overlap_with` (a DDP model) steps 1–3 run during the backward pass instead, per DDP
gradient bucket as backward produces it (:mod:`lioncub.optim.overlap`), and ``step()`` waits for the
votes and does step 4; the result is bit for bit the same.

The tie rule of the 1-bit vote alternates with the optimizer step (+1 on odd steps, −1 on even steps);
the step counter is part of the state dict, so resuming keeps the phase. A parameter whose gradient is
``None`` counts as a zero gradient, so that every rank keeps voting on the same layout.

Deviations from the authors' research code, on purpose: learning rate and weight decay come from the
param groups at every step (their 1-bit/4-bit code read the constructor's values); the 1-bit result is
not masked where this rank's ``c`` is exactly zero (that mask makes replicas diverge when workers
disagree); the 4-bit vote is ``sign(2·count − N)`` (correct for odd N); the world size comes from the
process group, never from launcher variables.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lioncub import diagnostics, kernels
from lioncub.collectives import Comm, CommCounter, Pending
from lioncub.optim.auto import DEFAULT_LATENCY_S, AutoChoice, NetworkSpec, check_candidates, choose_variant
from lioncub.optim.config import VoteConfig, make_vote, resolve_variant
from lioncub.optim.lion import (
    apply_update_,
    check_lion_hyperparameters,
    lion_direction,
    update_momentum_,
)
from lioncub.optim.sync import SyncSchedule, select_parameters

if TYPE_CHECKING:
    from lioncub.optim.overlap import OverlapHook

__all__ = ["LionCub", "ReplicaDivergenceError"]

STATE_VERSION = 1

_log = logging.getLogger("lioncub")


class ReplicaDivergenceError(RuntimeError):
    """The parameters of the ranks are no longer identical."""


class ReplicaMismatchError(ValueError):
    """The ranks were given different parameter lists (names, shapes, dtypes or order)."""


class NonFiniteGradientError(FloatingPointError):
    """A rank's gradients held NaN or Inf and ``nonfinite="raise"``."""


NONFINITE_MODES = ("skip", "raise")


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    group_index: list[int]
    dtype: torch.dtype
    device: torch.device
    numel: int = 0
    segments: list[int] = field(default_factory=list)
    flat: torch.Tensor | None = None  # reused buffer for the local directions / gradients


@dataclass
class _Voted:
    """The votes of one step, in flight: per bucket its parameters, this rank's max-abs of its
    contribution, the vote, and (diagnostics steps) a copy of the contribution."""

    params: list[list[torch.Tensor]] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    peak: list[torch.Tensor] = field(default_factory=list)
    directions: list[torch.Tensor] = field(default_factory=list)

    @property
    def peaks(self) -> torch.Tensor | None:
        return torch.stack(self.peak) if self.peak else None


def _peak(contribution: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (NaN if any element is NaN; Inf if any is ±Inf)."""
    return torch.linalg.vector_norm(contribution, float("inf")).float()


def _peaks(contributions: Sequence[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack([_peak(c) for c in contributions]) if contributions else None


@dataclass
class _Times:
    """Wall time of one step's phases, in seconds."""

    direction: float = 0.0  # the local directions c_i (or the gradient copy of the dense presets)
    encode: float = 0.0  # quantize / pack and posting the collectives
    exchange: float = 0.0  # waiting for the exchanges, incl. unpack/count between phases and decode
    apply: float = 0.0  # applying the update and the momentum
    sync: float = 0.0  # momentum synchronization (on the steps it is due)
    overlapped: float = 0.0  # overlap: quantize/pack and between-phase work done during the backward

    def add(self, other: _Times) -> None:
        for name in ("direction", "encode", "exchange", "apply", "sync", "overlapped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        return {
            "direction_s": self.direction,
            "encode_s": self.encode,
            "exchange_s": self.exchange,
            "apply_s": self.apply,
            "sync_s": self.sync,
            "overlapped_s": self.overlapped,
            "communication_s": self.encode + self.exchange + self.sync,  # quantize/pack + wire + unpack
        }


class LionCub(torch.optim.Optimizer):
    """Distributed Lion / Lion Cub: each rank keeps its own momentum and the ranks vote on the update.

    Args:
        params: parameters or param groups (the same, in the same order, on every rank).
        lr, betas, weight_decay: as :class:`~lioncub.optim.lion.Lion` (per param group).
        variant: a preset of :data:`lioncub.optim.config.PRESETS`: ``"32bit"``, ``"16bit"``, ``"1bit"``,
            ``"4bit"``, ``"8bit"`` (default), ``"8bit-sign"``, ``"dlion-mavo"``, ``"dlion-avg"``, or
            ``"auto"``: the preset the α–β cost model predicts fastest for this model, N and network.
        process_group: the data-parallel group (default: the default group).
        bucket_mb: bucket size cap in MiB of parameter bytes.
        transport, aggregation, quantizer, bits, clip_multiple, chunk_size: explicit knobs that override
            the preset (see :class:`~lioncub.optim.config.VoteConfig`).
        exchange: all-to-all / all-gather implementation: ``"auto"``, ``"p2p"`` or ``"native"``.
        broadcast_init: copy rank 0's parameters to every rank at construction.
        replica_check_every: every k steps compare a checksum of the parameters across ranks and raise
            :class:`ReplicaDivergenceError` on a mismatch (0 = never).
        maximize: maximise instead of minimise.
        seed: seeds stochastic quantizers (``qsgd``), combined with the rank.
        auto_network, auto_latency_s, auto_candidates: for ``variant="auto"``, the network the cost model
            predicts for (a ``lioncub calibrate`` JSON path, a rate such as ``"1gbit"`` with the one-way
            latency ``auto_latency_s`` in seconds, or ``None`` for ``$LIONCUB_CALIBRATION``) and the presets
            to choose from (default: all). Rank 0 decides, every rank follows; the decision and its reason
            are in :attr:`auto_choice` and logged to the ``"lioncub"`` logger.
        momentum_sync, sync_every, sync_until, sync_exp_k, sync_dtype, model: average the momenta of some
            parameters over the ranks at some steps (:mod:`lioncub.optim.sync`): ``"none"`` (default),
            ``"all"``, ``"io"`` (input/output layers of ``model``) or a list of parameter-name patterns /
            param-group names; every ``sync_every`` steps (or ``sync_exp_k``'s exponential schedule),
            only up to step ``sync_until`` if given; ``sync_dtype`` on the wire (fp32 or bf16). ``model``
            names the parameters (needed for ``"io"`` and name patterns).
        diagnostics_every: every k steps compute :mod:`lioncub.diagnostics` (match/flip against the
            full-precision vote, tie rate, momentum spread, update shape) into :attr:`last_diagnostics`;
            this costs extra collectives on those steps only (not counted in :meth:`comm_stats`). 0: off.
        nonfinite: what a step does when any rank's gradients hold NaN or Inf: ``"skip"`` (default: every
            rank leaves parameters and momenta untouched, counted in ``comm_stats()["total"]
            ["skipped_steps"]``) or ``"raise"`` (:class:`NonFiniteGradientError` on every rank, naming the
            ranks). Checked before anything is quantized or sent: one max-abs reduction per bucket and one
            all-gather of N int32 per step (counted in :meth:`comm_stats`).

    At construction every rank checks that all ranks hold the same parameter list (names, shapes, dtypes,
    order: one hash all-gathered) and raises :class:`ReplicaMismatchError` naming the first difference.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        variant: str = "8bit",
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        transport: str | None = None,
        aggregation: str | None = None,
        quantizer: str | None = None,
        bits: int | str | None = None,
        clip_multiple: float | None = None,
        chunk_size: int | None = None,
        exchange: str = "auto",
        broadcast_init: bool = True,
        replica_check_every: int = 0,
        maximize: bool = False,
        seed: int = 0,
        auto_network: NetworkSpec = None,
        auto_latency_s: float = DEFAULT_LATENCY_S,
        auto_candidates: Sequence[str] | None = None,
        momentum_sync: str | Sequence[str] = "none",
        sync_every: int = 10,
        sync_until: int | None = None,
        sync_exp_k: int | None = None,
        sync_dtype: torch.dtype = torch.float32,
        model: torch.nn.Module | None = None,
        diagnostics_every: int = 0,
        nonfinite: str = "skip",
    ) -> None:
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={nonfinite!r}: allowed values are {list(NONFINITE_MODES)}")
        if isinstance(bucket_mb, bool) or not (
            isinstance(bucket_mb, (int, float)) and 0 < bucket_mb < math.inf
        ):
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a finite number of MiB > 0")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model={model!r} must be the torch.nn.Module whose parameters are optimized, or None"
            )
        if not (isinstance(replica_check_every, int) and replica_check_every >= 0):
            raise ValueError(f"replica_check_every={replica_check_every!r} must be an int >= 0")
        knobs = dict(transport=transport, aggregation=aggregation, quantizer=quantizer, bits=bits)
        knobs.update(clip_multiple=clip_multiple, chunk_size=chunk_size)
        config = None
        if variant == "auto":
            overrides = sorted(
                k for k in ("transport", "aggregation", "quantizer", "bits") if knobs[k] is not None
            )
            if overrides:
                raise ValueError(
                    f"variant='auto' chooses a preset itself; {', '.join(overrides)} cannot be combined with "
                    "it (name a preset instead, or restrict the choice with auto_candidates=)"
                )
            candidates = check_candidates(auto_candidates)
        else:
            config = resolve_variant(variant, **knobs)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)
        self.comm = Comm(process_group, exchange=exchange)  # type: ignore[arg-type]
        named = self._named_parameters(model)
        self._check_same_parameters(named)
        self.nonfinite = nonfinite
        self._skipped = (0, 0)  # (last step, total): steps skipped for non-finite gradients
        #: the cost model's decision when ``variant="auto"`` (``None`` otherwise)
        self.auto_choice: AutoChoice | None = None
        if variant == "auto":
            self.auto_choice = self._choose_variant(candidates, bucket_mb, auto_network, auto_latency_s)
            variant = self.auto_choice.variant
            config = resolve_variant(variant, **knobs)
        self.config: VoteConfig = config
        self.variant = variant
        self.vote = make_vote(self.comm, self.config, seed=seed)
        self.seed = seed
        self.replica_check_every = replica_check_every
        self._global_step = 0
        self._buckets = self._make_buckets(bucket_mb)
        self._last = (CommCounter(), _Times())
        self._total = (CommCounter(), _Times())
        self.sync_schedule = SyncSchedule(sync_every, sync_until, sync_exp_k)
        if sync_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(
                f"sync_dtype={sync_dtype} must be torch.float32, torch.bfloat16 or torch.float64"
            )
        self.sync_dtype = sync_dtype
        #: names of the parameters whose momenta are synchronized (see :mod:`lioncub.optim.sync`)
        self.sync_names, self._sync_params = self._select_sync(momentum_sync, named, model)
        if not (isinstance(diagnostics_every, int) and diagnostics_every >= 0):
            raise ValueError(f"diagnostics_every={diagnostics_every!r} must be an int >= 0 (0: off)")
        if diagnostics_every and self.config.transport == "dense":
            raise ValueError(
                f"diagnostics_every: variant={self.variant!r} does not vote (global Lion); the vote "
                "diagnostics apply to the voting variants"
            )
        self.diagnostics_every = diagnostics_every
        self._names = {id(p): n for n, p in named}
        #: parameter → index of its param group, and its position in the optimizer's order
        self._group_index = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._order = {id(p): i for i, p in enumerate(p for b in self._buckets for p in b.params)}
        self._overlap: OverlapHook | None = None
        #: the diagnostics of the last step that computed them: ``(step, {name: {...}, "overall": {...}})``
        self.last_diagnostics: tuple[int, dict[str, dict[str, float]]] | None = None
        if broadcast_init:
            self._broadcast_parameters()

    # -- construction --------------------------------------------------------------------------------

    def _make_buckets(self, bucket_mb: float) -> list[_Bucket]:
        cap = int(bucket_mb * 2**20)
        open_buckets: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        buckets: list[_Bucket] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.is_complex():
                    raise ValueError("LionCub does not support complex parameters")
                key = (p.dtype, p.device)
                b = open_buckets.get(key)
                if b is None or ((b.numel + p.numel()) * p.element_size() > cap and b.params):
                    b = _Bucket([], [], p.dtype, p.device)
                    open_buckets[key] = b
                    buckets.append(b)
                b.params.append(p)
                b.group_index.append(gi)
                b.segments.append(p.numel())
                b.numel += p.numel()
        return buckets

    def _check_same_parameters(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """All-gather a hash of (group, name, shape, dtype) of every optimized parameter, in order; on a
        mismatch every rank gathers the lists and raises :class:`ReplicaMismatchError` naming the first
        differing parameter (instead of a hang or a vote over misaligned buffers later)."""
        n = self.comm.world_size
        if n == 1:
            return
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        layout = [
            f"group {group_of[id(p)]} {name} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for name, p in named
        ]
        digest = hashlib.sha256("\n".join(layout).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        gathered = torch.empty(n, 1, dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(gathered, mine.to(self.comm.device), "parameter layout check").wait()
        if bool((gathered == gathered[0]).all()):
            return
        layouts: list[Any] = [None] * n
        dist.all_gather_object(layouts, layout, group=self.comm.group)
        rank = next(r for r in range(n) if layouts[r] != layouts[0])
        ours, other = layouts[0], layouts[rank]
        i = next(
            (i for i in range(min(len(ours), len(other))) if ours[i] != other[i]), min(len(ours), len(other))
        )
        first = ours[i] if i < len(ours) else "(no parameter)"
        theirs = other[i] if i < len(other) else "(no parameter)"
        raise ReplicaMismatchError(
            f"rank {self.comm.rank}: the ranks do not optimize the same parameters: rank 0 has "
            f"{len(layouts[0])} tensors, rank {rank} has {len(other)}; first difference at position {i}: "
            f"rank 0 {first!r}, rank {rank} {theirs!r} (build the same model, in the same order, on every "
            "rank)"
        )

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        if self.comm.world_size == 1:
            return
        for b in self._buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in b.params])
            self.comm.broadcast(flat, 0, "initial parameter broadcast").wait()
            pos = 0
            for p in b.params:
                p.copy_(flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()

    def _named_parameters(self, model: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
        """The optimized parameters with names: ``model``'s, else ``param_groups[g][i]``."""
        mine = {id(p) for g in self.param_groups for p in g["params"] if p.requires_grad}
        if model is None:
            return [
                (f"param_groups[{gi}][{i}]", p)
                for gi, g in enumerate(self.param_groups)
                for i, p in enumerate(g["params"])
                if p.requires_grad
            ]
        named = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        missing = len(mine) - len({id(p) for _, p in named})
        if missing:
            raise ValueError(f"model=: {missing} optimized parameters are not parameters of the model")
        return named

    def _select_sync(
        self,
        spec: str | Sequence[str],
        named: list[tuple[str, torch.Tensor]],
        model: torch.nn.Module | None,
    ) -> tuple[list[str], list[torch.Tensor]]:
        chosen = select_parameters(spec, named, self.param_groups, model)
        if chosen and self.config.transport == "dense":
            raise ValueError(
                f"momentum_sync={spec!r}: variant={self.variant!r} keeps one global momentum already; "
                "momentum sync applies to the voting variants"
            )
        if chosen and self.comm.rank == 0:
            numel = sum(p.numel() for _, p in chosen)
            when = (
                f"every {self.sync_schedule.every} steps"
                if self.sync_schedule.exp_k is None
                else f"on the exponential schedule K={self.sync_schedule.exp_k}"
            )
            until = "" if self.sync_schedule.until is None else f" until step {self.sync_schedule.until}"
            _log.info(
                "momentum sync %r %s%s: %d tensors, %d elements: %s",
                spec,
                when,
                until,
                len(chosen),
                numel,
                ", ".join(n for n, _ in chosen),
            )
        return [n for n, _ in chosen], [p for _, p in chosen]

    def _sync_momenta(self) -> None:
        """Allreduce-mean the chosen momenta (one flat buffer per dtype)."""
        n = self.comm.world_size
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._sync_params:
            m = self._momentum(p)
            by_dtype.setdefault(m.dtype, []).append(m)
        for moms in by_dtype.values():
            flat = torch.cat([m.reshape(-1) for m in moms]).to(self.sync_dtype)
            self.comm.all_reduce(flat, "momentum sync").wait()
            flat.div_(n)
            pos = 0
            for m in moms:
                m.copy_(flat[pos : pos + m.numel()].view_as(m))
                pos += m.numel()

    def _choose_variant(
        self, candidates: tuple[str, ...], bucket_mb: float, network: NetworkSpec, latency_s: float
    ) -> AutoChoice:
        """Rank 0 asks the cost model; every rank takes rank 0's answer (or raises rank 0's error)."""
        d = sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)
        bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        choice: AutoChoice | None = None
        error: Exception | None = None
        if self.comm.rank == 0:
            try:
                choice = choose_variant(
                    d,
                    self.comm.world_size,
                    network,
                    latency_s=latency_s,
                    candidates=candidates,
                    bucket_numel=bucket_numel,
                )
            except (ValueError, TypeError, OSError) as err:
                error = err
        index = torch.tensor(
            [-1 if choice is None else candidates.index(choice.variant)],
            dtype=torch.int64,
            device=self.comm.device,
        )
        self.comm.broadcast(index, 0, "variant='auto' decision").wait()
        if error is not None:
            raise error
        if int(index) < 0:
            raise RuntimeError(f"rank {self.comm.rank}: variant='auto' failed on rank 0 (see rank 0's error)")
        if choice is None:  # not rank 0: the same preset, the reason is rank 0's
            variant = candidates[int(index)]
            choice = AutoChoice(variant, f"variant='auto': rank 0 chose {variant!r}", ())
        else:
            _log.info("%s", choice.reason)
        return choice

    # -- the step ------------------------------------------------------------------------------------

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]

    def _grad(self, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor | None) -> torch.Tensor:
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            raise RuntimeError("LionCub does not support sparse gradients")
        return -g if group["maximize"] else g

    def _local(self, b: _Bucket) -> torch.Tensor:
        """This rank's flat contribution: the gradients (dense) or the directions c_i (votes)."""
        if b.flat is None:
            b.flat = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        pos = 0
        for p, gi in zip(b.params, b.group_index, strict=True):
            self._local_into(b.flat[pos : pos + p.numel()].view_as(p), p, p.grad, self.param_groups[gi])
            pos += p.numel()
        return b.flat

    def _local_into(
        self, out: torch.Tensor, p: torch.Tensor, grad: torch.Tensor | None, group: dict[str, Any]
    ) -> None:
        """Write this rank's contribution for ``p`` into ``out`` (``p``'s shape): ``grad`` for the dense
        presets, ``c = β1·m + (1−β1)·grad`` for the votes (``grad`` None counts as zero)."""
        g = self._grad(p, group, grad)
        if self.config.transport == "dense":
            out.copy_(g)
        else:
            torch.mul(self._momentum(p), group["betas"][0], out=out).add_(g, alpha=1.0 - group["betas"][0])

    def _apply_params(
        self, params: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]], update: torch.Tensor
    ) -> None:
        """Apply the flat aggregated ``update`` of ``params`` (concatenated in this order) and update the
        momenta from each parameter's ``.grad``."""
        pos = 0
        dense = self.config.transport == "dense"
        for p, group in zip(params, groups, strict=True):
            beta1, beta2 = group["betas"]
            u = update[pos : pos + p.numel()].view_as(p)
            pos += p.numel()
            m = self._momentum(p)
            if dense:  # u is the mean gradient: global Lion, the same on every rank
                c = lion_direction(m, u, beta1)
                apply_update_(p, c.sign_(), lr=group["lr"], weight_decay=group["weight_decay"])
                update_momentum_(m, u, beta2)
            elif not u.dtype.is_floating_point and kernels.backend_for(p, u, m) == "triton":
                # GPU: p·(1 − lr·wd) − lr·u and m ← β2·m + (1−β2)·g in one pass (bit for bit the same)
                g = self._grad(p, group, p.grad)
                kernels.apply_votes_(
                    p, u, lr=group["lr"], weight_decay=group["weight_decay"], exp_avg=m, grad=g, beta2=beta2
                )
            else:
                _apply_chunked_(p, u, lr=group["lr"], weight_decay=group["weight_decay"])
                update_momentum_(m, self._grad(p, group, p.grad), beta2)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step (collective: every rank of the group must call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
        self._global_step += 1
        self.comm.step = self._global_step
        before = self.comm.counter.snapshot()
        times = _Times()
        diagnose = bool(self.diagnostics_every) and self._global_step % self.diagnostics_every == 0
        voted = self._overlap.collect(self._global_step, times) if self._overlap is not None else None
        if voted is not None:  # overlapped: the votes started during the backward
            if not self._all_finite(voted.peaks):  # non-finite somewhere: the votes' results are dropped
                self._overlap.drain()  # type: ignore[union-attr]
                self._finish_step(before, times, skipped=True)
                return loss
        else:
            voted = self._vote_buckets(times, diagnose)
            if voted is None:  # skipped for non-finite gradients: nothing was quantized or sent
                self._finish_step(before, times, skipped=True)
                return loss
        t0 = time.perf_counter()
        for vote in voted.pending:  # between-phase work of two-phase votes, overlapping the other buckets
            vote.advance()
        times.exchange += time.perf_counter() - t0
        updates: list[torch.Tensor] = []
        for params, vote in zip(voted.params, voted.pending, strict=True):
            t0 = time.perf_counter()
            update = vote.wait()
            if diagnose:
                updates.append(update.clone())
            t1 = time.perf_counter()
            self._apply_params(params, [self.param_groups[self._group_index[id(p)]] for p in params], update)
            times.exchange += t1 - t0
            times.apply += time.perf_counter() - t1
        if self._sync_params and self.comm.world_size > 1 and self.sync_schedule.due(self._global_step):
            t0 = time.perf_counter()
            self._sync_momenta()
            times.sync += time.perf_counter() - t0
        if self.replica_check_every and self._global_step % self.replica_check_every == 0:
            self.check_replicas()
        self._finish_step(before, times, skipped=False)
        if diagnose:  # after the accounting: its collectives are not the step's
            self.last_diagnostics = (self._global_step, self._diagnose(voted, updates))
        return loss

    def _vote_buckets(self, times: _Times, diagnose: bool) -> _Voted | None:
        """Compute this rank's contribution of every bucket, check that every rank's is finite (``None``:
        the step is skipped) and start every bucket's vote."""
        t0 = time.perf_counter()
        contributions = [self._local(b) for b in self._buckets]
        times.direction += time.perf_counter() - t0
        if not self._all_finite(_peaks(contributions)):  # nothing non-finite is quantized, sent or applied
            return None
        voted = _Voted()
        for i, (b, local) in enumerate(zip(self._buckets, contributions, strict=True)):
            t1 = time.perf_counter()
            if diagnose:
                voted.directions.append(local.clone())
            voted.params.append(b.params)
            voted.pending.append(self.vote.start(local, step=self._global_step, key=i, segments=b.segments))
            times.encode += time.perf_counter() - t1
        return voted

    def overlap_with(
        self, model: torch.nn.parallel.DistributedDataParallel, process_group: dist.ProcessGroup | None = None
    ) -> OverlapHook:
        """Start each bucket's vote during the backward pass of ``model`` (a
        :class:`~torch.nn.parallel.DistributedDataParallel` wrapping the optimized parameters): registers
        the communication hook of :mod:`lioncub.optim.overlap` (instead of
        :func:`lioncub.ddp.skip_gradient_allreduce`); :meth:`step` then waits for the votes and applies
        them. Results are bitwise those of the step without overlap. Collective: every rank calls it (it
        creates ``process_group``, the group the votes travel on, if not given). Returns the hook."""
        from lioncub.optim.overlap import OverlapHook

        if self._overlap is not None:
            raise RuntimeError("overlap_with: this optimizer already overlaps its votes with a model")
        self._overlap = OverlapHook(self, model, process_group)
        return self._overlap

    def _finish_step(self, before: CommCounter, times: _Times, *, skipped: bool) -> None:
        """The step's accounting: its bytes, collectives and times, and whether it was skipped."""
        delta = self.comm.counter.minus(before)
        if self._overlap is not None:  # the votes posted during the backward, on the hook's group
            sent, recv, colls = self._overlap.take_traffic()
            delta.add(sent, recv, colls)
        self._last = (delta, times)
        total_c, total_t = self._total
        total_c.add(delta.bytes_sent, delta.bytes_recv, delta.collectives)
        total_t.add(times)
        self._skipped = (int(skipped), self._skipped[1] + int(skipped))

    def _all_finite(self, peaks: torch.Tensor | None) -> bool:
        """True if every rank's contributions are finite, given this rank's max-abs per bucket (``None``:
        no bucket; NaN and Inf propagate through a max-abs): one all-gather of one int32 per rank, so that
        every rank takes the same decision; with ``nonfinite="raise"`` raises
        :class:`NonFiniteGradientError` on every rank."""
        if peaks is not None:
            bad = (~torch.isfinite(peaks)).any().to(torch.int32).reshape(1)
        else:
            bad = torch.zeros(1, dtype=torch.int32)
        n = self.comm.world_size
        if n > 1:
            flags = torch.empty(n, 1, dtype=torch.int32, device=self.comm.device)
            self.comm.all_gather(flags, bad.to(self.comm.device), "non-finite gradient check").wait()
            flags = flags.flatten()
        else:
            flags = bad
        if not bool(flags.any()):
            return True
        ranks = flags.nonzero().flatten().tolist()
        if self.nonfinite == "raise":
            if self._overlap is not None:
                self._overlap.drain()  # no vote stays in flight
            raise NonFiniteGradientError(
                f"rank {self.comm.rank}: non-finite gradients (NaN or Inf) at step {self._global_step} on "
                f"rank(s) {ranks}; nothing was applied (nonfinite='raise')"
            )
        _log.warning(
            "step %d skipped on every rank: non-finite gradients (NaN or Inf) on rank(s) %s",
            self._global_step,
            ranks,
        )
        return False

    # -- diagnostics -----------------------------------------------------------------------------------

    def _diagnose(self, voted: _Voted, updates: list[torch.Tensor]) -> dict[str, dict[str, float]]:
        """:func:`lioncub.diagnostics.collect` per parameter tensor, in the optimizer's parameter order
        (whatever the buckets were: the overlapped path's diagnostics are those of the plain step)."""
        pieces = []
        for params, c, u in zip(voted.params, voted.directions, updates, strict=True):
            pos = 0
            for p in params:
                pieces.append((self._order[id(p)], p, c[pos : pos + p.numel()], u[pos : pos + p.numel()]))
                pos += p.numel()
        pieces.sort(key=lambda piece: piece[0])
        names = [self._names[id(p)] for _, p, _, _ in pieces]
        return diagnostics.collect(
            self.comm,
            names,
            [c for _, _, c, _ in pieces],
            [u for _, _, _, u in pieces],
            [self._momentum(p) for _, p, _, _ in pieces],
        )

    @torch.no_grad()
    def parameter_checksum(self) -> torch.Tensor:
        """int64 ``[2]``: the sum of the parameters' raw bits and a position-weighted sum (exact)."""
        total = torch.zeros(2, dtype=torch.int64, device=self.comm.device)
        for b in self._buckets:
            for p in b.params:
                raw = p.detach().reshape(-1).view(_int_view(p.dtype)).to(torch.int64)
                total[0] += raw.sum()
                total[1] += (raw * torch.arange(1, raw.numel() + 1, device=raw.device) % 1_000_003).sum()
        return total.to(self.comm.device)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Compare parameter checksums across ranks; raise :class:`ReplicaDivergenceError` on a mismatch."""
        n = self.comm.world_size
        if n == 1:
            return
        mine = self.parameter_checksum()
        gathered = torch.empty(n, 2, dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(gathered, mine, "replica checksum all-gather").wait()
        differing = [r for r in range(n) if not torch.equal(gathered[r], gathered[0])]
        if differing:
            raise ReplicaDivergenceError(
                f"rank {self.comm.rank}: parameters differ between ranks at step {self._global_step}: "
                f"ranks {differing} disagree with rank 0 (checksums {gathered.tolist()})"
            )

    def comm_stats(self) -> dict[str, dict[str, float | int]]:
        """Bytes sent/received by this rank, collectives issued, and the step's time split (seconds:
        ``direction_s``, ``encode_s``, ``exchange_s``, ``apply_s``, ``sync_s`` (momentum sync),
        ``overlapped_s`` (with :meth:`overlap_with`: the contributions, quantize/pack and between-phase
        work done during the backward; ``exchange_s`` is then what the step still waited for) and
        ``communication_s`` = encode + exchange + sync), for the ``"last"`` step and the ``"total"`` since
        construction."""
        out: dict[str, dict[str, float | int]] = {}
        for name, (counter, times) in (("last", self._last), ("total", self._total)):
            out[name] = {
                "bytes_sent": counter.bytes_sent,
                "bytes_recv": counter.bytes_recv,
                "collectives": counter.collectives,
                **times.as_dict(),
            }
        out["last"]["skipped_steps"], out["total"]["skipped_steps"] = self._skipped
        out["total"]["steps"] = self._global_step
        return out

    # -- state -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["lioncub"] = {
            "version": STATE_VERSION,
            "step": self._global_step,
            "variant": self.variant,
            "config": {
                "transport": self.config.transport,
                "aggregation": self.config.aggregation,
                "quantizer": self.config.quantizer,
                "bits": self.config.bits,
            },
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            # a stochastic quantizer's stream: the overlap hook's vote draws from its own when overlapping
            "generator": _generator_state(self.vote if self._overlap is None else self._overlap.vote),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_world_size_change: bool = False) -> None:
        """Load this rank's state. Refuses another variant, or another world size unless
        ``allow_world_size_change`` (the momenta are then this rank's as saved)."""
        sd = dict(state_dict)
        meta = sd.pop("lioncub", None)
        if meta is not None:
            if meta.get("version") != STATE_VERSION:
                raise ValueError(f"optimizer state version {meta.get('version')} is not {STATE_VERSION}")
            if meta["variant"] != self.variant:
                raise ValueError(
                    f"the checkpoint was written by variant={meta['variant']!r}, this optimizer is "
                    f"variant={self.variant!r}"
                )
            if meta["world_size"] != self.comm.world_size and not allow_world_size_change:
                raise ValueError(
                    f"the checkpoint was written with world_size={meta['world_size']}, this job has "
                    f"world_size={self.comm.world_size}; per-rank momenta do not carry over "
                    "(pass allow_world_size_change=True to accept)"
                )
            self._global_step = int(meta["step"])
            for vote in (self.vote, *([self._overlap.vote] if self._overlap is not None else [])):
                if meta.get("generator") is not None and getattr(vote, "generator", None) is not None:
                    vote.generator.set_state(meta["generator"])
        super().load_state_dict(sd)

    @property
    def bucket_numels(self) -> list[int]:
        """Elements per bucket, in the order the buckets are voted on."""
        return [b.numel for b in self._buckets]

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (drives the 1-bit tie rule)."""
        return self._global_step


_PIECE = 1 << 16  # elements per cache-sized piece when converting an integer update


def _apply_chunked_(p: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """``p ← p·(1 − lr·wd) − lr·u`` for an update in another dtype (int8 votes): the update is converted
    to ``p``'s dtype piece by piece in cache, because a mixed-dtype ``add_`` is several times slower."""
    if update.dtype == p.dtype or not p.is_contiguous() or p.device.type != "cpu":
        apply_update_(p, update.to(p.dtype), lr=lr, weight_decay=weight_decay)
        return
    flat_p, flat_u = p.view(-1), update.reshape(-1)
    scratch = torch.empty(min(_PIECE, flat_p.numel()), dtype=p.dtype)
    for c0 in range(0, flat_p.numel(), _PIECE):
        c1 = min(c0 + _PIECE, flat_p.numel())
        u = scratch[: c1 - c0].copy_(flat_u[c0:c1])
        apply_update_(flat_p[c0:c1], u, lr=lr, weight_decay=weight_decay)


def _check_group(group: dict[str, Any]) -> None:
    check_lion_hyperparameters(group)
    if not isinstance(group["maximize"], bool):
        raise ValueError(f"Invalid maximize: {group['maximize']!r} (expected True or False)")


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        torch.empty(0, dtype=dtype).element_size()
    ]


def _generator_state(vote: Any) -> torch.Tensor | None:
    gen = getattr(vote, "generator", None)
    return None if gen is None else gen.get_state()
