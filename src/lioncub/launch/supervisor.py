"""Supervision of one attempt of a launch: start every process (a rank, or one node's torchrun agent), copy
its output line by line with a ``[rK]`` / ``[nK]`` prefix, wait, and on the first failure, timeout or
forwarded signal stop them all (SIGTERM, then SIGKILL after the grace period). Every wait is bounded.

The ranks get SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``); each runs in its own process group so
that its strays die with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, TextIO

from lioncub.launch.result import TIMEOUT_RC, describe_exit

__all__ = [
    "FORWARDED_SIGNALS",
    "Attempt",
    "Output",
    "Start",
    "Supervisor",
    "TorchrunReport",
    "exit_status",
    "forward_signals",
    "pdeathsig_setup",
    "popen",
]

#: the signals the launcher forwards to every rank (and a rank ends on with one line)
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: a line a rank wrote, already prefixed by torchrun (:data:`lioncub.launch.environment.RANK_LINE_PREFIX`)
RANK_LINE = re.compile(r"\[r\d+\] ")


def exit_status(code: int) -> int:
    """Shell convention: a death by signal S becomes 128+S."""
    return 128 - code if code < 0 else code


def pdeathsig_setup() -> Callable[[], None] | None:
    """preexec_fn that makes a rank get SIGTERM if the launcher dies (``kill -9``); Linux only."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return setup


class Output:
    """Thread-safe, line-prefixed writer of the ranks' (or the torchrun agents') output."""

    def __init__(self, out: TextIO, err: TextIO, nproc: int, unit: str = "r") -> None:
        self.out, self.err = out, err
        self.lock = threading.Lock()
        self.unit = unit
        self.width = len(str(nproc - 1)) + 2 + len(unit)

    def prefix(self, rank: int) -> str:
        """``[r3] `` (or ``[n3] ``), padded to the widest rank number."""
        return f"[{self.unit}{rank}]".ljust(self.width) + " "

    def write(self, stream: TextIO, text: str) -> None:
        """Write and flush ``text`` whole; a closed or broken ``stream`` drops it."""
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # closed or broken sink: drop the output, keep supervising
                pass

    def note(self, text: str) -> None:
        """A line of the launcher's own, ``[lioncub] text``, on the error stream."""
        self.write(self.err, f"[lioncub] {text}\n")

    def pump(
        self,
        pipe: IO[bytes],
        stream: TextIO,
        prefix: str,
        hook: Callable[[str], None] | None = None,
        passthrough: re.Pattern[str] | None = None,
    ) -> None:
        """Copy ``pipe`` to ``stream`` line by line with ``prefix`` (not on lines ``passthrough`` matches:
        a rank's line that torchrun already prefixed); ``hook`` sees every line."""
        with pipe:
            for raw in iter(lambda: pipe.readline(1 << 16), b""):
                line = raw.decode("utf-8", errors="replace")
                if hook is not None:
                    hook(line)
                head = "" if passthrough is not None and passthrough.match(line) else prefix
                self.write(stream, head + (line if line.endswith("\n") else line + "\n"))


class TorchrunReport:
    """Reads a torchrun agent's stderr for the root cause of a failure (torchrun's ``ChildFailedError``
    report: ``Root Cause (first observed failure):`` then ``rank : R (local_rank: K)`` and
    ``exitcode : C``)."""

    _RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
    _CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")

    def __init__(self) -> None:
        self.in_root = False
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.exitcode: int | None = None

    def feed(self, line: str) -> None:
        """Read one line of the agent's stderr."""
        if "Root Cause (first observed failure)" in line:
            self.in_root, self.rank, self.local_rank, self.exitcode = True, None, None, None
            return
        if not self.in_root:
            return
        if (m := self._RANK.match(line)) is not None and self.rank is None:
            self.rank, self.local_rank = int(m.group(1)), int(m.group(2))
        elif (m := self._CODE.match(line)) is not None and self.exitcode is None:
            self.exitcode = int(m.group(1))
        elif line.startswith("====="):
            self.in_root = False


@dataclass
class Attempt:
    """How one attempt ended: the exit code to report, every process's code and the first failure."""

    returncode: int
    codes: list[int | None]  # of the processes: ranks, or torchrun agents (nodes)
    failed_rank: int | None
    message: str
    timed_out: bool = False
    interrupted_by: str | None = None
    failed_index: int | None = None  # the process that failed first (a rank, or a node)
    failed_local_rank: int | None = None


#: how a process starts: ``start(argv, env, cwd)`` -> a started process with ``pid``, ``stdout`` and
#: ``stderr`` pipes, ``poll()`` and ``wait(timeout)`` (a :class:`subprocess.Popen`, or a rank forked from a
#: preloaded interpreter, :class:`lioncub.launch.preload.ForkedRank`, whose ``reason`` says why it ended
#: when that was not its own doing)
Start = Callable[[list[str], dict[str, str], str | None], Any]


def popen(argv: list[str], env: dict[str, str], cwd: str | None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a rank: its own session, stdin on /dev/null, stdout and stderr piped, SIGTERM if
    the launcher (the thread that calls this) dies."""
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=pdeathsig_setup(),
    )


class Supervisor:
    """Runs one attempt: starts all processes (ranks, or one torchrun agent per node when ``reports`` is
    given) with ``start`` (default :func:`popen`; or one per process), waits for them, stops them all on
    the first failure."""

    def __init__(
        self,
        events: queue.SimpleQueue[tuple[Any, ...]],
        output: Output,
        grace_s: float,
        reports: list[TorchrunReport] | None = None,
        start: Start | Sequence[Start] = popen,
    ) -> None:
        self.events = events
        self.output = output
        self.grace_s = grace_s
        self.start = start
        self.token = object()  # tags this attempt's exit events; a restart ignores stale ones
        self.reports = reports
        self.unit = "rank" if reports is None else "node"
        self.pumps: dict[int, list[threading.Thread]] = {}

    def _units(self, indices: Sequence[int]) -> str:
        return f"{self.unit}{'s' if len(indices) != 1 else ''} {', '.join(map(str, indices))}"

    def run(
        self, argvs: list[list[str]], envs: list[dict[str, str]], cwd: str | None, deadline: float | None
    ) -> Attempt:
        """Start ``argvs`` (with ``envs``, in ``cwd``), supervise them until all exit, one fails, the
        ``deadline`` passes or a signal arrives, and return how the attempt ended."""
        procs: list[subprocess.Popen[bytes]] = []
        codes: list[int | None] = [None] * len(argvs)
        threads: list[threading.Thread] = []
        try:
            # spawn every rank before starting any thread: preexec_fn and threads do not mix well
            for k, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
                start = self.start[k] if isinstance(self.start, Sequence) else self.start
                procs.append(start(argv, env, cwd))
        except OSError as exc:
            failed = len(procs)
            self._kill_groups(procs, signal.SIGKILL)
            for rank, proc in enumerate(procs):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    codes[rank] = proc.wait(5.0)
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            message = f"{self.unit} {failed} could not start `{argvs[failed][0]}`: {exc}"
            self.output.note(message)
            failed_rank = failed if self.reports is None else None
            return Attempt(127, codes, failed_rank, message, failed_index=failed)
        passthrough = None if self.reports is None else RANK_LINE
        for rank, proc in enumerate(procs):
            assert proc.stdout is not None and proc.stderr is not None
            prefix = self.output.prefix(rank)
            hook = None if self.reports is None else self.reports[rank].feed
            self.pumps[rank] = [
                threading.Thread(
                    target=self.output.pump,
                    args=(proc.stdout, self.output.out, prefix, None, passthrough),
                    daemon=True,
                ),
                threading.Thread(
                    target=self.output.pump,
                    args=(proc.stderr, self.output.err, prefix, hook, passthrough),
                    daemon=True,
                ),
            ]
            threads += [
                *self.pumps[rank],
                threading.Thread(target=self._wait, args=(rank, proc), daemon=True),
            ]
        for t in threads:
            t.start()
        try:
            return self._supervise(procs, codes, deadline)
        finally:
            self._kill_groups(procs, signal.SIGKILL, [k for k, c in enumerate(codes) if c is None])
            end = time.monotonic() + 2.0
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        # strays the rank left in its process group, right away so the group id has no time to be reused
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.events.put(("exit", self.token, rank, code))

    def _supervise(
        self, procs: list[subprocess.Popen[bytes]], codes: list[int | None], deadline: float | None
    ) -> Attempt:
        while any(c is None for c in codes):
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                running = [k for k, c in enumerate(codes) if c is None]
                message = f"timed out; {self.unit}s still running: {', '.join(map(str, running))}"
                self.output.note(message + "; stopping them")
                self._stop(procs, codes, signal.SIGTERM)
                return Attempt(TIMEOUT_RC, codes, None, message, timed_out=True)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                continue
            if event[0] == "signal":
                name = signal.Signals(event[1]).name
                self.output.note(f"got {name}; forwarding it to the ranks")
                self._stop(procs, codes, signal.Signals(event[1]))
                return Attempt(128 + event[1], codes, None, f"interrupted by {name}", interrupted_by=name)
            if event[1] is not self.token:
                continue
            _, _, rank, code = event
            codes[rank] = code
            if code != 0:
                attempt = self._failure(rank, code, codes, getattr(procs[rank], "reason", None))
                others = [k for k, c in enumerate(codes) if c is None]
                stopping = f"; stopping {self._units(others)}" if others else ""
                self.output.note(attempt.message + stopping)
                self._stop(procs, codes, signal.SIGTERM)
                return attempt
        return Attempt(0, codes, None, f"all {len(codes)} {self.unit}s exited with code 0")

    def _failure(self, index: int, code: int, codes: list[int | None], reason: str | None = None) -> Attempt:
        """The attempt's outcome when process ``index`` exited with ``code`` != 0 (``reason``: why, when not
        its own doing): for a torchrun agent, the rank its report names as the root cause (read to its end
        first, at most 3 s)."""
        if self.reports is None:
            message = f"{reason}, taking rank {index} with it" if reason else describe_exit(index, code)
            return Attempt(exit_status(code), codes, index, message, failed_index=index)
        end = time.monotonic() + 3.0
        for thread in self.pumps.get(index, []):
            thread.join(max(0.0, end - time.monotonic()))
        report = self.reports[index]
        if report.rank is None or report.exitcode is None or report.exitcode == 0:
            message = (
                f"node {index}: torchrun exited with code {code} without naming a failed rank "
                "(its output above says why)"
            )
            return Attempt(exit_status(code), codes, None, message, failed_index=index)
        where = f" (node {index}, local rank {report.local_rank})"
        message = describe_exit(report.rank, report.exitcode).replace(
            f"rank {report.rank}", f"rank {report.rank}{where}", 1
        )
        return Attempt(
            exit_status(report.exitcode),
            codes,
            report.rank,
            message,
            failed_index=index,
            failed_local_rank=report.local_rank,
        )

    def _kill_groups(
        self, procs: list[subprocess.Popen[bytes]], sig: signal.Signals, only: list[int] | None = None
    ) -> None:
        for rank, proc in enumerate(procs):
            if only is None or rank in only:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def _stop(
        self, procs: list[subprocess.Popen[bytes]], codes: list[int | None], sig: signal.Signals
    ) -> None:
        """Send ``sig`` to the running ranks, SIGKILL whatever is left after the grace period, reap all."""
        running = [k for k, c in enumerate(codes) if c is None and k < len(procs)]
        self._kill_groups(procs, sig, running)
        for phase_sig, wait_s in ((signal.SIGKILL, self.grace_s), (None, 5.0)):
            end = time.monotonic() + wait_s
            while any(codes[k] is None for k in running) and time.monotonic() < end:
                try:
                    event = self.events.get(timeout=max(0.01, end - time.monotonic()))
                except queue.Empty:
                    break
                if event[0] == "exit":
                    if event[1] is self.token:
                        codes[event[2]] = event[3]
                else:  # a second signal while stopping: no more grace
                    end = time.monotonic()
            left = [k for k in running if codes[k] is None]
            if left and phase_sig is not None:
                self.output.note(f"{self._units(left)} still running; sending SIGKILL")
                self._kill_groups(procs, phase_sig, left)
        for rank, proc in enumerate(procs):  # unkillable ranks (uninterruptible sleep)
            if codes[rank] is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    codes[rank] = proc.wait(0.1)


@contextlib.contextmanager
def forward_signals(events: queue.SimpleQueue[tuple[Any, ...]]) -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into events while the launch runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum: int, frame: object) -> None:
        events.put(("signal", signum))

    try:
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
