"""The global-Lion baselines' gradient mean (:class:`DenseMean`: presets ``32bit`` and ``16bit``)."""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from lioncub import transports
from lioncub.collectives.base import Comm, Handle
from lioncub.collectives.formats import Decoded, MeanGradient
from lioncub.collectives.protocol import Ballot, ParamState, Pending, Vote
from lioncub.collectives.signvote import fits_backend, flat_views, gradient
from lioncub.ops import native
from lioncub.ops.quantize import max_abs
from lioncub.ops.update import apply_update_, lion_direction, update_momentum_

__all__ = ["DenseMean"]


class DenseMean(Vote):
    """The global-Lion baselines: gradients cast to ``wire_dtype`` and divided by N (as DDP's allreduce
    (fp32) and ``fp16_compress_hook`` / ``bf16_compress_hook``), summed, cast back; every rank then takes
    Lion's step with the mean gradient ``ḡ`` (one momentum, the same on every rank):
    ``p ← p·(1 − lr·wd) − lr·sign(β1·m + (1−β1)·ḡ)``, ``m ← β2·m + (1−β2)·ḡ``.

    The sum is a reduce-scatter + all-gather built from an all-to-all (rank r receives slice r of every
    worker and adds the N slices **in rank order 0, 1, …, N−1** in ``wire_dtype``) rather than the backend's
    allreduce, whose summation order depends on where an element falls in the buffer: with it, the mean of
    N ≥ 3 floats changed in the last bit with the bucket layout. Here every element is
    ``((g_0/N + g_1/N) + g_2/N) + …`` whatever the bucketing, so the overlapped path (DDP's buckets) and the
    step's own buckets agree bit for bit. On the fused CPU path the contribution (the gradient in the wire
    dtype, divided by N) is one pass into the send buffer, and the step one pass over ``(p, ḡ, m)``.
    Bytes per rank: ``2·(N−1)/N · d_pad·size(wire_dtype)`` (``d_pad``: d rounded up to a multiple of N), as
    a ring allreduce. As DDP, NaN and ±Inf propagate, and values at the edge of or beyond the wire dtype's
    range (fp16: 65504) can become ±Inf.
    """

    name = "dense"
    result = "value"
    facts = transports.FACTS["dense"]

    def __init__(
        self, comm: Comm, wire_dtype: torch.dtype | None = None, *, keep_buffers: bool | None = None
    ) -> None:
        super().__init__(comm)
        if wire_dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"wire_dtype={wire_dtype} must be None, float32, bfloat16, float16 or float64")
        self.wire_dtype = wire_dtype
        self.name = {None: "dense", torch.float32: "32bit", torch.bfloat16: "16bit"}.get(wire_dtype, "dense")
        #: keep each bucket's exchange buffers from one step to the next (see :meth:`start`); default: on the
        #: CPU only, where a fresh buffer's pages fault in at every exchange (no caching allocator)
        self.keep_buffers = comm.device.type == "cpu" if keep_buffers is None else keep_buffers

    def scratch(self, key: Hashable | None, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements of ``dtype`` on the comm's device: the bucket ``key``'s own,
        reused, under :attr:`keep_buffers`, else a fresh one."""
        if self.keep_buffers:
            return self.buffer(key, name, numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self.comm.device)

    def send_buffer(self, key: Hashable | None, d: int, dtype: torch.dtype) -> torch.Tensor:
        """The send buffer of bucket ``key`` of d elements of ``dtype``: 1-D, N slices of ``⌈d/N⌉`` elements
        of the wire dtype (:meth:`scratch`; the padding is zeroed by :meth:`start`)."""
        n = self.world_size
        return self.scratch(key, "send", -(-d // n) * n, self.wire_dtype or dtype)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        """The exchange's buffers (send and receive: ``N·⌈d/N⌉`` elements of the wire dtype each; the
        gathered mean as many; this rank's slice ``⌈d/N⌉``). Under :attr:`keep_buffers` they are the
        bucket's own, kept from step to step (3 buckets' worth per bucket). Otherwise (the default on a
        CUDA device, whose caching allocator hands the same blocks back at the next exchange) each is
        released when done: the send and receive buffers once this rank's slice is summed
        (:meth:`Pending.advance`), the slice once it is gathered, the gathered mean when the ballot is
        applied or discarded (:meth:`apply`, :meth:`discard`) or when the caller of :meth:`update` drops it.
        On the CPU, fresh buffers made a dense step 2–14× slower (their pages fault in at every exchange;
        2 gloo ranks, 4 buckets of 4–23 MiB, 32bit and 16bit, a 2-core VM), hence the default there."""
        n, d = self.world_size, local.numel()
        if self.comm.alone:  # nothing travels, nothing is rounded: plain Lion
            return Pending(lambda: Decoded(local))
        dtype = self.wire_dtype or local.dtype
        piece = -(-d // n)  # elements of the slice each rank sums
        if encoded is None:
            send = self.send_buffer(key, d, local.dtype)
            send[:d].copy_(local).div_(n)  # cast, then divide in the wire dtype, as DDP's hooks
        elif encoded.shape != (n * piece,) or encoded.dtype != dtype:
            raise ValueError("DenseMean: the encoded contribution must be written into send_buffer()")
        else:
            send = encoded
        send[d:].zero_()
        recv = self.scratch(key, "recv", n * piece, dtype).view(n, piece)
        what = f"{self.name} gradient"
        # the closures' only references to the buffers (each phase's handle and output), popped when done
        phase1: list[tuple[Handle, torch.Tensor]] = [
            (self.comm.all_to_all(recv, send.view(n, piece), f"{what} reduce-scatter"), recv)
        ]
        phase2: list[tuple[Handle, torch.Tensor]] = []
        out_dtype = local.dtype

        def middle() -> None:  # this rank's slice: the N contributions added in rank order
            handle, rows = phase1.pop()
            handle.wait()
            total = self.scratch(key, "total", piece, dtype).copy_(rows[0])
            for row in rows[1:]:
                total.add_(row)
            del handle, rows  # the send and receive buffers go (their work may hold them a while on gloo)
            gathered = self.scratch(key, "gathered", n * piece, dtype).view(n, piece)
            phase2.append((self.comm.all_gather(gathered, total, f"{what} all-gather"), gathered))

        def finish() -> MeanGradient:  # the mean in the wire dtype (a fused step widens it as it reads)
            handle, gathered = phase2.pop()
            handle.wait()
            return MeanGradient(gathered.view(-1)[:d], out_dtype)

        return Pending(finish, middle=middle)

    def wire_bytes(self, numel, dtype: torch.dtype = torch.float32):
        bits = torch.finfo(self.wire_dtype or dtype).bits
        return self.facts.wire_bytes(numel, self.world_size, wire_bits=bits)

    # -- the protocol --------------------------------------------------------------------------------

    @torch.no_grad()
    def contribute(self, ballot, grads, state, *, step, keep_copy=False):
        d = ballot.local.numel()
        fused = (
            ballot.backend.fused
            and not keep_copy
            and not self.comm.alone
            and sum(ballot.segments) == d
            and fits_backend(ballot, state, grads)
        )
        send = self.send_buffer(ballot.key, d, ballot.local.dtype) if fused else None
        if send is not None and (ballot.local.dtype, send.dtype) in native.SCALE_DTYPES:
            self._contribute_fused(ballot, grads, state, send)
            return
        for p, g, view in zip(ballot.params, grads, flat_views(ballot.local, ballot.params), strict=True):
            view.copy_(gradient(p, g, state.hyper(p).maximize))
        ballot.peak = max_abs(ballot.local).float()
        ballot.direction = ballot.local.clone() if keep_copy else None

    def _contribute_fused(
        self, ballot: Ballot, grads: list[torch.Tensor | None], state: ParamState, send: torch.Tensor
    ) -> None:
        """The gradient in the wire dtype, divided by N, straight into the send buffer, in one pass."""
        peaks, pos, n = [], 0, self.world_size
        for p, g in zip(ballot.params, grads, strict=True):
            view = send[pos : pos + p.numel()]
            if g is None:
                view.zero_()
                peaks.append(0.0)
            else:
                peaks.append(native.scale(g.detach(), view, divisor=n, negate=state.hyper(p).maximize))
            pos += p.numel()
        peak = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
        ballot.peak = torch.tensor(peak, dtype=torch.float32)
        ballot.payload = send

    def post(self, ballot: Ballot, step: int) -> None:
        """Post the vote; the send buffer then belongs to the exchange alone (released once it is done)."""
        super().post(ballot, step)
        ballot.payload = None

    def update(self, ballot: Ballot) -> torch.Tensor:
        """The mean (flat, the bucket's dtype); the ballot lets go of the exchange: the mean's buffer lives as
        long as the caller keeps it."""
        mean = super().update(ballot)
        _release(ballot)
        return mean

    def discard(self, ballot: Ballot) -> None:
        """Wait for a posted vote, then release its buffers without applying it."""
        if ballot.pending is not None:
            ballot.pending.result()
        _release(ballot)

    @torch.no_grad()
    def apply(self, ballot, state, *, untouched=frozenset(), keep_update=False):
        assert ballot.pending is not None, "apply() before post()"
        result = ballot.pending.result()
        _release(ballot)  # the mean's buffer goes with this call's last reference to it
        mean = result.wire if isinstance(result, MeanGradient) else result.decode()
        dtypes = {p.dtype for p in ballot.params}
        fused = ballot.backend.fused and all(_dense_like(state.momentum(p), p) for p in ballot.params)
        widened = dtypes <= {mean.dtype} or (mean.dtype == torch.bfloat16 and dtypes <= {torch.float32})
        if not (fused and widened):
            mean = mean.to(ballot.local.dtype)  # the kernel widens only bfloat16 to float32 as it reads
        for p, u in zip(ballot.params, flat_views(mean, ballot.params), strict=True):
            if id(p) in untouched:
                continue
            h, m = state.hyper(p), state.momentum(p)
            hyper = {"lr": h.lr, "beta1": h.beta1, "beta2": h.beta2, "weight_decay": h.weight_decay}
            if fused:  # global Lion in one pass, the mean gradient read in the wire dtype
                native.lion(p.data, u.reshape(-1), m, **hyper)
                continue
            c = lion_direction(m, u, h.beta1)
            apply_update_(p, c.sign_(), lr=h.lr, weight_decay=h.weight_decay)
            update_momentum_(m, u, h.beta2)
        return mean.clone() if keep_update else None


def _release(ballot: Ballot) -> None:
    """Drop the ballot's references to its exchange (the send buffer, the pending vote and its buffers)."""
    ballot.payload = None
    ballot.pending = None


def _dense_like(m: torch.Tensor, p: torch.Tensor) -> bool:
    """The momentum is a plain dense contiguous tensor of ``p``'s dtype and device."""
    return m.dtype == p.dtype and m.device == p.device and m.layout == torch.strided and m.is_contiguous()
