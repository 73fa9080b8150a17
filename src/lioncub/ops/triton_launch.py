"""How a Triton kernel of :mod:`lioncub.ops.triton_kernels` is launched on its tensors' device.

* :func:`why_not_triton` — why Triton cannot run a call's tensors ("" if it can): Triton is importable and
  they are CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``, Triton's interpreter, see
  :func:`interpreting`), plain tensors (not a subclass), contiguous, and of one dtype of
  :data:`TRITON_DTYPES`.
* :func:`triton_module` — :mod:`lioncub.ops.triton_kernels`, imported on first use: Triton is imported only
  when a tensor is on its device (importing it costs ~0.2 s per process).
* :func:`on_device` — the guard every launch (and every upload of a table) runs in, :func:`launch_options`
  the compile options of a launch, :func:`raw` the storage a kernel reads.
* :class:`DeviceTables` — the device copies of host tables (segment starts, pointers, ...), made once per
  layout (:data:`TABLES`, :func:`device_constant`).

This module sits in the lowest layer: it imports torch, and :mod:`lioncub.ops.triton_kernels` (Triton) only
when asked.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "TABLES",
    "TRITON_DTYPES",
    "DeviceTables",
    "device_constant",
    "interpreting",
    "launch_options",
    "on_device",
    "raw",
    "tensor_subclass",
    "triton_module",
    "why_not_triton",
]

#: the dtypes the Triton kernels take, as their ``KIND`` argument
TRITON_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, read when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_module() -> ModuleType:
    """:mod:`lioncub.ops.triton_kernels`, imported on first use (importing Triton costs ~0.2 s per process,
    which a run on CPU tensors never needs)."""
    return importlib.import_module("lioncub.ops.triton_kernels")


def _device_ok(tensors: Sequence[torch.Tensor]) -> str:
    """Why Triton cannot run these tensors ("" if it can); Triton is imported only for tensors on its
    device."""
    want = "cpu" if interpreting() else "cuda"
    for t in tensors:
        if t.device.type != want:
            mode = (
                "under TRITON_INTERPRET=1 the interpreter takes CPU tensors"
                if want == "cpu"
                else ("compiled Triton takes CUDA tensors (set TRITON_INTERPRET=1 for CPU tensors)")
            )
            return f"a {t.device.type} tensor: {mode}"
    if not triton_module().HAVE_TRITON:
        return f"triton is not importable ({triton_module().TRITON_ERROR})"
    return ""


def tensor_subclass(tensors: Sequence[torch.Tensor]) -> str:
    """A tensor subclass among ``tensors`` (a DTensor, ...: its data is not behind its pointer), or ""."""
    odd = [t for t in tensors if type(t) not in (torch.Tensor, torch.nn.Parameter)]
    return f"a {type(odd[0]).__name__} (a tensor subclass)" if odd else ""


def why_not_triton(tensors: Sequence[torch.Tensor], floats: Sequence[torch.Tensor]) -> str:
    """Why the Triton kernels cannot run ``tensors`` ("" if they can); ``floats``: those among them whose
    dtype is the kernel's (one of :data:`TRITON_DTYPES`, the same for all)."""
    why = tensor_subclass(tensors) or _device_ok(tensors)
    if why:
        return why
    for t in tensors:
        if not t.is_contiguous():
            return "a non-contiguous tensor"
    for t in floats:
        if t.dtype not in TRITON_DTYPES:
            return f"dtype {t.dtype} (the Triton kernels take float32, bfloat16 and float16)"
    if floats and len({t.dtype for t in floats}) > 1:
        return f"mixed dtypes {sorted(str(t.dtype) for t in floats)}"
    return ""


def launch_options() -> dict:
    """The compile options of every launch: no contraction into fused multiply-adds (the kernels place
    their own ``tl.fma``; see :mod:`lioncub.ops.kernels`), none under the interpreter."""
    return {} if interpreting() else {"enable_fp_fusion": False}


def on_device(t: torch.Tensor | torch.device) -> contextlib.AbstractContextManager:
    """The context every Triton launch (and upload) runs in: ``torch.cuda.device`` of the tensors' device
    for a CUDA tensor, nothing otherwise. Triton launches on the *current* CUDA device (and its current
    stream), not on its arguments' device: a rank that moved its model to ``cuda:K`` without
    ``torch.cuda.set_device(K)`` would launch on ``cuda:0`` with pointers of ``cuda:K``."""
    device = t if isinstance(t, torch.device) else t.device
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def raw(t: torch.Tensor) -> torch.Tensor:
    """The storage Triton reads: bfloat16 as its int16 bits (the kernels convert those themselves)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ------------------------------------------------------------------------------------ device tables


class DeviceTables:
    """Device copies of host tables (segment starts, pointers, ...), kept per key in least-recently-used
    order.

    A copy from the host is a synchronization on a GPU (and a launch), and a bucket's tables are the same
    at every step, so they are made once per layout. Why an LRU that drops one table at a time with a cap
    far above any real count, rather than tables owned by the bucket: the kernels take flat tensors and
    segment lengths and never see the optimizer's buckets (``optim/`` builds them), and a layout's key
    identifies its tables as well as a bucket would. A step touches each of its layouts' tables (a few per
    bucket), so with ``cap`` above the tables of all buckets (overlap's second layout included) none is
    ever dropped and re-uploaded; beyond it, LRU order drops the tables not touched for longest (e.g. the
    layouts of a model that is gone, or gradients' addresses of earlier steps) — a wholesale clear at a
    fixed size (what this replaced, at 256 entries) re-uploaded every table of every step past ~127
    buckets. The tables are small (8 bytes per tensor or per 4096 elements), so the cap bounds memory at
    a few MB for typical layouts.

    On a GPU a table is copied from pinned memory without blocking the host, on the current stream; a
    launch on another stream before that copy is known to be done first makes its stream wait for it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.uploads = 0  #: tables copied from the host so far (tests count them)
        self._tables: OrderedDict[Hashable, Any] = OrderedDict()
        self._copying: dict[Hashable, tuple[Any, Any]] = {}  # key: (CUDA event, stream) of its copy
        self._lock = threading.RLock()  # the overlap hook's vote thread launches kernels too

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._copying.clear()

    def peek(self, key: Hashable) -> Any:
        """The entry of ``key`` (made most recent; a device table: ready for the current stream), or None."""
        with self._lock:
            entry = self._tables.get(key)
            if entry is not None:
                self._tables.move_to_end(key)
                if key in self._copying:
                    self._ready(key)
            return entry

    def put(self, key: Hashable, entry: Any) -> None:
        """Keeps ``entry`` (not a device table: counts of a layout) under ``key``."""
        with self._lock:
            self._tables[key] = entry
            self._drop()

    def get(
        self, key: Hashable, values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The device tensor of ``key`` (made from ``values`` on a miss)."""
        with self._lock:
            t = self.peek(key)
            if t is not None:
                return t
            t = self._tables[key] = _upload(values, dtype, device)
            self.uploads += 1
            if device.type == "cuda":
                with on_device(device):
                    event = torch.cuda.Event()
                    event.record()
                    self._copying[key] = (event, torch.cuda.current_stream())
            self._drop()
            return t

    def _ready(self, key: Hashable) -> None:
        """Makes the current stream wait for ``key``'s copy where it ran on another stream and may not be
        done; forgets copies that are done (``query`` does not block the host)."""
        event, stream = self._copying[key]
        if event.query():
            del self._copying[key]
            return
        with torch.cuda.device(stream.device):
            current = torch.cuda.current_stream()
        if current != stream:
            current.wait_event(event)

    def _drop(self) -> None:
        while len(self._tables) > self.cap:
            key, _ = self._tables.popitem(last=False)  # the least recently used one
            self._copying.pop(key, None)


def _upload(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``; to a GPU from pinned memory without blocking the host
    (the caching host allocator keeps the pinned block until the copy has run)."""
    host = torch.as_tensor(values, dtype=dtype, device="cpu")  # host side by design: staged, then copied
    if device.type != "cuda":
        return host.to(device)
    with on_device(device):
        return host.pin_memory().to(device, non_blocking=True)


#: the device tables of every layout seen (see :class:`DeviceTables` for the cap)
TABLES = DeviceTables(1 << 14)


def device_constant(
    what: str, device: torch.device, key: object, values: Sequence, dtype: torch.dtype
) -> torch.Tensor:
    """``torch.tensor(values, dtype, device)``, made once per ``(what, device, key)``: a copy from the
    host is a synchronization on a GPU, and a bucket's layout is the same at every step."""
    return TABLES.get((what, device, key), values, dtype, device)
