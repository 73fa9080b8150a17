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
on the launch's private bridge. See :mod:`lioncub.launch.netns` for the topology.
"""

from lioncub.launch.launcher import (
    LaunchConfig,
    LaunchResult,
    NodeTraffic,
    RankTraffic,
    build_command,
    describe_exit,
    format_node_traffic,
    format_traffic,
    launch,
    node_commands,
    node_env,
    rank_env,
    torchrun_command,
)
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
