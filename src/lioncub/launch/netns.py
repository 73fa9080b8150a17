"""An emulated network of shaped links: network namespaces, a bridge, veth pairs and ``tbf``.

Topology for launch id ``lcbXXXXX`` (``lcb`` + 5 hex digits) and N ranks, one host per rank::

    netns lcbXXXXX-r0   lo, veth lcbXXXXXv0  10.A.B.10/24  ──┐
    ...                                                       ├── netns lcbXXXXX-br: bridge lcbXXXXXb,
    netns lcbXXXXX-rK   lo, veth lcbXXXXXvK  10.A.B.(10+K)/24 ─┘   ports lcbXXXXXp0 .. lcbXXXXXpK

With ``nodes=True`` every host is a node of several ranks (``lioncub launch --nnodes M --nproc-per-node L``):
namespaces ``lcbXXXXX-n0 .. -nK`` at ``10.A.B.(100+K)`` (three digits, so sorting the addresses as text, as
torchrun's rendezvous does, sorts the nodes by K). The node's veth is its NIC; its ranks share its address
and reach each other over the namespace's ``lo``, which ``intra_link`` shapes (one ``tbf`` that every
intra-node byte crosses once: a bus shared by the node's ranks).

Every veth pair is created directly inside its two namespaces, so nothing (no interface, address or qdisc)
ever appears in the root namespace, and the namespaces have no route out: traffic cannot leave them. Each
end of every pair gets ``tbf rate R burst B latency 100ms`` as its root qdisc: the rank's upload is shaped on
its own veth, its download on its bridge port, like a switch port per rank. IPv6 is disabled (no neighbour
discovery chatter in the byte counters) and bridged frames skip netfilter. ``netem`` is absent from the
kernel this was built on, so there is no latency emulation; ``latency`` in tbf is only its queue length.
Measurements and limits: ``docs/network.md``.

Deleting a namespace destroys its veths, bridge and qdiscs, so teardown is: kill every process still in
the namespaces, delete them, verify they are gone. A state file per launch (``/run/lioncub/launch/<id>.json``,
override with ``$LIONCUB_STATE_DIR``) records the owning pid, so :func:`cleanup` can remove the leftovers of
launchers that died without tearing down (``kill -9``).

Needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN (for the netns mounts), and the ``ip`` and ``tc`` tools.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lioncub import env

PREFIX = "lcb"
_ID_RE = re.compile(rf"^{PREFIX}[0-9a-f]{{5}}$")
_NS_RE = re.compile(rf"^({PREFIX}[0-9a-f]{{5}})-(br|[rn]\d+)$")
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CMD_TIMEOUT_S = 10.0
MAX_RANKS = 240  # addresses 10.A.B.10 .. 10.A.B.249
MAX_NODES = 150  # addresses 10.A.B.100 .. 10.A.B.249
#: tbf bucket on a node's loopback: at least two of its 64 KiB frames (lo's MTU is 65536)
LOOPBACK_MIN_BURST = 1 << 17
_ETC_NETNS = Path("/etc/netns")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed, or the emulated network could not be built or removed."""


class PrivilegeError(NetnsError):
    """The process lacks a capability or a tool needed to create network namespaces."""


# Parsers of rates and sizes live in the torch-free bottom layer (the cost model reads rates too).


def default_burst(rate_bps: float) -> int:
    """tbf bucket size: 2 ms at the line rate (250 kB at 1 Gbit/s, 500 kB at 2 Gbit/s), at least 16 KiB.

    The bucket must hold a few timer ticks of traffic (notes: 64 KiB lost 3 % at 1 Gbit/s, 16 KiB is
    enough at 100 Mbit/s), but every byte of it is credit that an idle link sends at the veth's own speed:
    a fixed 256 KiB would let each phase of a collective skip 21 ms of a 100 Mbit/s link.
    """
    return max(16 * 1024, int(rate_bps / 8 * 0.002))


# -------------------------------------------------------------------------------------------- commands


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def run_cmd(args: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run one command, return its stdout; on failure raise :class:`NetnsError` naming command and stderr."""
    shown = " ".join(args)
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{shown}` did not finish within {timeout:g} s") from exc
    except OSError as exc:
        raise NetnsError(f"`{shown}` could not run: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"`{shown}` failed with exit code {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def _ip(*args: str, check: bool = True) -> str:
    return run_cmd([_tool("ip") or "ip", *args], check=check)


def _tc(*args: str) -> str:
    return run_cmd([_tool("tc") or "tc", *args])


def effective_capabilities() -> int:
    """The CapEff bit mask of this process (0 if /proc is unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> None:
    """Raise :class:`PrivilegeError` saying exactly what is missing to build an emulated network."""
    missing: list[str] = []
    caps = effective_capabilities()
    for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN)):
        if not caps >> bit & 1:
            missing.append(f"capability {name}")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if _tool(tool) is None:
            missing.append(f"the `{tool}` tool (package {package})")
    if missing:
        if os.geteuid() == 0:
            who, how = "root", "a container needs --cap-add NET_ADMIN --cap-add SYS_ADMIN (or --privileged)"
        else:
            who = f"uid {os.geteuid()}, not root"
            how = f"run it as root ({sudo_hint()}) or grant both capabilities"
        raise PrivilegeError(
            f"--link needs network namespaces, but this process ({who}) lacks: {', '.join(missing)}; {how}. "
            "Without --link the ranks run unshaped on loopback and need no privileges."
        )


def sudo_hint(argv0: str | None = None) -> str:
    """How to run this command as root: ``sudo /path/to/venv/bin/lioncub ...``. sudo resets ``PATH``, so a
    bare ``sudo lioncub`` finds no lioncub of a virtual environment (or another one): the hint names this
    program by its absolute path (``argv0``, default ``sys.argv[0]``), else by ``command -v lioncub``."""
    prog = sys.argv[0] if argv0 is None and sys.argv else argv0 or ""
    path = os.path.abspath(prog) if prog else ""
    if os.path.basename(path) == "lioncub" and os.access(path, os.X_OK):
        return f"sudo {shlex.quote(path)} ...; sudo resets PATH, so name your lioncub by its path"
    return 'sudo "$(command -v lioncub)" ...; sudo resets PATH, so name your lioncub by its path'


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def new_launch_id() -> str:
    """A fresh launch id: ``lcb`` + 5 hex digits, short enough for 15-char interface names."""
    return PREFIX + secrets.token_hex(3)[:5]


def subnet_for(launch_id: str) -> tuple[int, int]:
    """The (A, B) of the launch's 10.A.B.0/24 subnet, derived from its id so launches differ."""
    if not _ID_RE.match(launch_id):
        raise ValueError(f"not a launch id: {launch_id!r} (expected {PREFIX} + 5 hex digits)")
    h = int(launch_id[len(PREFIX) :], 16)
    return 100 + (h >> 8) % 100, h & 0xFF


# ------------------------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class LinkSpec:
    """Shaping of every rank's link: ``tbf rate`` in bits/s on both directions, MTU and bucket size."""

    rate_bps: float
    mtu: int = 1500
    burst_bytes: int | None = None  # None: default_burst(rate_bps)
    queue_ms: float = 100.0  # tbf ``latency``: the queue length, not a delay

    def __post_init__(self) -> None:
        if not (isinstance(self.rate_bps, (int, float)) and 0 < self.rate_bps < math.inf):
            raise ValueError(
                f"--link: the rate must be a positive, finite number of bits/s, got {self.rate_bps!r}"
            )
        if not (isinstance(self.mtu, int) and 68 <= self.mtu <= 65535):
            raise ValueError(f"--mtu: must be an integer within 68..65535, got {self.mtu!r}")
        if self.burst_bytes is not None and not isinstance(self.burst_bytes, int):
            raise ValueError(f"--burst: must be a whole number of bytes, got {self.burst_bytes!r}")
        if self.burst_bytes is not None and self.burst_bytes < self.mtu + 14:
            raise ValueError(
                f"--burst: {self.burst_bytes} bytes is smaller than one frame (MTU {self.mtu} + 14); "
                f"tbf would drop every full-size packet (give at least {self.mtu + 14} bytes)"
            )
        if not (isinstance(self.queue_ms, (int, float)) and 0 < self.queue_ms < math.inf):
            raise ValueError(
                f"queue_ms: must be a positive, finite number of milliseconds, got {self.queue_ms!r}"
            )

    @property
    def burst(self) -> int:
        return (
            self.burst_bytes
            if self.burst_bytes is not None
            else max(default_burst(self.rate_bps), self.mtu + 14)
        )


@dataclass(frozen=True)
class RankLink:
    """Where a host lives: its namespace, its veth (``GLOO_SOCKET_IFNAME``), address and bridge port.

    ``rank`` is the host's index: the rank, or the node when the network was built with ``nodes=True``.
    """

    rank: int
    netns: str
    ifname: str
    address: str
    bridge_port: str


@dataclass(frozen=True)
class IfCounters:
    """Kernel counters of one interface: bytes and frames handed to / received from the veth.

    Bytes include the Ethernet/IP/TCP headers once per frame, but with GSO/GRO a frame is a super-frame of up
    to 64 KB, so bulk transfers count about payload + 0.3 %, not the 4.6 % a 1500-byte MTU costs on the wire
    (tbf does charge that: it limits TCP payload to about 95.6 % of the rate at MTU 1500).
    """

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: IfCounters) -> IfCounters:
        return IfCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


@dataclass
class CleanupReport:
    """What :func:`cleanup` removed, and lioncub namespaces it left alone."""

    launches: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # no state file; removed only with all_launches
    live: list[str] = field(default_factory=list)  # launches whose launcher is still running


# ------------------------------------------------------------------------------------------- state files


def state_dir() -> Path:
    return Path(env.text("LIONCUB_STATE_DIR"))


def _pid_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of ``pid``, or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(state: dict[str, Any]) -> bool:
    pid = state.get("pid")
    if not isinstance(pid, int):
        return False
    start = _pid_start(pid)
    return start is not None and start == state.get("pid_start", start)


def _remove_namespaces(names: Iterable[str], grace_s: float = 3.0) -> None:
    """Kill the processes in ``names``, delete the namespaces and their /etc/netns dirs, and verify."""
    names = list(names)
    existing = set(list_netns())
    for ns in names:
        if ns not in existing:
            continue
        deadline = time.monotonic() + grace_s
        while True:
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split() if p.isdigit()]
            if not pids:
                break
            if time.monotonic() > deadline:
                raise NetnsError(f"processes {pids} in namespace {ns} survive SIGKILL; cannot remove it")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        _ip("netns", "del", ns)
    for ns in names:
        shutil.rmtree(_ETC_NETNS / ns, ignore_errors=True)
    left = sorted(set(names) & set(list_netns()))
    if left:
        raise NetnsError(f"namespaces still present after deletion: {', '.join(left)}")


def cleanup(all_launches: bool = False) -> CleanupReport:
    """Remove the leftovers of launches whose launcher process is dead (all lioncub launches with ``all``).

    Leftovers are found by state file and by name (``lcbXXXXX-br``, ``lcbXXXXX-rK``). Namespaces matching
    the pattern but without a state file are reported as orphans and removed only with ``all_launches``.
    """
    report = CleanupReport()
    directory = state_dir()
    states: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(directory.glob(f"{PREFIX}*.json")) if directory.is_dir() else []:
        try:
            states[path.stem] = (path, json.loads(path.read_text()))
        except (OSError, ValueError):
            states[path.stem] = (path, {})
    by_launch: dict[str, list[str]] = {}
    for ns in list_netns():
        match = _NS_RE.match(ns)
        if match:
            by_launch.setdefault(match.group(1), []).append(ns)
    for launch_id in sorted(set(states) | set(by_launch)):
        state_file, state = states.get(launch_id, (None, {}))
        if state_file is not None and _owner_alive(state) and not all_launches:
            report.live.append(launch_id)
            continue
        if state_file is None and not all_launches:
            report.orphans.extend(by_launch.get(launch_id, []))
            continue
        names = sorted(set(state.get("namespaces", [])) | set(by_launch.get(launch_id, [])))
        _remove_namespaces(names)
        if state_file is not None:
            state_file.unlink(missing_ok=True)
        report.launches.append(launch_id)
        report.namespaces.extend(names)
    return report


@dataclass
class Guard:
    """A process that outlives this one to remove the namespaces its state file lists, should this one die
    without removing them (:func:`start_guard`): ``fd`` is this process's end of the pipe it waits on."""

    proc: subprocess.Popen[bytes]
    fd: int

    def release(self) -> None:
        """The namespaces are removed (and the state file with them): let the guard go."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)


def start_guard(state_path: Path) -> Guard | None:
    """Start the guard of a launch's namespaces (:func:`guard`): a process in a session of its own (a
    signal to this process's group does not reach it), reading a pipe whose only writer is this process,
    so that it sees the pipe's end when this process ends however it ends -- ``kill -9`` included -- and
    then removes what the launch's state file ``state_path`` still lists. None (and nothing is guarded
    but by the next launch's :func:`cleanup`) if it cannot start."""
    read, write = os.pipe()  # not inherited by the processes this one starts (close-on-exec)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lioncub.launch.netns", "guard", str(state_path)],
            stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError:
        os.close(write)
        return None
    finally:
        os.close(read)
    return Guard(proc, write)


def guard(state_path: Path) -> None:
    """Wait until standard input ends (the launcher that started this process released it, or died), then
    remove the namespaces the launch's state file ``state_path`` still lists and the file (nothing if the
    launcher removed them itself)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the launcher's ^C or its terminal's end: not the guard's
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return
    names = [n for n in state.get("namespaces", []) if isinstance(n, str) and _NS_RE.match(n)]
    _remove_namespaces(names)
    state_path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- network


class EmulatedNetwork:
    """A private star network of ``hosts`` hosts; a context manager (``with EmulatedNetwork(4, spec):``).

    A host is one rank, or one node of several ranks with ``nodes=True``; ``link`` shapes each host's veth
    (both directions) and ``intra_link`` (nodes only) each node's loopback. ``link=None`` builds the same
    topology unshaped. ``service=True`` gives the bridge an address of the subnet (:attr:`service_address`)
    for a service of the launch (a torchft lighthouse) that every host reaches through its own link. Call
    :meth:`up` (or enter the context) to create it and :meth:`close` (or leave the
    context) to remove it; ``close`` is idempotent and also runs at exit.
    """

    def __init__(
        self,
        hosts: int,
        link: LinkSpec | None,
        launch_id: str | None = None,
        hosts_file: bool = True,
        *,
        nodes: bool = False,
        intra_link: LinkSpec | None = None,
        service: bool = False,
    ) -> None:
        limit, option = (MAX_NODES, "--nnodes") if nodes else (MAX_RANKS, "--nproc")
        if not 1 <= hosts <= limit:
            raise ValueError(f"{option}: an emulated network holds 1..{limit} {option[2:]}, got {hosts}")
        if intra_link is not None and not nodes:
            raise ValueError("--intra-link: shapes the link inside a node and applies only with --nnodes")
        self.nproc = hosts
        self.nodes = nodes
        self.link = link
        self.intra_link = intra_link
        self.launch_id = launch_id or new_launch_id()
        a, b = subnet_for(self.launch_id)
        self.subnet = f"10.{a}.{b}.0/24"
        self.bridge_netns = f"{self.launch_id}-br"
        self.bridge = f"{self.launch_id}b"
        kind, first = ("n", 100) if nodes else ("r", 10)
        self.ranks = [
            RankLink(
                k,
                f"{self.launch_id}-{kind}{k}",
                f"{self.launch_id}v{k}",
                f"10.{a}.{b}.{first + k}",
                f"{self.launch_id}p{k}",
            )
            for k in range(hosts)
        ]
        self.hosts_file = hosts_file
        #: the bridge's own address (``service=True``): a service every host reaches through its link
        self.service_address = f"10.{a}.{b}.1" if service else None
        self.state_path = state_dir() / f"{self.launch_id}.json"
        self._created = False
        self._closed = False
        self._guard: Guard | None = None

    @property
    def hosts(self) -> list[RankLink]:
        """The hosts: one per rank, or one per node (``nodes=True``)."""
        return self.ranks

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_netns, *(r.netns for r in self.ranks)]

    @property
    def master_addr(self) -> str:
        """Host 0's address: where the rendezvous (TCPStore) listens."""
        return self.ranks[0].address

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside host ``rank``'s namespace."""
        return [_tool("ip") or "ip", "netns", "exec", self.ranks[rank].netns]

    def exec_prefix_bridge(self) -> list[str]:
        """Command prefix that runs a program in the bridge's namespace (at :attr:`service_address`)."""
        return [_tool("ip") or "ip", "netns", "exec", self.bridge_netns]

    def __enter__(self) -> EmulatedNetwork:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_state(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "launch_id": self.launch_id,
            "pid": os.getpid(),
            "pid_start": _pid_start(os.getpid()),
            "namespaces": self.namespaces,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_path)

    def up(self) -> EmulatedNetwork:
        """Create namespaces, bridge, veths, addresses and shaping; on any failure remove what was made."""
        if self._created:
            return self
        check_privileges()
        clashes = set(self.namespaces) & set(list_netns())
        if clashes:
            raise NetnsError(f"namespaces already exist: {', '.join(sorted(clashes))}")
        self._write_state()  # before creating anything, so a crash mid-setup is still cleaned up
        self._created = True
        atexit.register(self.close)
        self._guard = start_guard(self.state_path)  # removes it all should this process die (kill -9)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _sysctls(self, ns: str) -> None:
        script = (
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; "
            'for f in /proc/sys/net/bridge/bridge-nf-call-*; do [ -w "$f" ] && echo 0 > "$f"; done; true'
        )
        _ip("netns", "exec", ns, "sh", "-c", script)

    def _build(self) -> None:
        br, bridge = self.bridge_netns, self.bridge
        mtu = str(self.link.mtu if self.link else 1500)
        _ip("netns", "add", br)
        self._sysctls(br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        for r in self.ranks:
            _ip("netns", "add", r.netns)
            self._sysctls(r.netns)
            _ip(
                "-n",
                r.netns,
                "link",
                "add",
                r.ifname,
                "mtu",
                mtu,
                "type",
                "veth",
                "peer",
                "name",
                r.bridge_port,
                "mtu",
                mtu,
                "netns",
                br,
            )
            _ip("-n", r.netns, "addr", "add", f"{r.address}/24", "dev", r.ifname)
            _ip("-n", r.netns, "link", "set", "lo", "up")
            _ip("-n", br, "link", "set", r.bridge_port, "master", bridge, "up")
            if self.link is not None:
                self._shape(r)
            if self.intra_link is not None:
                self._shape_loopback(r)
            _ip("-n", r.netns, "link", "set", r.ifname, "up")
        _ip("-n", br, "link", "set", bridge, "mtu", mtu, "up")
        if self.service_address is not None:
            _ip("-n", br, "addr", "add", f"{self.service_address}/24", "dev", bridge)
        if self.hosts_file:
            # c10d reverse-resolves peers, often as v4-mapped IPv6 (TCPStore listens on ::); without these
            # entries the lookup goes to DNS, which is unreachable here, and c10d warns "err=-3". The
            # machine's own name is the host's address (torchrun reports failures with socket.getfqdn())
            peers = "".join(f"{r.address} {r.netns}\n::ffff:{r.address} {r.netns}\n" for r in self.ranks)
            for r in self.ranks:
                (_ETC_NETNS / r.netns).mkdir(parents=True, exist_ok=True)
                own = f"{r.address} {socket.gethostname()}\n"
                (_ETC_NETNS / r.netns / "hosts").write_text("127.0.0.1 localhost\n" + own + peers)

    def _shape(self, r: RankLink) -> None:
        assert self.link is not None
        tbf = [
            "root",
            "tbf",
            "rate",
            f"{round(self.link.rate_bps)}bit",
            "burst",
            str(self.link.burst),
            "latency",
            f"{self.link.queue_ms:g}ms",
        ]
        _tc("-n", r.netns, "qdisc", "replace", "dev", r.ifname, *tbf)  # the rank's upload
        _tc("-n", self.bridge_netns, "qdisc", "replace", "dev", r.bridge_port, *tbf)  # its download

    def _shape_loopback(self, r: RankLink) -> None:
        """``tbf`` on the node's ``lo``: every byte between two of its ranks passes it once."""
        assert self.intra_link is not None
        burst = max(self.intra_link.burst, LOOPBACK_MIN_BURST)
        rate = f"{round(self.intra_link.rate_bps)}bit"
        latency = f"{self.intra_link.queue_ms:g}ms"
        _tc("-n", r.netns, "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", str(burst),
            "latency", latency)  # fmt: skip

    @staticmethod
    def _read_counters(netns: str, ifname: str) -> IfCounters:
        stats = json.loads(_ip("-n", netns, "-s", "-j", "link", "show", "dev", ifname))[0]["stats64"]
        return IfCounters(
            stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"], stats["rx"]["packets"]
        )

    def counters(self) -> list[IfCounters]:
        """Per-host counters of each host's own veth (a rank's link, or a node's NIC): tx = bytes the host
        sent to the others, rx = bytes it received from them."""
        return [self._read_counters(r.netns, r.ifname) for r in self.ranks]

    def loopback_counters(self) -> list[IfCounters]:
        """Per-host counters of ``lo``: a node's intra-node traffic (each byte once as tx, once as rx)."""
        return [self._read_counters(r.netns, "lo") for r in self.ranks]

    def close(self) -> None:
        """Kill what still runs in the namespaces, delete them, verify, and drop the state file."""
        if self._closed or not self._created:
            return
        self._closed = True
        atexit.unregister(self.close)
        _remove_namespaces(self.namespaces)
        self.state_path.unlink(missing_ok=True)
        if self._guard is not None:
            self._guard.release()  # nothing left to remove: the guard exits
            self._guard = None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        guard(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m lioncub.launch.netns guard STATE_FILE  (started by a launch under --link)")
