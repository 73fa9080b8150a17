"""What a launch returns (:class:`LaunchResult`, with the bytes each rank's or node's interface carried)
and how it is shown: the exit of a rank in words and the end-of-run traffic tables."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TIMEOUT_RC",
    "LaunchResult",
    "NodeTraffic",
    "RankTraffic",
    "describe_exit",
    "format_node_traffic",
    "format_traffic",
]

TIMEOUT_RC = 124  # like coreutils timeout


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
        """Every rank exited with code 0."""
        return self.returncode == 0


def describe_exit(rank: int, code: int) -> str:
    """``rank 1 exited with code 3`` or ``rank 1 was killed by SIGKILL`` (``code`` < 0: the signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {code}"


def format_node_traffic(traffic: Sequence[NodeTraffic]) -> str:
    """A small table of per-node NIC and loopback bytes, for the end-of-run report."""
    return _traffic_table("node", "NIC", traffic, [t.node for t in traffic], [t.local_bytes for t in traffic])


def format_traffic(traffic: Sequence[RankTraffic]) -> str:
    """A small table of per-rank interface bytes, for the end-of-run report."""
    return _traffic_table("rank", "interface", traffic, [t.rank for t in traffic])


def _traffic_table(
    unit: str,
    interface: str,
    traffic: Sequence[RankTraffic | NodeTraffic],
    index: list[int],
    local: list[int] | None = None,
) -> str:
    """One row of bytes and frames per rank or node (``index``), then the totals; with ``local``, each
    node's intra-node bytes in a last column."""
    lines = [
        f"{unit:>4}  {interface:<12} {'sent MB':>10} {'received MB':>12} {'frames out':>11} {'frames in':>10}"
        + (f" {'intra-node MB':>14}" if local is not None else "")
    ]
    for k, t in enumerate(traffic):
        lines.append(
            f"{index[k]:>4}  {t.interface:<12} {t.tx_bytes / 1e6:>10.3f} {t.rx_bytes / 1e6:>12.3f} "
            f"{t.tx_packets:>11} {t.rx_packets:>10}"
            + (f" {local[k] / 1e6:>14.3f}" if local is not None else "")
        )
    tx, rx = sum(t.tx_bytes for t in traffic), sum(t.rx_bytes for t in traffic)
    total = f"{'all':>4}  {'':<12} {tx / 1e6:>10.3f} {rx / 1e6:>12.3f}"
    if local is not None:
        total += f" {'':>11} {'':>10} {sum(local) / 1e6:>14.3f}"
    lines.append(total)
    return "\n".join(lines)
