"""Quantizers for Lion's pre-sign update ``c = β1·m + (1−β1)·g``: tensor → signed integer levels.

Every quantizer maps a real tensor ``x`` to integer levels ``q ∈ [−s, s]`` of the same shape (``int8``
when ``s ≤ 127``, else ``int16``/``int32``), where ``s`` is the per-worker level budget
(:func:`level_budget`). A vote sums the levels of N workers in an integer collective and takes the sign.

Normalised schemes (the Lion Cub paper, §3.6 of the spec)::

    q = clip(round((x / M(x)) · (s / k)), −s, s)

with ``M`` a norm-like normaliser of the tensor (or of each fixed-size chunk), ``k = clip_multiple`` and
``round`` the deterministic round-half-to-even of ``torch.round``. The level is computed as written, as
the authors' code does: divide by M first, then scale by ``s / k``, each rounded once in the work dtype
(float32 for float32/bfloat16/float16 input; float64 for float64 input, for more than 2^24 levels, and
for a normaliser outside float32's normal range). So a value equal to ±M lands exactly on ±s/k, which is
half-way between two levels for an odd s and k = 2 (every 1-element tensor, for one), and rounds to the
even one. (Scaling by a precomputed ``s / (k·M)`` instead rounds such values either way.)

* L1: ``M = mean |x|`` — the Lion Cub quantizer. ``k = 2`` is the authors' code (a value equal to
  mean |x| lands on level s/2, clipping starts at 2·mean |x|); ``k = 1`` is the paper's Eq. 1 as
  transcribed (clipping at 1·mean |x|).
* L0: ``M`` = geometric mean of |x| (over the nonzero entries by default; ``eps=1e-12`` gives the
  authors' ``exp(mean log(|x| + 1e−12))`` over all entries).
* Lp: ``M = (mean |x|^p)^(1/p)`` for any p > 0; L∞: ``M = max |x|``.

The normalisers are :mod:`lioncub.ops.normalizers`' and the level budget is
:func:`lioncub.transports.level_budget` (all importable from here).

Other schemes: :func:`quantize_sign` (levels −1/0/+1), :func:`quantize_qsgd` (QSGD / Q∞ stochastic
rounding, seeded by a ``torch.Generator``) and :func:`quantize_log` (power-of-two levels; the papers do
not define it, this module's definition is an interpretation).

Guarantees (tested with hypothesis): levels lie in ``[−s, s]``; a nonzero level has the sign of x; zeros
stay zero; an all-zero tensor (or chunk) maps to zeros, never NaN; normalised schemes are invariant to
scaling x by a power of two (and to any positive scale up to rounding at half-way points). Precision
limit: a float64 normaliser in the subnormal range (below 2.2e−308) keeps only a few significant bits,
and one that underflows to 0 (e.g. mean |x| < 2.5e−324) makes its tensor (chunk) map to zeros.
Non-finite inputs are the caller's job (the optimizer skips such steps), but they are well defined here:
the normalised schemes (L1, L0, Lp, L∞, QSGD, log) map a tensor — or, with ``chunk_size``, a chunk —
that holds any NaN or ±Inf to all-zero levels (its normaliser is undefined, so the worker abstains
there; other chunks are unaffected); :func:`quantize_sign` maps NaN to 0 and ±Inf to ±1.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch

from lioncub._validate import is_int
from lioncub.ops.normalizers import PIECE, check_eps, lp_normalizer, max_abs
from lioncub.transports import level_budget

__all__ = [
    "QUANTIZERS",
    "l1_divisors",
    "level_budget",
    "level_dtype",
    "lp_normalizer",
    "max_abs",
    "quantize",
    "quantize_l0",
    "quantize_l1",
    "quantize_linf",
    "quantize_log",
    "quantize_lp",
    "quantize_qsgd",
    "quantize_sign",
]


def level_dtype(levels: int) -> torch.dtype:
    """Smallest signed integer dtype holding ``[−levels, levels]``."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


def check_levels(levels: int) -> None:
    """``ValueError`` unless ``levels`` is an int in ``[1, 2**30)``."""
    if not isinstance(levels, int) or isinstance(levels, bool) or levels < 1:
        raise ValueError(f"levels={levels!r} must be an int >= 1")
    if levels >= 1 << 30:
        raise ValueError(f"levels={levels} must be < 2**30")


def check_clip_multiple(clip_multiple: float) -> None:
    """``ValueError`` unless ``clip_multiple`` is a finite number > 0."""
    if not (isinstance(clip_multiple, (int, float)) and math.isfinite(clip_multiple) and clip_multiple > 0):
        raise ValueError(
            f"clip_multiple={clip_multiple!r} must be a finite number > 0 (authors' code: 2, paper: 1)"
        )


def _check_real(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"quantizers take a floating-point tensor, got {x.dtype}")


def _scale_round_clip(
    rows: torch.Tensor,
    norm: torch.Tensor,
    levels: int,
    clip_multiple: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``clip(round((x / norm) · (levels / k)), −levels, levels)`` for ``rows`` ``[m, n]``, ``norm`` ``[m]``.

    Divides by the normaliser first, then scales, each rounded once in the work dtype (float32, or
    float64 for float64 input, for more than 2^24 levels and for a normaliser outside float32's normal
    range; see :func:`_works_wide`), as the authors' code: a value equal to M lands exactly on
    ``levels / k``, also half-way between two levels, and rounds half to even there. Works piece by piece
    (about ``PIECE`` elements) so that the temporaries stay in cache. A row whose normaliser is not
    finite (it holds a NaN or ±Inf) is divided by +Inf, and NaN quotients become 0: the row maps to zeros.
    """
    out = torch.empty(rows.shape, dtype=level_dtype(levels), device=rows.device) if out is None else out
    ok, divisor64 = _divisors(norm)
    if not _reads_free(rows):
        _scale_round_clip_device(rows, divisor64, levels, clip_multiple, out)
        return out
    finite = bool(ok.all())
    work = torch.float64 if bool(_works_wide(divisor64, levels, rows.dtype)) else torch.float32
    scale = _level_scale(levels, clip_multiple, work)
    # a device tensor, never a Python float: CUDA divides by a host scalar as a multiply by its reciprocal
    divisor = divisor64.to(work)[:, None]
    m, n = rows.shape
    if m == 1:  # per tensor: 1-D pieces
        flat, flat_out, d = rows.view(-1), out.view(-1), divisor.view(1)
        pieces = [(flat[c : c + PIECE], flat_out[c : c + PIECE], d) for c in range(0, n, PIECE)]
    else:
        step = max(1, PIECE // n)
        pieces = [(rows[r : r + step], out[r : r + step], divisor[r : r + step]) for r in range(0, m, step)]
    if _numpy_path(rows) and rows.dtype == work:
        _scale_round_clip_numpy(pieces, levels, scale, finite)
        return out
    scratch = torch.empty(min(PIECE, rows.numel()) if m == 1 else 0, dtype=work, device=rows.device)
    for xs, dst, d in pieces:
        if m == 1:
            t = torch.div(xs, d, out=scratch[: xs.numel()]) if xs.dtype == work else xs.to(work).div_(d)
        else:
            t = torch.div(xs if xs.dtype == work else xs.to(work), d)
        if scale != 1.0:
            t.mul_(scale)
        t.round_().clamp_(-levels, levels)
        if not finite:
            t.nan_to_num_(0.0)
        dst.copy_(t)
    return out


def _reads_free(t: torch.Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs nothing (a CPU tensor); on a GPU each read is a
    synchronization, so the quantizers read none there (:func:`_scale_round_clip_device`)."""
    return t.device.type == "cpu"


#: elements per piece of :func:`_scale_round_clip_device` (its float64 temporaries: 32 MB each)
DEVICE_PIECE = 1 << 22


def _scale_round_clip_device(
    rows: torch.Tensor, divisor64: torch.Tensor, levels: int, clip_multiple: float, out: torch.Tensor
) -> None:
    """:func:`_scale_round_clip` off the CPU, without reading on the host which work dtype a tensor takes
    (or whether it is finite): it computes in float64 and rounds to float32 after the division and after
    the scaling unless the tensor works wide — the same bits as float32 arithmetic, because float64 holds
    a product of two float32 exactly and rounding a float64 quotient to float32 is the correctly rounded
    float32 quotient (double rounding is harmless for ÷ when 53 ≥ 2·24 + 2). NaN quotients become 0 in
    every tensor (a finite one has none). ``rows`` ``[m, n]``, ``divisor64`` ``[m]`` float64, ``out``
    integer ``[m, n]``."""
    wide = _works_wide(divisor64, levels, rows.dtype)  # 0-dim bool on the device
    f64 = torch.float64
    divisor = torch.where(wide, divisor64, divisor64.to(torch.float32))[:, None]  # float64
    scale = torch.full((), _level_scale(levels, clip_multiple, torch.float32), dtype=f64, device=rows.device)
    scale.masked_fill_(wide, _level_scale(levels, clip_multiple, f64))
    m, n = rows.shape
    width = min(n, DEVICE_PIECE)
    step = max(1, DEVICE_PIECE // max(width, 1))
    for r in range(0, m, step):
        for c in range(0, n, width):
            xs, dst = rows[r : r + step, c : c + width], out[r : r + step, c : c + width]
            t = xs.to(f64).div_(divisor[r : r + step])
            t = torch.where(wide, t, t.to(torch.float32)).mul_(scale)
            t = torch.where(wide, t, t.to(torch.float32))
            dst.copy_(t.round_().clamp_(-levels, levels).nan_to_num_(0.0))


def _divisors(norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite normaliser, float64 divisor: M, 1 where M is 0 (the row is all zeros), +Inf where M is
    not finite)."""
    ok = torch.isfinite(norm)  # a finite normaliser means every element of the row is finite
    safe = torch.where(norm > 0, norm, 1.0)
    return ok, torch.where(ok, safe, math.inf)


def _level_scale(levels: int, clip_multiple: float, work: torch.dtype) -> float:
    """``levels / k`` rounded to the work dtype (as torch and numpy round a Python scalar), as a float."""
    scale = levels / clip_multiple
    return scale if work == torch.float64 else float(np.float32(scale))


_TINY32 = float(torch.finfo(torch.float32).tiny)
_MAX32 = float(torch.finfo(torch.float32).max)


def _works_wide(divisor64: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """0-dim bool (no host sync): whether the scaling works in float64 rather than float32."""
    # float32 holds every integer level up to 2^24 exactly; beyond, clamping to ±levels needs float64;
    # a normaliser below float32's normal range would lose bits (or become 0) as a float32 divisor
    if dtype == torch.float64 or levels > 1 << 24:
        return torch.ones((), dtype=torch.bool, device=divisor64.device)
    return ((divisor64 < _TINY32) | ((divisor64 > _MAX32) & (divisor64 < math.inf))).any()


def l1_divisors(
    x: torch.Tensor, levels: int, *, clip_multiple: float = 2.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of :func:`quantize_l1`, for a fused pass 2 (:func:`lioncub.ops.kernels.quantize_l1`).

    Returns the float64 divisor of the tensor (``[1]``) or of each chunk (``[ceil(n / chunk_size)]``):
    ``mean |x|``, 1 for an all-zero one, +Inf for one holding NaN/±Inf; and a 0-dim bool tensor: whether
    :func:`quantize_l1` works in float64 (else in float32). Pass 2 is then
    ``clip(round_half_even((x / w(divisor)) · w(levels / k)), −s, s)`` with NaN → 0, where ``w`` rounds
    to the work dtype and each of the two operations rounds to it once. ``x`` must not be empty.
    """
    _check_real(x)
    check_levels(levels)
    check_clip_multiple(clip_multiple)
    rows, n = _as_rows(x, chunk_size)
    if n == 0:
        raise ValueError("l1_divisors of an empty tensor")
    if chunk_size is not None and n % chunk_size:
        norm = _padded_normalizer(rows, n, 1.0, None)
    else:
        norm = lp_normalizer(rows, 1.0)
    _ok, divisor64 = _divisors(norm)
    return divisor64, _works_wide(divisor64, levels, x.dtype)


def _numpy_path(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the numpy (CPU) kernel; the torch kernel serves every other device."""
    return t.device.type == "cpu"


def _scale_round_clip_numpy(
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], levels: int, scale: float, finite: bool
) -> None:
    """CPU path of :func:`_scale_round_clip`: numpy's in-place ``divide``, ``multiply``, ``rint`` and ``clip``
    over cache-sized pieces (fewer passes than torch's ops, which allocate).

    ``np.rint`` rounds half to even like ``torch.round``; the cast of the clipped integral floats to the
    integer output is exact. Large inputs are split over ``torch.get_num_threads()`` threads (numpy
    releases the GIL inside the ufuncs), so the kernel follows the same thread setting as torch.
    """
    total = sum(xs.numel() for xs, _, _ in pieces)
    threads = min(torch.get_num_threads(), len(pieces), max(1, total // _MIN_ELEMENTS_PER_THREAD))
    if threads <= 1:
        _scale_round_clip_pieces(pieces, levels, scale, finite)
        return
    bounds = [len(pieces) * i // threads for i in range(threads + 1)]
    groups = [pieces[a:b] for a, b in itertools.pairwise(bounds)]
    pool = _thread_pool(threads)
    for done in [pool.submit(_scale_round_clip_pieces, g, levels, scale, finite) for g in groups]:
        done.result()


_MIN_ELEMENTS_PER_THREAD = 1 << 21
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="lioncub-quantize")
    return _POOLS[threads]


def _scale_round_clip_pieces(
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], levels: int, scale: float, finite: bool
) -> None:
    scratch = None
    for xs, dst, d in pieces:
        src = xs.numpy()
        if scratch is None or scratch.size < src.size:
            scratch = np.empty(src.size, dtype=src.dtype)
        t = scratch[: src.size].reshape(src.shape)
        divisor = d.numpy()
        if divisor.size == 1:
            divisor = divisor.reshape(())[()]  # a numpy scalar of the work dtype
        with np.errstate(invalid="ignore", over="ignore"):  # ±inf clips to ±levels, inf / inf = NaN → 0 below
            np.divide(src, divisor, out=t)
            if scale != 1.0:
                np.multiply(t, src.dtype.type(scale), out=t)
        np.rint(t, out=t)
        np.clip(t, -levels, levels, out=t)
        if not finite:
            np.nan_to_num(t, copy=False, nan=0.0)
        dst.numpy()[...] = t


def _as_rows(x: torch.Tensor, chunk_size: int | None) -> tuple[torch.Tensor, int]:
    """Flatten to ``[rows, chunk]`` (zero-padded when chunking); returns the view and the true length."""
    flat = x.reshape(-1)
    n = flat.numel()
    if chunk_size is None:
        return flat.view(1, n), n
    if not is_int(chunk_size, 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be None (per tensor) or an int >= 1")
    pad = (-n) % chunk_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk_size), n


def _finish(q_rows: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    return q_rows.reshape(-1)[:n].view(like.shape)


def quantize_lp(
    x: torch.Tensor,
    levels: int,
    *,
    p: float = 1.0,
    clip_multiple: float = 2.0,
    chunk_size: int | None = None,
    eps: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalised quantizer ``clip(round((x / M_p) · (s / k)), −s, s)`` (see the module docstring).

    Args:
        x: floating tensor, any shape.
        levels: s, the per-worker level budget (see :func:`level_budget`).
        p: the normaliser's order (1 = L1, 0 = geometric mean, ``math.inf`` = max).
        clip_multiple: k; the authors' code uses 2, the paper's Eq. 1 as transcribed uses 1.
        chunk_size: ``None`` normalises the whole tensor (as the authors); an int normalises each run of
            ``chunk_size`` consecutive elements separately (the last, possibly only, run over its true
            length).
        eps: see :func:`lp_normalizer` (p = 0 only).
        out: optional contiguous tensor of x's shape and dtype ``level_dtype(levels)`` to write into
            (saves the allocation and its page faults when called every step).
    Returns:
        integer levels, same shape as x, dtype :func:`level_dtype(levels) <level_dtype>` (``out`` if given).
    """
    _check_real(x)
    check_levels(levels)
    check_clip_multiple(clip_multiple)
    check_eps(eps)
    _check_out(out, x, levels)
    rows, n = _as_rows(x, chunk_size)
    if n == 0:
        return torch.empty(x.shape, dtype=level_dtype(levels), device=x.device) if out is None else out
    if chunk_size is not None and n % chunk_size:  # the last chunk is padded: its true length
        norm = _padded_normalizer(rows, n, p, eps)
    else:
        norm = lp_normalizer(rows, p, eps=eps)
    direct = out is not None and rows.numel() == n
    into = out.view(rows.shape) if out is not None and direct else None
    q = _scale_round_clip(rows, norm, levels, float(clip_multiple), out=into)
    if out is None:
        return _finish(q, n, x)
    if not direct:
        out.view(-1).copy_(q.reshape(-1)[:n])
    return out


def _check_out(out: torch.Tensor | None, x: torch.Tensor, levels: int) -> None:
    if out is None:
        return
    want = level_dtype(levels)
    if out.shape != x.shape or out.dtype != want or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {want} tensor of shape {tuple(x.shape)} on {x.device}; got "
            f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )


def _padded_normalizer(rows: torch.Tensor, n: int, p: float, eps: float | None) -> torch.Tensor:
    """Normalisers of ``rows`` whose last row is zero-padded: the last one over its true length (also
    when it is the only row: a tensor shorter than the chunk is not normalised over padding zeros)."""
    norm = lp_normalizer(rows[:-1], p, eps=eps)
    tail = rows[-1, : n - (rows.shape[0] - 1) * rows.shape[1]]
    return torch.cat([norm, lp_normalizer(tail[None], p, eps=eps)])


def quantize_l1(
    x: torch.Tensor,
    levels: int,
    *,
    clip_multiple: float = 2.0,
    chunk_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """L1 (mean |x|) quantizer of Lion Cub; see :func:`quantize_lp`."""
    return quantize_lp(x, levels, p=1.0, clip_multiple=clip_multiple, chunk_size=chunk_size, out=out)


def quantize_l0(
    x: torch.Tensor,
    levels: int,
    *,
    clip_multiple: float = 2.0,
    chunk_size: int | None = None,
    eps: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """L0 (geometric mean of |x|) quantizer; ``eps=1e-12`` reproduces the authors' normaliser."""
    return quantize_lp(x, levels, p=0.0, clip_multiple=clip_multiple, chunk_size=chunk_size, eps=eps, out=out)


def quantize_linf(
    x: torch.Tensor,
    levels: int,
    *,
    clip_multiple: float = 2.0,
    chunk_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Deterministic L∞ (max |x|) quantizer; with heavy-tailed x most entries round to 0."""
    return quantize_lp(x, levels, p=math.inf, clip_multiple=clip_multiple, chunk_size=chunk_size, out=out)


def quantize_sign(x: torch.Tensor, levels: int = 1) -> torch.Tensor:
    """``sign(x)`` as ``int8`` levels −1/0/+1 (``levels`` is accepted for a uniform interface; NaN → 0)."""
    _check_real(x)
    check_levels(levels)
    return torch.sign(x).nan_to_num_(0.0).to(torch.int8)


def quantize_qsgd(
    x: torch.Tensor,
    levels: int,
    *,
    norm: Literal["inf", "2"] | float = "inf",
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """QSGD stochastic quantizer (Alistarh et al. 2017); ``norm="inf"`` is the paper's Q∞.

    ``ℓ = ⌊s·|x_i|/‖x‖⌋``; the level is ``sign(x_i)·(ℓ + 1)`` with probability ``s·|x_i|/‖x‖ − ℓ``, else
    ``sign(x_i)·ℓ`` — unbiased: ``E[q]·‖x‖/s = x``. Uniform draws come from ``generator`` (on x's device).
    A tensor (chunk) holding a NaN or ±Inf maps to zeros.
    """
    _check_real(x)
    check_levels(levels)
    if norm in ("inf", math.inf):
        order = math.inf
    elif norm in ("2", 2, 2.0):
        order = 2.0
    else:
        raise ValueError(f"norm={norm!r} must be 'inf' or '2'")
    rows, n = _as_rows(x, chunk_size)
    if n == 0:
        return torch.empty(x.shape, dtype=level_dtype(levels), device=x.device)
    if chunk_size is not None and n % chunk_size:  # the last chunk is padded: its true length
        nrm = _padded_normalizer(rows, n, order, None)
    else:
        nrm = lp_normalizer(rows, order)
    # A NaN/Inf normaliser stays: |x|/NaN and Inf/Inf are NaN, finite/Inf is 0, and NaN becomes 0 below.
    rel = rows.abs().to(torch.float64) / torch.where(nrm == 0, 1.0, nrm)[:, None]
    if order == 2.0:  # lp_normalizer gives the RMS; QSGD uses the plain 2-norm = RMS·√n (may overflow)
        counts = torch.full_like(nrm, rows.shape[1])
        if chunk_size is not None and n % chunk_size:
            counts[-1] = n - (rows.shape[0] - 1) * rows.shape[1]
        rel /= counts.sqrt()[:, None]
    rel = rel.mul_(levels).nan_to_num_(0.0).clamp_(0, levels)
    low = rel.floor()
    u = torch.rand(rel.shape, generator=generator, dtype=torch.float64, device=x.device)
    mag = low + (u < rel - low).to(torch.float64)
    q = (torch.sign(rows).nan_to_num_(0.0).to(torch.float64) * mag.clamp_(max=levels)).to(level_dtype(levels))
    return _finish(q, n, x)


def quantize_log(x: torch.Tensor, levels: int, *, chunk_size: int | None = None) -> torch.Tensor:
    """Logarithmic quantizer — **an interpretation**: the papers name it but do not define it.

    Each magnitude is rounded to the nearest power of two relative to the maximum,
    ``e = round(log2(max|x| / |x_i|))``, and de-quantised to the integer level ``round(s · 2^−e)`` so
    that levels add in an integer collective (power-of-two exponents do not). Levels are therefore
    ``{s, round(s/2), round(s/4), …, 1}``; magnitudes below the smallest level map to 0. A tensor (chunk)
    holding a NaN or ±Inf maps to zeros (its maximum is NaN or Inf).
    """
    _check_real(x)
    check_levels(levels)
    rows, n = _as_rows(x, chunk_size)
    if n == 0:
        return torch.empty(x.shape, dtype=level_dtype(levels), device=x.device)
    if chunk_size is not None and n % chunk_size:  # the last chunk is padded: its true length
        top = _padded_normalizer(rows, n, math.inf, None)
    else:
        top = lp_normalizer(rows, math.inf)
    a = rows.abs().to(torch.float64)
    ratio = torch.where(a > 0, top[:, None] / torch.where(a > 0, a, 1.0), math.inf)
    e = torch.log2(ratio).round_().clamp_(max=64.0)
    mag = (levels * torch.exp2(-e)).round_().nan_to_num_(0.0)
    q = torch.sign(rows).nan_to_num_(0.0).to(torch.float64) * mag
    return _finish(q.to(level_dtype(levels)), n, x)


QUANTIZERS: dict[str, Callable[..., torch.Tensor]] = {
    "sign": quantize_sign,
    "l1": quantize_l1,
    "l0": quantize_l0,
    "linf": quantize_linf,
    "lp": quantize_lp,
    "qsgd": quantize_qsgd,
    "log": quantize_log,
}


def quantize(name: str, x: torch.Tensor, levels: int, **options: object) -> torch.Tensor:
    """Dispatch by name (one of :data:`QUANTIZERS`); ``options`` go to the quantizer (``ValueError``
    naming its keyword options for any other)."""
    try:
        fn = QUANTIZERS[name]
    except KeyError:
        raise ValueError(f"quantizer={name!r} is not one of {sorted(QUANTIZERS)}") from None
    allowed = _option_names(fn)
    if allowed is not None and not allowed.issuperset(options):
        unknown = sorted(set(options) - allowed)
        takes = f"its options are {sorted(allowed)}" if allowed else "it takes no options"
        raise ValueError(f"quantizer={name!r}: unknown option(s) {unknown}; {takes}")
    return fn(x, levels, **options)


@functools.cache
def _option_names(fn: Callable[..., torch.Tensor]) -> frozenset[str] | None:
    """The parameters of a quantizer after ``(x, levels)`` that :func:`quantize` may pass by keyword
    (``None``: any, the quantizer takes ``**options``)."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in keyword)
