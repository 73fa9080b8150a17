"""LionCub's whole vote path on one device, for ``benchmarks/gpu_check.sh`` (section 3 of gpu_check.py).

Every check runs the same ranks twice: on ``device`` over the default group (NCCL on a GPU) and on the CPU
over a gloo group of the same ranks, and compares the two bit for bit — the vote algorithms, every
``LionCub`` preset, the overlap hook, local steps, ``consolidate_state_dict`` and a checkpoint round trip
through the CPU — and it counts the host synchronizations of a step. Section ``shards`` compares
``LionCub`` on FSDP2's shards with the unsharded ``LionCub`` on the same device instead (:func:`shards`).
At world size 1 the votes run their collectives too (:func:`lioncub.collectives.exchange_when_alone`):
step check, encode, exchange, decode and apply all run on one GPU. With several GPUs ``gpu_check.py``
also starts one process per GPU, each running :func:`vote_path` (``python benchmarks/gpu_path.py --rank
R --world N --store FILE``).

The data of the cross-device checks lies on a grid of multiples of 2^-6 below 4 and the betas are
(0.5, 0.5), and no tensor has more than 2^16 elements: every contribution, momentum and quantizer
normaliser (a sum of |c|, below 2^18) is then exact in float32, so the CPU's and the GPU's reductions,
which add in different orders and widths, agree to the bit and any difference is a defect. The overlap
check compares two runs on the same device and takes any data. The CPU reference runs the path CPU
tensors take beside a GPU (the C kernels, :func:`host_path`), in a dry run too, where the device's CPU
tensors take the Triton kernels in Triton's interpreter.

Each check is a section run under :class:`Sections`' guard: an exception marks the section FAIL with its
traceback and the next section runs. On several ranks the ranks then agree (over a gloo group of their own)
whether every rank failed it the same way: if not (some ranks only, or a collective that timed out on the
others), their collectives may no longer match, and every rank skips the sections left (SKIP) instead of
hanging in them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import io
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

#: (section, item, differing elements) of a bitwise check; (section, item, measured, target, ok) of a row
Check = Callable[[str, str, int], None]
Row = Callable[..., None]
#: the sections of :func:`vote_path`, in order (the names ``--fail-section`` takes)
SECTIONS = (
    "gloo group",
    "votes",
    "presets",
    "overlap hook",
    "local steps",
    "consolidation",
    "host syncs",
    "CUDA syncs (profiler)",
    "shards",
)

BETAS = (0.5, 0.5)  # with grid data every value stays exact in float32 (module docstring)
LR, WD = 2.0**-7, 0.125
SHAPES = [(64, 48), (48,), (33, 7), (1,), (96, 5)]


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ bit for bit (a NaN equals a NaN); a shape or dtype mismatch: all of them."""
    a, b = a.detach().reshape(-1).cpu(), b.detach().reshape(-1).cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    if a.dtype.is_floating_point:
        an, bn = a.isnan(), b.isnan()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return int(((an != bn) | (~an & ~bn & (a.view(ints) != b.view(ints)))).sum())
    return int((a != b).sum())


def grid(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 multiples of 2^-6 in (−4, 4) (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-255, 256, shape, generator=gen).to(torch.float32) / 64


# ------------------------------------------------------------------------------------ Triton's interpreter

_PATCHING = threading.Lock()  # the first launches of two threads (the overlap hook's vote thread)


def interpreter_patches_once() -> bool:
    """Make Triton's interpreter (``TRITON_INTERPRET=1``: a dry run, the suite's interpreter cases) patch
    ``triton.language`` once per process and per globals instead of at every launch and at every call of
    a ``@triton.jit`` helper.

    The interpreter's launch patches the language seen from the kernel's globals (builtins wrapped for
    numpy; ``inspect.getmembers`` over ``triton.language``) and restores it after the launch; each call of
    a helper inside it patches the language seen from the helper's globals again and never restores that.
    A patch from globals already patched finds every builtin wrapped and sets the other attributes to
    equal values: it changes nothing. Here the first patch from each globals stays for the rest of the
    process (not restored; later launches and helper calls from the same globals patch nothing): every
    launch runs with the language patched as the interpreter patches it, the same kernels, programs and
    numpy arithmetic, without repatching it each time (~15-20 % of the interpreter's CPU in these
    kernels). Only for a process that runs Triton's interpreter and nothing else of
    ``triton.language``. Returns whether the interpreter is patched (False, and nothing changed, if Triton
    or the function is missing); idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope is None:
        return False
    if getattr(patch_lang, "patches_once", False):
        return True
    patched: set[int] = set()  # ids of the globals whose language is patched

    def once(fn: Any) -> Any:
        with _PATCHING:
            if id(fn.__globals__) not in patched:
                patch_lang(fn)  # its scope dropped: never restored
                patched.add(id(fn.__globals__))
        return scope()  # nothing (more) patched, nothing to restore

    once.patches_once = True  # type: ignore[attr-defined]  # marks the module patched
    interpreter._patch_lang = once
    return True


def interpreter_dtypes_once() -> bool:
    """Make Triton's interpreter (``TRITON_INTERPRET=1``) map each Triton dtype to its numpy dtype once.

    The interpreter's ``_get_np_dtype`` builds its table of 19 dtypes (hashing each) at every call, i.e. at
    nearly every operation of a program (5-10 % of the interpreter's CPU in these kernels). Its result
    depends on the scalar dtype only (a block's: its element dtype's), and scalar dtypes that compare
    equal (hashed by their names) give the same one; here each scalar dtype's result is remembered at its
    first call (pointers, unhashable, go to the lookup: its first line answers them). Returns whether the
    interpreter is patched (False, and nothing changed, if Triton or the function is missing); idempotent.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        return False
    if getattr(lookup, "remembers", False):
        return True
    known: dict[Any, Any] = {}
    block = tl.block_type

    def remembered(tt_dtype: Any) -> Any:
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype  # blocks: unhashable
        try:
            return known[scalar]
        except KeyError:
            found = known[scalar] = lookup(scalar)
            return found
        except TypeError:  # a pointer (unhashable): the lookup's first line returns uint64, no table
            return lookup(scalar)

    remembered.remembers = True  # type: ignore[attr-defined]  # marks the module patched
    interpreter._get_np_dtype = remembered
    return True


@contextlib.contextmanager
def host_path() -> Iterator[None]:
    """CPU tensors take, in the block, the path they take beside a GPU: the C kernels (or torch), not
    Triton. Under ``TRITON_INTERPRET=1`` (a dry run) they would take the Triton kernels in Triton's
    interpreter, the device's path: for the block :func:`lioncub.ops.triton_launch.interpreting` says
    False, so the CPU reference is the GPU run's one and the dry run compares the interpreted Triton path
    with it (a third of the interpreter's work less). Elsewhere nothing changes."""
    from lioncub.ops import triton_launch

    if not triton_launch.interpreting():
        yield
        return
    saved = triton_launch.interpreting
    triton_launch.interpreting = lambda: False
    try:
        yield
    finally:
        triton_launch.interpreting = saved


# ------------------------------------------------------------------------------------ sections


def summary(err: BaseException) -> str:
    """``Type: message``, on one line, at most 200 characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= 200 else text[:197] + "..."


class Sections:
    """Runs a check's sections, each under a guard (:meth:`run`): an exception in a section goes to
    ``on_fail(section, summary, traceback)`` and the check goes on with the next one; ``faulthandler``
    dumps every thread's stack if a section runs longer than ``bound_s`` (a hang: it does not stop it).
    ``inject``: sections that raise at their end, after their work (``--fail-section``, the test hook of
    the guard). ``after()`` runs before and after every section (to write what was measured so far)."""

    def __init__(
        self,
        on_fail: Callable[[str, str, str], None],
        on_skip: Callable[[str, str], None],
        inject: Iterable[str] = (),
        bound_s: float = 240.0,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.on_fail, self.on_skip, self.inject = on_fail, on_skip, frozenset(inject)
        self.bound_s, self.after = bound_s, after
        #: (section, seconds, "ok" | "FAIL" | "SKIP"), in the order they ran
        self.results: list[tuple[str, float, str]] = []
        #: (section, summary) of each failure
        self.errors: list[tuple[str, str]] = []
        #: the section running now
        self.current: str | None = None

    @contextlib.contextmanager
    def run(self, name: str, bound_s: float | None = None) -> Iterator[None]:
        """The with-block as section ``name``: its exception (an ``Exception``, or a ``SystemExit`` that a
        library raised) is reported, not raised; a ``KeyboardInterrupt`` ends the check. Past ``bound_s``
        every thread's stack is dumped to stderr (the section goes on)."""
        t0 = time.perf_counter()
        self.current = name
        if self.after is not None:
            self.after()
        faulthandler.dump_traceback_later(bound_s or self.bound_s, exit=False)
        status = "ok"
        try:
            yield
            if name in self.inject:
                raise RuntimeError(f"failure injected at the end of section {name!r} (--fail-section)")
        except (Exception, SystemExit) as err:
            status = "FAIL"
            self.errors.append((name, summary(err)))
            self.on_fail(name, summary(err), traceback.format_exc())
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.current = None
            self.results.append((name, time.perf_counter() - t0, status))
            if self.after is not None:
                self.after()

    def skip(self, name: str, why: str) -> None:
        """Section ``name`` does not run, because of ``why``."""
        self.on_skip(name, why)
        self.results.append((name, 0.0, "SKIP"))
        if self.after is not None:
            self.after()


def _raise(section: str, what: str, tb: str) -> None:
    raise RuntimeError(f"section {section!r} failed: {what}\n{tb}")


# ------------------------------------------------------------------------------------ the checks


def _run(device: torch.device, group: Any, variant: str, steps: int, **options: Any) -> list[torch.Tensor]:
    """``steps`` LionCub steps of ``variant`` on ``device`` over ``group`` (rank-dependent grid gradients):
    the parameters and momenta after them."""
    from lioncub.optim import LionCub

    rank = dist.get_rank()
    params = [torch.nn.Parameter(grid(s, 100 + i).to(device)) for i, s in enumerate(SHAPES)]
    opt = LionCub(
        params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, process_group=group, **options
    )
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grid(p.shape, 1000 * step + 10 * rank + i).to(device)
        opt.step()
    return [p.detach() for p in params] + [opt.state[p]["exp_avg"] for p in params]


def votes(device: torch.device, gloo: Any, check: Check, n: int) -> None:
    """Every vote algorithm on ``device`` against the CPU over gloo."""
    from lioncub.collectives import (
        AverageVote,
        Comm,
        DenseMean,
        LaneVote,
        OneBitVote,
        QuantizedVote,
        ServerVote,
        SignSumVote,
    )

    comm_dev, comm_cpu = Comm(None, device=device), Comm(gloo)
    makers = {
        "OneBitVote": lambda c: OneBitVote(c),
        "LaneVote(4)": lambda c: LaneVote(c, 4),
        "LaneVote(auto)": lambda c: LaneVote(c, "auto"),
        "SignSumVote": lambda c: SignSumVote(c),
        "QuantizedVote(l1, 8)": lambda c: QuantizedVote(c, "l1", 8),
        "QuantizedVote(l1, 4)": lambda c: QuantizedVote(c, "l1", 4),
        "QuantizedVote(linf, 8, chunk 256)": lambda c: QuantizedVote(c, "linf", 8, chunk_size=256),
        "AverageVote": lambda c: AverageVote(c),
        "ServerVote(majority)": lambda c: ServerVote(c, "majority"),
        "ServerVote(average)": lambda c: ServerVote(c, "average"),
        "DenseMean(fp32)": lambda c: DenseMean(c, torch.float32),
        "DenseMean(bf16)": lambda c: DenseMean(c, torch.bfloat16),
    }
    n = min(n, 1 << 16)  # exact sums (module docstring)
    local = grid((n,), 5 + comm_dev.rank)
    local[::97] = 0.0
    segments = [n // 2, n - n // 2]
    for step in (1, 2):  # both phases of the tie rule
        for name, make in makers.items():
            out_dev = make(comm_dev).start(local.to(device), step=step, segments=segments).wait()
            with host_path():
                out_cpu = make(comm_cpu).start(local.clone(), step=step, segments=segments).wait()
            what = f"{name}, step {step} ({comm_dev.backend} vs gloo)"
            check("vote path", what, differing(out_dev, out_cpu))


def presets(device: torch.device, gloo: Any, check: Check) -> None:
    """Every LionCub preset, 3 steps (step check, encode, exchange, decode, apply) against the CPU."""
    from lioncub.optim.config import PRESETS

    for preset in PRESETS:
        ours = _run(device, None, preset, 3)
        with host_path():
            ref = _run(torch.device("cpu"), gloo, preset, 3)
        diff = sum(differing(a, b) for a, b in zip(ours, ref, strict=True))
        check("vote path", f"LionCub {preset}: 3 steps, parameters and momenta vs gloo", diff)


def overlap(device: torch.device, check: Check) -> None:
    """``LionCub.overlap_with`` (the DDP hook, the vote thread on the device) against the plain step."""
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.optim import LionCub
    from lioncub.optim.ddp import skip_gradient_allreduce

    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    batches = [torch.randn(16, 32, generator=gen) for _ in range(3)]
    for preset in ("1bit", "8bit", "32bit"):
        results = []
        for overlapped in (False, True):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            net = net.to(device)
            ids = [device.index] if device.type == "cuda" else None
            model = DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=0.004)
            opt = LionCub(net.parameters(), lr=1e-2, weight_decay=0.1, variant=preset)
            if overlapped:
                opt.overlap_with(model)
            else:
                skip_gradient_allreduce(model)
            try:
                for x in batches:
                    model(x.to(device)).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            finally:  # the vote thread ends even when a step raised (the next sections run in this process)
                if overlapped:
                    opt.overlap_hook.close()
            results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        check("vote path", f"LionCub {preset}: overlap_with vs plain step, 3 steps", differing(*results))


def local_steps(device: torch.device, gloo: Any, check: Check) -> None:
    """Local steps (inner Lion steps, the outer vote or DiLoCo's mean) on the device against the CPU."""
    from lioncub.optim import LocalSteps

    for preset, rule in (("1bit", "vote"), ("4bit", "vote"), ("32bit", "diloco")):
        local = LocalSteps(h=2, outer=rule)
        ours = _run(device, None, preset, 5, local_steps=local)
        with host_path():
            ref = _run(torch.device("cpu"), gloo, preset, 5, local_steps=local)
        diff = sum(differing(a, b) for a, b in zip(ours, ref, strict=True))
        check("vote path", f"LionCub {preset}, local steps h=2 outer={rule}: 5 steps vs gloo", diff)


def consolidated_problems(sd: dict[str, Any], momenta: list[list[torch.Tensor]]) -> tuple[int, str]:
    """What is wrong with ``sd``, a state dict of rank 0 after ``consolidate_state_dict(to=0)``, given every
    rank's momenta (``momenta[r][i]``: rank r's ``exp_avg`` of parameter i, on the CPU): one entry per rank
    (rank 0's own ``None``, its state the top level; rank r's travelled on the CPU), each holding its rank's
    momenta bit for bit. Returns the number of problems and where rank 0's own momenta are (its live state,
    on the parameters' device: it did not travel). At N = 1 this checks rank 0's entry, not nothing."""
    ranks = sd["lioncub"].get("ranks")
    if ranks is None:
        return sum(m.numel() for ms in momenta for m in ms), "no entries"
    problems = abs(len(ranks) - len(momenta))
    own = ""
    for r, mine in enumerate(momenta[: len(ranks)]):
        if r == 0:
            problems += ranks[0] is not None  # the gathering rank's own state is the top level
            state = sd["state"]
            own = "/".join(
                sorted({t.device.type for s in state.values() for t in s.values() if torch.is_tensor(t)})
            )
        elif ranks[r] is None:
            problems += 1
            continue
        else:
            state = ranks[r]["state"]
            tensors = [t for s in state.values() for t in s.values() if torch.is_tensor(t)]
            problems += sum(t.device.type != "cpu" for t in tensors)
        for i, m in enumerate(mine):
            problems += differing(state[i]["exp_avg"], m) if i in state else max(m.numel(), 1)
    return problems, own


def checkpoint_round_trip(device: torch.device, gloo: Any, check: Check) -> None:
    """``consolidate_state_dict`` (every rank's state gathered on rank 0, on the CPU: one entry per rank,
    each with its rank's momenta, compared with the momenta gathered over gloo — at N = 1 too, where the
    one entry is rank 0's own) and a save/load through the CPU (``map_location="cpu"``, as
    ``lioncub.train.checkpoint``) in the middle of a run: the resumed run equals the uninterrupted one, and
    the loaded momenta are on the parameters' device."""
    from lioncub.optim import LionCub

    rank, world = dist.get_rank(), dist.get_world_size()
    for variant, options in (("8bit", {}), ("1bit", {"local_steps": 2})):
        whole = _run(device, None, variant, 4, **options)
        params = [torch.nn.Parameter(grid(s, 100 + i).to(device)) for i, s in enumerate(SHAPES)]
        opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, **options)
        for step in range(4):
            if step == 3:  # mid-window with local steps (step 3 of h=2 windows): the replicas travel too
                opt.consolidate_state_dict(to=0)
                momenta: list[Any] = [None] * world
                mine = [opt.state[p]["exp_avg"].detach().cpu() for p in params]
                dist.all_gather_object(momenta, mine, group=gloo)
                if rank == 0:
                    problems, own = consolidated_problems(opt.state_dict(), momenta)
                    check(
                        "vote path",
                        f"{variant}: consolidated on rank 0: {world} entries (rank 0's own on {own}, "
                        f"{world - 1} gathered on the CPU), each = its rank's momenta",
                        problems,
                    )
                buf = io.BytesIO()
                torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
                saved = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=False)
                params = [torch.nn.Parameter(t.to(device)) for t in saved["model"]]
                opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, **options)
                opt.load_state_dict(saved["opt"])
                wrong = sum(opt.state[p]["exp_avg"].device != p.device for p in params)
                check("vote path", f"{variant}: loaded momenta on the parameters' device", int(wrong))
            for i, p in enumerate(params):
                p.grad = grid(p.shape, 1000 * step + 10 * rank + i).to(device)
            opt.step()
        resumed = [p.detach() for p in params] + [opt.state[p]["exp_avg"] for p in params]
        diff = sum(differing(a, b) for a, b in zip(resumed, whole, strict=True))
        label = f"{variant}{', local steps h=2' if options else ''}: saved at step 3 and resumed"
        check("vote path", f"{label} = uninterrupted, 4 steps", diff)


# ------------------------------------------------------------------------------------ host syncs


class HostReads(TorchFunctionMode):
    """Counts what makes the host wait for a device: a tensor's value read on the host (``bool``,
    ``int``, ``float``, ``item``, ``tolist``, a copy to the CPU or numpy) and a tensor built from host data
    (``torch.tensor``, a copy to the device). On the CPU these cost nothing; on a GPU each is a
    synchronization, so a step's count must not grow with its number of tensors."""

    READS = frozenset(
        {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "tensor"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class SyncCalls:
    """Counts the host's explicit waits for a CUDA device in a block: ``torch.cuda.synchronize`` and the
    ``synchronize`` of a ``torch.cuda.Event`` or ``torch.cuda.Stream`` (patched for the block). Without the
    profiler, this sees a per-bucket ``synchronize`` (e.g. a phase clock's); on the CPU the code takes no
    such wait and the count is 0."""

    TARGETS = (
        (torch.cuda, "synchronize"),
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
    )

    def __init__(self) -> None:
        self.count = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> SyncCalls:
        for owner, name in self.TARGETS:
            self._saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self._counting(getattr(owner, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, before in reversed(self._saved):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._saved.clear()


class TritonLaunches:
    """Counts the Triton launches in a block: each ``KERNEL[grid](...)`` of :mod:`lioncub.ops.triton_kernels`
    (its kernels wrapped for the block). A process that has not imported that module launches none (the
    probes count a third step, so Triton's import is not put on a step that runs no Triton)."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}
        self._module: Any = None

    def __enter__(self) -> TritonLaunches:
        self._module = sys.modules.get("lioncub.ops.triton_kernels")
        for name in getattr(self._module, "__all__", ()):
            if name.endswith("_kernel") and hasattr(self._module, name):
                kernel = self._saved[name] = getattr(self._module, name)
                setattr(self._module, name, _Counted(kernel, self))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, kernel in self._saved.items():
            setattr(self._module, name, kernel)
        self._saved.clear()


class _Counted:
    """A Triton kernel whose launches :class:`TritonLaunches` counts."""

    def __init__(self, kernel: Any, counter: TritonLaunches) -> None:
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counter.count += 1
            return launch(*args, **kwargs)

        return counted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def _sync_events(device: torch.device, step: Callable[[], None]) -> int:
    """CUDA synchronizations (``cuda*Synchronize`` and blocking copies) in one ``step()``, from the
    profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events()]
    return sum("Synchronize" in n or n == "cudaMemcpy" for n in names) - 1  # the one above


def _stepper(opt: Any, params: list[torch.nn.Parameter], device: torch.device) -> Callable[[], None]:
    """One step of ``opt`` on fixed grid gradients."""
    grads = [grid(p.shape, 7 + i).to(device) for i, p in enumerate(params)]

    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()

    return step


def _probe_sizes(device: torch.device) -> tuple[int, int, int, int]:
    """(elements in all, few tensors, many tensors, the middle bucket count) of the host-sync probes: on a
    GPU 2^17 elements in 8 vs 64 tensors, the 64 in 1 / 8 / 64 buckets. The counts depend neither on the
    tensors' size nor (much) on their number; on the CPU the Triton interpreter's time does (per tensor):
    there a dry run takes 2^13 elements in 4 vs 8 tensors, the 8 in 1 / 2 / 8 buckets."""
    return (1 << 17, 8, 64, 8) if device.type == "cuda" else (1 << 13, 4, 8, 2)


def _probe(
    device: torch.device,
    variant: str,
    tensors: int,
    buckets: int,
    measure: Callable[[Callable[[], None]], Any],
) -> tuple[int, Any]:
    """``measure(step)`` on the third step of a LionCub ``variant`` over ``tensors`` tensors of the same total
    size in ``buckets`` buckets (a small ``bucket_mb``); returns the buckets the optimizer made and what
    ``measure`` returned."""
    from lioncub.optim import LionCub

    numel = _probe_sizes(device)[0] // tensors
    params = [torch.nn.Parameter(grid((numel,), i).to(device)) for i in range(tensors)]
    options = {} if buckets == 1 else {"bucket_mb": tensors // buckets * numel * 4 / 2**20}
    opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, **options)
    step = _stepper(opt, params, device)
    for _ in range(2):  # the first steps build buffers and compare gradients once
        step()
    made = len(getattr(getattr(opt, "layout", None), "buckets", ())) or buckets
    return made, measure(step)


def _per_bucket(label: str, counts: list[int], buckets: list[int]) -> str:
    per_step = " / ".join(str(c) for c in counts)
    per_bucket = " / ".join(f"{c / b:.3g}" for c, b in zip(counts, buckets, strict=True))
    return f"{label} per step {per_step} (per bucket {per_bucket})"


def host_syncs(device: torch.device, row: Row, verdict: Callable[[bool], bool | None]) -> None:
    """Host reads and explicit ``synchronize`` calls of one LionCub step: for 8 and for 64 tensors (4 and 8
    on the CPU) of the same total size in one bucket, and for the 64 (8) tensors in 1, 8 (2) and 64 (8)
    buckets. Per step neither may grow: a synchronization per tensor or per bucket would show as a count
    growing with them (also reported per bucket)."""
    _, few, many, mid = _probe_sizes(device)

    def measure(step: Callable[[], None]) -> tuple[int, dict[str, int], int, int]:
        with HostReads() as reads, SyncCalls() as calls, TritonLaunches() as launched:
            step()
        return reads.count, reads.names, calls.count, launched.count

    for variant in ("1bit", "8bit"):
        _, (r_few, names, c_few, l_few) = _probe(device, variant, few, 1, measure)
        made, reads, calls, launches = [], [], [], []
        for buckets in (1, mid, many):
            b, (r, _, c, n_launched) = _probe(device, variant, many, buckets, measure)
            made.append(b)
            reads.append(r)
            calls.append(c)
            launches.append(n_launched)
        measured = f"{r_few} host reads {names}, {c_few} synchronize calls per step; {many} tensors: "
        measured += f"{reads[0]}, {calls[0]}"
        ok = r_few == reads[0] and c_few == calls[0]
        row(
            "host syncs",
            f"LionCub {variant} step, {few} vs {many} tensors (1 bucket)",
            measured,
            "same count",
            verdict(ok),
        )
        measured = (
            _per_bucket("host reads", reads, made) + "; " + _per_bucket("synchronize calls", calls, made)
        )
        ok = all(r <= reads[0] for r in reads) and all(c <= calls[0] for c in calls)
        label = f"LionCub {variant} step, {many} tensors in {' / '.join(map(str, made))} buckets"
        row("host syncs", label, measured, "per step: no growth with buckets", verdict(ok))
        measured = f"{few} vs {many} tensors (1 bucket): {l_few}, {launches[0]}; {many} tensors in "
        measured += f"{' / '.join(map(str, made))} buckets: " + _per_bucket("", launches, made).lstrip()
        row(
            "host syncs",
            f"LionCub {variant} step, Triton launches",
            measured,
            "per bucket: no growth with tensors",
            verdict(l_few == launches[0]),
        )


def cuda_syncs(device: torch.device, row: Row, verdict: Callable[[bool], bool | None]) -> None:
    """The CUDA synchronizations the profiler (CUPTI) sees in one LionCub step, as :func:`host_syncs`
    (few vs many tensors; many tensors in more and more buckets): per step they may not grow. Not measured
    on the CPU."""
    if device.type != "cuda":
        row("host syncs", "CUDA syncs (profiler)", "not measured: no CUDA device")
        return
    _, few, many, mid = _probe_sizes(device)
    for variant in ("1bit", "8bit"):
        _, s_few = _probe(device, variant, few, 1, lambda step: _sync_events(device, step))
        made, syncs = [], []
        for buckets in (1, mid, many):
            b, s = _probe(device, variant, many, buckets, lambda step: _sync_events(device, step))
            made.append(b)
            syncs.append(s)
        label = f"LionCub {variant} step, {few} vs {many} tensors (1 bucket), profiled"
        row(
            "host syncs",
            label,
            f"{s_few} CUDA syncs per step; {many} tensors: {syncs[0]}",
            "same count",
            verdict(s_few == syncs[0]),
        )
        label = f"LionCub {variant} step, {many} tensors in {' / '.join(map(str, made))} buckets, profiled"
        measured = _per_bucket("CUDA syncs", syncs, made)
        row(
            "host syncs",
            label,
            measured,
            "per step: no growth with buckets",
            verdict(all(s <= syncs[0] for s in syncs)),
        )


# ------------------------------------------------------------------------------------ shards (FSDP2)


#: the presets of :func:`shards`: the elementwise vote and the quantized one (whose norms need the whole
#: tensors: its shard group's all-gather)
SHARD_PRESETS = ("1bit", "8bit")
SHARD_STEPS = 3


def _shard_model(device: torch.device) -> torch.nn.Sequential:
    """The model of :func:`shards` (as tests/test_shards.py's: uneven dim-0 sizes 7, 5 and 1, so 2 shards
    hold 4 and 3 rows, 3 and 2, 1 and none), the same initial values on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    )
    return model.to(device)


def _shard_batch(device: torch.device, step: int, replica: int, shard: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * replica + shard)
    return torch.randn(6, 13, generator=gen).to(device), torch.randn(6, 1, generator=gen).to(device)


def shard_layouts(world: int) -> list[tuple[int, int]]:
    """The meshes (replicate R × shard S) :func:`shards` runs on ``world`` ranks: a mesh of one at N = 1;
    on several ranks the vote between replicas (N × 1) and one replica sharded over every rank (1 × N)."""
    return [(1, 1)] if world == 1 else [(world, 1), (1, world)]


def shards(device: torch.device, check: Check, row: Row, verdict: Callable[[bool], bool | None]) -> None:
    """LionCub on FSDP2's shards (``fully_shard`` over the ``"shard"`` dimension of a 2-D mesh
    ``("replicate", "shard")``; docs/gpu.md, "Shards") against the unsharded LionCub over the same voters
    (the ``"replicate"`` group) on the same gradients — each replica's mean gradient as FSDP2
    reduce-scattered it, gathered whole — bit for bit: parameters and momenta after every step, and the
    steps skipped. On the device the shards' aliases, gradients and momenta stay on it, FSDP2's
    collectives and the vote's run over the default group's backend (NCCL on a GPU), and the quantized
    vote all-gathers its buckets over the shard group. Also the host reads of one step on shards against
    the unsharded step's: at most one more (the replica's skip verdict, ``ShardView.agree_skip``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lioncub.optim import LionCub
    from lioncub.optim.shards import SHARD_DIMS, shard_piece

    for replicas, shards_n in shard_layouts(dist.get_world_size()):
        mesh = init_device_mesh(device.type, (replicas, shards_n), mesh_dim_names=SHARD_DIMS)
        replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
        for preset in SHARD_PRESETS:
            model, whole = _shard_model(device), _shard_model(device)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            kwargs: dict[str, Any] = dict(lr=0.01, weight_decay=0.1, variant=preset)
            opt = LionCub(model.parameters(), process_group=mesh, **kwargs)
            ref = LionCub(whole.parameters(), process_group=mesh.get_group("replicate"), **kwargs)
            diff, misplaced, reads = 0, 0, [0, 0]
            for step in range(SHARD_STEPS):
                x, y = _shard_batch(device, step, replica, shard)
                torch.nn.functional.mse_loss(model(x), y).backward()
                for p, w in zip(model.parameters(), whole.parameters(), strict=True):
                    assert isinstance(p.grad, DTensor)
                    w.grad = p.grad.full_tensor()  # the replica's mean gradient, whole
                for i, o in enumerate((opt, ref)):
                    with HostReads() as counted:
                        o.step()
                    reads[i] = counted.count  # the last step's (the first ones build buffers)
                opt.zero_grad()
                ref.zero_grad()
                for p, w in zip(model.parameters(), whole.parameters(), strict=True):
                    assert isinstance(p, DTensor)
                    piece = shard_piece(p.shape, shards_n, shard)
                    rows = slice(piece.start, piece.start + piece.counts[shard])
                    m, wm = opt.state[p]["exp_avg"], ref.state[w]["exp_avg"]
                    diff += differing(p.to_local().reshape(-1), w.detach().reshape(-1)[rows])
                    diff += differing(m.reshape(-1), wm.reshape(-1)[rows])
                    misplaced += (p.to_local().device != device) + (m.device != device)
            skipped = [o.comm_stats()["total"]["skipped_steps"] for o in (opt, ref)]
            diff += abs(skipped[0] - skipped[1])
            label = f"LionCub {preset} on FSDP2 shards, mesh {replicas}x{shards_n}"
            check("vote path", f"{label}: {SHARD_STEPS} steps = unsharded, parameters and momenta", diff)
            check("vote path", f"{label}: shards and momenta on {device.type}", misplaced)
            row(
                "host syncs",
                f"{label}: host reads per step",
                f"{reads[0]} on shards, {reads[1]} unsharded",
                "at most 1 more (the skip verdict)",
                verdict(reads[0] <= reads[1] + 1),
            )


# ------------------------------------------------------------------------------------ entry points


#: how long the ranks wait for each other to agree after a section (longer than a collective's timeout,
#: 120 s, after which a rank left waiting in a section fails it)
AGREE_TIMEOUT_S = 200


def _in_step(sections: Sections, name: str, status: Any, world: int) -> str | None:
    """After section ``name``: ``None`` when the ranks can go on — it failed on no rank, or on every rank
    with the same error (in step: their collectives still match) — else why they cannot. Collective over
    ``status``, a gloo group of its own."""
    if world == 1:
        return None
    mine = next((what for n, what in reversed(sections.errors) if n == name), None)
    if status is None:
        return "the ranks cannot agree (section 'gloo group' failed)" if mine else None
    every: list[Any] = [None] * world
    try:
        dist.all_gather_object(every, mine, group=status)
    except Exception as err:
        return f"the ranks could not agree after section {name!r}: {summary(err)}"
    failed = [r for r, what in enumerate(every) if what is not None]
    if not failed or (len(failed) == world and len(set(every)) == 1):
        return None
    return (
        f"section {name!r} failed on rank(s) {failed} of {world}"
        + (" with different errors" if len(failed) == world else "")
        + ": their collectives may no longer match"
    )


def vote_path(
    device: torch.device,
    n: int,
    check: Check,
    row: Row,
    verdict: Callable[[bool], bool | None],
    sections: Sections | None = None,
) -> None:
    """Every check of this module on this rank (collective: every rank of the default group calls it), each
    a section of ``sections`` (:data:`SECTIONS`; without it an exception ends the check)."""
    from lioncub.collectives import exchange_when_alone

    if sections is None:
        sections = Sections(_raise, lambda name, why: None)
    world = dist.get_world_size()
    groups: dict[str, Any] = {}
    with sections.run("gloo group"):
        groups["gloo"] = dist.new_group(list(range(world)), backend="gloo")
        if world > 1:
            timeout = datetime.timedelta(seconds=AGREE_TIMEOUT_S)
            groups["status"] = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)

    def gloo() -> Any:
        if "gloo" not in groups:
            raise RuntimeError("no gloo group to compare with (section 'gloo group' failed)")
        return groups["gloo"]

    body: list[tuple[str, Callable[[], None]]] = [
        ("votes", lambda: votes(device, gloo(), check, n)),
        ("presets", lambda: presets(device, gloo(), check)),
        ("overlap hook", lambda: overlap(device, check)),
        ("local steps", lambda: local_steps(device, gloo(), check)),
        ("consolidation", lambda: checkpoint_round_trip(device, gloo(), check)),
        ("host syncs", lambda: host_syncs(device, row, verdict)),
        ("CUDA syncs (profiler)", lambda: cuda_syncs(device, row, verdict)),
        ("shards", lambda: shards(device, check, row, verdict)),
    ]
    assert [name for name, _ in body] == list(SECTIONS[1:])
    stop = _in_step(sections, "gloo group", groups.get("status"), world)
    with exchange_when_alone():
        for name, fn in body:
            if stop is not None:
                sections.skip(name, stop)
                continue
            with sections.run(name):
                fn()
            stop = _in_step(sections, name, groups.get("status"), world)


def _write_json(path: str, rows: list[list[Any]]) -> None:
    """``rows`` as JSON in ``path``, replaced whole (a rank stopped later leaves what it had measured)."""
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(path + ".tmp", path)


def rank_main() -> int:
    """One rank of the several-GPU check: the rows it produced as JSON in ``--out``, rewritten after every
    section; a failed section is a row ``["fail", section, summary, traceback]``, a skipped one ``["skip",
    section, why]``. SIGABRT (the parent's on a time-out) dumps every thread's stack to stderr."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--fail-section", action="append", default=[], choices=SECTIONS)
    args = parser.parse_args()
    faulthandler.enable(all_threads=True)
    rows: list[list[Any]] = []

    def failed(section: str, what: str, tb: str) -> None:
        print(f"[{section}] FAIL: {what}\n{tb}", file=sys.stderr, flush=True)
        rows.append(["fail", section, what, tb])

    sections = Sections(
        failed,
        lambda section, why: rows.append(["skip", section, why]),
        inject=args.fail_section,
        after=lambda: _write_json(args.out, rows),
    )
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", args.rank)
    bound: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        bound["device_id"] = device
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo" if args.dry_run else "nccl",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
        **bound,
    )
    t0 = time.perf_counter()
    try:
        vote_path(
            device,
            args.n,
            lambda section, item, diff: rows.append(["check", section, item, diff]),
            lambda section, item, measured, target="", ok=None: rows.append(
                ["row", section, item, measured, target, ok]
            ),
            lambda ok: None if args.dry_run else ok,
            sections,
        )
    finally:
        dist.destroy_process_group()
    rows.append(
        ["row", "vote path", f"rank {args.rank}: wall time", f"{time.perf_counter() - t0:.0f} s", "", None]
    )
    _write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
