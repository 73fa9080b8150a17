r"""The fused CPU kernels (``_cpu_kernels.c``, built and loaded by :mod:`lioncub.ops.native_build`): their
Python entries, one per kernel.

Where no compiler exists, the build fails, the probe disagrees with torch (ATen built without fused
multiply-adds) or ``LIONCUB_CPU_KERNELS=0`` is set, :func:`available` is False and :func:`reason` says why;
:mod:`lioncub.ops.kernels` then takes its torch backend (``backend="auto"``), which gives the same bits.

The entries take contiguous CPU tensors of one dtype (float32, float64 or bfloat16) and Python floats for
the scalars, rounded to the work type as torch rounds them (float32 for float32 and bfloat16 tensors).
Each checks what it is handed before a pointer reaches C — a plain dense contiguous CPU tensor of the right
dtype and length, else ``ValueError`` — so that no input from Python can make a kernel read or write out
of bounds (a tensor subclass such as DTensor is refused). Functions operate in place on their outputs; the
direction functions return the largest ``|c|`` (``inf``/``nan`` when some ``c`` is not finite). Large
tensors are split over ``torch.get_num_threads()`` threads (ctypes releases the GIL). Results equal
torch's bit for bit, except that a NaN result may carry another sign or payload (which operand an x86
multiply-add propagates is the compiler's choice); a step with NaN is skipped anyway.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from lioncub import env
from lioncub.ops import native_build
from lioncub.ops.native_build import DTYPES, ENV_SWITCH, enabled, prefetch_choice, set_prefetch

__all__ = [
    "DTYPES",
    "ENV_SWITCH",
    "SCALE_DTYPES",
    "Momentum",
    "apply_bits",
    "apply_int8",
    "apply_lanes",
    "apply_mean",
    "apply_values",
    "available",
    "build_seconds",
    "direction",
    "direction_lanes",
    "direction_sign",
    "enabled",
    "fill_lanes",
    "lion",
    "load",
    "majority",
    "momentum",
    "prefetch",
    "prefetch_choice",
    "quantize",
    "reason",
    "scale",
    "server_majority",
    "set_prefetch",
]


def load() -> ctypes.CDLL | None:
    """The loaded library (built on first use and checked against torch), or None (see :func:`reason`)."""
    return native_build.load(_probe)


def available() -> bool:
    """Whether the kernels can run (loads them on first call; False when switched off)."""
    return enabled() and load() is not None


def reason() -> str:
    """Why the kernels are not used ("" when they are)."""
    if not enabled():
        return f"switched off by {ENV_SWITCH}={env.text('LIONCUB_CPU_KERNELS')!r}"
    load()
    return native_build.error()


def prefetch() -> tuple[bool, str]:
    """Whether the streaming kernels prefetch ahead in software, and why (loads the kernels)."""
    load()
    return native_build.prefetch()


def build_seconds() -> float:
    """Seconds the first :func:`load` of this process took (compiling included when it compiled)."""
    load()
    return native_build.build_seconds()


def _probe() -> None:
    """Check the kernels against torch's own ops on values where a fused multiply-add rounds differently
    from a multiply then an add (raises if ATen does not fuse them on this machine)."""
    gen = torch.Generator().manual_seed(12345)
    for dtype in (torch.float32, torch.float64):
        m = torch.randn(1031, generator=gen, dtype=dtype)
        g = torch.randn(1031, generator=gen, dtype=dtype) * 1e-3
        p = torch.randn(1031, generator=gen, dtype=dtype)
        c = torch.empty_like(m)
        direction(m, g, 0.9, out=c)
        want = torch.mul(m, 0.9).add_(g, alpha=1.0 - 0.9)
        p1, m1 = p.clone(), m.clone()
        lion(p1, g, m1, lr=0.0123, beta1=0.9, beta2=0.99, weight_decay=0.1)
        p2, m2 = p.clone(), m.clone()
        p2.mul_(1.0 - 0.0123 * 0.1).add_(torch.mul(m, 0.9).add_(g, alpha=0.1).sign_(), alpha=-0.0123)
        m2.mul_(0.99).add_(g, alpha=1.0 - 0.99)
        if not (torch.equal(c, want) and torch.equal(p1, p2) and torch.equal(m1, m2)):
            raise RuntimeError(
                f"the kernels round differently from torch's {dtype} ops on this machine (ATen CPU "
                f"capability {torch.backends.cpu.get_cpu_capability()}, without fused multiply-adds?)"
            )


# ------------------------------------------------------------------------------------------- threads

#: elements per thread below which a call runs on the calling thread only
MIN_PER_THREAD = 1 << 20
_pools: dict[int, ThreadPoolExecutor] = {}


def _parts(n: int, align: int = 64, first: int = 0) -> list[tuple[int, int]]:
    """``[start, stop)`` pieces of ``range(n)`` for ``torch.get_num_threads()`` threads; every start but the
    first is ≡ ``-first`` modulo ``align`` (``first``: the position of element 0 in a packed output)."""
    threads = min(torch.get_num_threads(), n // MIN_PER_THREAD)
    if threads <= 1:
        return [(0, n)]
    bounds = [0]
    for k in range(1, threads):
        cut = n * k // threads
        cut -= (first + cut) % align
        if bounds[-1] < cut < n:
            bounds.append(cut)
    bounds.append(n)
    return list(itertools.pairwise(bounds))


_T = TypeVar("_T")


def _run(parts: list[tuple[int, int]], fn: Callable[[int, int], _T]) -> list[_T]:
    if len(parts) == 1:
        return [fn(*parts[0])]
    pool = _pools.get(len(parts))
    if pool is None:
        pool = _pools[len(parts)] = ThreadPoolExecutor(len(parts), thread_name_prefix="lioncub-kernels")
    futures = [pool.submit(fn, a, b) for a, b in parts[1:]]
    results = [fn(*parts[0])]
    return results + [f.result() for f in futures]


def _peak(parts: list[float]) -> float:
    values = [float(v) for v in parts]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


# ------------------------------------------------------------------------------------------- wrappers


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the fused CPU kernels are unavailable: {reason()}")
    return lib


#: the tensor types the kernels read through ``data_ptr()`` (a subclass such as DTensor may hold its data
#: elsewhere: refused)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _check(
    t: torch.Tensor | None,
    name: str,
    dtypes: tuple[torch.dtype, ...] | None = None,
    numel: int | None = None,
) -> None:
    """``ValueError`` unless ``t`` (``None`` passes) is what a kernel may read through its pointer: a plain
    dense contiguous CPU tensor (of one of ``dtypes``, with at least ``numel`` elements)."""
    if t is None:
        return
    if type(t) not in _PLAIN:
        raise ValueError(f"{name}: a {type(t).__name__}; the fused CPU kernels take plain torch tensors")
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or not t.is_contiguous():
        raise ValueError(
            f"{name}: a {t.device.type} {t.layout} tensor (contiguous: {t.is_contiguous()}); the fused CPU "
            "kernels take dense contiguous CPU tensors"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}; this kernel takes {[str(d) for d in dtypes]}")
    if numel is not None and t.numel() < numel:
        raise ValueError(f"{name}: {t.numel()} elements, the kernel reads {numel}")


def _check_step(param: torch.Tensor, *others: tuple[torch.Tensor | None, str]) -> None:
    """``param`` (``"param"``) and the same-dtype float tensors ``others`` of its elementwise step."""
    _check(param, "param", tuple(DTYPES))
    for t, name in others:
        _check(t, name, (param.dtype,), param.numel())


def _suffix(t: torch.Tensor) -> str:
    return DTYPES[t.dtype]


def _ptr(t: torch.Tensor | None, offset: int = 0) -> int | None:
    return None if t is None else t.data_ptr() + offset * t.element_size()


def direction(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | None,
    beta1: float,
    *,
    out: torch.Tensor,
    negate: bool = False,
    next_momentum: torch.Tensor | None = None,
    beta2: float = 0.0,
) -> float:
    """``out ← β1·m + (1−β1)·g`` (``g`` negated when ``negate``; ``None`` = zeros); returns max ``|c|``.
    With ``next_momentum`` (a tensor like ``m``) also ``next_momentum ← β2·m + (1−β2)·g``, in the same pass
    (``m`` itself is not written: a skipped step keeps it)."""
    _check_step(exp_avg, (grad, "grad"), (out, "out"), (next_momentum, "next_momentum"))
    return _elementwise_direction("direction", exp_avg, grad, beta1, out, negate, next_momentum, beta2)


def direction_sign(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | None,
    beta1: float,
    *,
    out: torch.Tensor,
    negate: bool = False,
    next_momentum: torch.Tensor | None = None,
    beta2: float = 0.0,
) -> float:
    """``out ← sign(c)`` as int8 (``c`` and ``next_momentum`` as :func:`direction`, NaN → 0); returns max
    ``|c|``."""
    _check_step(exp_avg, (grad, "grad"), (next_momentum, "next_momentum"))
    _check(out, "out", (torch.int8,), exp_avg.numel())
    return _elementwise_direction("direction_sign", exp_avg, grad, beta1, out, negate, next_momentum, beta2)


def _elementwise_direction(
    kernel: str,
    exp_avg: torch.Tensor,
    grad: torch.Tensor | None,
    beta1: float,
    out: torch.Tensor,
    negate: bool,
    next_momentum: torch.Tensor | None,
    beta2: float,
) -> float:
    """``lc_{kernel}`` over the checked tensors, one output element per input element; max ``|c|``."""
    fn = getattr(_lib(), f"lc_{kernel}_{_suffix(exp_avg)}")
    has_g = grad is not None

    def part(a: int, b: int) -> float:
        m, g, mn = _ptr(exp_avg, a), _ptr(grad, a), _ptr(next_momentum, a)
        return fn(m, g, b - a, beta1, 1.0 - beta1, negate, has_g, _ptr(out, a), mn, beta2, 1.0 - beta2)

    return _peak(_run(_parts(exp_avg.numel()), part))


def _lanes_bytes(start: int, stop: int, bits: int) -> int:
    """Bytes that hold lanes ``[start, stop)`` of ``bits`` bits (from byte 0)."""
    return -(-stop * bits // 8) if stop > start else 0


def direction_lanes(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | None,
    beta1: float,
    *,
    out: torch.Tensor,
    position: int,
    bits: int = 1,
    negate: bool = False,
    next_momentum: torch.Tensor | None = None,
    beta2: float = 0.0,
    zeros_vote_plus: bool = True,
) -> float:
    """The votes ``[c > 0]``, and ``[c == 0]`` where ``zeros_vote_plus`` (so ``[c ≥ 0]`` by default), into
    ``bits``-bit lanes ``[position, position + n)`` of ``out`` (uint8, the layout of
    :func:`lioncub.ops.packing.pack_lanes`; the other lanes of the two end bytes are kept);
    ``next_momentum`` as :func:`direction`; returns max ``|c|``."""
    n, has_g = exp_avg.numel(), grad is not None
    if bits not in (1, 2, 4, 8) or position < 0:
        raise ValueError(f"bits={bits} must be 1, 2, 4 or 8 and position={position} >= 0")
    _check_step(exp_avg, (grad, "grad"), (next_momentum, "next_momentum"))
    _check(out, "out", (torch.uint8,), _lanes_bytes(position, position + n, bits))
    fn = getattr(_lib(), f"lc_direction_lanes_{_suffix(exp_avg)}")
    base = out.data_ptr()

    def part(a: int, b: int) -> float:
        m, g, mn = _ptr(exp_avg, a), _ptr(grad, a), _ptr(next_momentum, a)
        zplus = int(bool(zeros_vote_plus))
        return fn(
            m, g, b - a, beta1, 1.0 - beta1, negate, has_g, base, position + a, bits, zplus, mn, beta2,
            1.0 - beta2,
        )  # fmt: skip

    return _peak(_run(_parts(n, align=8 // bits, first=position), part))


def fill_lanes(out: torch.Tensor, start: int, stop: int, bits: int, value: int) -> None:
    """Set the ``bits``-bit lanes ``[start, stop)`` of ``out`` (uint8) to ``value`` (0 or 1)."""
    if stop > start:
        if bits not in (1, 2, 4, 8) or start < 0 or value not in (0, 1):
            raise ValueError(f"bits={bits}, start={start}, value={value}: 1/2/4/8 bits, start >= 0, 0 or 1")
        _check(out, "out", (torch.uint8,), _lanes_bytes(start, stop, bits))
        _lib().lc_fill_lanes(out.data_ptr(), start, stop, bits, int(value))


#: what the apply reads (``kind`` of ``lc_apply``)
_BITS, _INT8, _VALUES, _LANES, _MEAN = 0, 1, 2, 3, 4
_TABLES: dict[tuple[int, ...], torch.Tensor] = {}


def _table(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as an int8 tensor (kept: the C side reads it while the call runs)."""
    t = _TABLES.get(values)
    if t is None:
        t = _TABLES[values] = torch.tensor(values, dtype=torch.int8)
    return t


@dataclass(frozen=True)
class Momentum:
    """The momentum update an apply fuses in: ``exp_avg ← β2·exp_avg + (1−β2)·g`` with ``g = grad``
    (``None`` = zeros), negated when ``negate``."""

    exp_avg: torch.Tensor
    grad: torch.Tensor | None
    beta2: float
    negate: bool = False


def _apply(
    param: torch.Tensor,
    source: torch.Tensor,
    kind: int,
    *,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None,
    position: int = 0,
    sign_of: bool = False,
    arg: int = 1,
    table: torch.Tensor | None = None,
) -> None:
    """``lc_apply``: the update read from ``source`` as ``kind`` (the public functions below check
    ``source``), then the ``momentum`` update."""
    m = momentum
    exp_avg, grad = (None, None) if m is None else (m.exp_avg, m.grad)
    _check_step(param, (exp_avg, "exp_avg"), (grad, "grad"))
    fn = getattr(_lib(), f"lc_apply_{_suffix(param)}")
    beta2, negate = (0.0, False) if m is None else (float(m.beta2), bool(m.negate))
    decay = lr * weight_decay != 0
    lut = None if table is None else table.data_ptr()

    def part(a: int, b: int) -> None:
        src = source.data_ptr() if kind in (_BITS, _LANES) else _ptr(source, a)
        fn(
            _ptr(param, a), b - a, kind, src, position + a, sign_of, -lr, decay, 1.0 - lr * weight_decay,
            m is not None, _ptr(exp_avg, a), _ptr(grad, a), beta2, 1.0 - beta2, negate, grad is not None,
            arg, lut,
        )  # fmt: skip

    _run(_parts(param.numel()), part)


def apply_bits(
    param: torch.Tensor,
    packed: torch.Tensor,
    *,
    position: int = 0,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None = None,
) -> None:
    """``p ← p·(1 − lr·wd) − lr·u`` (the decay skipped when ``lr·wd == 0``) with ``u = ±1`` from the packed
    bits ``[position, position + n)`` of ``packed`` (uint8, MSB first; 1 → +1), then the ``momentum``
    update, in one pass."""
    _check(packed, "packed", (torch.uint8,), _lanes_bytes(position, position + param.numel(), 1))
    _apply(param, packed, _BITS, position=position, lr=lr, weight_decay=weight_decay, momentum=momentum)


def apply_lanes(
    param: torch.Tensor,
    lanes: torch.Tensor,
    *,
    bits: int,
    table: tuple[int, ...],
    position: int = 0,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None = None,
) -> None:
    """:func:`apply_bits` with ``u = table[v]`` for the ``bits``-bit lane value ``v`` (2, 4 or 8 bits;
    lanes ``[position, position + n)`` of ``lanes``, uint8 in the layout of ``pack_lanes``; ``table``:
    ``2**bits`` int8 values)."""
    if bits not in (2, 4, 8) or len(table) != 1 << bits:
        raise ValueError(f"{bits}-bit lanes need a table of {1 << bits} values, got {len(table)}")
    _check(lanes, "lanes", (torch.uint8,), _lanes_bytes(position, position + param.numel(), bits))
    _apply(
        param, lanes, _LANES, lr=lr, weight_decay=weight_decay, momentum=momentum,
        arg=bits, table=_table(tuple(table)), position=position,
    )  # fmt: skip


def apply_int8(
    param: torch.Tensor,
    votes: torch.Tensor,
    *,
    sign_of: bool = False,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None = None,
) -> None:
    """:func:`apply_bits` with ``u`` the int8 ``votes`` (their sign when ``sign_of``: an integer sum)."""
    _check(votes, "votes", (torch.int8,), param.numel())
    _apply(param, votes, _INT8, sign_of=sign_of, lr=lr, weight_decay=weight_decay, momentum=momentum)


def apply_mean(
    param: torch.Tensor,
    sums: torch.Tensor,
    *,
    divisor: int,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None = None,
) -> None:
    """:func:`apply_bits` with ``u = sums / divisor`` in the parameter's dtype (int8 ``sums``; as
    ``u.copy_(sums).div_(divisor)``)."""
    _check(sums, "sums", (torch.int8,), param.numel())
    _apply(param, sums, _MEAN, arg=int(divisor), lr=lr, weight_decay=weight_decay, momentum=momentum)


def apply_values(
    param: torch.Tensor,
    update: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: Momentum | None = None,
) -> None:
    """:func:`apply_bits` with ``u`` the floating ``update`` of the parameter's dtype."""
    _check(update, "update", (param.dtype,), param.numel())
    _apply(param, update, _VALUES, lr=lr, weight_decay=weight_decay, momentum=momentum)


def momentum(exp_avg: torch.Tensor, grad: torch.Tensor | None, beta2: float, *, negate: bool = False) -> None:
    """``m ← β2·m + (1−β2)·g`` in place (``grad`` ``None`` = zeros)."""
    _check_step(exp_avg, (grad, "grad"))
    fn = getattr(_lib(), f"lc_momentum_{_suffix(exp_avg)}")
    has_g = grad is not None
    _run(
        _parts(exp_avg.numel()),
        lambda a, b: fn(_ptr(exp_avg, a), _ptr(grad, a), b - a, beta2, 1.0 - beta2, negate, has_g),
    )


def lion(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    negate: bool = False,
) -> None:
    """One Lion step in one pass over (p, g, m): :func:`lioncub.optim.lion.lion_update_` bit for bit. A
    float32 parameter may take a bfloat16 ``grad`` (widened exactly, as ``grad.float()``)."""
    decay, factor = lr * weight_decay != 0, 1.0 - lr * weight_decay
    if param.dtype == torch.float32 and grad.dtype == torch.bfloat16:
        _check_step(param, (exp_avg, "exp_avg"))
        _check(grad, "grad", (torch.bfloat16,), param.numel())
        mixed = _lib().lc_lion_f32_bf16g
        if negate:
            raise ValueError("a bfloat16 gradient is not negated here")

        def half(a: int, b: int) -> None:
            p, g, m = _ptr(param, a), _ptr(grad, a), _ptr(exp_avg, a)
            mixed(p, g, m, b - a, beta1, 1.0 - beta1, beta2, 1.0 - beta2, -lr, decay, factor)

        _run(_parts(param.numel()), half)
        return
    _check_step(param, (grad, "grad"), (exp_avg, "exp_avg"))
    fn = getattr(_lib(), f"lc_lion_{_suffix(param)}")

    def part(a: int, b: int) -> None:
        p, g, m = _ptr(param, a), _ptr(grad, a), _ptr(exp_avg, a)
        fn(p, g, m, b - a, beta1, 1.0 - beta1, beta2, 1.0 - beta2, -lr, decay, factor, negate)

    _run(_parts(param.numel()), part)


#: the integer level dtypes :func:`quantize` writes
_LEVEL_DTYPES = (torch.int8, torch.int16, torch.int32)


def quantize(
    x: torch.Tensor,
    divisors: torch.Tensor,
    *,
    chunk: int | None,
    wide: bool,
    scale: float,
    levels: int,
    out: torch.Tensor,
) -> None:
    """Pass 2 of the L1 quantizer: ``out ← clip(rint((x / d) · scale), ±levels)``, NaN → 0, in float32
    (``wide``: float64); ``divisors`` float64, one per ``chunk`` elements (``None``: one for all)."""
    n = x.numel()
    _check(x, "x", tuple(DTYPES))
    _check(out, "out", _LEVEL_DTYPES, n)
    groups = 1 if chunk is None else -(-n // chunk)
    if divisors.numel() < groups:
        raise ValueError(f"divisors: {divisors.numel()} values for {groups} groups")
    fn = getattr(_lib(), f"lc_quantize_{_suffix(x)}")
    d = divisors.to(torch.float64).contiguous()
    size = out.element_size()
    if chunk is None:
        _run(
            _parts(n),
            lambda a, b: fn(_ptr(x, a), b - a, d.data_ptr(), 0, wide, scale, levels, _ptr(out, a), size),
        )
        return
    fn(x.data_ptr(), n, d.data_ptr(), chunk, wide, scale, levels, out.data_ptr(), size)


#: the (gradient, wire) dtypes of :func:`scale`
SCALE_DTYPES = {
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float64, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.bfloat16),
}
_IN = {torch.float32: 0, torch.float64: 1}
_WIRE = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}


def scale(grad: torch.Tensor, out: torch.Tensor, *, divisor: int, negate: bool = False) -> float:
    """A dense contribution in one pass: ``out ← (g converted to out's dtype) / divisor`` (``−g`` with
    ``negate``), as ``out.copy_(g).div_(divisor)``; returns max ``|g|`` (``inf``/``nan`` when some ``g``
    is not finite). ``(grad.dtype, out.dtype)`` must be one of :data:`SCALE_DTYPES`."""
    if (grad.dtype, out.dtype) not in SCALE_DTYPES:
        raise ValueError(f"scale takes {sorted(map(str, SCALE_DTYPES))}, got {grad.dtype} -> {out.dtype}")
    _check(grad, "grad")
    _check(out, "out", None, grad.numel())
    fn = _lib().lc_scale
    kin, kw = _IN[grad.dtype], _WIRE[out.dtype]
    return _peak(
        _run(
            _parts(grad.numel()),
            lambda a, b: fn(_ptr(grad, a), b - a, kin, negate, divisor, _ptr(out, a), kw),
        )
    )


def _check_rows(rows: torch.Tensor, out: torch.Tensor, out_bytes: int) -> tuple[int, int]:
    if rows.dim() != 2:
        raise ValueError(f"rows: shape {tuple(rows.shape)}, expected [N, B]")
    _check(rows, "rows", (torch.uint8,))
    _check(out, "out", (torch.uint8,), out_bytes)
    return rows.shape[0], rows.shape[1]


def server_majority(rows: torch.Tensor, out: torch.Tensor, *, n_bits: int) -> None:
    """The parameter server's majority: ``out`` (uint8, 2-bit lanes as ``pack_lanes``) ← ``sign(2·count −
    N) + 1`` of the rows' (uint8 ``[N, B]``) set bits at positions ``< n_bits``, 0 beyond."""
    n, row_bytes = _check_rows(rows, out, 0)
    if not 0 <= n_bits <= row_bytes * 8:
        raise ValueError(f"n_bits={n_bits} does not fit in rows of {row_bytes} bytes")
    _lib().lc_server_majority(rows.data_ptr(), n, row_bytes, out.data_ptr(), out.numel(), n_bits)


def majority(rows: torch.Tensor, out: torch.Tensor, *, n_bits: int, threshold: int) -> None:
    """``out`` (uint8) ← bit set where at least ``threshold`` of the rows (uint8 ``[N, B]``) have it set;
    bits from ``n_bits`` on are 0."""
    n, row_bytes = _check_rows(rows, out, 0)
    if not 0 <= n_bits <= row_bytes * 8:
        raise ValueError(f"n_bits={n_bits} does not fit in rows of {row_bytes} bytes")
    _lib().lc_majority(rows.data_ptr(), n, row_bytes, out.data_ptr(), out.numel(), n_bits, threshold)
