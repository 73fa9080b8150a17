"""Building and loading the fused CPU kernels (``_cpu_kernels.c``): compiled once per machine, loaded with
:mod:`ctypes`; the calls themselves are :mod:`lioncub.ops.native`.

The C file is compiled on first use with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``;
``-O3 -ffp-contract=off``, and on x86-64 with gcc one clone per instruction set, AVX-512/AVX2/baseline,
chosen when loaded) into a cache folder (``$LIONCUB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lioncub`` or
``~/.cache/lioncub``), named by a hash of the source, the flags and the compiler, under a file lock (ranks
starting together build it once). :func:`load` builds or loads it and checks it with the caller's probe;
it takes ~9 s the first time on a machine (gcc 12, three clones, Intel Xeon), milliseconds after. The
streaming passes prefetch ahead in software where that pays (:func:`prefetch` says whether and why;
``LIONCUB_CPU_PREFETCH`` overrides); it changes speed only.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import torch

from lioncub import env

__all__ = [
    "DTYPES",
    "ENV_SWITCH",
    "PREFETCH_SWITCH",
    "build_seconds",
    "enabled",
    "error",
    "load",
    "prefetch",
    "prefetch_choice",
    "set_prefetch",
]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_cpu_kernels.c")
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
FLAGS += ["-fvisibility=hidden"]
ENV_SWITCH = "LIONCUB_CPU_KERNELS"
PREFETCH_SWITCH = "LIONCUB_CPU_PREFETCH"

#: the dtypes the kernels take, and their suffix in the C file
DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}

_lock = threading.Lock()


class _State(TypedDict, total=False):
    """What :func:`load` found (each key set once it is known)."""

    lib: ctypes.CDLL  # the loaded library
    error: str  # why there is none
    build_s: float  # seconds the first load took
    prefetch: tuple[bool, str]  # whether the kernels prefetch, and why


_state: _State = {}


def enabled() -> bool:
    """False when ``LIONCUB_CPU_KERNELS=0`` (read at every call: tests switch it per call)."""
    return env.text("LIONCUB_CPU_KERNELS").strip().lower() not in ("0", "off", "false", "no", "")


def error() -> str:
    """Why the last :func:`load` gave no library ("" when it loaded, or before it ran)."""
    return str(_state.get("error", ""))


def prefetch() -> tuple[bool, str]:
    """Whether the loaded kernels prefetch ahead in software, and why."""
    return _state.get("prefetch", (False, "the kernels are not loaded"))


def set_prefetch(on: bool) -> None:
    """Switch the software prefetch of the loaded kernels (for tests and benchmarks; results are the same
    bits either way)."""
    lib = _state.get("lib")
    if lib is None:
        raise RuntimeError(f"the fused CPU kernels are not loaded: {error()}")
    lib.lc_set_prefetch(int(bool(on)))
    _state["prefetch"] = (bool(on), "set_prefetch")


def prefetch_choice() -> tuple[bool, str]:
    """``LIONCUB_CPU_PREFETCH`` (``1``/``0``) if set, else by CPU vendor: off on AMD, where the hardware
    prefetchers alone make the direction and momentum passes 15–25 % faster (BENCHMARKS.md, AMD EPYC),
    on elsewhere (the Intel Xeon the kernels were first tuned on). Only speed depends on it, never bits."""
    value = env.get("LIONCUB_CPU_PREFETCH")
    if value is not None:
        word = value.strip().lower()
        if word in ("1", "on", "true", "yes"):
            return True, f"{PREFETCH_SWITCH}={value!r}"
        if word in ("0", "off", "false", "no"):
            return False, f"{PREFETCH_SWITCH}={value!r}"
        raise ValueError(f"{PREFETCH_SWITCH}={value!r}: must be 1 or 0 (unset: chosen by the CPU's vendor)")
    vendor = _cpu_vendor()
    if vendor == "AuthenticAMD":
        return False, "AMD CPU: its hardware prefetchers do better alone"
    return True, f"{vendor or 'unknown'} CPU"


def _cpu_vendor() -> str:
    """``vendor_id`` of ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_seconds() -> float:
    """Seconds the first :func:`load` of this process took (compiling included when it compiled)."""
    return float(_state.get("build_s", 0.0))


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cache_dir() -> Path:
    explicit = env.get("LIONCUB_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lioncub"


def _build(cc: str) -> Path:
    """The compiled library for this source, flags and compiler (built under a file lock if missing)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        SOURCE.read_bytes() + repr((FLAGS, version, platform.machine(), sys.platform)).encode()
    ).hexdigest()[:16]
    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"lioncub-kernels-{os.getuid()}"
        folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    with open(folder / f"cpu_kernels-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.perf_counter()
        if lib.exists():  # another process built it while this one waited
            return lib
        tmp = folder / f"cpu_kernels-{key}.{os.getpid()}.tmp.so"
        cmd = [cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
        _log.info("lioncub: compiled the fused CPU kernels into %s (%.1f s)", lib, time.perf_counter() - t0)
    return lib


_P, _I, _L, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double


def _declare(lib: ctypes.CDLL) -> None:
    for suffix in DTYPES.values():
        w = ctypes.c_double if suffix == "f64" else ctypes.c_float
        sig = {
            "direction": ([_P, _P, _L, w, w, _I, _I, _P, _P, w, w], _D),
            "direction_sign": ([_P, _P, _L, w, w, _I, _I, _P, _P, w, w], _D),
            "direction_lanes": ([_P, _P, _L, w, w, _I, _I, _P, _L, _I, _I, _P, w, w], _D),
            "apply": ([_P, _L, _I, _P, _L, _I, w, _I, w, _I, _P, _P, w, w, _I, _I, _I, _P], None),
            "momentum": ([_P, _P, _L, w, w, _I, _I], None),
            "lion": ([_P, _P, _P, _L, w, w, w, w, w, _I, w, _I], None),
            "quantize": ([_P, _L, _P, _L, _I, _D, _L, _P, _I], None),
        }
        for name, (args, res) in sig.items():
            fn = getattr(lib, f"lc_{name}_{suffix}")
            fn.argtypes, fn.restype = args, res
    lib.lc_fill_lanes.argtypes, lib.lc_fill_lanes.restype = [_P, _L, _L, _I, _I], None
    lib.lc_majority.argtypes, lib.lc_majority.restype = [_P, _L, _L, _P, _L, _L, _L], None
    lib.lc_server_majority.argtypes, lib.lc_server_majority.restype = [_P, _L, _L, _P, _L, _L], None
    lib.lc_scale.argtypes, lib.lc_scale.restype = [_P, _L, _I, _I, _D, _P, _I], _D
    _F = ctypes.c_float
    lib.lc_lion_f32_bf16g.argtypes = [_P, _P, _P, _L, _F, _F, _F, _F, _F, _I, _F]
    lib.lc_lion_f32_bf16g.restype = None
    lib.lc_abi_version.argtypes, lib.lc_abi_version.restype = [], _I
    lib.lc_set_prefetch.argtypes, lib.lc_set_prefetch.restype = [_I], None


def load(probe: Callable[[], None]) -> ctypes.CDLL | None:
    """The loaded library (built on first use, then checked by ``probe``, which raises where the kernels
    disagree with torch), or None (:func:`error` says why)."""
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    with _lock:
        if "lib" in _state or "error" in _state:
            return _state.get("lib")
        choice = prefetch_choice()  # a bad LIONCUB_CPU_PREFETCH raises here, not as "unavailable"
        t0 = time.perf_counter()
        try:
            if sys.byteorder != "little":
                raise RuntimeError("the kernels' bit layouts assume a little-endian host")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc or clang); install gcc to use them")
            lib = ctypes.CDLL(str(_build(cc)))
            _declare(lib)
            if lib.lc_abi_version() != 5:
                raise RuntimeError("the compiled library is of another version")
            lib.lc_set_prefetch(int(choice[0]))
            _state["lib"], _state["prefetch"] = lib, choice
            probe()
        except Exception as exc:  # no compiler, a failed build, a probe that disagrees with torch
            _state.pop("lib", None)
            _state["error"] = f"{type(exc).__name__}: {exc}"
            _log.info("lioncub: fused CPU kernels unavailable (%s); the torch path runs", _state["error"])
        _state["build_s"] = time.perf_counter() - t0
    return _state.get("lib")
