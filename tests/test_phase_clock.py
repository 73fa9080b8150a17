"""The phase times of a step on a GPU come from CUDA events read after the step, never from a device-wide
synchronization inside it (issue 44, finding 3: ``PhaseClock`` synchronized three times per bucket and
twice per phase, ~170 times a step for 350M parameters in 25 MB buckets, and the first wait of every
bucket stopped applying bucket b from overlapping communicating bucket b+1).

CI has no GPU, so the CUDA calls are replaced by recorders: ``torch.cuda.synchronize`` counts, and
``torch.cuda.Event`` is a fake whose ``elapsed_time`` is the host time between its two records. The
step itself runs the whole vote path on CPU tensors of a one-rank gloo group
(:func:`lioncub.collectives.exchange_when_alone`), with the engine's clock told it is on ``cuda:0``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from lioncub import LionCub
from lioncub.collectives import exchange_when_alone
from lioncub.optim.engine import PHASES, PhaseClock, StepTimes
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.sync import MomentumSync


class FakeEvent:
    """A CUDA event on the host: ``record`` reads ``perf_counter``; ``query`` is whether it was
    recorded; counts how often the host waited on it."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "phase events must be made with enable_timing=True"
        self.at: float | None = None
        self.waits = 0
        self.done = True
        FakeEvent.made.append(self)

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None and self.done

    def synchronize(self) -> None:
        self.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "elapsed_time of an event never recorded"
        return (end.at - self.at) * 1000.0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``torch.cuda``'s events, device guard and synchronize replaced; returns the synchronize calls."""
    synced: list[Any] = []
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    return synced


def _model(tensors: int) -> list[torch.nn.Parameter]:
    """``tensors`` parameters of 4096 float32 each (16 KiB: one per 16 KiB bucket)."""
    g = torch.Generator().manual_seed(tensors)
    return [torch.nn.Parameter(torch.randn(4096, generator=g)) for _ in range(tensors)]


def _steps(opt: LionCub, params: list[torch.nn.Parameter], steps: int) -> None:
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.sin(p.detach() * (i + 1) + step)  # depends on the parameters
        opt.step()


#: the paths of a step besides the plain vote: H local steps (an outer step every second), momentum sync
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "local-steps": {"local_steps": LocalSteps(h=2)},
    "momentum-sync": {"momentum_sync": MomentumSync("all", every=2)},
}


@pytest.mark.parametrize(
    ("variant", "options"),
    [("1bit", "plain"), ("8bit", "plain"), ("32bit", "plain"), ("1bit", "local-steps"),
     ("8bit", "local-steps"), ("1bit", "momentum-sync")],
)  # fmt: skip
def test_a_gpu_step_never_synchronizes_the_device(
    one_rank: Any, fake_cuda: list[Any], variant: str, options: str
) -> None:
    """With the clock on a GPU a step makes no ``torch.cuda.synchronize`` at 4 or at 32 buckets (the
    old clock: 3 per bucket plus 2 per phase), records two events per bucket (the wait and the apply)
    and a few per step, waits on none of them inside the step, and ``comm_stats`` reads them without a
    device-wide synchronization; also on the steps of local steps (inner and outer) and of momentum
    sync."""
    made = {}
    for tensors in (4, 32):
        params = _model(tensors)
        with exchange_when_alone():
            opt = LionCub(params, lr=1e-3, variant=variant, bucket_mb=4096 * 4 / 2**20, **OPTIONS[options])
        assert len(opt.layout.buckets) == tensors
        opt.engine.clock = PhaseClock(torch.device("cuda", 0))
        _steps(opt, params, 1)  # the first step: the layout's one-time work
        before = len(FakeEvent.made)
        _steps(opt, params, 3)
        made[tensors] = (len(FakeEvent.made) - before) / 3
        assert fake_cuda == [], f"{len(fake_cuda)} device-wide synchronizations in 4 steps"
        assert all(e.waits == 0 for e in FakeEvent.made[before:]), "the step waited on its own events"
        stats = opt.comm_stats()
        assert stats["last"]["apply_s"] > 0 and stats["last"]["exchange_s"] > 0
        assert stats["total"]["apply_s"] >= stats["last"]["apply_s"]
        assert fake_cuda == [], "reading the times synchronized the device"
    # events: a bounded number per bucket (2 per bucket for wait/apply, a few per phase), never per tensor
    per_bucket = (made[32] - made[4]) / 28
    assert per_bucket <= 2.0, made


def test_step_times_read_the_event_pairs_once() -> None:
    """``StepTimes`` of a GPU: ``book`` keeps the pair; ``settle(wait=False)`` reads only finished pairs;
    ``as_dict`` waits for the rest; ``add`` and ``copy`` keep the pairs apart from their source."""
    clock = PhaseClock(torch.device("cuda", 0))
    times = StepTimes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Event", FakeEvent)
        mp.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        a, b, c = FakeEvent(True), FakeEvent(True), FakeEvent(True)
        a.at, b.at, c.at = 1.0, 1.25, 2.0
        c.done = False  # still queued on the device
        clock.book(times, "exchange", a, b)
        clock.book(times, "apply", b, c)
        total = StepTimes()
        total.add(times)
        copied = times.copy()
        times.settle(wait=False)
        assert (times.exchange, times.apply, len(times.pending)) == (0.25, 0.0, 1)
        assert c.waits == 0
        d = times.as_dict()
        assert (d["exchange_s"], d["apply_s"], c.waits) == (0.25, 0.75, 1)
        assert len(total.pending) == 2 and len(copied.pending) == 2  # their own lists
        assert total.as_dict()["communication_s"] == 0.25
        with pytest.raises(ValueError, match="phase 'wire' is not one of"):
            clock.book(times, "wire", a, b)
    assert set(PHASES) == {"direction", "encode", "exchange", "apply", "sync", "overlapped"}


def test_the_cpu_clock_books_seconds_at_once() -> None:
    clock = PhaseClock(torch.device("cpu"))
    times = StepTimes()
    t0 = clock.mark()
    assert isinstance(t0, float)
    end = clock.book(times, "sync", t0, t0 + 0.5)
    assert (end, times.sync, times.pending) == (t0 + 0.5, 0.5, [])


def test_the_optimizer_never_takes_the_synchronized_reading() -> None:
    """Inside ``optim/`` the clock is only marked and booked (``clock.mark()``, ``clock.book(...)``); its
    synchronized reading (calling the clock: ``torch.cuda.synchronize`` on a GPU) is for the harnesses
    that time whole steps (``train/``, ``benchmarks/``)."""
    import ast

    import sources

    src = Path(__file__).resolve().parents[1] / "src" / "lioncub" / "optim"
    calls = []
    for path in sorted(src.glob("*.py")):
        every = sources.nodes(path)  # parsed once per pytest process (test_layers reads the same trees)
        clock = [n for n in every if isinstance(n, ast.ClassDef) and n.name == "PhaseClock"]
        inside = {id(n) for c in clock for n in ast.walk(c)}  # the reading itself
        for node in every:
            if isinstance(node, ast.Call) and id(node) not in inside:
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name == "clock" or (name == "synchronize" and "cuda" in ast.unparse(f)):
                    calls.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not calls, calls
