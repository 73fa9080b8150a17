"""The global-Lion baselines' gradient mean (:class:`DenseMean`: presets ``32bit`` and ``16bit``)."""

from __future__ import annotations

import math

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

    def __init__(self, comm: Comm, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(comm)
        if wire_dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"wire_dtype={wire_dtype} must be None, float32, bfloat16, float16 or float64")
        self.wire_dtype = wire_dtype
        self.name = {None: "dense", torch.float32: "32bit", torch.bfloat16: "16bit"}.get(wire_dtype, "dense")

    def send_buffer(self, key: object, d: int, dtype: torch.dtype) -> torch.Tensor:
        """The reusable send buffer of a bucket of d elements of ``dtype`` (N slices of ``⌈d/N⌉``)."""
        n = self.world_size
        return self.buffer(key, "send", -(-d // n) * n, self.wire_dtype or dtype)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        if self.comm.alone:  # nothing travels, nothing is rounded: plain Lion
            return Pending(lambda: Decoded(local))
        dtype = self.wire_dtype or local.dtype
        piece = -(-d // n)  # elements of the slice each rank sums
        send = self.send_buffer(key, d, local.dtype)
        send[d:].zero_()
        if encoded is None:
            send[:d].copy_(local).div_(n)  # cast, then divide in the wire dtype, as DDP's hooks
        elif encoded.data_ptr() != send.data_ptr():
            raise ValueError("DenseMean: the encoded contribution must be written into send_buffer()")
        recv = self.buffer(key, "recv", n * piece, dtype).view(n, piece)
        handle = self.comm.all_to_all(recv, send.view(n, piece), f"{self.name} gradient reduce-scatter")
        gathered = self.buffer(key, "gathered", n * piece, dtype).view(n, piece)
        phase2: list[Handle] = []

        def middle() -> None:  # this rank's slice: the N contributions added in rank order
            handle.wait()
            total = self.buffer(key, "total", piece, dtype).copy_(recv[0])
            for row in recv[1:]:
                total.add_(row)
            phase2.append(self.comm.all_gather(gathered, total, f"{self.name} gradient all-gather"))

        def finish() -> MeanGradient:  # the mean in the wire dtype (a fused step widens it as it reads)
            phase2[0].wait()
            return MeanGradient(gathered.view(-1)[:d], local.dtype)

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

    @torch.no_grad()
    def apply(self, ballot, state, *, untouched=frozenset(), keep_update=False):
        assert ballot.pending is not None, "apply() before post()"
        result = ballot.pending.result()
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


def _dense_like(m: torch.Tensor, p: torch.Tensor) -> bool:
    """The momentum is a plain dense contiguous tensor of ``p``'s dtype and device."""
    return m.dtype == p.dtype and m.device == p.device and m.layout == torch.strided and m.is_contiguous()
