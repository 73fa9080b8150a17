"""The normalisers ``M(x)`` of the quantizers (:mod:`lioncub.ops.quantize`, pass 1): ``max |x|``
(:func:`max_abs`) and the power means ``(mean |x|^p)^(1/p)`` over the last dimension
(:func:`lp_normalizer`; p = 0: the geometric mean, p = inf: the max), in float64 and without overflow or
underflow however wide the range of ``|x|``. On the CPU the L1 sums run in cache-sized float32 pieces and
may branch on values read by the host; on a GPU they reduce in float64 (without a float64 copy of the
input) and read nothing on the host.
"""

from __future__ import annotations

import math

import torch

from lioncub._validate import check_number
from lioncub.ops import abs_sums

__all__ = ["PIECE", "check_eps", "lp_normalizer", "max_abs", "on_host"]

#: elements per piece of a quantizer's pass: keeps temporaries in cache (4 passes over ~1 MiB instead of
#: over the whole tensor)
PIECE = 1 << 18


def check_eps(eps: float | None) -> None:
    """``ValueError`` unless ``eps`` (of the L0 normaliser, :func:`lp_normalizer`) is None or > 0."""
    if eps is not None:
        check_number("eps", eps, "None or a finite number > 0 (authors' L0: 1e-12)", gt=0)


def on_host(x: torch.Tensor) -> bool:
    """Whether ``x``'s reductions may branch on a value read by the host: on the CPU that costs nothing;
    on a GPU every read is a synchronization, so the GPU paths do not branch (they reduce in float64)."""
    return x.device.type == "cpu"


#: elements per piece of the float64 sums off the CPU without Triton (their float64 copy: 32 MB)
DEVICE_PIECE = 1 << 22


def _abs_sums(x: torch.Tensor) -> torch.Tensor:
    """``Σ|x|`` over the last dimension in float64: on the CPU in float32 cache-sized pieces (faster than
    ``vector_norm``), a piece that overflows its dtype redone in float64; elsewhere in float64 with no
    host synchronization (float64 sums of float32/16-bit values cannot overflow) and no float64 copy of
    ``x`` (``vector_norm(dtype=float64)`` and ``sum(dtype=float64)`` cast their whole input to float64
    first): where Triton takes ``x`` (a CUDA tensor of float32, bfloat16 or float16) the sums of
    :func:`lioncub.ops.abs_sums.l1_abs_sums`, which the fused quantizer's pass 1 runs per bucket with the
    same bits per row; else ``vector_norm`` in pieces of ``DEVICE_PIECE`` elements."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    if not on_host(x):
        if abs_sums.l1_sums_backend(rows) == "triton":
            return abs_sums.l1_abs_sums(rows).reshape(x.shape[:-1])
        return _abs_sums_pieces(rows).reshape(x.shape[:-1])
    m, n = rows.shape
    sums = torch.empty(m, dtype=torch.float64, device=x.device)
    step = max(1, PIECE // max(n, 1))
    width = min(n, PIECE)
    scratch = torch.empty((min(step, m), width), dtype=x.dtype, device=x.device)
    for r0 in range(0, m, step):
        r1 = min(r0 + step, m)
        total = torch.zeros(r1 - r0, dtype=torch.float64, device=x.device)
        for c0 in range(0, n, width):
            c1 = min(c0 + width, n)
            a = torch.abs(rows[r0:r1, c0:c1], out=scratch[: r1 - r0, : c1 - c0])
            part = a.sum(dim=1)
            bad = ~torch.isfinite(part)
            if bool(bad.any()):  # rows that overflowed their dtype (or hold NaN/Inf): those in float64
                part = part.to(torch.float64)
                part[bad] = a[bad].to(torch.float64).sum(dim=1)
            total += part
        sums[r0:r1] = total
    return sums.reshape(x.shape[:-1])


def _abs_sums_pieces(rows: torch.Tensor) -> torch.Tensor:
    """``Σ|x|`` of each row of ``rows`` ``[m, n]`` in float64, ``vector_norm`` over pieces of at most
    ``DEVICE_PIECE`` elements (each piece's float64 copy, not the whole input's), added in order."""
    m, n = rows.shape
    sums = torch.zeros(m, dtype=torch.float64, device=rows.device)
    if not n:
        return sums
    width = min(n, DEVICE_PIECE)
    step = max(1, DEVICE_PIECE // max(width, 1))
    for r0 in range(0, m, step):
        for c0 in range(0, n, width):
            piece = rows[r0 : r0 + step, c0 : c0 + width]
            sums[r0 : r0 + step] += torch.linalg.vector_norm(piece, 1, dim=1, dtype=torch.float64)
    return sums


def max_abs(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |x|`` over all elements (``dim=None``; 0 for an empty tensor) or over ``dim``, exactly, in
    ``x``'s dtype: NaN where a NaN is present, Inf where an ±Inf is. The values of
    ``torch.linalg.vector_norm(x, inf)``, from ``torch.aminmax`` (one pass; on CPU ``vector_norm``'s inf
    norm takes ~11x as long: 56 against 5 ms for 16 M float32 on one core, torch 2.13)."""
    if dim is None:
        if x.numel() == 0:
            return x.new_zeros(())
        low, high = torch.aminmax(x)
    else:
        low, high = torch.aminmax(x, dim=dim)
    return torch.maximum(low.abs(), high.abs())


def lp_normalizer(x: torch.Tensor, p: float, *, eps: float | None = None) -> torch.Tensor:
    """``(mean |x|^p)^(1/p)`` over the last dimension, in float64 (p = inf: max; p = 0: geometric mean).

    Args:
        x: ``[..., n]`` floating tensor, ``n ≥ 1``.
        p: ``0``, a positive finite number, or ``math.inf``.
        eps: only for ``p = 0``: ``None`` takes the geometric mean over the nonzero entries (0 when all
            are zero); a number takes ``exp(mean log(|x| + eps))`` over all entries (the authors' L0).
    Returns:
        float64 tensor of shape ``[...]``: finite exactly when the row is (NaN or ±Inf in a row gives
        NaN or Inf; a float64 row of huge finite values does not overflow).
    """
    if not (p == 0 or p == math.inf or (isinstance(p, (int, float)) and p > 0 and math.isfinite(p))):
        raise ValueError(f"p={p!r} must be 0, a positive finite number or math.inf")
    check_eps(eps)
    if p == math.inf:
        return max_abs(x, dim=-1).to(torch.float64)
    if p == 1:
        mean = _abs_sums(x) / x.shape[-1]
        if not on_host(x):
            if x.dtype != torch.float64:
                return mean  # a non-finite mean is a NaN/Inf of the row: it stays
            # a float64 sum may overflow: those rows max-scaled, chosen on the device (no host read)
            return torch.where(torch.isfinite(mean), mean, _scaled_power_mean(x.abs(), 1.0))
        bad = ~torch.isfinite(mean)
        if bool(bad.any()):  # a NaN/Inf (stays), or a float64 sum of huge values overflowed: max-scaled
            mean[bad] = _scaled_power_mean(x.abs()[bad], 1.0)
        return mean
    a = x.abs()
    if p == 0:
        a64 = a.to(torch.float64)
        if eps is not None:
            return torch.log(a64 + eps).mean(dim=-1).exp()
        # Mantissas and exponents apart (a = m·2^e, m in [0.5, 1)): nothing underflows however wide the
        # range of |x|, and scaling x by 2^j shifts the integer exponents only, so the result exactly.
        mant, expo = torch.frexp(a64)
        nonzero = a64 != 0  # NaN counts (and makes the result NaN): a NaN row must not look finite
        count = nonzero.sum(dim=-1)
        k = count.clamp(min=1)
        logs = torch.where(nonzero, torch.log(torch.where(nonzero, mant, 1.0)), 0.0).sum(dim=-1)
        esum = torch.where(nonzero, expo.to(torch.int64), 0).sum(dim=-1)
        whole = torch.div(esum, k, rounding_mode="floor")  # mean exponent = whole + frac, frac in [0, 1)
        frac = (esum - whole * k).to(torch.float64) / k
        mean = torch.exp(logs / k + frac * math.log(2.0))  # in [0.5, 2): 2·mean·2^(whole−1) cannot overflow
        return torch.where(count > 0, torch.ldexp(2.0 * mean, whole - 1), 0.0)
    return _scaled_power_mean(a, p)


def _scaled_power_mean(a: torch.Tensor, p: float) -> torch.Tensor:
    """``(mean a^p)^(1/p)`` over the last dimension of ``a = |x|``, in float64."""
    # Scale by the max first so that |x|^p cannot overflow or underflow.
    top = a.amax(dim=-1, keepdim=True).to(torch.float64)
    safe = torch.where(top > 0, top, 1.0)
    rel = a.to(torch.float64) / safe
    return (rel.pow(p).mean(dim=-1)).pow(1.0 / p) * top.squeeze(-1)
