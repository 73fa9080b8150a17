r"""The one step path of :class:`~lioncub.optim.LionCub`: contributions, votes and the apply, per flat bucket.

A step on rank i of N, for every bucket (a list of parameters laid out one after another in a flat
buffer, see :func:`flat_views`):

1. :meth:`Voting.contribute` writes this rank's contribution of every parameter into the bucket's flat
   buffer — ``c_i = β1·m_i + (1−β1)·g_i`` for the votes, the gradient ``g_i`` for the dense presets
   (``g`` negated under ``maximize``; a ``None`` gradient counts as zero) — and takes its max-abs (NaN or
   Inf propagate) for the non-finite check of :func:`check_step`.
2. :meth:`Voting.post` quantizes / packs the buffer and posts the vote's first collective
   (:meth:`lioncub.collectives.VoteAlgorithm.start`).
3. :meth:`Voting.apply` runs every vote's between-phase work (``advance``) before waiting for the first
   (phase 2 of one bucket overlaps the wait for the next), then waits for each vote and applies it:
   ``p ← p·(1 − lr·wd) − lr·u`` with each parameter's own group's current ``lr`` and ``weight_decay``,
   then ``m_i ← β2·m_i + (1−β2)·g_i``. For the dense presets ``u`` is the mean gradient and the step is
   global Lion (``m`` the same on every rank).

On CPU (float32/float64, :func:`lioncub.ops.kernels.step_backend_for`) the passes are fused C kernels
(:mod:`lioncub.ops.native`), bit for bit the torch code they replace: step 1 writes the vote's payload
(packed votes, lanes or int8 signs, :meth:`lioncub.collectives.VoteAlgorithm.encoding`) straight from
``(m, g)`` in one pass, or ``c`` where the vote needs it (the quantizers); the 1-bit count and the L1
quantizer's second pass are C kernels; step 3 applies the undecoded result (packed bits, integer sums)
with the weight decay and the momentum update in one pass over ``(p, m, g)``; the dense presets' global
Lion step is one pass too. ``LIONCUB_CPU_KERNELS=0`` runs the torch code instead. The contribution pass
also writes each momentum's next value into a second buffer, and the apply swaps the two storages: the
optimizer's ``exp_avg`` tensors keep their identity, but a view of one taken before a step does not follow
it (read ``state[p]["exp_avg"]`` again after ``step()``).

:class:`~lioncub.optim.LionCub`'s ``step()`` calls 1–3 on its own buckets; the DDP hook of
:mod:`lioncub.optim.overlap` calls 1 and 2 on DDP's buckets during the backward and ``step()`` calls 3.
Both give the same bits: every vote is elementwise, with quantizer normalisation per parameter tensor.

The state (each parameter's momentum ``exp_avg`` and param group) is the optimizer's: :class:`Voting`
reads the optimizer's ``param_groups`` and ``state`` at every call, so LR schedules, ``load_state_dict``
(which replaces both) and DDP's bucket rebuild change nothing.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lioncub.collectives import (
    AverageVote,
    Comm,
    DenseMean,
    LaneVote,
    OneBitVote,
    Pending,
    QuantizedVote,
    RawResult,
    ServerVote,
    SignSumVote,
    VoteAlgorithm,
    make_topology_vote,
)
from lioncub.ops import kernels, native
from lioncub.ops.quantize import max_abs
from lioncub.optim.config import VoteConfig, check_workers
from lioncub.optim.lion import apply_update_, lion_direction, update_momentum_

__all__ = [
    "NONFINITE_MODES",
    "STEP_CHECK_WORDS",
    "BucketVote",
    "GradientChangedError",
    "NonFiniteGradientError",
    "StepCheck",
    "StepMismatchError",
    "StepTimes",
    "Voting",
    "check_step",
    "flat_views",
    "grad_checksum",
    "make_vote",
]

#: what a step does when a rank's gradients hold NaN or Inf (:class:`~lioncub.optim.lioncub.Checks`)
NONFINITE_MODES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A rank's gradients held NaN or Inf and ``nonfinite="raise"``."""


def flat_views(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's view into ``flat`` (1-D), the parameters laid out one after another in order.

    ``flat`` must hold at least ``sum(p.numel())`` elements; the views have the parameters' shapes and
    share ``flat``'s storage and dtype."""
    views, pos = [], 0
    for p in params:
        views.append(flat[pos : pos + p.numel()].view_as(p))
        pos += p.numel()
    return views


def make_vote(comm: Comm, config: VoteConfig, levels: tuple[Comm, Comm] | None = None) -> VoteAlgorithm:
    """The vote algorithm for ``config`` on ``comm`` (raises when N workers could overflow a lane: the
    message names ``bits``, the transport and the widths or presets that fit N, see
    :func:`lioncub.optim.config.check_workers`), laid over the nodes as ``config.topology`` with
    ``levels`` = (intra-node, inter-node) groups of this rank (:mod:`lioncub.collectives.hierarchical`)."""
    config.validate()
    if config.topology != "flat" and levels is None:
        raise ValueError(f"topology={config.topology!r} needs the (node, local) groups of this rank")
    try:
        flat = _build_vote(comm, config)
    except ValueError as exc:
        try:
            check_workers(config, comm.world_size)  # an overflow for N workers: say which option to change
        except ValueError as named:
            raise named from exc
        raise
    return make_topology_vote(config.topology, flat, lambda: levels)  # type: ignore[arg-type,return-value]


def _build_vote(comm: Comm, config: VoteConfig) -> VoteAlgorithm:
    t, agg = config.transport, config.aggregation
    if t == "dense":
        wire = None if config.wire_dtype_name is None else getattr(torch, config.wire_dtype_name)
        return DenseMean(comm, wire)
    if t == "1bit":
        return OneBitVote(comm)
    if t == "lanes":
        return LaneVote(comm, config.bits if config.bits is not None else 4)
    if t == "int8":
        return AverageVote(comm) if agg == "average" else SignSumVote(comm)
    if t == "server":
        return ServerVote(comm, "average" if agg == "average" else "majority", root=config.server_root)
    return QuantizedVote(
        comm,
        config.quantizer or "l1",
        config.bits if config.bits is not None else 8,
        clip_multiple=config.clip_multiple,
        chunk_size=config.chunk_size,
        options=config.quantizer_options,
        seed=config.seed,
    )


@dataclass
class StepTimes:
    """Wall time of one step's phases, in seconds."""

    direction: float = 0.0  # the local directions c_i (or the gradient copy of the dense presets)
    encode: float = 0.0  # quantize / pack and posting the collectives
    exchange: float = 0.0  # waiting for the exchanges, incl. unpack/count between phases and decode
    apply: float = 0.0  # applying the update and the momentum
    sync: float = 0.0  # momentum synchronization (on the steps it is due)
    overlapped: float = 0.0  # overlap: contributions, quantize/pack and between-phase work in the backward

    def add(self, other: StepTimes) -> None:
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


@dataclass
class BucketVote:
    """One bucket of one step: its parameters (in the flat layout's order), this rank's flat contribution
    ``local`` and its max-abs ``peak`` (float32 scalar; NaN or Inf when some element is not finite), the
    vote once posted, (diagnostics steps) a copy of the contribution, and (fused CPU path) the vote's
    payload ``encoded`` written instead of ``local``, which then holds no values, and each parameter's next
    momentum ``β2·m + (1−β2)·g`` with the ``β2`` it used (``next_momenta``), computed in the same pass."""

    key: int
    params: list[torch.Tensor]
    local: torch.Tensor
    peak: torch.Tensor
    direction: torch.Tensor | None = None
    pending: Pending | None = None
    encoded: torch.Tensor | None = None
    next_momenta: list[tuple[torch.Tensor, float] | None] | None = None


class Voting:
    """Contributions, votes and the apply of :class:`~lioncub.optim.LionCub`'s step on one process group.

    Args:
        comm: the group the votes travel on.
        config: the vote configuration (validated here).
        optimizer: whose ``param_groups`` and ``state`` (momenta) are read at every call.
        levels: (intra-node, inter-node) groups of this rank, for ``config.topology`` other than flat.
    """

    def __init__(
        self,
        comm: Comm,
        config: VoteConfig,
        optimizer: torch.optim.Optimizer,
        levels: tuple[Comm, Comm] | None = None,
    ) -> None:
        self.comm = comm
        self.config = config
        self.vote = make_vote(comm, config, levels)
        self.dense = config.transport == "dense"
        self._optimizer = optimizer
        self._group_of: dict[int, int] = {}
        self._scratch: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # id(m): (m, scratch)
        self.refresh()
        if any(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
            native.available()  # builds or loads the fused CPU kernels now, not in the first step

    def refresh(self) -> None:
        """Re-read which param group each parameter belongs to (after ``add_param_group``)."""
        groups = self._optimizer.param_groups
        self._group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}

    def group(self, p: torch.Tensor) -> dict[str, Any]:
        """The param group of ``p`` (``KeyError`` if the optimizer does not hold ``p``)."""
        return self._optimizer.param_groups[self._group_of[id(p)]]

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self._group_of

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's momentum of ``p`` (created as zeros on first use)."""
        state = self._optimizer.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]

    def grad(self, p: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """The gradient Lion descends: ``g`` (zeros for ``None``), negated under ``maximize``."""
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            raise RuntimeError("LionCub does not support sparse gradients")
        return -g if self.group(p)["maximize"] else g

    # -- 1. contributions --------------------------------------------------------------------------

    @torch.no_grad()
    def contribute(
        self,
        key: int,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        out: torch.Tensor,
        *,
        keep_copy: bool = False,
    ) -> BucketVote:
        """Write this rank's contribution of ``params`` (with gradients ``grads``) into the flat buffer
        ``out`` and take its max-abs; ``keep_copy`` keeps a copy for the diagnostics. On the fused CPU path
        the vote's payload is written instead (``BucketVote.encoded``) where the vote takes one."""
        if self._fused(out, params, grads):
            if not self.dense:
                return self._contribute_fused(key, params, grads, out, keep_copy)
            bucket = self._contribute_dense(key, params, grads, out, keep_copy)
            if bucket is not None:
                return bucket
        for p, g, view in zip(params, grads, flat_views(out, params), strict=True):
            grad = self.grad(p, g)
            if self.dense:
                view.copy_(grad)
            else:
                beta1 = self.group(p)["betas"][0]
                torch.mul(self.momentum(p), beta1, out=view).add_(grad, alpha=1.0 - beta1)
        peak = max_abs(out).float()
        return BucketVote(key, list(params), out, peak, out.clone() if keep_copy else None)

    def _fused(
        self, out: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> bool:
        """Whether the fused CPU kernels take this bucket: every parameter, momentum and gradient a dense
        contiguous CPU tensor of ``out``'s dtype (float32/float64), the kernels available."""
        if kernels.step_backend_for(out) != "cpu":
            return False
        for p, g in zip(params, grads, strict=True):
            if kernels.step_backend_for(out, p, self.momentum(p), g) != "cpu":
                return False
        return True

    def _contribute_fused(
        self,
        key: int,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        out: torch.Tensor,
        keep_copy: bool,
    ) -> BucketVote:
        d = out.numel()
        enc = None if keep_copy or sum(p.numel() for p in params) != d else self.vote.encoding()
        payload = self.vote.payload(key, d) if enc is not None else None
        peaks: list[float] = []
        nexts: list[tuple[torch.Tensor, float] | None] = []
        pos = 0
        for p, g, view in zip(params, grads, flat_views(out, params), strict=True):
            group = self.group(p)
            (beta1, beta2), neg = (float(b) for b in group["betas"]), bool(group["maximize"])
            m, gr = self.momentum(p), (None if g is None else g.detach())
            nxt = self._scratch_momentum(m)
            nexts.append(None if nxt is None else (nxt, beta2))
            more = {"negate": neg, "next_momentum": nxt, "beta2": beta2}
            if enc is None:
                peaks.append(native.direction(m, gr, beta1, out=view, **more))
            elif enc.kind == "sign":
                signs = payload[pos : pos + p.numel()]  # type: ignore[index]
                peaks.append(native.direction_sign(m, gr, beta1, out=signs, **more))
            else:
                lanes = {"out": payload, "position": pos, "bits": enc.bits}
                peaks.append(native.direction_lanes(m, gr, beta1, **lanes, **more))  # type: ignore[arg-type]
            pos += p.numel()
        if enc is not None and enc.kind == "lanes":  # the padding: "+" votes (1 bit), zero lanes (wider)
            lanes_total = payload.numel() * 8 // enc.bits  # type: ignore[union-attr]
            native.fill_lanes(payload, d, lanes_total, enc.bits, 1 if enc.bits == 1 else 0)  # type: ignore[arg-type]
        peak = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
        return BucketVote(
            key, list(params), out, torch.tensor(peak, dtype=torch.float32),
            out.clone() if keep_copy else None, encoded=payload, next_momenta=nexts,
        )  # fmt: skip

    def _contribute_dense(
        self,
        key: int,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        out: torch.Tensor,
        keep_copy: bool,
    ) -> BucketVote | None:
        """The dense presets' contribution written straight into the vote's send buffer (the gradient in the
        wire dtype, divided by N) in one pass; ``None`` where the vote or the dtypes do not take it."""
        enc = self.vote.encoding()
        d = out.numel()
        if keep_copy or enc is None or enc.kind != "scaled" or sum(p.numel() for p in params) != d:
            return None
        payload = self.vote.payload(key, d, out.dtype)
        if (out.dtype, payload.dtype) not in native.SCALE_DTYPES:
            return None
        peaks, pos, n = [], 0, enc.bits
        for p, g in zip(params, grads, strict=True):
            view = payload[pos : pos + p.numel()]
            if g is None:
                view.zero_()
                peaks.append(0.0)
            else:
                peaks.append(
                    native.scale(g.detach(), view, divisor=n, negate=bool(self.group(p)["maximize"]))
                )
            pos += p.numel()
        peak = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
        return BucketVote(key, list(params), out, torch.tensor(peak, dtype=torch.float32), encoded=payload)

    def _scratch_momentum(self, m: torch.Tensor) -> torch.Tensor | None:
        """A reusable tensor like ``m`` for its next value (the fused apply then swaps the two storages:
        the momentum is written once, in the contribution pass, and a skipped step keeps the old one);
        ``None`` where ``m`` does not own its whole storage (a view: its storage is not swapped)."""
        if m.storage_offset() != 0 or m.untyped_storage().nbytes() != m.numel() * m.element_size():
            return None
        entry = self._scratch.get(id(m))
        if entry is not None and entry[0]() is m and entry[1].shape == m.shape and entry[1].dtype == m.dtype:
            return entry[1]
        for key in [k for k, (ref, _) in self._scratch.items() if ref() is None]:
            del self._scratch[key]  # momenta replaced since (load_state_dict)
        scratch = torch.empty_like(m, memory_format=torch.contiguous_format)
        self._scratch[id(m)] = (weakref.ref(m), scratch)
        return scratch

    @staticmethod
    def _swap_momentum(m: torch.Tensor, fresh: torch.Tensor) -> None:
        """``m`` takes ``fresh``'s storage (its next value); ``fresh`` keeps ``m``'s old storage as the next
        step's scratch. The tensor object ``m`` (the optimizer's ``state[p]["exp_avg"]``) stays the same."""
        old = torch.empty(0, dtype=m.dtype)
        old.set_(m)
        m.set_(fresh)
        fresh.set_(old)

    # -- 2. the vote -------------------------------------------------------------------------------

    def post(self, bucket: BucketVote, step: int) -> None:
        """Quantize / pack ``bucket`` and post its vote for optimizer step ``step`` (the step also names
        the step in the error of a failing collective)."""
        self.comm.step = step
        extra = {} if bucket.encoded is None else {"encoded": bucket.encoded}
        bucket.pending = self.vote.start(
            bucket.local, step=step, key=bucket.key, segments=[p.numel() for p in bucket.params], **extra
        )

    # -- 3. the apply ------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(
        self,
        buckets: Sequence[BucketVote],
        times: StepTimes,
        *,
        keep_updates: bool = False,
        untouched: frozenset[int] = frozenset(),
    ) -> list[torch.Tensor]:
        """Finish every bucket's vote and apply it with the momentum update (see the module docstring);
        the parameters whose ``id`` is in ``untouched`` (no gradient on any rank) keep their value and
        momentum. Returns copies of the flat updates if ``keep_updates`` (diagnostics), else ``[]``."""
        t0 = time.perf_counter()
        for b in buckets:  # between-phase work of two-phase votes, overlapping the other buckets
            assert b.pending is not None
            b.pending.advance()
        times.exchange += time.perf_counter() - t0
        updates: list[torch.Tensor] = []
        for b in buckets:
            t0 = time.perf_counter()
            assert b.pending is not None
            raw = None
            if not keep_updates and b.pending.raw is not None:
                wire = self.vote.wire_dtype or b.local.dtype if self.dense else None  # type: ignore[attr-defined]
                if self._fused_apply(b.params, wire):
                    raw = b.pending.wait_raw()
            if raw is not None:  # fused CPU path: decoded as it is applied
                t1 = time.perf_counter()
                pos = 0
                for i, p in enumerate(b.params):
                    if id(p) not in untouched:
                        self._apply_raw(p, raw, pos, b.next_momenta[i] if b.next_momenta else None)
                    pos += p.numel()
            else:
                update = b.pending.wait()
                if keep_updates:
                    updates.append(update.clone())
                t1 = time.perf_counter()
                for i, (p, u) in enumerate(zip(b.params, flat_views(update, b.params), strict=True)):
                    if id(p) not in untouched:
                        self._apply_one(p, u, b.next_momenta[i] if b.next_momenta else None)
            times.exchange += t1 - t0
            times.apply += time.perf_counter() - t1
        return updates

    def wait_all(self, buckets: Sequence[BucketVote]) -> None:
        """Wait for every posted vote without applying it (a dropped step: none stays in flight)."""
        for b in buckets:
            if b.pending is not None:
                b.pending.wait()

    def _fused_apply(self, params: Sequence[torch.Tensor], raw_dtype: torch.dtype | None = None) -> bool:
        """Whether the fused CPU apply takes every parameter of a bucket (with its momentum and gradient;
        dense: the mean gradient of dtype ``raw_dtype``, the parameter's or bfloat16 for float32)."""
        if self.dense:
            ok = {p.dtype for p in params} <= {raw_dtype} or (
                raw_dtype == torch.bfloat16 and {p.dtype for p in params} <= {torch.float32}
            )
            return ok and all(kernels.step_backend_for(p, self.momentum(p)) == "cpu" for p in params)
        return all(kernels.step_backend_for(p, self.momentum(p), p.grad) == "cpu" for p in params)

    def _momentum_args(
        self, p: torch.Tensor, nxt: tuple[torch.Tensor, float] | None
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The momentum arguments of :func:`lioncub.ops.native.apply` for ``p``, and the next momentum to
        swap in afterwards (then the apply leaves the momentum alone); a next momentum computed with
        another ``β2`` than the group's now is not used."""
        group = self.group(p)
        beta2 = float(group["betas"][1])
        if nxt is not None and nxt[1] == beta2:
            return {}, nxt[0]
        g = None if p.grad is None else p.grad.detach()
        return {
            "exp_avg": self.momentum(p),
            "grad": g,
            "beta2": beta2,
            "negate": bool(group["maximize"]),
        }, None

    def _apply_raw(
        self, p: torch.Tensor, raw: RawResult, pos: int, nxt: tuple[torch.Tensor, float] | None = None
    ) -> None:
        """The apply of :meth:`_apply_one` from an undecoded result (:meth:`Pending.wait_raw`) whose element
        ``pos`` is this parameter's first."""
        group = self.group(p)
        if raw.kind == "values":  # dense: global Lion with the mean gradient, read in the wire dtype
            u = raw.data[pos : pos + p.numel()]
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
            native.lion(p.data, u, self.momentum(p), beta1=beta1, beta2=beta2, **hyper)
            return
        mom, fresh = self._momentum_args(p, nxt)
        common = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]), **mom}
        if raw.kind == "bits":
            native.apply(p.data, raw.data, kind="bits", position=pos, **common)
        elif raw.kind == "lanes":
            native.apply(
                p.data, raw.data, kind="lanes", position=pos, lane_bits=raw.bits, table=raw.table, **common
            )
        elif raw.kind == "mean":
            native.apply(p.data, raw.data[pos : pos + p.numel()], kind="mean", divisor=raw.divisor, **common)
        else:
            native.apply(p.data, raw.data[pos : pos + p.numel()], kind="int8", sign_of=True, **common)
        if fresh is not None:
            self._swap_momentum(self.momentum(p), fresh)

    def _apply_one(
        self, p: torch.Tensor, u: torch.Tensor, nxt: tuple[torch.Tensor, float] | None = None
    ) -> None:
        group = self.group(p)
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        m = self.momentum(p)
        g = None if self.dense else p.grad
        fused = kernels.step_backend_for(p, m, u if u.dtype.is_floating_point else None, g) == "cpu"
        if fused and self.dense:  # global Lion in one pass: the mean gradient u as the gradient
            hyper = {"lr": float(lr), "beta1": float(beta1), "beta2": float(beta2), "weight_decay": float(wd)}
            native.lion(p.data, u, m, **hyper)
            return
        if fused and (u.dtype == torch.int8 or u.dtype == p.dtype):
            kind = "int8" if u.dtype == torch.int8 else "values"
            mom, fresh = self._momentum_args(p, nxt)
            native.apply(p.data, u, kind=kind, lr=float(lr), weight_decay=float(wd), **mom)
            if fresh is not None:
                self._swap_momentum(m, fresh)
            return
        if self.dense:  # u is the mean gradient: global Lion, the same on every rank
            c = lion_direction(m, u, beta1)
            apply_update_(p, c.sign_(), lr=lr, weight_decay=wd)
            update_momentum_(m, u, beta2)
        elif not u.dtype.is_floating_point and kernels.backend_for(p, u, m) == "triton":
            # GPU: p·(1 − lr·wd) − lr·u and m ← β2·m + (1−β2)·g in one pass (bit for bit the same)
            kernels.apply_votes_(
                p, u, lr=lr, weight_decay=wd, exp_avg=m, grad=self.grad(p, p.grad), beta2=beta2
            )
        else:
            _apply_chunked_(p, u, lr=lr, weight_decay=wd)
            update_momentum_(m, self.grad(p, p.grad), beta2)


#: int32 words every rank all-gathers once per step (:func:`check_step`)
STEP_CHECK_WORDS = 6


class StepMismatchError(RuntimeError):
    """The ranks called ``step()`` a different number of times, or optimize different parameter lists."""


class GradientChangedError(RuntimeError):
    """With the overlap hook, ``.grad`` changed between the backward (whose gradients the votes used) and
    ``step()``: gradient clipping, ``GradScaler.unscale_`` or an edit of ``.grad``."""


@dataclass(frozen=True)
class StepCheck:
    """What every rank learns from :func:`check_step`, the same on every rank.

    Attributes:
        ok: no rank had NaN/Inf (or a GradScaler overflow): the step is applied.
        bad_ranks: the ranks with NaN/Inf or an overflow.
        missing_grads: some rank has a parameter without a gradient (``.grad is None``).
        identical_grads: the gradient checksums sent were equal and non-zero on every rank (only asked
            for on one step: see ``grad_checksum``); ``False`` when not asked.
    """

    ok: bool
    bad_ranks: list[int]
    missing_grads: bool
    identical_grads: bool


def check_step(
    comm: Comm,
    peaks: Sequence[torch.Tensor],
    *,
    step: int,
    layout: int,
    missing_grads: int,
    overflow: bool = False,
    changed: Sequence[str] = (),
    grad_checksum: int | None = None,
    nonfinite: str,
) -> StepCheck:
    """The ranks' agreement before a step is applied: one all-gather of :data:`STEP_CHECK_WORDS` int32 per
    rank — flags (non-finite: from this rank's max-abs per bucket, ``peaks``, or a GradScaler ``overflow``;
    gradients ``changed`` after the overlapped votes used them: this rank's parameter names),
    optimizer step number, parameter ``layout`` hash (int32), number of this rank's optimized parameters
    without a gradient, and an int64 ``grad_checksum`` (0 when not asked).

    Raises on every rank: :class:`StepMismatchError` when the step numbers or layouts differ (naming
    the ranks and both values), :class:`GradientChangedError` when any rank's gradients changed, and
    with ``nonfinite="raise"`` :class:`NonFiniteGradientError` instead of returning ``ok=False``."""
    bad = bool(overflow)
    if peaks:
        bad = bad or bool((~torch.isfinite(torch.stack(list(peaks)))).any())
    checksum = 0 if grad_checksum is None else grad_checksum
    mine = torch.tensor(
        [
            int(bad) | int(bool(changed)) << 1,
            step,
            layout,
            missing_grads,
            checksum >> 32,
            checksum & 0xFFFFFFFF,
        ],
        dtype=torch.int64,
    )
    mine = ((mine + 2**31) % 2**32 - 2**31).to(torch.int32)  # each word as a signed int32
    step, layout = int(mine[1]), int(mine[2])
    n = comm.world_size
    if n > 1:
        rows = torch.empty(n, STEP_CHECK_WORDS, dtype=torch.int32, device=comm.device)
        comm.all_gather(rows, mine.to(comm.device), "step check").wait()
        rows = rows.cpu()
    else:
        rows = mine.reshape(1, -1)
    steps, layouts = rows[:, 1].tolist(), rows[:, 2].tolist()
    if len(set(steps)) > 1:
        others = [r for r, s in enumerate(steps) if s != step]
        raise StepMismatchError(
            f"rank {comm.rank}: this rank is at optimizer step {step}, rank(s) {others} at step(s) "
            f"{[steps[r] for r in others]}: a rank skipped or repeated step(). Call step() once per "
            "iteration on every rank, also when this rank's gradients overflowed: LionCub skips a step with "
            "NaN/Inf on any rank on every rank by itself (and takes a GradScaler's decision)"
        )
    if len(set(layouts)) > 1:
        others = [r for r, h in enumerate(layouts) if h != layout]
        raise StepMismatchError(
            f"rank {comm.rank}: rank(s) {others} optimize a different list of parameters at step {step} "
            "(parameters frozen/unfrozen with requires_grad_ or add_param_group on some ranks only, or with "
            "other shapes/dtypes); every rank must change the trainable parameters the same way"
        )
    flags = rows[:, 0]
    if bool((flags & 2).any()):
        ranks = (flags & 2).nonzero().flatten().tolist()
        mine_names = f" (here: {list(changed)[:5]})" if changed else ""
        raise GradientChangedError(
            f"rank {comm.rank}: .grad changed between backward and step() {step} on rank(s) {ranks}"
            f"{mine_names}, but the overlapped votes already used the gradients backward produced "
            "(gradient clipping, GradScaler.unscale_ or an edit of .grad). Use the plain step instead of "
            "overlap_with (lioncub.optim.ddp.skip_gradient_allreduce(model)), or leave .grad as backward "
            "wrote it"
        )
    flags = flags & 1
    sums = rows[:, 4:].to(torch.int64)
    sums = sums[:, 0] * 2**32 + (sums[:, 1] & 0xFFFFFFFF)
    identical = grad_checksum is not None and n > 1 and bool((sums == sums[0]).all()) and grad_checksum != 0
    missing = bool(rows[:, 3].any())
    if not bool(flags.any()):
        return StepCheck(True, [], missing, identical)
    ranks = flags.nonzero().flatten().tolist()
    if nonfinite == "raise":
        raise NonFiniteGradientError(
            f"rank {comm.rank}: non-finite gradients (NaN or Inf) at step {step} on rank(s) {ranks}; nothing "
            "was applied (nonfinite='raise')"
        )
    return StepCheck(False, ranks, missing, identical)


def grad_checksum(grads: Sequence[torch.Tensor], sample: int = 1 << 16) -> int:
    """An int64 fingerprint of the gradients' bits (the first ``sample`` elements of each), equal on two
    ranks only if those elements are bitwise equal (up to hash collisions)."""
    total = 0
    for g in grads:
        head = g.detach().reshape(-1)[:sample].float().contiguous()
        bits = head.view(torch.int32).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
        total = (total * 1_000_003 + int((bits * weights).sum())) % (2**61 - 1)
    return total


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
