r"""Fused kernels of a vote step: Triton on GPUs, C on CPUs, with a plain-torch fallback.

Three kernels, each a Triton kernel (``backend="triton"``), a C kernel (``backend="cpu"``,
:mod:`lioncub.ops.native`) and a torch reference (``backend="torch"``) that give bit-for-bit the same
result; ``backend="auto"`` (the default) takes Triton when it can run the tensors (Triton is importable
and they are CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``, Triton's interpreter), else the C
kernels for CPU tensors (when they compiled, see :func:`lioncub.ops.native.reason`, and unless
``LIONCUB_CPU_KERNELS=0``), and torch otherwise, also for inputs the fused kernels do not take (other
dtypes, non-contiguous tensors): :func:`backend_for` says which one a call takes. The C kernels take
contiguous float32, float64 and bfloat16 tensors (int8 votes for :func:`apply_votes_`) and follow the
arithmetic below (float64 as float32, with double scalars).

* :func:`quantize_l1` — the L1 quantizer of :mod:`lioncub.ops.quantize` (``quantize("l1", ...)`` per segment,
  as ``QuantizedVote.levels_of``), its NaN/Inf/zero/denormal behaviour included. Pass 1 (the normaliser
  ``mean |c|`` of each tensor or chunk) runs the *same reduction* in both backends: a sum in another
  order could differ in the float64 scale's last bit, which moves levels that lie at a rounding boundary.
  On the CPU that is the reference's own per-tensor torch reduction; off the CPU the reference sums in
  float64 with :func:`lioncub.ops.abs_sums.l1_abs_sums` (two Triton kernels whose order per tensor or
  chunk depends on its own elements only), so the fused quantizer runs them once for the whole bucket
  (3 launches, not ~12 per tensor). Pass 2 (divide by the normaliser, scale by ``s / k``, round half to
  even, clip, NaN → 0, cast) is the fused kernel; it divides with ``tl.math.div_rn`` (IEEE round to
  nearest: Triton's ``/`` on float32 compiles to an approximate division) and float64 ``/`` (IEEE).
* :func:`majority_pack` — the middle step of the 1-bit vote: unpack the N received rows, count the "+"
  votes per bit, apply the tie rule and repack (:func:`lioncub.ops.packing.count_votes` followed by
  :func:`lioncub.ops.packing.pack_majority`).
* :func:`apply_votes_` — ``p ← p·(1 − lr·wd) − lr·u`` from int8 votes, optionally with the momentum
  update fused in; :func:`apply_votes_multi_` the same for all tensors of a bucket in one launch, and
  :func:`lion_directions_` a bucket's contribution ``β1·m + (1−β1)·g`` in one launch (Triton reads each
  tensor's address from a pointer table).

Every Triton launch runs under its tensors' CUDA device (:func:`lioncub.ops.triton_launch.on_device`); host
tables are copied to the device once per layout (:class:`lioncub.ops.triton_launch.DeviceTables`).

Arithmetic, so that both backends round identically:

* float32: each torch op rounds once. ``x.add_(y, alpha=a)`` is one *fused* multiply-add on CPU (ATen's
  vectorised ``fmadd``, also in the scalar tail) and on CUDA (``a + alpha * b`` contracted by nvcc). The
  kernels therefore compute ``t = m·β`` (rounded) and ``c = fma(g, 1−β, t)`` (rounded once) with
  ``tl.fma``, and are compiled with ``enable_fp_fusion=False`` so that Triton contracts nothing else.
  Triton's interpreter evaluates ``tl.fma`` as ``x*y + z`` in numpy (two roundings), so under the
  interpreter an exact emulation runs instead: the float64 sum of the exact product (a product of two
  float32 is exact in float64) is rounded to odd with its TwoSum error, then to float32, which is the
  correctly rounded fma (Boldo & Melquiond, round-to-odd with 53 ≥ 24 + 2 bits). ``emulate_fma=True``
  forces the emulation on a GPU too (``benchmarks/gpu_check.py`` checks both).
* bfloat16 / float16: every op computes in float32 and rounds to the storage dtype after each torch op
  (PyTorch's "opmath"; what its CUDA kernels do), the fused multiply-add included. The torch backend
  spells this out in float32 (``m.float()·β``, then ``.to(bf16)``, …) instead of calling
  ``Tensor.add_(alpha=)`` on the bf16 tensors: on CPU, ATen's bf16 ``add_`` rounds ``alpha`` to bf16 in
  its vectorised loop but not in its scalar tail, so its result depends on an element's position.
  For float32 the torch backend *is* :mod:`lioncub.ops.update` (``apply_update_``,
  ``update_momentum_``).
  Triton's interpreter rounds float32 → bfloat16 by truncation, so the kernels round bf16 themselves
  on the raw bits (round half to even, NaN → ``0x7FC0`` as ``c10::BFloat16``; CUDA's conversion gives
  ``0x7FFF`` for NaN: compare NaN-aware).
* Rounding to integer levels uses the float32 (float64) "magic number" ``(t + 1.5·2^23) − 1.5·2^23``,
  exact round-half-to-even for ``|t| ≤ 2^22`` after the clip to ``±levels``.

The Triton kernels take contiguous float32, bfloat16 and float16 tensors (float64 and other dtypes go to
the torch backend under ``"auto"``, and raise under ``"triton"``). This module sits in the lowest layer:
it imports torch, :mod:`lioncub.ops.native`, :mod:`lioncub.ops.packing`, :mod:`lioncub.ops.quantize`,
:mod:`lioncub.ops.normalizers`, :mod:`lioncub.ops.abs_sums` (pass 1's float64 sums on Triton's device) and
:mod:`lioncub.ops.triton_launch` (how a Triton kernel is launched: Triton itself is imported only when a
tensor is on its device).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lioncub.ops import abs_sums, native, normalizers, packing, quantize, triton_launch

__all__ = [  # and, imported when first asked, HAVE_TRITON, TRITON_ERROR and triton (module __getattr__)
    "STEP_BACKENDS",
    "Backend",
    "StepBackend",
    "apply_votes_",
    "apply_votes_multi_",
    "backend_for",
    "lion_directions_",
    "majority_pack",
    "quantize_l1",
    "step_backend",
    "step_backend_for",
]

Backend = Literal["auto", "triton", "cpu", "torch"]
BACKENDS = ("auto", "triton", "cpu", "torch")

_MAX_LEVELS = 1 << 22  # the magic-number rint is exact up to 2^22


def __getattr__(name: str) -> Any:
    """``HAVE_TRITON``, ``TRITON_ERROR`` and ``triton``: from :mod:`lioncub.ops.triton_kernels`, imported
    when first asked."""
    if name in ("HAVE_TRITON", "TRITON_ERROR", "triton"):
        return getattr(triton_launch.triton_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _why_not_cpu(tensors: Sequence[torch.Tensor], floats: Sequence[torch.Tensor]) -> str:
    """Why the C kernels cannot run these tensors ("" if they can)."""
    if not native.available():
        return f"the fused CPU kernels are unavailable ({native.reason()})"
    if triton_launch.tensor_subclass(tensors):
        return triton_launch.tensor_subclass(tensors)
    for t in tensors:
        if t.device.type != "cpu":
            return f"a {t.device.type} tensor: the C kernels take CPU tensors"
        if not t.is_contiguous():
            return "a non-contiguous tensor"
    for t in floats:
        if t.dtype not in native.DTYPES:
            return f"dtype {t.dtype} (the C kernels take float32, float64 and bfloat16)"
    if floats and len({t.dtype for t in floats}) > 1:
        return f"mixed dtypes {sorted(str(t.dtype) for t in floats)}"
    return ""


def _resolve(backend: str, tensors: Sequence[torch.Tensor], floats: Sequence[torch.Tensor] = ()) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    if backend == "cpu":
        why = _why_not_cpu(tensors, floats)
        if why:
            raise RuntimeError(f"backend='cpu' cannot run this call: {why}")
        return "cpu"
    why = triton_launch.why_not_triton(tensors, floats)
    if not why:
        return "triton"
    if backend == "triton":
        raise RuntimeError(f"backend='triton' cannot run this call: {why}")
    return "cpu" if not _why_not_cpu(tensors, floats) else "torch"


def backend_for(*tensors: torch.Tensor, backend: Backend = "auto") -> str:
    """The backend (``"triton"``, ``"cpu"`` or ``"torch"``) a kernel of this module takes for these
    tensors."""
    floats = [t for t in tensors if t.dtype.is_floating_point]
    return _resolve(backend, tensors, floats)


#: the dtypes the optimizer steps hand to the C kernels: their torch steps compute bfloat16 in ATen's own
#: bfloat16 kernels, not in the float32 "opmath" of this module's reference, so bfloat16 stays on torch
STEP_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class StepBackend:
    """How a bucket's per-element work runs, chosen once, when the bucket is built (:func:`step_backend`).

    Attributes:
        name: ``"cpu"`` (the fused C kernels of :mod:`lioncub.ops.native`), ``"triton"`` or ``"torch"``.
        fused: the contribution writes the vote's payload in one pass, and the apply decodes a result as it
            reads it (the C kernels; where a step's tensors do not fit them, the torch path runs).
        votes_kernel: integer votes are applied with the momentum update in one kernel
            (:func:`apply_votes_`: Triton).
    """

    name: str
    fused: bool = False
    votes_kernel: bool = False


#: the step backends by name (:func:`step_backend_for`)
STEP_BACKENDS = {
    "cpu": StepBackend("cpu", fused=True),
    "triton": StepBackend("triton", votes_kernel=True),
    "torch": StepBackend("torch"),
}


def step_backend(*tensors: torch.Tensor | None) -> StepBackend:
    """The :class:`StepBackend` of :func:`step_backend_for` these tensors."""
    return STEP_BACKENDS[step_backend_for(*tensors)]


def step_backend_for(*tensors: torch.Tensor | None) -> str:
    """The backend of an optimizer step's fused CPU passes for these tensors (``None`` entries, a missing
    gradient, are skipped): ``"triton"`` where Triton takes them (the step's own Triton branches run
    then), ``"cpu"`` where the C kernels may (CPU, contiguous, dense, one dtype among
    :data:`STEP_DTYPES`, integer votes aside, the kernels available), else ``"torch"``."""
    present = [t for t in tensors if t is not None]
    if any(t.layout != torch.strided for t in present):
        return "torch"
    floats = [t for t in present if t.dtype.is_floating_point]
    if not triton_launch.why_not_triton(present, floats):
        return "triton"
    if not floats or floats[0].dtype not in STEP_DTYPES:
        return "torch"
    return "cpu" if not _why_not_cpu(present, floats) else "torch"


def _f32(x: float) -> float:
    """``x`` rounded to float32 (as torch rounds a Python scalar for a float32 op), as a Python float."""
    if math.isinf(x) or math.isnan(x) or abs(x) > 3.4028234663852886e38:
        return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))
    return struct.unpack("f", struct.pack("f", x))[0]


def _emulate(emulate_fma: bool | None) -> bool:
    return triton_launch.interpreting() if emulate_fma is None else bool(emulate_fma)


# ------------------------------------------------------------------------------------ torch reference


def _lerp_ref(a: torch.Tensor, b: torch.Tensor, beta: float) -> torch.Tensor:
    """``a·β + (1−β)·b`` as a new tensor of a's dtype, rounded as documented in the module docstring."""
    if a.dtype == torch.float32 or a.dtype == torch.float64:
        return torch.mul(a, beta).add_(b, alpha=1.0 - beta)  # = lioncub.ops.update.lion_direction
    t = torch.mul(a.float(), beta).to(a.dtype).float()
    return t.add_(b.float(), alpha=1.0 - beta).to(a.dtype)


def _apply_ref_(p: torch.Tensor, u: torch.Tensor, lr: float, weight_decay: float) -> None:
    """``p ← p·(1 − lr·wd) − lr·u`` in place (``apply_update_`` for float32, opmath for 16-bit)."""
    if p.dtype == torch.float32 or p.dtype == torch.float64:
        if lr * weight_decay != 0:
            p.mul_(1.0 - lr * weight_decay)
        p.add_(u.to(p.dtype), alpha=-lr)
        return
    w = p.float()
    if lr * weight_decay != 0:
        w = w.mul_(1.0 - lr * weight_decay).to(p.dtype).float()
    p.copy_(w.add_(u.float(), alpha=-lr))


def _momentum_ref_(m: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    if m.dtype == torch.float32 or m.dtype == torch.float64:
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)  # = update_momentum_
    else:
        m.copy_(_lerp_ref(m, g, beta2))


# ------------------------------------------------------------------------------------ Triton kernels

_BLOCK = 1024  # elements per program

# The 1-bit majority (issue 44, finding 9): it moves N·B bytes in and B out, so it should run at copy
# bandwidth. Its first kernel took 128 bytes of each row per program with one byte load per byte and
# counted each bit apart (unpack to 8 lanes: a shift, an and and an add per bit, 24 integer ops per byte and
# row), and was measured at ~9 % of copy bandwidth. Now a program takes 2 KiB of each row (512 words,
# 4 per thread at 4 warps: 16 bytes in flight per thread and row), loads 32-bit words where the rows allow it
# (row length a multiple of 4 bytes, aligned: one load per 4 bytes, vectorised further where Triton can
# prove alignment; else 4 byte loads assembled into a word) and counts bit-sliced: 2 bitwise ops per
# counter plane per word, log2(N + 1) planes, i.e. ~2·log2(N + 1)/4 ops per byte and row (N = 8: 2, not
# 24). Loads per byte drop 4x and integer work ~10x, so the kernel should be bound by memory, not by
# instructions (a GPU measures it: benchmarks/gpu_check.py's majority_pack row).
_MAJORITY_WORDS = 512  # 32-bit words of each row per program (2 KiB)
_MAX_COUNT = (1 << 16) - 1  # the kernel's 16 counter planes


# ------------------------------------------------------------------------------------ L1 quantizer


def _l1_divisors(
    x: torch.Tensor, levels: int, clip_multiple: float, chunk_size: int | None, segments: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1 (the reference's own reduction): per group (segment, or chunk of a segment) the float64
    divisor ``mean|x|`` (1 for an all-zero group, +Inf for a non-finite one); per segment whether it
    works in float64 (int, ``[len(segments)]``); the segment starts and each segment's first group
    (int64, int32: made on the device once per layout, not copied from the host at every call).

    On the CPU per segment (:func:`lioncub.ops.quantize.l1_divisors`, whose sums may branch on the host);
    where the reference sums in float64 with :func:`lioncub.ops.abs_sums.l1_abs_sums` (Triton's device) in
    3 launches for the whole bucket (:func:`_l1_divisors_bucket`): a group's sum there depends on its own
    elements only, so the bits are those of the reference run per segment."""
    if not normalizers.on_host(x) and abs_sums.l1_sums_backend(x) == "triton":
        return _l1_divisors_bucket(x, chunk_size, tuple(segments))
    divisors, wide = [], []
    pos = 0
    device = x.device
    for length in segments:
        if length:
            d64, work = quantize.l1_divisors(
                x[pos : pos + length], levels, clip_multiple=clip_multiple, chunk_size=chunk_size
            )
            divisors.append(d64)
            wide.append(work.reshape(1))
        else:
            wide.append(triton_launch.device_constant("false", device, (), [False], torch.bool))
        pos += length
    divisor = torch.cat(divisors) if divisors else torch.ones(1, dtype=torch.float64, device=device)
    wide_t = torch.cat(wide).to(torch.int8) if wide else torch.zeros(1, dtype=torch.int8, device=device)
    starts, bases = _segment_tables(device, tuple(segments), chunk_size)
    return divisor, wide_t, starts, bases


def _l1_divisors_bucket(
    flat: torch.Tensor, chunk_size: int | None, segments: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_l1_divisors` of a whole bucket in 3 launches (a zeroed flag per segment, the 2 stages of
    :func:`lioncub.ops.abs_sums.l1_abs_sums` with the divisor computed in stage 2)."""
    device = flat.device
    starts_t, bases_t = _segment_tables(device, segments, chunk_size)

    def layout() -> tuple[list[int], list[int], list[int]]:
        g_start, g_len, g_seg, pos = [], [], [], 0
        for s, length in enumerate(segments):
            step = chunk_size or max(length, 1)
            for c in range(0, length, step):
                g_start.append(pos + c)
                g_len.append(min(step, length - c))
                g_seg.append(s)
            pos += length
        return g_start, g_len, g_seg

    tables = abs_sums.group_tables(device, ("segments", segments, chunk_size), layout)
    n_groups = tables[3]
    wide = torch.zeros(max(len(segments), 1), dtype=torch.int32, device=device)
    if not n_groups:
        return torch.ones(1, dtype=torch.float64, device=device), wide, starts_t, bases_t
    divisor = torch.empty(n_groups, dtype=torch.float64, device=device)
    abs_sums.run_l1_sums(flat, tables, divisor, wide)
    return divisor, wide, starts_t, bases_t


def _segment_tables(
    device: torch.device, segments: tuple[int, ...], chunk_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 start of each segment, int32 index of each segment's first divisor group) on ``device``."""
    starts, bases, pos, groups = [], [], 0, 0
    for length in segments:
        starts.append(pos)
        bases.append(groups)
        groups += (-(-length // chunk_size) if chunk_size else 1) if length else 0
        pos += length
    key = (segments, chunk_size)
    return (
        triton_launch.device_constant("starts", device, key, starts or [0], torch.int64),
        triton_launch.device_constant("bases", device, key, bases or [0], torch.int32),
    )


def quantize_l1(
    x: torch.Tensor,
    levels: int,
    *,
    clip_multiple: float = 2.0,
    chunk_size: int | None = None,
    segments: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """L1 levels of a flat tensor, normalised per segment (and per chunk of ``chunk_size`` within a
    segment): bit for bit ``quantize.quantize("l1", x[seg], levels, clip_multiple=..., chunk_size=...)``
    for every segment, as ``QuantizedVote.levels_of``. Returns ``level_dtype(levels)`` of x's length."""
    flat = x.reshape(-1)
    n = flat.numel()
    segs = list(segments) if segments is not None else [n]
    if sum(segs) != n or any(s < 0 for s in segs):
        raise ValueError(f"segments {segs[:8]}... must be lengths >= 0 that add up to {n}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"quantizers take a floating-point tensor, got {x.dtype}")
    want = quantize.level_dtype(levels) if isinstance(levels, int) else torch.int8
    out = packing.out_buffer(out, n, want, flat.device)
    which = _resolve(backend, [flat, out], [flat])
    if which == "triton" and not (isinstance(levels, int) and 1 <= levels <= _MAX_LEVELS):
        if backend == "triton":
            raise RuntimeError(f"backend='triton' takes levels in [1, {_MAX_LEVELS}], got {levels!r}")
        which = "torch"
    quantize.check_levels(levels)
    quantize.check_clip_multiple(clip_multiple)
    pos = 0
    for length in segs:  # pass 1 is torch's reduction everywhere (as the reference)
        piece, dst = flat[pos : pos + length], out[pos : pos + length]
        if which == "torch":
            quantize.quantize_l1(piece, levels, clip_multiple=clip_multiple, chunk_size=chunk_size, out=dst)
        elif which == "cpu" and length:  # pass 2: the C kernel
            divisor, wide = quantize.l1_divisors(
                piece, levels, clip_multiple=clip_multiple, chunk_size=chunk_size
            )
            scale = levels / clip_multiple
            native.quantize(
                piece, divisor, chunk=chunk_size, wide=bool(wide), scale=scale, levels=levels, out=dst
            )
        pos += length
    if which == "triton" and n:
        _quantize_triton(flat, levels, float(clip_multiple), chunk_size, segs, out)
    return out


def _quantize_triton(
    flat: torch.Tensor,
    levels: int,
    clip_multiple: float,
    chunk_size: int | None,
    segs: list[int],
    out: torch.Tensor,
) -> None:
    """:func:`quantize_l1`'s Triton pass 2 over every segment at once (pass 1: :func:`_l1_divisors`)."""
    n = flat.numel()
    divisor, wide, starts, bases = _l1_divisors(flat, levels, clip_multiple, chunk_size, segs)
    scale = triton_launch.device_constant(
        "scale", flat.device, (levels, clip_multiple), [levels / clip_multiple], torch.float64
    )
    n_seg = len(segs)
    search = max(0, (n_seg - 1).bit_length())
    grid = -(-n // _BLOCK)
    with triton_launch.on_device(flat):
        triton_launch.triton_module().quantize_kernel[(grid,)](
            triton_launch.raw(flat),
            out,
            divisor,
            scale,
            wide,
            starts,
            bases,
            n,
            n_seg,
            chunk_size or 1,
            float(levels),
            BLOCK=_BLOCK,
            KIND=triton_launch.TRITON_DTYPES[flat.dtype],
            SEARCH=search,
            CHUNKED=chunk_size is not None,
            ANY_WIDE=True,
            **triton_launch.launch_options(),
        )


# ------------------------------------------------------------------------------------ 1-bit majority


def majority_pack(
    rows: torch.Tensor,
    tie_positive: bool,
    *,
    n_bits: int | None = None,
    n_workers: int | None = None,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Packed majority of the packed vote rows ``uint8 [N, B]``: bit 1 where ``2·count > N`` or, on a
    tie, where ``tie_positive`` — ``pack_majority(count_votes(rows, n_bits), N, tie_positive)``.
    Returns ``ceil(n_bits / 8)`` bytes (bits past ``n_bits`` are 0)."""
    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError(f"rows must be uint8 [N, B], got {rows.dtype} {tuple(rows.shape)}")
    n, row_bytes = rows.shape
    n_workers = n if n_workers is None else n_workers
    n_bits = row_bytes * 8 if n_bits is None else n_bits
    if not 0 <= n_bits <= row_bytes * 8:
        raise ValueError(f"n_bits={n_bits} does not fit in rows of {row_bytes} bytes")
    out_bytes = (n_bits + 7) // 8
    which = _resolve(backend, [rows] + ([out] if out is not None else []))
    if which == "torch":
        result = packing.pack_majority(packing.count_votes(rows, n_bits), n_workers, tie_positive)
        if out is None:
            return result.to(rows.device)
        return packing.out_buffer(out, out_bytes, torch.uint8, rows.device).copy_(result)
    out = packing.out_buffer(out, out_bytes, torch.uint8, rows.device)
    threshold = (n_workers + 1) // 2 if tie_positive else n_workers // 2 + 1
    if which == "cpu":
        native.majority(rows, out, n_bits=n_bits, threshold=threshold)
        return out
    if not out_bytes:
        return out
    if max(n, threshold) > _MAX_COUNT:  # more workers than the kernel's counters hold: torch's count
        return out.copy_(packing.pack_majority(packing.count_votes(rows, n_bits), n_workers, tie_positive))
    words = row_bytes % 4 == 0 and rows.data_ptr() % 4 == 0
    grid = -(-out_bytes // (4 * _MAJORITY_WORDS))
    with triton_launch.on_device(rows):
        triton_launch.triton_module().majority_kernel[(grid,)](
            rows.view(torch.int32) if words else rows,
            out,
            n,
            row_bytes // 4 if words else row_bytes,
            out_bytes,
            n_bits,
            threshold,
            BLOCK_W=_MAJORITY_WORDS,
            PLANES=max(1, n.bit_length()),
            WORDS=words,
        )
    return out


# ------------------------------------------------------------------------------------ apply


def apply_votes_(
    param: torch.Tensor,
    votes: torch.Tensor,
    *,
    lr: float,
    weight_decay: float = 0.0,
    exp_avg: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    beta2: float | None = None,
    negate_grad: bool = False,
    backend: Backend = "auto",
    emulate_fma: bool | None = None,
) -> torch.Tensor:
    """In place: ``p ← p·(1 − lr·wd) − lr·u`` for integer votes ``u`` (int8 ``{−1, 0, +1}`` from a
    vote, ``p.numel()`` elements); with ``exp_avg``/``grad``/``beta2`` also ``m ← β2·m + (1−β2)·g``
    (``−g`` with ``negate_grad``) in the same pass. Equals :func:`lioncub.ops.update.apply_update_` then
    :func:`lioncub.ops.update.update_momentum_`."""
    if votes.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32):
        raise TypeError(f"votes must be an integer tensor, got {votes.dtype}")
    source = votes.reshape(-1)
    n = param.numel()
    momentum = exp_avg is not None
    if exp_avg is not None and (grad is None or beta2 is None):
        raise ValueError("the fused momentum update needs exp_avg, grad and beta2")
    m, g = (exp_avg, grad) if exp_avg is not None and grad is not None else (param, param)
    b2 = beta2 if beta2 is not None else 0.0
    if momentum and (m.numel() != n or g.numel() != n):
        raise ValueError("exp_avg and grad must have the parameter's number of elements")
    if source.numel() != n:
        raise ValueError(f"votes has {source.numel()} elements, the parameter {n}")
    tensors = [param, source] + ([m, g] if momentum else [])
    which = _resolve(backend, tensors, [param] + ([m, g] if momentum else []))
    if which == "cpu" and source.dtype != torch.int8:
        if backend == "cpu":
            raise RuntimeError(f"backend='cpu' takes int8 votes, got {source.dtype}")
        which = "torch"
    if which == "cpu":
        mom = native.Momentum(m, g, b2, negate_grad) if momentum else None
        native.apply_int8(param, source, lr=lr, weight_decay=weight_decay, momentum=mom)
        return param
    if which == "torch":
        _apply_ref_(param, source.reshape(param.shape), lr, weight_decay)
        if momentum:
            _momentum_ref_(m, -g if negate_grad else g, b2)
        return param
    if n:
        grid = -(-n // _BLOCK)
        with triton_launch.on_device(param):
            triton_launch.triton_module().apply_kernel[(grid,)](
                triton_launch.raw(param),
                source,
                triton_launch.raw(m),
                triton_launch.raw(g),
                n,
                _f32(-lr),
                _f32(1.0 - lr * weight_decay),
                _f32(b2),
                _f32(1.0 - b2),
                BLOCK=_BLOCK,
                KIND=triton_launch.TRITON_DTYPES[param.dtype],
                DECAY=lr * weight_decay != 0,
                MOMENTUM=momentum,
                NEG=bool(negate_grad),
                EMULATE=_emulate(emulate_fma),
                **triton_launch.launch_options(),
            )
    return param


# ------------------------------------------------------------------------------------ per bucket
#
# The contribution and the apply of a bucket in one launch each (issue 44, finding 5), over tensors that
# are separate allocations: the kernels read each tensor's address from a pointer table (int64, on the
# device) and find their tensor by a binary search over its first block. The tables are device tables
# (triton_launch.TABLES): the layout's once, the parameters' and momenta's addresses once (they do not
# move), the gradients' whenever the allocator hands out other addresses (then one upload per bucket, from
# pinned memory without blocking the host). Hyperparameters are kernel arguments: a bucket whose tensors
# hold several (lr, β1, β2, weight decay, maximize) takes one launch per distinct setting.


def _pointers(device: torch.device, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """int64 addresses of ``tensors`` (0 for None) on ``device``, uploaded when they change."""
    addrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
    return triton_launch.TABLES.get(("pointers", device, addrs), addrs, torch.int64, device)


def _bucket_layout(
    device: torch.device, starts: Sequence[int], numels: Sequence[int]
) -> tuple[torch.Tensor, int, int]:
    """(int64 ``[T, 3]``: first block, elements, start of each tensor; blocks; binary-search steps)."""
    key = (tuple(starts), tuple(numels))
    firsts, blocks = [], 0
    for n in numels:
        firsts.append(blocks)
        blocks += -(-n // _BLOCK)
    rows = [v for row in zip(firsts, numels, starts, strict=True) for v in row]
    table = triton_launch.device_constant("bucket layout", device, key, rows, torch.int64)
    return table, blocks, max(0, (len(numels) - 1).bit_length())


def _check_bucket(starts: Sequence[int], tensors: Sequence[torch.Tensor], n: int, what: str) -> None:
    if len(starts) != len(tensors):
        raise ValueError(f"{len(starts)} starts for {len(tensors)} tensors")
    for s, t in zip(starts, tensors, strict=True):
        if s < 0 or s + t.numel() > n:
            raise ValueError(f"a tensor of {t.numel()} elements at {s} does not fit in the {n} of {what}")


def lion_directions_(
    out: torch.Tensor,
    starts: Sequence[int],
    momenta: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    *,
    beta1: float,
    negate: bool = False,
    backend: Backend = "auto",
    emulate_fma: bool | None = None,
) -> torch.Tensor:
    """``out[s_i : s_i + n_i] ← β1·m_i + (1−β1)·g_i`` for every momentum ``m_i`` (``g_i`` None: zeros;
    ``negate``: ``−g_i``), rounded as ``torch.mul(m, β1).add_(g, alpha=1−β1)`` (:func:`_lerp_ref`).
    ``out``: flat, the tensors' dtype. On Triton in one launch for all tensors; else per tensor in torch."""
    _check_bucket(starts, momenta, out.numel(), "out")
    present = [g for g in grads if g is not None]
    tensors = [out, *momenta, *present]
    which = _resolve(backend, tensors, tensors)
    if which != "triton" or not momenta:
        flat = out.reshape(-1)
        for s, m, g in zip(starts, momenta, grads, strict=True):
            grad = torch.zeros_like(m) if g is None else (-g if negate else g)
            flat[s : s + m.numel()].view_as(m).copy_(_lerp_ref(m, grad, beta1))
        return out
    device = out.device
    layout, blocks, search = _bucket_layout(device, starts, [m.numel() for m in momenta])
    if blocks:
        m_table, g_table = _pointers(device, momenta), _pointers(device, grads)
        with triton_launch.on_device(out):
            triton_launch.triton_module().lion_kernel[(blocks,)](
                triton_launch.raw(out),
                m_table,
                g_table,
                layout,
                len(momenta),
                _f32(beta1),
                _f32(1.0 - beta1),
                BLOCK=_BLOCK,
                SEARCH=search,
                KIND=triton_launch.TRITON_DTYPES[out.dtype],
                NEG=bool(negate),
                EMULATE=_emulate(emulate_fma),
                **triton_launch.launch_options(),
            )
    return out


def apply_votes_multi_(
    params: Sequence[torch.Tensor],
    votes: torch.Tensor,
    starts: Sequence[int],
    *,
    lr: float,
    weight_decay: float = 0.0,
    exp_avgs: Sequence[torch.Tensor] | None = None,
    grads: Sequence[torch.Tensor | None] | None = None,
    beta2: float | None = None,
    negate_grad: bool = False,
    backend: Backend = "auto",
    emulate_fma: bool | None = None,
) -> None:
    """:func:`apply_votes_` for every parameter ``p_i`` with the votes ``votes[s_i : s_i + n_i]`` (flat
    integer votes of the bucket), and with ``exp_avgs``/``grads``/``beta2`` the momentum update (a None
    gradient: zeros, never negated). On Triton in one launch for all parameters; else per parameter."""
    if votes.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32):
        raise TypeError(f"votes must be an integer tensor, got {votes.dtype}")
    momenta: Sequence[torch.Tensor] = exp_avgs if exp_avgs is not None else []
    momentum = exp_avgs is not None
    if momentum and (grads is None or beta2 is None or len(momenta) != len(params)):
        raise ValueError("the fused momentum update needs exp_avgs, grads and beta2 for every parameter")
    source = votes.reshape(-1)
    _check_bucket(starts, params, source.numel(), "votes")
    gs: Sequence[torch.Tensor | None] = grads if grads is not None else [None] * len(params)
    floats = [*params, *momenta, *(g for g in gs if momentum and g is not None)]
    which = _resolve(backend, [source, *floats], floats)
    if which != "triton" or not params:
        for i, (s, p) in enumerate(zip(starts, params, strict=True)):
            mine = source[s : s + p.numel()]
            if not momentum:
                apply_votes_(p, mine, lr=lr, weight_decay=weight_decay, backend=backend)
                continue
            g = gs[i]
            apply_votes_(
                p, mine, lr=lr, weight_decay=weight_decay, exp_avg=momenta[i],
                grad=torch.zeros_like(p) if g is None else g, beta2=beta2,
                negate_grad=negate_grad and g is not None, backend=backend,
            )  # fmt: skip
        return
    device = source.device
    layout, blocks, search = _bucket_layout(device, starts, [p.numel() for p in params])
    if not blocks:
        return
    b2 = beta2 if beta2 is not None else 0.0
    p_table = _pointers(device, params)
    m_table = _pointers(device, momenta) if momentum else p_table
    g_table = _pointers(device, gs) if momentum else p_table
    with triton_launch.on_device(source):
        triton_launch.triton_module().apply_multi_kernel[(blocks,)](
            source,
            p_table,
            m_table,
            g_table,
            layout,
            len(params),
            _f32(-lr),
            _f32(1.0 - lr * weight_decay),
            _f32(b2),
            _f32(1.0 - b2),
            BLOCK=_BLOCK,
            SEARCH=search,
            KIND=triton_launch.TRITON_DTYPES[params[0].dtype],
            DECAY=lr * weight_decay != 0,
            MOMENTUM=momentum,
            NEG=bool(negate_grad),
            EMULATE=_emulate(emulate_fma),
            **triton_launch.launch_options(),
        )
