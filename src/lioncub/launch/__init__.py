"""``lioncub launch``: run N ranks like torchrun, optionally each behind its own shaped network link, or
M emulated nodes of L ranks behind one shaped NIC per node, each node started by a multi-node torchrun.

Library use::

    from lioncub.launch import LaunchConfig, launch, parse_rate

    result = launch(LaunchConfig(["train.py"], nproc=4, link_rate_bps=parse_rate("1gbit")))
    result.returncode, result.failed_rank, result.traffic  # traffic: per-rank interface bytes
    nodes = LaunchConfig(["train.py"], nnodes=2, nproc_per_node=2, link_rate_bps=parse_rate("1gbit"))
    launch(nodes).node_traffic  # per node: NIC bytes and intra-node (loopback) bytes

Without a link the ranks run on loopback and need no privileges; with one, each rank (or node) runs in its
own network namespace (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN). The rendezvous listens only on loopback or
on the launch's private bridge.

Modules: :mod:`~lioncub.launch.launcher` (:func:`launch`: the network, the attempts, restarts, traffic),
:mod:`~lioncub.launch.config` (:class:`LaunchConfig`), :mod:`~lioncub.launch.environment` (each rank's
and node agent's argv and environment), :mod:`~lioncub.launch.supervisor` (one attempt: start, copy the
output, stop on the first failure), :mod:`~lioncub.launch.result` (:class:`LaunchResult` and its tables),
:mod:`~lioncub.launch.netns` (the emulated network and its topology) and :mod:`~lioncub.launch.preload`
(ranks forked from an interpreter that imported torch once; the forking side is
:mod:`~lioncub.launch.zygote`, which nothing here imports).
"""

from lioncub.launch.config import LaunchConfig
from lioncub.launch.environment import build_command, node_env, rank_env, torchrun_command
from lioncub.launch.launcher import launch, node_commands
from lioncub.launch.netns import (
    CleanupReport,
    EmulatedNetwork,
    IfCounters,
    LinkSpec,
    NetnsError,
    PrivilegeError,
    RankLink,
    check_privileges,
    cleanup,
    default_burst,
    new_launch_id,
)
from lioncub.launch.result import (
    LaunchResult,
    NodeTraffic,
    RankTraffic,
    describe_exit,
    format_node_traffic,
    format_traffic,
)
from lioncub.units import format_rate, parse_rate, parse_size

__all__ = [
    "CleanupReport",
    "EmulatedNetwork",
    "IfCounters",
    "LaunchConfig",
    "LaunchResult",
    "LinkSpec",
    "NetnsError",
    "NodeTraffic",
    "PrivilegeError",
    "RankLink",
    "RankTraffic",
    "build_command",
    "check_privileges",
    "cleanup",
    "default_burst",
    "describe_exit",
    "format_node_traffic",
    "format_rate",
    "format_traffic",
    "launch",
    "new_launch_id",
    "node_commands",
    "node_env",
    "parse_rate",
    "parse_size",
    "rank_env",
    "torchrun_command",
]
