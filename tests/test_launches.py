"""How lioncub.ops.kernels and lioncub.ops.abs_sums launch their Triton kernels (lioncub.ops.triton_launch),
checked on the CPU (no GPU here): every launch runs under its tensors' CUDA device (the kernels replaced by
recorders), the device tables of a layout are made once however many layouts a run has, the majority
kernel's programs take kilobytes, and the launches of a vote step per bucket do not grow with the bucket's
tensors (issue 44, findings 1, 4, 5 and 9). The per-bucket kernels run in Triton's interpreter in a
subprocess (tests/kernels_interp.py's cases ``pass1_bucket``, ``multi_tensor`` and ``launch_counts``), as a
background job (tests/background.py) shared with tests/test_kernels.py: one interpreter for every case."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import background
import kernels_interp
from lioncub.ops import abs_sums, kernels, normalizers, triton_launch

ROOT = Path(__file__).resolve().parents[1]
#: the modules that launch Triton kernels, and the fewest launches each holds
LAUNCHING = {"kernels.py": 5, "abs_sums.py": 2}  # quantize, majority, apply, per bucket 2; the 2 stages
HAVE_TRITON = importlib.util.find_spec("triton") is not None
LAUNCH_CASES = ["pass1_bucket", "multi_tensor", "launch_counts"]


#: the subprocess of this module (with tests/test_kernels.py's cases), started when collection ends
#: (tests/background.py)
BACKGROUND = {"kernels_interp": kernels_interp.job}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """The records of the interpreter cases, by case."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install -c constraints.txt -e .[dev] brings it)")
    return kernels_interp.records(background.result("kernels_interp", BACKGROUND["kernels_interp"]))


# ----------------------------------------------------------------------------- finding 1: the device guard


def _is_launch(node: ast.AST) -> bool:
    """Whether ``node`` is ``triton_launch.triton_module().KERNEL[grid]`` (a launch, when called)."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Call)
        and ast.unparse(node.value.value.func) == "triton_launch.triton_module"
    )


def _launches_outside_the_guard(tree: ast.Module) -> list[int]:
    """Lines of launches not inside a ``with triton_launch.on_device(...)`` block."""
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    bad = []
    for node in ast.walk(tree):
        if not _is_launch(node):
            continue
        up: ast.AST | None = node
        guarded = False
        while up is not None and not guarded:
            up = parents.get(id(up))
            if isinstance(up, ast.With):
                guarded = any(
                    isinstance(item.context_expr, ast.Call)
                    and ast.unparse(item.context_expr.func) == "triton_launch.on_device"
                    for item in up.items
                )
        if not guarded:
            bad.append(node.lineno)
    return bad


def test_every_triton_launch_sits_inside_the_device_guard() -> None:
    """In every module that launches a Triton kernel; no other module of ``ops/`` names the kernels'
    module (``triton_module()``) but :mod:`lioncub.ops.triton_launch`, which defines it."""
    ops = ROOT / "src" / "lioncub" / "ops"
    for name, fewest in LAUNCHING.items():
        tree = ast.parse((ops / name).read_text())
        launches = [n for n in ast.walk(tree) if _is_launch(n)]
        assert len(launches) >= fewest, name
        assert _launches_outside_the_guard(tree) == [], name
    others = [
        p.name
        for p in ops.glob("*.py")
        if p.name not in (*LAUNCHING, "triton_launch.py") and "triton_module()" in p.read_text()
    ]
    assert others == []


def test_the_guard_makes_a_cuda_tensors_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_device`` enters ``torch.cuda.device`` of the tensors' device (faked: no GPU here), and nothing
    for a CPU tensor."""
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    with triton_launch.on_device(torch.device("cuda", 3)):
        pass
    with triton_launch.on_device(torch.zeros(2)):
        pass
    assert entered == [torch.device("cuda", 3)]


class _Recorder:
    """Stands in for lioncub.ops.triton_kernels: each ``KERNEL[grid](*args)`` records the kernel's name and
    the device the guard had entered at that moment."""

    HAVE_TRITON = True
    TRITON_ERROR = ""

    def __init__(self) -> None:
        self.current: list[Any] = []  # the guard's stack of entered tensors' devices
        self.launches: list[tuple[str, Any, list[torch.device]]] = []
        self.calls: list[tuple[str, Any, tuple, dict]] = []  # (kernel, grid, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if not name.endswith("_kernel"):
            raise AttributeError(name)
        recorder = self

        class Kernel:
            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> None:
                    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
                    where = recorder.current[-1] if recorder.current else None
                    recorder.launches.append((name, where, devices))
                    recorder.calls.append((name, grid, args, kwargs))

                return launch

        return Kernel()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """Triton 'takes' CPU tensors (as its interpreter does), its kernels record, and the device guard records
    the device it enters."""
    rec = _Recorder()
    monkeypatch.setattr(triton_launch, "triton_module", lambda: rec)
    monkeypatch.setattr(triton_launch, "interpreting", lambda: True)

    @contextlib.contextmanager
    def guard(t: torch.Tensor | torch.device) -> Iterator[None]:
        rec.current.append(t if isinstance(t, torch.device) else t.device)
        try:
            yield
        finally:
            rec.current.pop()

    monkeypatch.setattr(triton_launch, "on_device", guard)
    return rec


def test_every_triton_launch_path_enters_its_tensors_device(
    recorded: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quantize (pass 1 per bucket and per tensor, pass 2), majority, apply (per tensor and per bucket) and
    the per-bucket contribution: each launch happens inside the guard, entered with the device of the
    tensors it launches on."""
    x = torch.randn(300)
    kernels.quantize_l1(x, 63, segments=[100, 0, 200], chunk_size=64, backend="triton")
    monkeypatch.setattr(normalizers, "on_host", lambda t: False)  # pass 1 as off the CPU: Triton's
    kernels.quantize_l1(x, 63, segments=[100, 0, 200], chunk_size=64, backend="triton")
    abs_sums.l1_abs_sums(x.view(3, 100))
    kernels.majority_pack(torch.zeros(3, 9, dtype=torch.uint8), True, backend="triton")
    p, m, g = torch.randn(10), torch.randn(10), torch.randn(10)
    votes = torch.ones(10, dtype=torch.int8)
    kernels.apply_votes_(p, votes, lr=0.1, exp_avg=m, grad=g, beta2=0.9, backend="triton")
    ps, ms, gs = [torch.randn(4), torch.randn(6)], [torch.randn(4), torch.randn(6)], [torch.randn(4), None]
    kernels.apply_votes_multi_(ps, votes, [0, 4], lr=0.1, exp_avgs=ms, grads=gs, beta2=0.9, backend="triton")
    kernels.lion_directions_(torch.empty(10), [0, 4], ms, gs, beta1=0.9, backend="triton")
    names = [name for name, _, _ in recorded.launches]
    kinds = ("quantize_kernel", "abs_sum_tiles_kernel", "abs_sum_groups_kernel", "majority_kernel")
    for kernel in (*kinds, "apply_kernel", "apply_multi_kernel", "lion_kernel"):
        assert kernel in names, names
    for name, where, devices in recorded.launches:
        assert where is not None, f"{name} launched outside the device guard"
        assert devices and all(d == where for d in devices), (name, where, devices)


# ----------------------------------------------------------------------------- finding 9: the majority


def test_the_majority_kernel_takes_kilobytes_per_program_in_words(recorded: _Recorder) -> None:
    """Each program takes 2 KiB of every row (the first kernel: 128 bytes), read as 32-bit words where the
    rows allow it (a row of a multiple of 4 bytes at an aligned address), else as bytes."""
    rows = torch.zeros(8, 8192, dtype=torch.uint8)
    kernels.majority_pack(rows, True, backend="triton")
    kernels.majority_pack(torch.zeros(8, 8191, dtype=torch.uint8), True, backend="triton")
    (_, grid, args, kwargs), (_, grid_b, args_b, kwargs_b) = recorded.calls
    assert grid == (4,) and kwargs["WORDS"] and args[0].dtype == torch.int32  # 8 KiB rows: 4 programs
    assert grid_b == (4,) and not kwargs_b["WORDS"] and args_b[0].dtype == torch.uint8


# ----------------------------------------------------------------------------- finding 5: launches per bucket


@pytest.mark.slow
@pytest.mark.background("kernels_interp")
@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_the_per_bucket_kernels_in_the_interpreter(interpreted: dict[str, dict], case: str) -> None:
    """pass1_bucket: the 3-launch pass 1 of a bucket equals the reference per tensor bit for bit (and its
    sums the exact ones within float64 rounding); multi_tensor: the one-launch contribution and apply
    equal the torch reference per tensor; launch_counts: see below."""
    record = interpreted.get(case)
    assert record is not None, f"case {case} did not report"
    assert record["ok"], record["error"]


@pytest.mark.slow
@pytest.mark.background("kernels_interp")
def test_a_vote_step_launches_per_bucket_not_per_tensor(interpreted: dict[str, dict]) -> None:
    """A QuantizedVote(l1, 8) step of one bucket on the Triton path (pass 1 as off the CPU), 4 vs 16
    tensors: (Triton launches, other kernel-launching torch ops) per phase are the same — before, per
    tensor: the contribution 2 torch ops, pass 1 ~17 torch ops, the apply 1 Triton launch (then measured
    at 8 tensors: 0/21, 1/139, 8/2; 64 tensors: 0/133, 1/1091, 64/2)."""
    info = interpreted["launch_counts"].get("info")
    assert info is not None, interpreted["launch_counts"]["error"]
    per_bucket = {"contribution": [1, 4], "levels": [3, 1], "apply": [1, 1]}
    assert info == {"4": per_bucket, "16": per_bucket}


# ----------------------------------------------------------------------------- finding 4: tables per layout


class _Uploads(TorchFunctionMode):
    """Counts tensors made from host values (``torch.tensor``, ``torch.as_tensor``): a table's upload."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("tensor", "as_tensor"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_tables_of_300_layouts_are_uploaded_once() -> None:
    """Cycling through 300 bucket layouts (more than the old cache's 256 entries / 2 tables) twice: the
    second pass finds every table (the old cache was cleared wholesale and re-uploaded them all)."""
    device = torch.device("cpu")
    layouts = [(k + 1, 7, 3) for k in range(300)]
    with _Uploads() as first:
        for layout in layouts:
            kernels._segment_tables(device, layout, None)
    with _Uploads() as second:
        for _ in range(2):
            for layout in layouts:
                kernels._segment_tables(device, layout, None)
    assert first.count >= 300
    assert second.count == 0


def test_the_table_cache_drops_the_least_recently_used_one_at_a_time() -> None:
    tables = triton_launch.DeviceTables(3)
    cpu = torch.device("cpu")
    for key in "abc":
        tables.get(key, [1], torch.int64, cpu)
    tables.get("a", [1], torch.int64, cpu)  # a is now the most recent: b is dropped next
    tables.get("d", [1], torch.int64, cpu)
    assert tables.uploads == 4 and len(tables) == 3
    tables.get("a", [1], torch.int64, cpu)
    tables.get("c", [1], torch.int64, cpu)
    assert tables.uploads == 4
    tables.get("b", [1], torch.int64, cpu)
    assert tables.uploads == 5


def test_a_layouts_tables_are_rebuilt_when_one_of_them_was_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = triton_launch.DeviceTables(2)  # room for two entries: the counts and one of the two tables
    monkeypatch.setattr(triton_launch, "TABLES", tables)
    cpu = torch.device("cpu")
    built: list[int] = []

    def layout() -> tuple[list[int], ...]:
        built.append(1)
        return [0, 5000], [5000, 3], [0, 1]

    want = abs_sums.group_tables(cpu, "k", layout)
    got = abs_sums.group_tables(cpu, "k", layout)
    assert len(built) == 2  # a table was dropped: all rebuilt from the layout, not from nothing
    assert got[2:] == want[2:] == (3, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[0].tolist() == [0, 4096, 4096, 904, 5000, 3]
    assert want[1].tolist() == [0, 2, 5000, 0, 2, 3, 3, 1]


def test_a_table_copied_on_one_stream_is_waited_for_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a table is copied without blocking the host on the current stream; a launch on another
    stream before the copy is known to be done makes its stream wait for it (CUDA faked)."""
    log: list[Any] = []
    done = [False]
    streams = {"now": "side"}

    class Event:
        def record(self) -> None:
            log.append(("record", streams["now"]))

        def query(self) -> bool:
            return done[0]

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.device = name, torch.device("cuda", 1)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other.name == self.name

        def wait_event(self, event: Event) -> None:
            log.append(("wait", self.name))

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(streams["now"]))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(
        triton_launch, "_upload", lambda values, dtype, device: torch.tensor(values, dtype=dtype)
    )
    tables = triton_launch.DeviceTables(8)
    gpu = torch.device("cuda", 1)
    tables.get("k", [1, 2], torch.int64, gpu)
    tables.get("k", [1, 2], torch.int64, gpu)  # the same stream: ordered after the copy
    streams["now"] = "main"
    tables.get("k", [1, 2], torch.int64, gpu)
    done[0] = True
    tables.get("k", [1, 2], torch.int64, gpu)  # done: forgotten
    done[0] = False
    tables.get("k", [1, 2], torch.int64, gpu)
    assert log == [("record", "side"), ("wait", "main")] and tables.uploads == 1
