"""The processes a launch starts: each rank's argv and environment (torchrun's variables, gloo's interface,
the ``LIONCUB_*`` description of the emulated network), and each emulated node's torchrun agent."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence

__all__ = [
    "RANK_LINE_PREFIX",
    "TORCHRUN_VARIABLES",
    "build_command",
    "free_port",
    "node_env",
    "rank_env",
    "torchrun_command",
]


def build_command(cmd: Sequence[str]) -> list[str]:
    """The argv each rank runs: ``-m mod ...``, ``-c code ...`` and ``script.py ...`` get the current
    interpreter prepended."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command to launch: put it after `--`, e.g. `lioncub launch --nproc 2 -- x.py`")
    if cmd[0] in ("-m", "-c") or cmd[0].endswith(".py"):
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
