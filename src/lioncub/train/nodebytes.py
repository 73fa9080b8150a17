"""Where a step's bytes go on emulated nodes (``--nnodes M --nproc-per-node L``): ``nic_bytes``, the bytes a
node sends through its NIC, and ``intra_bytes``, the bytes a rank sends to the ranks of its own node, in
every ``step`` record of such a run (:func:`node_bytes`); ``bytes_sent`` stays all the bytes of a rank.

A vote laid over the nodes (``hierarchical``, ``node-majority``) counts its two levels itself, and a node's
NIC carries the inter-node bytes of its L ranks. A flat collective -- a flat vote, the DDP baselines'
allreduce -- crosses the node boundaries as its pattern makes it, so a rank's measured bytes are split by
the cost model's shares of that pattern (:func:`flat_shares`, from
:func:`lioncub.planning.nodes.topology_phases`): a ring crosses each boundary once, so a NIC carries one
rank's ring traffic while every rank but one per node sends the same inside it; a pairwise exchange sends
``L·(N−L)/(N−1)`` of a rank's vector through its node's NIC. With a flat vote the step check's few bytes
and a momentum sync count as the vote's; with a vote laid over the nodes, what the optimizer sends on its
flat group besides (the step check, a momentum sync, local steps' averaged inner momenta: allreduces) is
split by the shares of a ring allreduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lioncub.optim.config import VoteConfig

__all__ = ["flat_shares", "node_bytes"]


def flat_shares(variant: str | VoteConfig, d: int, nnodes: int, per_node: int) -> tuple[float, float]:
    """``(NIC bytes per node, in-node bytes per rank)`` per byte a rank sends, for ``variant``'s flat vote
    (or DDP's allreduce, ``"32bit"``/``"16bit"``) of ``d`` elements over ``nnodes`` × ``per_node`` ranks."""
    from lioncub.planning.nodes import topology_phases

    if isinstance(variant, VoteConfig) and variant.topology != "flat":
        variant = dataclasses.replace(variant, topology="flat")
    phases, _ = topology_phases(variant, max(int(d), 1), nnodes, per_node, "flat")
    sent = sum(p.sent * p.count for p in phases)
    if not sent:
        return 0.0, 0.0
    return sum(p.nic_sent * p.count for p in phases) / sent, sum(
        p.intra_sent * p.count for p in phases
    ) / sent


def node_bytes(
    last: dict[str, Any],
    bytes_sent: float,
    shares: tuple[float, float],
    per_node: int,
    ring_shares: tuple[float, float] = (0.0, 0.0),
) -> dict[str, float]:
    """The ``nic_bytes`` and ``intra_bytes`` of a step: from the vote's own level counters (``last``, the
    optimizer's ``comm_stats()["last"]``) when it is laid over the nodes, plus the rest of ``bytes_sent``
    (the flat group's allreduces) split by ``ring_shares``; else ``bytes_sent`` split by the flat
    ``shares``."""
    if "inter_node_bytes_sent" in last:
        inter, intra = float(last["inter_node_bytes_sent"]), float(last.get("intra_node_bytes_sent", 0.0))
        rest = max(bytes_sent - inter - intra, 0.0)
        return {
            "nic_bytes": per_node * inter + ring_shares[0] * rest,
            "intra_bytes": intra + ring_shares[1] * rest,
        }
    return {"nic_bytes": shares[0] * bytes_sent, "intra_bytes": shares[1] * bytes_sent}
