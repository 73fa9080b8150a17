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
import math
import os
import queue
import re
import socket
import sys
import tempfile
import time
from typing import Any, TextIO

from lioncub.launch.config import LaunchConfig
from lioncub.launch.environment import build_command, free_port, node_env, rank_env, torchrun_command
from lioncub.launch.netns import (
    EmulatedNetwork,
    IfCounters,
    NetnsError,
    check_privileges,
    cleanup,
    new_launch_id,
)
from lioncub.launch.preload import PreloadError, Zygote, gpu_refusal, lease, shared_env
from lioncub.launch.result import TIMEOUT_RC, LaunchResult, NodeTraffic, RankTraffic
from lioncub.launch.supervisor import (
    Attempt,
    Output,
    Start,
    Supervisor,
    TorchrunReport,
    forward_signals,
    popen,
)
from lioncub.launch.workers import WorkerRelay
from lioncub.units import format_rate

__all__ = ["AGENT_SHUTDOWN_MARGIN_S", "DEFAULT_LINK_PORT", "launch", "node_commands"]

DEFAULT_LINK_PORT = 29500  # rank 0's (node 0's) namespace is fresh, so a fixed port is always free there
#: seconds a torchrun agent gets, beyond its own --shutdown-timeout, to stop its ranks and report
AGENT_SHUTDOWN_MARGIN_S = 3.0


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
    run = _launch_nodes if config.nnodes is not None else _launch_ranks
    return run(config, out or sys.stdout, err or sys.stderr, launch_id, started, deadline)


def _launch_ranks(
    config: LaunchConfig, out: TextIO, err: TextIO, launch_id: str, started: float, deadline: float | None
) -> LaunchResult:
    """:func:`launch` for ``config.nproc`` ranks, each its own node: behind its own link, or on loopback."""
    output = Output(out, err, config.nproc)
    spec = config.link_spec()
    events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    traffic: list[RankTraffic] | None = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(forward_signals(events))
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
        attempt, restarts = _run_ranks(config, net, (master_addr, port), launch_id, events, output, deadline)
        if net is not None and before is not None:
            traffic = [
                RankTraffic(k, net.ranks[k].ifname, d.tx_bytes, d.rx_bytes, d.tx_packets, d.rx_packets)
                for k, d in enumerate(_deltas(net.counters(), before))
            ]
    return _result(attempt, launch_id, started, restarts, rank_returncodes=attempt.codes, traffic=traffic)


def _run_ranks(
    config: LaunchConfig,
    net: EmulatedNetwork | None,
    master: tuple[str, int],
    launch_id: str,
    events: queue.SimpleQueue[tuple[Any, ...]],
    output: Output,
    deadline: float | None,
) -> tuple[Attempt, int]:
    """Start and supervise every rank, again after a failure up to ``config.restarts`` times, with the
    rendezvous at ``master`` (address, port); returns the last attempt and the number of restarts."""
    cmd = build_command(config.cmd)
    master_addr, port = master
    restarts = 0
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
        with contextlib.ExitStack() as held:  # the zygote, if any, for as long as this attempt runs
            start = _preloaded(config, net, cmd, envs, output, held) if config.preload else popen
            attempt = Supervisor(events, output, config.grace_s, start=start).run(
                argvs, envs, config.cwd, deadline
            )
        if store is not None:  # a restart gets a fresh store (and port): no key of this attempt survives
            store[1].close()
            del store
        final = attempt.returncode == 0 or attempt.timed_out or attempt.interrupted_by is not None
        if final or restarts >= config.restarts:
            return attempt, restarts
        restarts += 1
        output.note(f"restarting all ranks ({restarts}/{config.restarts})")


def _preloaded(
    config: LaunchConfig,
    net: EmulatedNetwork | None,
    cmd: list[str],
    envs: list[dict[str, str]],
    output: Output,
    held: contextlib.ExitStack,
) -> Start | list[Start]:
    """How to start the ranks of a launch with ``preload``: each a fork of the zygote that imported those
    modules (:mod:`lioncub.launch.preload`, held by ``held``), inside its network namespace under a link;
    or every rank a fresh interpreter, with a note saying why, where ranks that may use a GPU are not
    forked or no zygote can start."""
    why = gpu_refusal(config.preload_device)
    if why is None:
        try:
            zygote = held.enter_context(lease(shared_env(envs), config.cwd or os.getcwd(), config.preload))
        except PreloadError as exc:
            why = str(exc)
    if why is not None:
        output.note(f"starting every rank as a fresh interpreter: {why}")
        return popen
    return [_forked(zygote, k, cmd, net.ranks[k].netns if net else None, output) for k in range(config.nproc)]


def _forked(
    zygote: Zygote, rank: int, cmd: list[str], netns: str | None, output: Output, unit: str = "rank"
) -> Start:
    """Start rank (or node agent) ``rank`` as a fork of ``zygote`` running ``cmd`` inside ``netns``; if it
    cannot fork (it died, or a thread started in it), as the fresh interpreter of the supervisor's argv,
    with a note."""

    def start(argv: list[str], env: dict[str, str], cwd: str | None) -> Any:
        try:
            return zygote.fork(cmd, env, cwd, netns=netns)
        except PreloadError as exc:
            output.note(f"starting {unit} {rank} as a fresh interpreter: {exc}")
            return popen(argv, env, cwd)

    return start


def _node_zygote(
    config: LaunchConfig,
    net: EmulatedNetwork,
    port: int,
    log_dir: str,
    output: Output,
    held: contextlib.ExitStack,
) -> Zygote | None:
    """The zygote that forks a launch of nodes' agents and ranks (:mod:`lioncub.launch.workers`), held by
    ``held``; ``None`` (every process a fresh interpreter, with a note saying why) without ``preload``,
    where ranks may use a GPU, or where no zygote can start."""
    if not config.preload:
        return None
    why = gpu_refusal(config.preload_device)
    if why is None:
        _, envs = node_commands(config, net, port, log_dir)
        try:
            return held.enter_context(lease(shared_env(envs), config.cwd or os.getcwd(), config.preload))
        except PreloadError as exc:
            why = str(exc)
    output.note(f"starting every agent and rank as a fresh interpreter: {why}")
    return None


def _result(
    attempt: Attempt,
    launch_id: str,
    started: float,
    restarts: int,
    *,
    rank_returncodes: list[int | None],
    traffic: list[RankTraffic] | None = None,
    **nodes: Any,
) -> LaunchResult:
    """The :class:`LaunchResult` of the last ``attempt``; ``nodes``: what only a launch of nodes has."""
    return LaunchResult(
        returncode=attempt.returncode,
        rank_returncodes=rank_returncodes,
        failed_rank=attempt.failed_rank,
        message=attempt.message,
        wall_s=time.monotonic() - started,
        restarts=restarts,
        timed_out=attempt.timed_out,
        interrupted_by=attempt.interrupted_by,
        launch_id=launch_id,
        traffic=traffic,
        **nodes,
    )


def _remove_leftovers(output: Output) -> None:
    """Remove what launchers that died (``kill -9``) left behind; a failure is noted, not raised."""
    try:
        report = cleanup()
        if report.launches:
            output.note(f"removed leftovers of dead launches: {', '.join(report.launches)}")
    except NetnsError as exc:  # not ours to fail on; `lioncub launch --cleanup` retries
        output.note(f"could not remove leftovers of earlier launches: {exc}")


def node_commands(
    config: LaunchConfig,
    net: EmulatedNetwork,
    port: int,
    log_dir: str | None,
    relay: WorkerRelay | None = None,
) -> tuple[list[list[str]], list[dict[str, str]]]:
    """Each node's argv (its torchrun agent inside its namespace) and environment; with ``relay`` the agent
    starts each rank through :data:`lioncub.launch.workers.SHIM` (a fork of the preloaded interpreter)."""
    assert config.nnodes is not None and config.nproc_per_node is not None and config.link_rate_bps
    cmd = build_command(config.cmd)
    shutdown_s = max(1, math.ceil(config.grace_s))
    argvs, envs = [], []
    for k, host in enumerate(net.hosts):
        agent = torchrun_command(
            cmd if relay is None else relay.command(k, cmd),
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
    output = Output(out, err, m, unit="n")
    events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    reports = [TorchrunReport() for _ in range(m)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(forward_signals(events))
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
        zygote = _node_zygote(config, net, port, log_dir, output, stack)
        relay = None
        if zygote is not None:
            netns = [net.ranks[k].netns for k in range(m)]
            relay = stack.enter_context(WorkerRelay(zygote, log_dir, netns))
        argvs, envs = node_commands(config, net, port, log_dir, relay)
        start: Start | list[Start] = popen
        if zygote is not None:  # each agent a fork too, inside its node's namespace
            start = [_forked(zygote, k, argv[len(net.exec_prefix(k)) :], netns[k], output, "node")
                     for k, argv in enumerate(argvs)]  # fmt: skip
        before, before_lo = net.counters(), net.loopback_counters()
        grace = config.grace_s + AGENT_SHUTDOWN_MARGIN_S  # the agents stop their own ranks first
        supervisor = Supervisor(events, output, grace, reports, start=start)
        attempt = supervisor.run(argvs, envs, config.cwd, deadline)
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
    return _result(
        attempt,
        launch_id,
        started,
        restarts,
        rank_returncodes=rank_codes,
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
