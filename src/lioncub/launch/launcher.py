"""Run N ranks of a program like ``torchrun --standalone``, optionally each behind its own shaped link, or
M emulated nodes of L ranks each, every node started by a real multi-node ``torchrun``.

With ``--nproc`` each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT) plus ``GLOO_SOCKET_IFNAME`` and
``LIONCUB_*`` variables; output is streamed line by line with a ``[rK]`` prefix. The first rank to fail
decides the result; the others are stopped (SIGTERM, then SIGKILL after a grace period).

With ``--nnodes M --nproc-per-node L`` (and a link) the launcher starts one
``python -m torch.distributed.run --nnodes M --nproc-per-node L --rdzv-backend c10d --rdzv-endpoint
<node 0>:PORT --no-python CMD`` inside each node's network namespace: rendezvous, the ranks' environment
(GROUP_RANK, LOCAL_RANK, ...) and ``--restarts`` are torchrun's own. Rank lines come through torchrun's
``--tee`` with a ``[rK]`` prefix, the agents' own lines with ``[nK]``; when a node fails, the rank torchrun
names as the root cause is reported and every other node is stopped.

SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to every rank (or torchrun agent). Every wait is
bounded by the job timeout and the grace period.

Security: the rendezvous (rank 0's TCPStore, or torchrun's c10d store on node 0) and gloo listen only on
loopback without a link, or inside the launch's network namespaces with one, which have no route to any
other network.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

from lioncub._validate import is_int, is_number
from lioncub.launch.netns import (
    MAX_NODES,
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

DEFAULT_LINK_PORT = 29500  # rank 0's (node 0's) namespace is fresh, so a fixed port is always free there
TIMEOUT_RC = 124  # like coreutils timeout
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: a line a rank wrote, already prefixed by torchrun (:data:`RANK_LINE_PREFIX`)
_RANK_LINE = re.compile(r"\[r\d+\] ")
#: seconds a torchrun agent gets, beyond its own --shutdown-timeout, to stop its ranks and report
AGENT_SHUTDOWN_MARGIN_S = 3.0


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
    if link_bps is None:  # an outer launch's network must not leak into an unshaped one
        for name in ("LIONCUB_LINK_BPS", "LIONCUB_NODE", "LIONCUB_NNODES", "LIONCUB_INTRA_LINK_BPS"):
            env.pop(name, None)
    else:  # one emulated node per rank: its own namespace and link
        env.update(LIONCUB_LINK_BPS=f"{link_bps:.0f}", LIONCUB_NODE=str(rank), LIONCUB_NNODES=str(world_size))
        env.pop("LIONCUB_INTRA_LINK_BPS", None)
    env.update(extra)
    return env


#: what torchrun sets for its workers: never inherited by an agent from an outer job
TORCHRUN_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "LIONCUB_RESTART_COUNT",
)  # fmt: skip
#: torchrun's prefix of every line a rank writes (``--tee``), as lioncub's own ``[rK]``
RANK_LINE_PREFIX = "[r${rank}] "


def node_env(
    node: int,
    nnodes: int,
    *,
    ifname: str,
    launch_id: str,
    link_bps: float,
    intra_link_bps: float | None = None,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of node ``node``'s torchrun agent, which its ranks inherit (torchrun adds RANK,
    LOCAL_RANK, GROUP_RANK, ...): ``base`` (default ``os.environ``) without any torchrun variable, gloo
    bound to the node's NIC, the ``LIONCUB_*`` description of the emulated network, then ``extra``."""
    env = dict(os.environ if base is None else base)
    extra = dict(extra or {})
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    for name, default in (("OMP_NUM_THREADS", "1"), ("PYTHONUNBUFFERED", "1")):
        if name not in env and name not in extra:
            env[name] = default
    env.update(
        GLOO_SOCKET_IFNAME=ifname,
        LIONCUB_LAUNCH_ID=launch_id,
        LIONCUB_NODE=str(node),
        LIONCUB_NNODES=str(nnodes),
        LIONCUB_LINK_BPS=f"{link_bps:.0f}",
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=RANK_LINE_PREFIX,
    )
    if intra_link_bps is None:
        env.pop("LIONCUB_INTRA_LINK_BPS", None)
    else:
        env["LIONCUB_INTRA_LINK_BPS"] = f"{intra_link_bps:.0f}"
    env.update(extra)
    return env


def torchrun_command(
    cmd: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    node: int,
    local_addr: str,
    restarts: int = 0,
    log_dir: str | None = None,
    shutdown_s: int = 5,
) -> list[str]:
    """The argv of one node's torchrun agent: a c10d rendezvous at ``endpoint`` (node 0 hosts its store),
    ``--no-python`` so that ``cmd`` (as :func:`build_command` made it) runs once per rank.

    ``--local-addr`` is the node's address: torchrun's rendezvous orders the nodes by it, so node ``k``
    becomes GROUP_RANK ``k`` (``--node-rank`` is ignored by the c10d backend). ``log_dir``: ``--tee 3``
    into it, each line a rank writes reaching the console with a ``[rK]`` prefix.
    """
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "--local-addr", local_addr,
        "--max-restarts", str(restarts), "--shutdown-timeout", str(shutdown_s),
    ]  # fmt: skip
    if log_dir is not None:
        argv += ["--tee", "3", "--log-dir", log_dir]
    return [*argv, "--no-python", *cmd]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchConfig:
    """What to run and how: ``cmd`` on ``nproc`` ranks, each behind a ``link_rate_bps`` link if given; or on
    ``nnodes`` emulated nodes of ``nproc_per_node`` ranks (``nproc`` becomes their product), each node
    behind one ``link_rate_bps`` NIC, its ranks linked by its loopback (shaped to ``intra_link_rate_bps``
    if given)."""

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
    nnodes: int | None = None  # None: one emulated node per rank (--nproc)
    nproc_per_node: int | None = None
    intra_link_rate_bps: float | None = None  # None: the node's loopback, unshaped

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
        self._check_nodes()
        if self.nnodes is None and self.link_rate_bps is not None and self.nproc > MAX_RANKS:
            raise ValueError(
                f"--nproc: an emulated network (--link) holds 1..{MAX_RANKS} ranks, got {self.nproc}"
            )
        build_command(self.cmd)
        self.link_spec()  # validates rate, MTU and burst

    def _check_nodes(self) -> None:
        """Validate --nnodes / --nproc-per-node / --intra-link and set ``nproc`` to the world size."""
        m, ell = self.nnodes, self.nproc_per_node
        if m is None:
            if ell is not None:
                raise ValueError(
                    f"--nproc-per-node {ell}: applies only with --nnodes M (L ranks on each of M emulated "
                    "nodes); for N ranks, each with its own link, use --nproc N"
                )
            if self.intra_link_rate_bps is not None:
                raise ValueError("--intra-link: shapes the link inside a node and applies only with --nnodes")
            return
        if not (is_int(m) and 1 <= m <= MAX_NODES):
            raise ValueError(f"--nnodes must be an integer within 1..{MAX_NODES}, got {m!r}")
        if ell is None:
            raise ValueError(f"--nnodes {m}: needs --nproc-per-node L, the ranks on each node")
        if not (is_int(ell) and ell >= 1):
            raise ValueError(f"--nproc-per-node must be an integer >= 1, got {ell!r}")
        if self.nproc not in (1, m * ell):
            raise ValueError(
                f"--nproc {self.nproc} with --nnodes: the world size is --nnodes × --nproc-per-node = "
                f"{m * ell}; give either --nproc N (one node per rank) or --nnodes M --nproc-per-node L"
            )
        if self.link_rate_bps is None:
            raise ValueError(
                f"--nnodes {m}: emulates nodes behind shaped NICs and needs --link RATE (root); without a "
                "link, use --nproc N (ranks on loopback)"
            )
        intra = self.intra_link_rate_bps
        if intra is not None and not is_number(intra, gt=0):
            raise ValueError(
                f"--intra-link: the rate must be a positive, finite number of bits/s, got {intra!r}"
            )
        self.nproc = m * ell

    def link_spec(self) -> LinkSpec | None:
        if self.link_rate_bps is None:
            return None
        return LinkSpec(self.link_rate_bps, mtu=self.mtu, burst_bytes=self.burst_bytes)

    def intra_link_spec(self) -> LinkSpec | None:
        """The shaping of each node's loopback (its MTU is lo's own; the bucket holds its 64 KiB frames)."""
        if self.intra_link_rate_bps is None:
            return None
        return LinkSpec(self.intra_link_rate_bps)


@dataclass(frozen=True)
class RankTraffic:
    """Bytes and frames a rank's interface sent (tx) and received (rx) in the run (L2, headers included)."""

    rank: int
    interface: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int


@dataclass(frozen=True)
class NodeTraffic:
    """Bytes and frames of one emulated node in the run: its NIC (tx: sent to other nodes, rx: received
    from them) and its loopback (``local_bytes``: traffic between its own ranks, each byte once)."""

    node: int
    interface: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    local_bytes: int
    local_packets: int


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
    traffic: list[RankTraffic] | None  # only under a link, one per rank (--nproc)
    node_traffic: list[NodeTraffic] | None = None  # only with --nnodes, one per node
    failed_node: int | None = None  # with --nnodes: the node whose torchrun failed first
    node_returncodes: list[int | None] | None = None  # with --nnodes: each torchrun's exit code

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
    """Thread-safe, line-prefixed writer of the ranks' (or the torchrun agents') output."""

    def __init__(self, out: TextIO, err: TextIO, nproc: int, unit: str = "r") -> None:
        self.out, self.err = out, err
        self.lock = threading.Lock()
        self.unit = unit
        self.width = len(str(nproc - 1)) + 2 + len(unit)

    def prefix(self, rank: int) -> str:
        return f"[{self.unit}{rank}]".ljust(self.width) + " "

    def write(self, stream: TextIO, text: str) -> None:
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # closed or broken sink: drop the output, keep supervising
                pass

    def note(self, text: str) -> None:
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


class _TorchrunReport:
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
class _Attempt:
    returncode: int
    codes: list[int | None]  # of the processes: ranks, or torchrun agents (nodes)
    failed_rank: int | None
    message: str
    timed_out: bool = False
    interrupted_by: str | None = None
    failed_index: int | None = None  # the process that failed first (a rank, or a node)
    failed_local_rank: int | None = None


class _Supervisor:
    """Runs one attempt: starts all processes (ranks, or one torchrun agent per node when ``reports`` is
    given), waits for them, stops them all on the first failure."""

    def __init__(
        self,
        events: queue.SimpleQueue,
        output: _Output,
        grace_s: float,
        reports: list[_TorchrunReport] | None = None,
    ) -> None:
        self.events = events
        self.output = output
        self.grace_s = grace_s
        self.token = object()  # tags this attempt's exit events; a restart ignores stale ones
        self.reports = reports
        self.unit = "rank" if reports is None else "node"
        self.pumps: dict[int, list[threading.Thread]] = {}

    def _units(self, indices: Sequence[int]) -> str:
        return f"{self.unit}{'s' if len(indices) != 1 else ''} {', '.join(map(str, indices))}"

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
            message = f"{self.unit} {failed} could not start `{argvs[failed][0]}`: {exc}"
            self.output.note(message)
            rank = failed if self.reports is None else None
            return _Attempt(127, codes, rank, message, failed_index=failed)
        passthrough = None if self.reports is None else _RANK_LINE
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
    ) -> _Attempt:
        while any(c is None for c in codes):
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                running = [k for k, c in enumerate(codes) if c is None]
                message = f"timed out; {self.unit}s still running: {', '.join(map(str, running))}"
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
                attempt = self._failure(rank, code, codes)
                others = [k for k, c in enumerate(codes) if c is None]
                stopping = f"; stopping {self._units(others)}" if others else ""
                self.output.note(attempt.message + stopping)
                self._stop(procs, codes, signal.SIGTERM)
                return attempt
        return _Attempt(0, codes, None, f"all {len(codes)} {self.unit}s exited with code 0")

    def _failure(self, index: int, code: int, codes: list[int | None]) -> _Attempt:
        """The attempt's outcome when process ``index`` exited with ``code`` != 0: for a torchrun agent, the
        rank its report names as the root cause (read to its end first, at most 3 s)."""
        if self.reports is None:
            return _Attempt(_exit_status(code), codes, index, describe_exit(index, code), failed_index=index)
        end = time.monotonic() + 3.0
        for thread in self.pumps.get(index, []):
            thread.join(max(0.0, end - time.monotonic()))
        report = self.reports[index]
        if report.rank is None or report.exitcode is None or report.exitcode == 0:
            message = (
                f"node {index}: torchrun exited with code {code} without naming a failed rank "
                "(its output above says why)"
            )
            return _Attempt(_exit_status(code), codes, None, message, failed_index=index)
        where = f" (node {index}, local rank {report.local_rank})"
        message = describe_exit(report.rank, report.exitcode).replace(
            f"rank {report.rank}", f"rank {report.rank}{where}", 1
        )
        return _Attempt(
            _exit_status(report.exitcode),
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
    launch_id = launch_id or new_launch_id()
    if config.nnodes is not None:
        return _launch_nodes(config, out or sys.stdout, err or sys.stderr, launch_id, started, deadline)
    output = _Output(out or sys.stdout, err or sys.stderr, config.nproc)
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
            _remove_leftovers(output)
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


def _remove_leftovers(output: _Output) -> None:
    """Remove what launchers that died (``kill -9``) left behind; a failure is noted, not raised."""
    try:
        report = cleanup()
        if report.launches:
            output.note(f"removed leftovers of dead launches: {', '.join(report.launches)}")
    except NetnsError as exc:  # not ours to fail on; `lioncub launch --cleanup` retries
        output.note(f"could not remove leftovers of earlier launches: {exc}")


def node_commands(
    config: LaunchConfig, net: EmulatedNetwork, port: int, log_dir: str | None
) -> tuple[list[list[str]], list[dict[str, str]]]:
    """Each node's argv (its torchrun agent inside its namespace) and environment."""
    assert config.nnodes is not None and config.nproc_per_node is not None and config.link_rate_bps
    cmd = build_command(config.cmd)
    shutdown_s = max(1, math.ceil(config.grace_s))
    argvs, envs = [], []
    for k, host in enumerate(net.hosts):
        agent = torchrun_command(
            cmd,
            nnodes=config.nnodes,
            nproc_per_node=config.nproc_per_node,
            endpoint=f"{net.master_addr}:{port}",
            run_id=net.launch_id,
            node=k,
            local_addr=host.address,
            restarts=config.restarts,
            log_dir=None if log_dir is None else os.path.join(log_dir, f"n{k}"),
            shutdown_s=shutdown_s,
        )
        argvs.append(net.exec_prefix(k) + agent)
        envs.append(
            node_env(
                k,
                config.nnodes,
                ifname=host.ifname,
                launch_id=net.launch_id,
                link_bps=config.link_rate_bps,
                intra_link_bps=config.intra_link_rate_bps,
                extra=config.env,
            )
        )
    return argvs, envs


def _attempts(log_dir: str) -> int:
    """How many times torchrun started the ranks: its ``--log-dir`` holds one ``attempt_K`` per start."""
    seen = [
        int(name.removeprefix("attempt_"))
        for _, dirs, _ in os.walk(log_dir)
        for name in dirs
        if re.fullmatch(r"attempt_\d+", name)
    ]
    return max(seen, default=0) + 1 if seen else 0


def _launch_nodes(
    config: LaunchConfig, out: TextIO, err: TextIO, launch_id: str, started: float, deadline: float | None
) -> LaunchResult:
    """:func:`launch` for ``config.nnodes`` emulated nodes, one torchrun agent in each."""
    assert config.nnodes is not None and config.nproc_per_node is not None
    m, ell = config.nnodes, config.nproc_per_node
    spec, intra = config.link_spec(), config.intra_link_spec()
    assert spec is not None
    output = _Output(out, err, m, unit="n")
    events: queue.SimpleQueue = queue.SimpleQueue()
    reports = [_TorchrunReport() for _ in range(m)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forward_signals(events))
        check_privileges()
        _remove_leftovers(output)
        net = stack.enter_context(EmulatedNetwork(m, spec, launch_id, nodes=True, intra_link=intra))
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"lioncub-{launch_id}-"))
        port = config.master_port or DEFAULT_LINK_PORT
        inside = f"{format_rate(intra.rate_bps)} loopback" if intra is not None else "unshaped loopback"
        output.note(
            f"launch {launch_id}: {m} nodes × {ell} ranks, each node behind a "
            f"{format_rate(spec.rate_bps)} NIC "
            f"(MTU {spec.mtu}, burst {spec.burst} B), ranks of a node on its {inside}, subnet {net.subnet}; "
            f"torchrun rendezvous at {net.master_addr}:{port}"
        )
        argvs, envs = node_commands(config, net, port, log_dir)
        before, before_lo = net.counters(), net.loopback_counters()
        grace = config.grace_s + AGENT_SHUTDOWN_MARGIN_S  # the agents stop their own ranks first
        attempt = _Supervisor(events, output, grace, reports).run(argvs, envs, config.cwd, deadline)
        nic, lo = _deltas(net.counters(), before), _deltas(net.loopback_counters(), before_lo)
        traffic = [
            NodeTraffic(k, net.hosts[k].ifname, d.tx_bytes, d.rx_bytes, d.tx_packets, d.rx_packets,
                        loop.tx_bytes, loop.tx_packets)
            for k, (d, loop) in enumerate(zip(nic, lo, strict=True))
        ]  # fmt: skip
        restarts = max(0, _attempts(log_dir) - 1)
    rank_codes: list[int | None] = [None] * (m * ell)
    for k, code in enumerate(attempt.codes):
        if code == 0:
            rank_codes[k * ell : (k + 1) * ell] = [0] * ell
    if attempt.failed_rank is not None and reports[attempt.failed_index or 0].exitcode is not None:
        rank_codes[attempt.failed_rank] = reports[attempt.failed_index or 0].exitcode
    return LaunchResult(
        returncode=attempt.returncode,
        rank_returncodes=rank_codes,
        failed_rank=attempt.failed_rank,
        message=attempt.message,
        wall_s=time.monotonic() - started,
        restarts=restarts,
        timed_out=attempt.timed_out,
        interrupted_by=attempt.interrupted_by,
        launch_id=launch_id,
        traffic=None,
        node_traffic=traffic,
        failed_node=attempt.failed_index if attempt.returncode not in (0, TIMEOUT_RC) else None,
        node_returncodes=attempt.codes,
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


def format_node_traffic(traffic: Sequence[NodeTraffic]) -> str:
    """A small table of per-node NIC and loopback bytes, for the end-of-run report."""
    lines = [
        f"{'node':>4}  {'NIC':<12} {'sent MB':>10} {'received MB':>12} {'frames out':>11} {'frames in':>10} "
        f"{'intra-node MB':>14}"
    ]
    for t in traffic:
        lines.append(
            f"{t.node:>4}  {t.interface:<12} {t.tx_bytes / 1e6:>10.3f} {t.rx_bytes / 1e6:>12.3f} "
            f"{t.tx_packets:>11} {t.rx_packets:>10} {t.local_bytes / 1e6:>14.3f}"
        )
    tx, rx = sum(t.tx_bytes for t in traffic), sum(t.rx_bytes for t in traffic)
    local = sum(t.local_bytes for t in traffic)
    lines.append(
        f"{'all':>4}  {'':<12} {tx / 1e6:>10.3f} {rx / 1e6:>12.3f} {'':>11} {'':>10} {local / 1e6:>14.3f}"
    )
    return "\n".join(lines)


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
