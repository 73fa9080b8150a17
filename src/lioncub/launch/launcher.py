"""Run N ranks of a program like ``torchrun --standalone``, optionally each behind its own shaped link.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT) plus ``GLOO_SOCKET_IFNAME`` and ``LIONCUB_*``
variables. Output is streamed line by line with a ``[rK]`` prefix. The first rank to fail decides the
result; the others are stopped (SIGTERM, then SIGKILL after a grace period). SIGINT/SIGTERM/SIGHUP sent to
the launcher are forwarded to every rank. Every wait is bounded by the job timeout and the grace period.

Security: the rendezvous (rank 0's TCPStore) and gloo listen only on loopback without a link, or on the
private bridge of the launch's network namespaces with one, which have no route to any other network.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

from lioncub._validate import is_int, is_number
from lioncub.launch.netns import (
    MAX_RANKS,
    EmulatedNetwork,
    IfCounters,
    LinkSpec,
    NetnsError,
    check_privileges,
    cleanup,
    new_launch_id,
)
from lioncub.units import format_rate

DEFAULT_LINK_PORT = 29500  # rank 0's namespace is fresh, so a fixed port is always free there
TIMEOUT_RC = 124  # like coreutils timeout
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def build_command(cmd: Sequence[str]) -> list[str]:
    """The argv each rank runs: ``-m mod ...`` and ``script.py ...`` get the current interpreter prepended."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command to launch: put it after `--`, e.g. `lioncub launch --nproc 2 -- x.py`")
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return [sys.executable, *cmd]
    return cmd


def rank_env(
    rank: int,
    world_size: int,
    *,
    master_addr: str,
    master_port: int,
    ifname: str,
    launch_id: str,
    link_bps: float | None = None,
    restart_count: int = 0,
    max_restarts: int = 0,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one rank: ``base`` (default ``os.environ``), the launch variables, ``extra``.

    OMP_NUM_THREADS=1 and PYTHONUNBUFFERED=1 are set unless ``base`` or ``extra`` already has them.
    """
    env = dict(os.environ if base is None else base)
    extra = dict(extra or {})
    for name, default in (("OMP_NUM_THREADS", "1"), ("PYTHONUNBUFFERED", "1")):
        if name not in env and name not in extra:
            env[name] = default
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        GLOO_SOCKET_IFNAME=ifname,
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        LIONCUB_RESTART_COUNT=str(restart_count),
        LIONCUB_LAUNCH_ID=launch_id,
    )
    if link_bps is None:
        env.pop("LIONCUB_LINK_BPS", None)
    else:
        env["LIONCUB_LINK_BPS"] = f"{link_bps:.0f}"
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchConfig:
    """What to run and how: ``cmd`` on ``nproc`` ranks, each behind a ``link_rate_bps`` link if given."""

    cmd: list[str]
    nproc: int = 1
    link_rate_bps: float | None = None  # None: plain loopback, no namespaces
    mtu: int = 1500
    burst_bytes: int | None = None  # tbf bucket; None: 2 ms at the rate, at least 16 KiB
    timeout_s: float | None = 3600.0  # whole job, restarts included; None: unbounded
    master_port: int | None = None  # None: 29500 under a link, a free loopback port otherwise
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    grace_s: float = 5.0  # between SIGTERM and SIGKILL
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.nproc) or self.nproc < 1:
            raise ValueError(f"--nproc must be an integer >= 1, got {self.nproc!r}")
        if not is_int(self.restarts) or self.restarts < 0:
            raise ValueError(f"--restarts must be an integer >= 0, got {self.restarts!r}")
        if self.timeout_s is not None and not is_number(self.timeout_s, gt=0):
            raise ValueError(
                f"--timeout must be a finite number of seconds > 0 (0 on the command line: no limit), "
                f"got {self.timeout_s!r}"
            )
        if self.master_port is not None and not (is_int(self.master_port) and 1 <= self.master_port <= 65535):
            raise ValueError(f"--port must be an integer within 1..65535, got {self.master_port!r}")
        if not is_number(self.grace_s, ge=0):
            raise ValueError(f"--grace must be a finite number of seconds >= 0, got {self.grace_s!r}")
        if not (is_int(self.mtu) and 68 <= self.mtu <= 65535):
            raise ValueError(f"--mtu must be an integer within 68..65535, got {self.mtu!r}")
        if self.link_rate_bps is not None and self.nproc > MAX_RANKS:
            raise ValueError(
                f"--nproc: an emulated network (--link) holds 1..{MAX_RANKS} ranks, got {self.nproc}"
            )
        build_command(self.cmd)
        self.link_spec()  # validates rate, MTU and burst

    def link_spec(self) -> LinkSpec | None:
        if self.link_rate_bps is None:
            return None
        return LinkSpec(self.link_rate_bps, mtu=self.mtu, burst_bytes=self.burst_bytes)


@dataclass(frozen=True)
class RankTraffic:
    """Bytes and frames a rank's interface sent (tx) and received (rx) in the run (L2, headers included)."""

    rank: int
    interface: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int


@dataclass
class LaunchResult:
    """Outcome of :func:`launch`. ``returncode``: 0, the failed rank's code, 128+signal, or 124 on timeout."""

    returncode: int
    rank_returncodes: list[int | None]  # of the last attempt; negative: killed by that signal
    failed_rank: int | None
    message: str
    wall_s: float
    restarts: int
    timed_out: bool
    interrupted_by: str | None  # name of the signal that stopped the launcher, if any
    launch_id: str
    traffic: list[RankTraffic] | None  # only under a link

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def describe_exit(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {code}"


def _exit_status(code: int) -> int:
    """Shell convention: a death by signal S becomes 128+S."""
    return 128 - code if code < 0 else code


# ------------------------------------------------------------------------------------------ processes


def _pdeathsig_setup() -> Callable[[], None] | None:
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


class _Output:
    """Thread-safe, line-prefixed writer of the ranks' output."""

    def __init__(self, out: TextIO, err: TextIO, nproc: int) -> None:
        self.out, self.err = out, err
        self.lock = threading.Lock()
        self.width = len(str(nproc - 1)) + 3

    def prefix(self, rank: int) -> str:
        return f"[r{rank}]".ljust(self.width) + " "

    def write(self, stream: TextIO, text: str) -> None:
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # closed or broken sink: drop the output, keep supervising
                pass

    def note(self, text: str) -> None:
        self.write(self.err, f"[lioncub] {text}\n")

    def pump(self, pipe: IO[bytes], stream: TextIO, prefix: str) -> None:
        with pipe:
            for raw in iter(lambda: pipe.readline(1 << 16), b""):
                line = raw.decode("utf-8", errors="replace")
                self.write(stream, prefix + (line if line.endswith("\n") else line + "\n"))


@dataclass
class _Attempt:
    returncode: int
    codes: list[int | None]
    failed_rank: int | None
    message: str
    timed_out: bool = False
    interrupted_by: str | None = None


class _Supervisor:
    """Runs one attempt: starts all ranks, waits for them, stops them all on the first failure."""

    def __init__(self, events: queue.SimpleQueue, output: _Output, grace_s: float) -> None:
        self.events = events
        self.output = output
        self.grace_s = grace_s
        self.token = object()  # tags this attempt's exit events; a restart ignores stale ones

    def run(
        self, argvs: list[list[str]], envs: list[dict[str, str]], cwd: str | None, deadline: float | None
    ) -> _Attempt:
        procs: list[subprocess.Popen[bytes]] = []
        codes: list[int | None] = [None] * len(argvs)
        threads: list[threading.Thread] = []
        preexec = _pdeathsig_setup()
        try:
            # spawn every rank before starting any thread: preexec_fn and threads do not mix well
            for argv, env in zip(argvs, envs, strict=True):
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        preexec_fn=preexec,
                    )
                )
        except OSError as exc:
            failed = len(procs)
            self._kill_groups(procs, signal.SIGKILL)
            for rank, proc in enumerate(procs):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    codes[rank] = proc.wait(5.0)
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            message = f"rank {failed} could not start `{argvs[failed][0]}`: {exc}"
            self.output.note(message)
            return _Attempt(127, codes, failed, message)
        for rank, proc in enumerate(procs):
            assert proc.stdout is not None and proc.stderr is not None
            prefix = self.output.prefix(rank)
            threads += [
                threading.Thread(
                    target=self.output.pump, args=(proc.stdout, self.output.out, prefix), daemon=True
                ),
                threading.Thread(
                    target=self.output.pump, args=(proc.stderr, self.output.err, prefix), daemon=True
                ),
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
    ) -> _Attempt:
        while any(c is None for c in codes):
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                running = [k for k, c in enumerate(codes) if c is None]
                message = f"timed out; ranks still running: {', '.join(map(str, running))}"
                self.output.note(message + "; stopping them")
                self._stop(procs, codes, signal.SIGTERM)
                return _Attempt(TIMEOUT_RC, codes, None, message, timed_out=True)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                continue
            if event[0] == "signal":
                name = signal.Signals(event[1]).name
                self.output.note(f"got {name}; forwarding it to the ranks")
                self._stop(procs, codes, signal.Signals(event[1]))
                return _Attempt(128 + event[1], codes, None, f"interrupted by {name}", interrupted_by=name)
            if event[1] is not self.token:
                continue
            _, _, rank, code = event
            codes[rank] = code
            if code != 0:
                message = describe_exit(rank, code)
                others = [k for k, c in enumerate(codes) if c is None]
                stopping = f"; stopping ranks {', '.join(map(str, others))}" if others else ""
                self.output.note(message + stopping)
                self._stop(procs, codes, signal.SIGTERM)
                return _Attempt(_exit_status(code), codes, rank, message)
        return _Attempt(0, codes, None, f"all {len(codes)} ranks exited with code 0")

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
                self.output.note(f"ranks {', '.join(map(str, left))} still running; sending SIGKILL")
                self._kill_groups(procs, phase_sig, left)
        for rank, proc in enumerate(procs):  # unkillable ranks (uninterruptible sleep)
            if codes[rank] is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    codes[rank] = proc.wait(0.1)


@contextlib.contextmanager
def _forward_signals(events: queue.SimpleQueue) -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into events while the launch runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum: int, frame: object) -> None:
        events.put(("signal", signum))

    try:
        for sig in _FORWARDED:
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ------------------------------------------------------------------------------------------- in a rank


@contextlib.contextmanager
def interrupt_as_one_line(where: Callable[[], str] = lambda: "") -> Iterator[None]:
    """In a rank: end the process with one line on stderr, ``interrupted (SIGINT) at step 7`` (``where()``
    gives the ``at step 7``), and exit status 128 + the signal when SIGINT, SIGTERM or SIGHUP arrives --
    what the launcher forwards on Ctrl-C and sends to stop the ranks -- instead of a ``KeyboardInterrupt``
    traceback (SIGINT) or a silent death (SIGTERM, SIGHUP).

    The signal is acted on at once even while the main thread waits inside a C++ call (a collective): a
    watcher thread reads it from :func:`signal.set_wakeup_fd`; the handler in the main thread does the
    same if it runs first. The process ends with ``os._exit``: files are already written atomically or
    record by record. Outside the main thread this does nothing; on exit everything is put back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    once = threading.Lock()
    wanted = {int(sig) for sig in _FORWARDED}

    def stop(signum: int) -> None:
        once.acquire()  # the first caller ends the process; another one waits here until it has
        try:
            detail = where()
        except Exception:  # the line must come out whatever state the rank is in
            detail = ""
        line = f"interrupted ({signal.Signals(signum).name}){' ' + detail if detail else ''}\n"
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(128 + signum)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # the write end was closed: the context is left
                return
            for signum in data:
                if signum in wanted:
                    stop(signum)

    previous = {sig: signal.signal(sig, lambda signum, frame: stop(signum)) for sig in _FORWARDED}
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="lioncub-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_fd)
        watcher.join(1.0)
        os.close(read_fd)


# ---------------------------------------------------------------------------------------------- launch


def launch(
    config: LaunchConfig,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    launch_id: str | None = None,
) -> LaunchResult:
    """Run ``config.cmd`` on ``config.nproc`` ranks and return how it went; never leaves a network behind.

    Ranks' stdout goes to ``out`` (default ``sys.stdout``), their stderr and the launcher's notes to ``err``.
    """
    started = time.monotonic()
    deadline = None if config.timeout_s is None else started + config.timeout_s
    output = _Output(out or sys.stdout, err or sys.stderr, config.nproc)
    launch_id = launch_id or new_launch_id()
    cmd = build_command(config.cmd)
    spec = config.link_spec()
    events: queue.SimpleQueue = queue.SimpleQueue()
    restarts = 0
    traffic: list[RankTraffic] | None = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forward_signals(events))
        net: EmulatedNetwork | None = None
        if spec is not None:
            check_privileges()
            try:
                report = cleanup()  # leftovers of launchers that died (kill -9)
                if report.launches:
                    output.note(f"removed leftovers of dead launches: {', '.join(report.launches)}")
            except NetnsError as exc:  # not ours to fail on; `lioncub launch --cleanup` retries
                output.note(f"could not remove leftovers of earlier launches: {exc}")
            net = stack.enter_context(EmulatedNetwork(config.nproc, spec, launch_id))
            master_addr, port = net.master_addr, config.master_port or DEFAULT_LINK_PORT
            output.note(
                f"launch {launch_id}: {config.nproc} ranks, each on a {format_rate(spec.rate_bps)} "
                f"link (MTU {spec.mtu}, burst {spec.burst} B), subnet {net.subnet}"
            )
        else:
            master_addr, port = "127.0.0.1", config.master_port or free_port()
        before = net.counters() if net is not None else None
        while True:
            extra = dict(config.env)
            store = None
            if net is None and config.master_port is None:  # the launcher hosts the store, on loopback only
                store, port = _loopback_store()
                extra.setdefault("TORCHELASTIC_USE_AGENT_STORE", "True")
            envs = [
                rank_env(
                    k,
                    config.nproc,
                    master_addr=master_addr,
                    master_port=port,
                    ifname=net.ranks[k].ifname if net else "lo",
                    launch_id=launch_id,
                    link_bps=config.link_rate_bps,
                    restart_count=restarts,
                    max_restarts=config.restarts,
                    extra=extra,
                )
                for k in range(config.nproc)
            ]
            argvs = [(net.exec_prefix(k) if net else []) + cmd for k in range(config.nproc)]
            attempt = _Supervisor(events, output, config.grace_s).run(argvs, envs, config.cwd, deadline)
            if store is not None:  # a restart gets a fresh store (and port): no key of this attempt survives
                store[1].close()
                del store
            final = attempt.returncode == 0 or attempt.timed_out or attempt.interrupted_by is not None
            if final or restarts >= config.restarts:
                break
            restarts += 1
            output.note(f"restarting all ranks ({restarts}/{config.restarts})")
        if net is not None and before is not None:
            traffic = [
                RankTraffic(k, net.ranks[k].ifname, d.tx_bytes, d.rx_bytes, d.tx_packets, d.rx_packets)
                for k, d in enumerate(_deltas(net.counters(), before))
            ]
    return LaunchResult(
        returncode=attempt.returncode,
        rank_returncodes=attempt.codes,
        failed_rank=attempt.failed_rank,
        message=attempt.message,
        wall_s=time.monotonic() - started,
        restarts=restarts,
        timed_out=attempt.timed_out,
        interrupted_by=attempt.interrupted_by,
        launch_id=launch_id,
        traffic=traffic,
    )


def _loopback_store() -> tuple[tuple[Any, socket.socket], int]:
    """A TCPStore server for the ranks' rendezvous, listening on 127.0.0.1 only (torch's own store, which
    rank 0 would otherwise host, listens on every interface). The ranks connect as clients, as under
    torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``). Returns (store, its listening socket) and the port."""
    import datetime

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        datetime.timedelta(seconds=300),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    return (store, sock), port  # the listening socket must stay open as long as the store lives


def _deltas(after: list[IfCounters], before: list[IfCounters]) -> list[IfCounters]:
    return [a - b for a, b in zip(after, before, strict=True)]


def format_traffic(traffic: Sequence[RankTraffic]) -> str:
    """A small table of per-rank interface bytes, for the end-of-run report."""
    lines = [
        f"{'rank':>4}  {'interface':<12} {'sent MB':>10} {'received MB':>12} "
        f"{'frames out':>11} {'frames in':>10}"
    ]
    for t in traffic:
        lines.append(
            f"{t.rank:>4}  {t.interface:<12} {t.tx_bytes / 1e6:>10.3f} {t.rx_bytes / 1e6:>12.3f} "
            f"{t.tx_packets:>11} {t.rx_packets:>10}"
        )
    tx, rx = sum(t.tx_bytes for t in traffic), sum(t.rx_bytes for t in traffic)
    lines.append(f"{'all':>4}  {'':<12} {tx / 1e6:>10.3f} {rx / 1e6:>12.3f}")
    return "\n".join(lines)
