"""``lioncub launch``: run N ranks like torchrun, optionally each behind its own shaped network link.

Library use::

    from lioncub.launch import LaunchConfig, launch, parse_rate

    result = launch(LaunchConfig(["train.py"], nproc=4, link_rate_bps=parse_rate("1gbit")))
    result.returncode, result.failed_rank, result.traffic  # traffic: per-rank interface bytes

Without a link the ranks run on loopback and need no privileges; with one, each rank runs in its own network
namespace (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN). The rendezvous listens only on loopback or on the
launch's private bridge. See :mod:`lioncub.launch.netns` for the topology.
"""

from lioncub.launch.launcher import (
    LaunchConfig,
    LaunchResult,
    RankTraffic,
    build_command,
    describe_exit,
    format_traffic,
    launch,
    rank_env,
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
    "PrivilegeError",
    "RankLink",
    "RankTraffic",
    "build_command",
    "check_privileges",
    "cleanup",
    "default_burst",
    "describe_exit",
    "format_rate",
    "format_traffic",
    "launch",
    "new_launch_id",
    "parse_rate",
    "parse_size",
    "rank_env",
]
