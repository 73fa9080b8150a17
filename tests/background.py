"""Background jobs: long, self-contained parts of tests (a subprocess, a set of spawned ranks) that start
when collection ends and run while the suite goes on, in the order of the tests: one at a time, and a
second beside it while the machine leaves a core idle (the pump thread, :func:`_pump_while_idle`).

Most of the suite runs in the pytest process on one core; on a 2-core machine a job in the background
uses the other. A test marked ``@pytest.mark.background("KEY")`` names a job of its module's
``BACKGROUND`` dict (``KEY`` -> a factory returning a :class:`Job`, or ``None`` when there is nothing to
run, e.g. a missing optional dependency); the test calls :func:`result` to get what the job produced,
which waits for it (or starts it at once, if its turn has not come). What the test asserts on that result
is unchanged: only *when* the work happens moves. Deselected (or skipped) tests start nothing;
``--collect-only`` starts nothing; the jobs still running when the session ends are killed.

Kinds of job: :class:`Subprocess` (one command), :class:`Spawned` (a function on N spawned processes) and
:class:`Forked` (a script's ``main`` in one of them, its result a ``CompletedProcess`` as a command's).
With ``-v`` or ``--durations`` the session ends with each job's start, end and how long tests waited for
it (:func:`timings`).
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

import processes


class Job:
    """Work started by :meth:`start`, finished when :meth:`done`; :meth:`wait` returns its result."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="lioncub-bg-"))
        # the environment and working directory the job runs in: the process's when the job is made (at the
        # end of collection, or by the test that asks for it), never a later test's monkeypatched ones (the
        # pump thread starts jobs while tests run)
        self.env_at, self.cwd_at = dict(os.environ), os.getcwd()
        self.started_at: float | None = None
        self.ended_at: float | None = None  #: when it was first seen done (or its wait returned)
        self.waited_s = 0.0  #: how long tests blocked in :func:`result` for it

    def start(self) -> None:
        self.started_at = time.monotonic()

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        """Kill what is still running (idempotent)."""

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Subprocess(Job):
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)``, in
    the background: :meth:`wait` returns its ``CompletedProcess`` or raises ``TimeoutExpired`` (the process
    killed) once ``timeout`` seconds have passed since the start."""

    def __init__(self, cmd: Callable[[Path], list[str]], timeout: float, env: dict[str, str] | None = None):
        super().__init__()
        self.cmd, self.timeout, self.env = cmd(self.workdir), timeout, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        super().start()
        self.out = open(self.workdir / "stdout", "wb")  # noqa: SIM115 (closed by wait/stop)
        self.err = open(self.workdir / "stderr", "wb")  # noqa: SIM115
        env = self.env if self.env is not None else self.env_at
        # no preexec_fn: the pump thread starts jobs while other threads run, and a forked child running
        # Python before its exec can wait forever on a lock another thread held at the fork (seen once)
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=self.err, env=env, cwd=self.cwd_at)

    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait(self) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None and self.started_at is not None
        left = self.timeout - (time.monotonic() - self.started_at)
        try:
            self.proc.wait(max(0.0, left))
        except subprocess.TimeoutExpired:
            self.stop()
            raise subprocess.TimeoutExpired(self.cmd, self.timeout, *self._output()) from None
        self.out.close()
        self.err.close()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, *self._output())

    def _output(self) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            (self.workdir / name).read_text(errors="replace") for name in ("stdout", "stderr")
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self.out.close()
            self.err.close()


def _as_caller(env: dict[str, str], cwd: str, target: Callable[..., Any], *args: Any) -> None:
    """``target(*args)`` in the environment and working directory the test process had."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


class Spawned(Job):
    """``target(rank, world, workdir, *args)`` on ``world`` new processes (forks of the fork server of
    ``processes.context``, torch imported; in the environment and working directory of the test process
    when the job starts), in the background; done once the ranks ``wait_for`` (default: all) have exited.
    :meth:`wait` waits for those until ``timeout`` seconds after the start, then kills what still runs and
    returns every rank's exit code as it was (None: was still running)."""

    def __init__(
        self,
        target: Callable[..., Any],
        world: int,
        args: tuple = (),
        timeout: float = 90.0,
        wait_for: Iterable[int] | None = None,
    ) -> None:
        super().__init__()
        self.target, self.world, self.args, self.timeout = target, world, args, timeout
        self.wait_for = list(range(world) if wait_for is None else wait_for)
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def start(self) -> None:
        super().start()
        ctx = processes.context()  # forks of a process that has imported torch
        caller = (self.env_at, self.cwd_at, self.target)
        self.procs = [
            ctx.Process(
                target=_as_caller, args=(*caller, r, self.world, self.workdir, *self.args), daemon=True
            )
            for r in range(self.world)
        ]
        for proc in self.procs:
            proc.start()

    def done(self) -> bool:
        # the sentinels, not is_alive(): the pump thread asks too, and a forkserver process's poll reads
        # its exit code off the sentinel, so two threads polling at once could leave one with 255
        sentinels = [self.procs[r].sentinel for r in self.wait_for] if self.procs else []
        return bool(sentinels) and len(multiprocessing.connection.wait(sentinels, 0)) == len(sentinels)

    def wait(self) -> list[int | None]:
        assert self.started_at is not None
        for r in self.wait_for:
            self.procs[r].join(max(0.0, self.timeout - (time.monotonic() - self.started_at)))
        codes = [proc.exitcode for proc in self.procs]
        self.stop()
        return codes

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _script_main(rank: int, world: int, workdir: Path, main: Callable[[Path], int]) -> None:
    """:class:`Forked`'s process: ``main(workdir)`` with file descriptors 1 and 2 on ``workdir/stdout`` and
    ``workdir/stderr`` (an exception's traceback too), exiting with its status."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(workdir / name, "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.exit(main(workdir))


class Forked(Spawned):
    """A script's ``main(workdir) -> exit status`` in one fork of the fork server (torch imported: no
    interpreter to start, as :class:`Subprocess` would), in the environment of the test process updated
    with ``env``; :meth:`wait` returns a ``CompletedProcess`` as :class:`Subprocess`'s does (its output from
    file descriptors 1 and 2; ``returncode`` -9 where it was killed at ``timeout``)."""

    def __init__(self, main: Callable[[Path], int], timeout: float, env: dict[str, str] | None = None):
        super().__init__(_script_main, 1, (main,), timeout)
        self.main = main
        self.env_at = {**self.env_at, **(env or {})}

    def wait(self) -> subprocess.CompletedProcess[str]:  # type: ignore[override]  # a script's result
        (code,) = super().wait()
        out, err = (
            path.read_text(errors="replace") if path.exists() else ""
            for path in (self.workdir / "stdout", self.workdir / "stderr")
        )
        name = f"{self.main.__module__}.{self.main.__name__}"
        return subprocess.CompletedProcess([name], -9 if code is None else code, out, err)


_JOBS: dict[str, Job] = {}
_QUEUE: list[str] = []  # keys not started yet, in the order of the tests
_RUNNING: list[str] = []  # keys started by pump() and not yet seen done
_LOCK = threading.RLock()  # the queue and the running list: the pytest process's thread and the pump thread
_STOP = threading.Event()


def start_for(items: Iterable[pytest.Item]) -> None:
    """Queue the jobs of the selected tests (in their order) and start the first."""
    for item in items:
        if item.get_closest_marker("skip") is not None:  # e.g. a root test where namespaces cannot be built
            continue
        for mark in item.iter_markers("background"):
            for key in mark.args:
                if key in _JOBS:
                    continue
                job = item.module.BACKGROUND[key]()  # type: ignore[union-attr]
                if job is not None:
                    _JOBS[key] = job
                    _QUEUE.append(key)
    pump()
    if _QUEUE:
        threading.Thread(target=_pump_while_idle, name="background-pump", daemon=True).start()


def _ended(key: str) -> bool:
    job = _JOBS[key]
    if job.ended_at is None and job.done():
        job.ended_at = time.monotonic()
    return job.ended_at is not None


def pump(slots: int = 1) -> None:
    """Start queued jobs until ``slots`` are running (called after every test with one slot; with two
    while a test waits for a job, as the pytest process then leaves its core idle)."""
    with _LOCK:
        _RUNNING[:] = [key for key in _RUNNING if not _ended(key)]
        while _QUEUE and len(_RUNNING) < slots:
            key = _QUEUE.pop(0)
            _JOBS[key].start()
            _RUNNING.append(key)


#: seconds between two looks of the pump thread, and the idle CPU (in cores, averaged over IDLE_WINDOW
#: looks) above which it starts a second job beside the first
LOOK_S, IDLE_CORES, IDLE_WINDOW = 0.25, 0.75, 6


def _idle_ticks() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot (``/proc/stat``; (0, 0) where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user .. steal


def _pump_while_idle() -> None:
    """The pump thread: a job that ends mid-test is followed at once (not at the end of the test), and a
    second job starts beside the first while the machine has a core idle (a test waiting on a timeout, a
    shaped link or a child's start), until the queue is empty."""
    cores = os.cpu_count() or 1
    samples = [_idle_ticks()]
    while not _STOP.wait(LOOK_S):
        samples = [*samples, _idle_ticks()][-(IDLE_WINDOW + 1) :]
        (idle0, total0), (idle1, total1) = samples[0], samples[-1]
        idle_cores = cores * (idle1 - idle0) / (total1 - total0) if total1 > total0 else 0.0
        slots = 2 if len(samples) > IDLE_WINDOW and idle_cores > IDLE_CORES else 1
        with _LOCK:
            if not _QUEUE:
                return
            before = len(_RUNNING)
            pump(slots)
            if len(_RUNNING) > before:  # the new job's start is not idle time: look again from here
                samples = [_idle_ticks()]


def result(key: str, factory: Callable[[], Job | None]) -> Any:
    """What job ``key`` produced: waits for it, starting it now if it has not started (or was never
    queued: the test was run some other way)."""
    job = _JOBS.get(key)
    if job is None:
        job = factory()
        if job is None:
            raise RuntimeError(f"background job {key!r}: nothing to run")
        _JOBS[key] = job
    with _LOCK:
        if job.started_at is None:
            if key in _QUEUE:
                _QUEUE.remove(key)
            job.start()
            _RUNNING.append(key)
        pump(slots=2)
    t0 = time.monotonic()
    try:
        return job.wait()
    finally:
        job.waited_s += time.monotonic() - t0
        if job.ended_at is None:
            job.ended_at = time.monotonic()
        pump()


def workdir(key: str) -> Path:
    """The scratch directory of job ``key`` (removed when the session ends)."""
    return _JOBS[key].workdir


def timings() -> list[str]:
    """One line per job of this session: when it started and ended (seconds after the first start), and
    how long tests waited for it."""
    starts = [job.started_at for job in _JOBS.values() if job.started_at is not None]
    origin = min(starts, default=0.0)
    lines = []
    for key, job in sorted(_JOBS.items(), key=lambda kv: kv[1].started_at or float("inf")):
        if job.started_at is None:
            lines.append(f"{key}: never started")
            continue
        end = f"{job.ended_at - origin:6.1f}" if job.ended_at is not None else "   ..."
        lines.append(f"{key}: {job.started_at - origin:6.1f} -> {end} s, tests waited {job.waited_s:5.1f} s")
    return lines


def stop_all() -> None:
    _STOP.set()
    for job in _JOBS.values():
        job.cleanup()
    _JOBS.clear()
    _QUEUE.clear()


atexit.register(stop_all)
