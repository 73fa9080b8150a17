"""Launch replica groups that come and go: every process one replica group of a fault-tolerant job
(``lioncub train --fault-tolerant``), a torchft lighthouse for them, and the failure schedule.

Each of ``config.nproc`` processes runs ``config.cmd`` as one replica group (on loopback, or inside its own
network namespace behind its own ``--link``); with ``config.nnodes`` M, each of M groups is
``config.nproc_per_node`` L processes in one emulated node (behind the node's NIC), a ``torch.distributed``
world of their own (``RANK`` 0..L-1, ``WORLD_SIZE`` L, ``MASTER_ADDR``/``MASTER_PORT`` on the node). Every
process has ``LIONCUB_GROUP`` (its group's index), ``LIONCUB_GROUP_LIFE`` (0 for the first start, k for its
k-th rejoin), ``LIONCUB_LIGHTHOUSE`` (the lighthouse's URL) and ``LIONCUB_GROUP_HOST`` (the address the
other groups reach it at). Unless one is given, the launcher starts
a lighthouse for the job: on loopback, or in the emulated network's bridge namespace, where every group
reaches it through its own link.

The failure schedule (:class:`Fault`, ``--kill G@STEP``, ``--rejoin G@STEP``) is carried out by the
launcher: it SIGKILLs group G's processes once that group has finished step STEP (``progress(G)``), and it
starts group G again once the job (the furthest group) has finished step STEP. Unlike a plain launch,
the death of one group does not stop the others: they go on without it at their next quorum. A group one
of whose processes exits with a non-zero code the schedule did not cause is stopped whole (its other
processes SIGKILLed) and fails the launch when the others have finished (its code, and the message naming
it). The lighthouse is watched (:class:`_LighthouseWatch`): its loss stops every group and fails the launch
naming it, at once for the one the launcher started, within :data:`LIGHTHOUSE_GRACE_S` for one given by
URL. Signals, the timeout and the grace period are as in :mod:`lioncub.launch.launcher`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from lioncub.launch.config import LaunchConfig
from lioncub.launch.environment import build_command, free_port, rank_env
from lioncub.launch.netns import EmulatedNetwork, NetnsError, check_privileges, cleanup, new_launch_id
from lioncub.launch.preload import ForkedRank, PreloadError, Zygote, gpu_refusal, lease
from lioncub.launch.result import TIMEOUT_RC, LaunchResult, RankTraffic, describe_exit
from lioncub.launch.supervisor import Output, forward_signals, popen
from lioncub.units import format_rate

__all__ = [
    "FAULT_KINDS",
    "LIGHTHOUSE_PORT",
    "Fault",
    "Resumed",
    "launch_groups",
    "parse_faults",
    "probe_lighthouse",
    "schedule_after",
    "serve_lighthouse",
]

#: what the schedule can do to a group: SIGKILL it, start it again
FAULT_KINDS = ("kill", "rejoin")
#: the lighthouse's port in the emulated network's bridge namespace (fresh: always free)
LIGHTHOUSE_PORT = 29510
#: the lighthouse the launcher starts: a group whose heartbeats stop for this long is out of the quorum
HEARTBEAT_TIMEOUT_MS = 2000
#: ... and a quorum waits this long for a live group that has not joined it yet
JOIN_TIMEOUT_MS = 60000
#: a lighthouse given by URL is probed this often (seconds) while the groups run ...
PROBE_S = 1.0
#: ... and is lost (the job stops, naming it) when no probe succeeded for this long (seconds)
LIGHTHOUSE_GRACE_S = 5.0
_SPEC = re.compile(r"^\s*(\d+)\s*@\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Fault:
    """One event of the failure schedule: at ``step`` (the job's optimizer step, 1-based), ``kind``
    (``"kill"`` or ``"rejoin"``) replica group ``group``."""

    step: int
    kind: str
    group: int

    @property
    def spec(self) -> str:
        """As the command line gives it: ``--kill 1@20``."""
        return f"--{self.kind} {self.group}@{self.step}"


def parse_faults(
    kill: Sequence[str], rejoin: Sequence[str], groups: int, steps: int, h: int | None = None
) -> list[Fault]:
    """The schedule of ``--kill G@STEP`` and ``--rejoin G@STEP`` (lists of ``"G@STEP"``) for ``groups``
    groups and ``steps`` steps with windows of ``h`` steps (``--local-steps``; ``None``: 1, a quorum every
    step), sorted by step; ``ValueError`` naming the option: a group that does not exist, a step outside
    ``[1, steps)``, a group's events that do not alternate kill, rejoin, kill, ... (a rejoin before its
    kill, two kills), a schedule that leaves no group alive, and what cannot happen with windows: a group
    rejoins at the next window start (after a multiple of ``h``), where a quorum heals it from a live
    peer, so a rejoin after the last window start (``steps − h``) or where no other group is alive at
    that start to heal it is refused (else the group would start after the others finished and train
    alone), and so is a kill of a rejoined group before the window it joins."""
    h = 1 if h is None else int(h)
    faults = _read_specs(kill, rejoin, groups, steps)
    alive = set(range(groups))
    dead_since: dict[int, int] = {}
    joins_after: dict[int, int] = {}  # a rejoined group's first window starts after this step
    last_start = steps - h  # the last window starts after this step: its quorum is the last
    for f in faults:
        if f.kind == "kill":
            if f.group not in alive:
                raise ValueError(
                    f"{f.spec}: group {f.group} is not running then (killed at step {dead_since[f.group]}); "
                    f"give --rejoin {f.group}@STEP before killing it again"
                )
            joined = joins_after.get(f.group)
            if joined is not None and f.step <= joined:
                raise ValueError(
                    f"{f.spec}: group {f.group} rejoins in the window after step {joined} (--local-steps "
                    f"{h}: the next window start after its --rejoin); the step must be within "
                    f"{joined + 1}..{steps - 1} (--steps {steps})"
                )
            alive.discard(f.group)
            dead_since[f.group] = f.step
            if not alive:
                raise ValueError(f"{f.spec}: no group would be left to train after step {f.step}")
        else:
            if f.group in alive:
                raise ValueError(
                    f"{f.spec}: group {f.group} is running then; a group rejoins after a --kill at an "
                    "earlier step"
                )
            if dead_since[f.group] == f.step:
                raise ValueError(f"{f.spec}: the same step as its --kill; rejoin at a later step")
            start = -(-f.step // h) * h  # the window start it joins at
            if start > last_start:
                first = dead_since[f.group] + 1
                allowed = (
                    f"the step must be within {first}..{last_start}"
                    if first <= last_start
                    else f"no window start is left after its --kill {f.group}@{dead_since[f.group]}"
                )
                raise ValueError(
                    f"{f.spec}: {allowed} (--steps {steps} --local-steps {h}: a group rejoins at a window "
                    f"start, where a quorum of live groups heals it, and the last window starts after step "
                    f"{last_start}; later it would start after the others finished and train alone)"
                )
            alive.add(f.group)
            joins_after[f.group] = start
    for f in faults:  # a live peer at the window start each rejoin joins at
        start = joins_after.get(f.group, -1) if f.kind == "rejoin" else -1
        if f.kind == "rejoin" and not _healers(faults, groups, start, h) - {f.group}:
            raise ValueError(
                f"{f.spec}: no other group is alive at the window start after step {start} to heal group "
                f"{f.group} (--local-steps {h}: it joins there); rejoin it at a step where another group runs"
            )
    return faults


@dataclass(frozen=True)
class Resumed:
    """The schedule seen from a resume after a step (:func:`schedule_after`): the life each group starts
    as next (``lives``: its ``--rejoin`` events up to the step, one more for a group dead then), the groups
    dead then (``absent``: killed and not started again; they stay out until their next rejoin), and the
    events after the step (``pending``), which the resumed job carries out as the whole run would have."""

    lives: tuple[int, ...]
    absent: frozenset[int]
    pending: tuple[Fault, ...]


def schedule_after(faults: Sequence[Fault], groups: int, step: int) -> Resumed:
    """The schedule ``faults`` (:func:`parse_faults`) of ``groups`` groups seen from a resume after
    ``step`` (:class:`Resumed`); ``step`` 0: the whole schedule, every group starting as its life 0."""
    rejoins, absent = [0] * groups, set()
    for f in faults:
        if f.step <= step and f.kind == "kill":
            absent.add(f.group)
        elif f.step <= step:
            rejoins[f.group] += 1
            absent.discard(f.group)
    lives = tuple(n + (g in absent) for g, n in enumerate(rejoins))
    return Resumed(lives, frozenset(absent), tuple(f for f in faults if f.step > step))


def _read_specs(kill: Sequence[str], rejoin: Sequence[str], groups: int, steps: int) -> list[Fault]:
    """The events of ``--kill`` and ``--rejoin``, each checked alone (its form, group and step), sorted."""
    faults = []
    for kind, specs in (("kill", kill), ("rejoin", rejoin)):
        for text in specs:
            match = _SPEC.match(str(text))
            if match is None:
                raise ValueError(f"--{kind} {text!r}: give GROUP@STEP, e.g. --{kind} 1@20")
            group, step = int(match[1]), int(match[2])
            if group >= groups:
                raise ValueError(
                    f"--{kind} {group}@{step}: there is no group {group} (groups 0..{groups - 1}: one per "
                    "rank, or with --nnodes one per node)"
                )
            if not 1 <= step < steps:
                raise ValueError(
                    f"--{kind} {group}@{step}: the step must be within 1..{steps - 1} (--steps {steps}; a "
                    "fault at or after the last step changes nothing)"
                )
            faults.append(Fault(step, kind, group))
    return sorted(faults)


def _healers(faults: list[Fault], groups: int, start: int, h: int) -> set[int]:
    """The groups alive at the quorum after step ``start`` that do not join there themselves (a rejoin
    in the window before it)."""
    alive = set(range(groups))
    for f in faults:
        if f.step <= start:
            (alive.discard if f.kind == "kill" else alive.add)(f.group)
    return alive - {f.group for f in faults if f.kind == "rejoin" and start - h < f.step <= start}


def serve_lighthouse(bind: str, heartbeat_timeout_ms: int, join_timeout_ms: int) -> None:
    """Run a torchft lighthouse at ``bind`` (``host:port``) until SIGTERM/SIGINT, printing ``ready URL``
    once it listens (``python -m lioncub.launch.groups lighthouse HOST:PORT``)."""
    LighthouseServer = _lighthouse_class()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    server = LighthouseServer(
        bind=bind,
        min_replicas=1,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    host, port = bind.rsplit(":", 1)
    print(f"ready http://{host}:{port}", flush=True)
    stop.wait()
    server.shutdown()


def _lighthouse_class() -> Any:
    """torchft's ``LighthouseServer``, from its compiled extension alone where it can be found: importing
    the ``torchft`` package imports torch (seconds of a core), which a lighthouse does not need."""
    import importlib.util

    spec = importlib.util.find_spec("torchft")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        for name in sorted(os.listdir(where)):
            if name.startswith("_torchft.") and name.endswith(".so"):
                ext = importlib.util.spec_from_file_location("torchft._torchft", os.path.join(where, name))
                if ext is not None and ext.loader is not None:
                    module = importlib.util.module_from_spec(ext)
                    ext.loader.exec_module(module)
                    return module.LighthouseServer
    from torchft.coordination import LighthouseServer

    return LighthouseServer


def _start_lighthouse(
    net: EmulatedNetwork | None, output: Output, timeout_s: float = 30.0
) -> tuple[Any, str]:
    """Start :func:`serve_lighthouse` (in the bridge namespace under a link); its process and URL."""
    host = "127.0.0.1" if net is None else net.service_address
    port = free_port() if net is None else LIGHTHOUSE_PORT
    prefix = [] if net is None else net.exec_prefix_bridge()
    argv = [
        *prefix, sys.executable, "-m", "lioncub.launch.groups", "lighthouse", f"{host}:{port}",
        str(HEARTBEAT_TIMEOUT_MS), str(JOIN_TIMEOUT_MS),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    proc = popen(argv, env, None)
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            lines.put(raw.decode(errors="replace"))
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=output.pump, args=(proc.stderr, output.err, "[lighthouse] "), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        line = ""
    if not line.startswith("ready "):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(
            f"the torchft lighthouse did not start within {timeout_s:g} s (exit code {proc.poll()}); "
            "its lines above say why"
        )
    return proc, line.split()[1]


@dataclass
class _Life:
    """One start of a group: its processes (one per rank of the group), its number (0: first start),
    whether the schedule killed it, and once every process ended the group's exit code."""

    procs: list[Any]
    life: int
    killed: bool = False
    code: int | None = None

    def poll(self) -> int | None:
        """The group's code once its processes ended: the first non-zero of theirs, else 0. A process that
        fails ends the group: the others are SIGKILLed (strays of their process groups too)."""
        codes = [p.poll() for p in self.procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is None and None in codes:
            return None
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
        return 0 if failed is None else failed


def launch_groups(
    config: LaunchConfig,
    faults: Sequence[Fault],
    progress: Callable[[int], int],
    *,
    lighthouse: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    ended: Callable[[int, int, int], None] | None = None,
    resumed: Resumed | None = None,
) -> LaunchResult:
    """Run ``config.cmd`` as replica groups (module docstring) with the schedule
    ``faults``; ``progress(g)`` is the last step group ``g`` finished (its log), read by the schedule.
    ``resumed``: a resumed job's (:func:`schedule_after`): group g starts as its life ``resumed.lives[g]``,
    the groups ``resumed.absent`` only at a rejoin of ``faults``; default: every group at once, life 0.
    ``lighthouse``: the URL of a running lighthouse (None: the launcher starts one); either is watched, and
    its loss stops the job within :data:`LIGHTHOUSE_GRACE_S` seconds, naming it. ``ended(g, life, code)``
    is told when a life of a group has ended (its exit code; negative: the signal), whatever the cause.
    Returns how it went: ``rank_returncodes`` are each group's last life's; ``traffic`` each group's
    interface under a link."""
    out, err = out or sys.stdout, err or sys.stderr
    started = time.monotonic()
    deadline = None if config.timeout_s is None else started + config.timeout_s
    launch_id = new_launch_id()
    output = Output(out, err, config.nnodes or config.nproc, unit="g")
    spec = config.link_spec()
    events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    with contextlib.ExitStack() as stack:
        stack.enter_context(forward_signals(events))
        net: EmulatedNetwork | None = None
        if spec is not None:
            check_privileges()
            _remove_leftovers(output)
            nodes, groups = config.nnodes is not None, config.nnodes or config.nproc
            net = stack.enter_context(
                EmulatedNetwork(
                    groups, spec, launch_id, nodes=nodes, intra_link=config.intra_link_spec(), service=True
                )
            )
            inside = f" of {config.nproc_per_node} ranks" if nodes else ""
            rate = format_rate(spec.rate_bps)
            output.note(
                f"launch {launch_id}: {groups} replica groups{inside}, each on a {rate} link, "
                f"subnet {net.subnet}"
            )
        proc = None
        if lighthouse is None:
            proc, lighthouse = _start_lighthouse(net, output)
            stack.callback(_end, proc)
            output.note(f"torchft lighthouse at {lighthouse}")
        watch = stack.enter_context(_LighthouseWatch(lighthouse, proc))
        before = net.counters() if net is not None else None
        run = _GroupRun(config, net, lighthouse, launch_id, events, output, deadline)
        run.watch, run.ended = watch, ended
        if resumed is not None:
            run.first, run.absent = list(resumed.lives), set(resumed.absent)
        run.zygote = _zygote(config, stack, output) if config.preload else None
        returncode, failed, message, timed_out, interrupted = run.supervise(sorted(faults), progress)
        traffic = None
        if net is not None and before is not None:
            traffic = [
                RankTraffic(k, net.ranks[k].ifname, a.tx_bytes - b.tx_bytes, a.rx_bytes - b.rx_bytes,
                            a.tx_packets - b.tx_packets, a.rx_packets - b.rx_packets)
                for k, (a, b) in enumerate(zip(net.counters(), before, strict=True))
            ]  # fmt: skip
    return LaunchResult(
        returncode=returncode,
        rank_returncodes=[lives[-1].code if lives else None for lives in run.lives],  # per group
        failed_rank=failed,
        message=message,
        wall_s=time.monotonic() - started,
        restarts=0,
        timed_out=timed_out,
        interrupted_by=interrupted,
        launch_id=launch_id,
        traffic=traffic,
    )


def _zygote(config: LaunchConfig, stack: contextlib.ExitStack, output: Output) -> Zygote | None:
    """The preloaded interpreter the groups are forked from (held by ``stack``), or None where it cannot be
    (a GPU the ranks may use, a failed start: said so)."""
    why = gpu_refusal(config.preload_device)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIONCUB_GROUP")}
        if why is None:
            return stack.enter_context(lease(env, config.cwd or os.getcwd(), config.preload))
    except PreloadError as exc:
        why = str(exc)
    output.note(f"starting every group as a fresh interpreter: {why}")
    return None


def _end(proc: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5.0)


def _remove_leftovers(output: Output) -> None:
    """Remove the network namespaces that launchers which died (``kill -9``) left behind, saying so; a
    failure is noted, not raised."""
    try:
        report = cleanup()
    except NetnsError as exc:  # not ours to fail on; `lioncub launch --cleanup` retries
        output.note(f"could not remove leftovers of earlier launches: {exc}")
        return
    if report.launches:
        output.note(
            f"removed the leftovers of dead launches {', '.join(report.launches)}: network namespaces "
            f"{', '.join(report.namespaces)}"
        )


class _LighthouseWatch:
    """Whether the job's lighthouse lives (:meth:`lost`): the process the launcher started (its exit, at
    once), or for a lighthouse given by URL its ``/status`` page, read every :data:`PROBE_S` seconds by a
    thread, lost once no read succeeded for :data:`LIGHTHOUSE_GRACE_S` seconds."""

    def __init__(self, url: str, proc: Any | None) -> None:
        self.url, self.proc = url, proc
        self.last_seen = time.monotonic()
        self.error = ""
        self.stop = threading.Event()
        self.thread = None if proc is not None else threading.Thread(target=self._probe, daemon=True)

    def __enter__(self) -> _LighthouseWatch:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    def _probe(self) -> None:
        while not self.stop.wait(PROBE_S):
            why = probe_lighthouse(self.url, timeout_s=PROBE_S)
            if why is None:
                self.last_seen = time.monotonic()
            else:
                self.error = why

    def lost(self) -> str | None:
        """None while the lighthouse lives, else what became of it."""
        if self.proc is not None:
            code = self.proc.poll()
            return None if code is None else f"the torchft lighthouse at {self.url} {_how_it_ended(code)}"
        silent = time.monotonic() - self.last_seen
        if silent < LIGHTHOUSE_GRACE_S:
            return None
        return f"the torchft lighthouse at {self.url} has not answered for {silent:.0f} s ({self.error})"


def _how_it_ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def probe_lighthouse(url: str, timeout_s: float = 3.0) -> str | None:
    """None if a torchft lighthouse answers at ``url`` (its ``/status`` page within ``timeout_s``), else
    why not (the error, in a few words)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout_s) as page:
            page.read(1)
    except urllib.error.HTTPError as exc:  # it answers: a lighthouse without that page is still there
        return None if exc.code < 500 else f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
    return None


class _GroupRun:
    """The groups' processes of one launch and their supervision."""

    def __init__(
        self,
        config: LaunchConfig,
        net: EmulatedNetwork | None,
        lighthouse: str,
        launch_id: str,
        events: queue.SimpleQueue[tuple[Any, ...]],
        output: Output,
        deadline: float | None,
    ) -> None:
        self.config, self.net, self.lighthouse, self.launch_id = config, net, lighthouse, launch_id
        self.events, self.output, self.deadline = events, output, deadline
        self.cmd = build_command(config.cmd)
        self.groups, self.size = config.nnodes or config.nproc, config.nproc_per_node or 1
        self.lives: list[list[_Life]] = [[] for _ in range(self.groups)]
        #: the life each group starts as first, and the groups not started until a rejoin (a resumed job)
        self.first: list[int] = [0] * self.groups
        self.absent: set[int] = set()
        self.zygote: Zygote | None = None  # with config.preload: the groups are its forks
        self.watch: _LighthouseWatch | None = None  # the job's lighthouse: its loss stops the job
        self.ended: Callable[[int, int, int], None] | None = None  # told (group, life, code) of every end

    def start(self, group: int) -> None:
        """Start (again) group ``group``: its ``size`` processes (module docstring)."""
        life = self.first[group] + len(self.lives[group])
        net, size = self.net, self.size
        host = "127.0.0.1" if net is None else net.ranks[group].address
        port = free_port() if net is None else 29500
        extra = {
            **self.config.env,
            "LIONCUB_GROUP": str(group),
            "LIONCUB_GROUP_LIFE": str(life),
            "LIONCUB_LIGHTHOUSE": self.lighthouse,
            "LIONCUB_GROUP_HOST": host,
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's Rust side: a line per quorum
        }
        if net is not None and size > 1:  # the emulated node is the group's, not the rank's
            extra.update(LIONCUB_NODE=str(group), LIONCUB_NNODES=str(self.groups))
        procs = []
        for rank in range(size):
            env = rank_env(
                rank if size > 1 else group,  # a group of one process: its rank in the job
                size if size > 1 else self.groups,
                master_addr=host,
                master_port=port,
                ifname="lo" if net is None else net.ranks[group].ifname,
                launch_id=self.launch_id,
                link_bps=self.config.link_rate_bps,
                extra=extra,
            )
            procs.append(self._spawn(group, env))
        self.lives[group].append(_Life(procs, life))

    def _spawn(self, group: int, env: dict[str, str]) -> Any:
        """One process of group ``group`` (a zygote's fork, or a fresh interpreter), its output pumped."""
        net = self.net
        proc: ForkedRank | subprocess.Popen[bytes] | None = None
        argv = (net.exec_prefix(group) if net is not None else []) + self.cmd
        if self.zygote is not None:
            try:
                netns = net.ranks[group].netns if net is not None else None
                proc = self.zygote.fork(self.cmd, env, self.config.cwd, netns=netns)
            except PreloadError as exc:
                self.output.note(f"starting group {group} as a fresh interpreter: {exc}")
        if proc is None:
            proc = popen(argv, env, self.config.cwd)
        prefix = self.output.prefix(group)
        for pipe, stream in ((proc.stdout, self.output.out), (proc.stderr, self.output.err)):
            threading.Thread(target=self.output.pump, args=(pipe, stream, prefix), daemon=True).start()
        return proc

    def running(self) -> list[int]:
        return [g for g, lives in enumerate(self.lives) if lives and lives[-1].code is None]

    def kill(self, group: int, sig: signal.Signals = signal.SIGKILL) -> None:
        for proc in self.lives[group][-1].procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def supervise(
        self, pending: list[Fault], progress: Callable[[int], int]
    ) -> tuple[int, int | None, str, bool, str | None]:
        """Start every group, carry out the schedule, wait for the groups; (returncode, failed group,
        message, timed out, the signal that interrupted it)."""
        for g in range(self.groups):
            if g not in self.absent:
                self.start(g)
        failures: list[tuple[int, int]] = []
        try:
            while self.running():
                if self.deadline is not None and time.monotonic() > self.deadline:
                    running = self.running()
                    message = f"timed out; groups still running: {', '.join(map(str, running))}"
                    self.output.note(message + "; stopping them")
                    self._stop()
                    return TIMEOUT_RC, None, message, True, None
                with contextlib.suppress(queue.Empty):
                    event = self.events.get(timeout=0.05)
                    name = signal.Signals(event[1]).name
                    self.output.note(f"got {name}; forwarding it to the groups")
                    self._stop(signal.Signals(event[1]))
                    return 128 + event[1], None, f"interrupted by {name}", False, name
                lost = self.watch.lost() if self.watch is not None else None
                if lost is not None:
                    message = f"{lost}; the groups cannot form a quorum without it"
                    self.output.note(message + ": stopping them")
                    self._stop()
                    return 1, None, message, False, None
                self._schedule(pending, progress)
                for g in self.running():
                    life = self.lives[g][-1]
                    code = life.poll()
                    if code is None:
                        continue
                    self._end_life(g, life, code)
                    if code != 0 and not life.killed:
                        failures.append((g, code))
                        self.output.note(
                            f"{describe_exit(g, code).replace('rank', 'group', 1)}; the others go on"
                        )
        finally:
            self._stop(signal.SIGKILL)
        if pending:
            self.output.note(f"the job ended before {', '.join(f.spec for f in pending)}")
        if failures:
            g, code = failures[0]
            message = describe_exit(g, code).replace("rank", "group", 1)
            return (128 - code if code < 0 else code), g, message, False, None
        return 0, None, f"all {self.groups} groups finished", False, None

    def _schedule(self, pending: list[Fault], progress: Callable[[int], int]) -> None:
        """Carry out the due events of ``pending`` in order (a kill once its group finished its step; a
        rejoin once the furthest group did)."""
        while pending:
            fault = pending[0]
            if fault.kind == "kill":
                if progress(fault.group) < fault.step:
                    return
                self.lives[fault.group][-1].killed = True
                self.kill(fault.group)
                self.output.note(f"{fault.spec}: group {fault.group} SIGKILLed after its step {fault.step}")
            else:
                if max((progress(g) for g in range(self.groups)), default=0) < fault.step:
                    return
                life = self.lives[fault.group][-1] if self.lives[fault.group] else None
                if life is not None and life.code is None and (code := life.poll()) is not None:
                    self._end_life(fault.group, life, code)
                if life is not None and life.code is None:  # its SIGKILL has not been reaped yet
                    return
                self.start(fault.group)
                self.output.note(f"{fault.spec}: group {fault.group} started again at step {fault.step}")
            pending.pop(0)

    def _stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """``sig`` to every running group, SIGKILL after the grace period, reap them."""
        running = self.running()
        for g in running:
            self.kill(g, sig)
        end = time.monotonic() + (self.config.grace_s if sig != signal.SIGKILL else 5.0)
        for g in running:
            life = self.lives[g][-1]
            codes = []
            for proc in life.procs:
                try:
                    codes.append(proc.wait(max(0.01, end - time.monotonic())))
                except subprocess.TimeoutExpired:
                    self.kill(g)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        codes.append(proc.wait(5.0))
            if len(codes) == len(life.procs):
                self._end_life(g, life, next((c for c in codes if c != 0), 0))

    def _end_life(self, group: int, life: _Life, code: int) -> None:
        """Life ``life`` of group ``group`` ended with ``code``: kept, and :attr:`ended` told."""
        life.code = code
        if self.ended is not None:
            try:
                self.ended(group, life.life, code)
            except OSError as exc:  # e.g. a full disk: the groups waiting on it time out instead
                self.output.note(f"could not record the end of group {group} (life {life.life}): {exc}")


def main(argv: list[str] | None = None) -> int:
    """``python -m lioncub.launch.groups lighthouse HOST:PORT [HEARTBEAT_MS JOIN_MS]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 4) or args[0] != "lighthouse":
        print(
            "usage: python -m lioncub.launch.groups lighthouse HOST:PORT [HEARTBEAT_MS JOIN_MS]",
            file=sys.stderr,
        )
        return 2
    heartbeat, join = (
        (int(args[2]), int(args[3])) if len(args) == 4 else (HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS)
    )
    serve_lighthouse(args[1], heartbeat, join)
    return 0


if __name__ == "__main__":
    sys.exit(main())
