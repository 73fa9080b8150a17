r"""One vote on M nodes of L ranks (:class:`~lioncub.planning.machine.Cluster`): every collective split by
level (:class:`Phase`: inside the nodes, between them, or the whole group at once), laid out as a
topology of :data:`~lioncub.transports.TOPOLOGIES`, and the predicted time per step
(:func:`predict_cluster`). The flat topology splits the collectives of
:func:`lioncub.planning.flat.plan`; the hierarchical and node-majority votes
(:mod:`lioncub.collectives.hierarchical`) put :meth:`lioncub.transports.Transport.hierarchical_payloads`
and :func:`~lioncub.transports.node_majority_payloads` into their phases. Per node's NIC and step:

=======================  ===================================================================================
flat ring allreduce      ``2(N−1)/N · B``: the ring over node-ordered ranks crosses each node boundary once
flat 1-bit               ``2·L·(N−L)/N · d_pad/8 = 2·L·(M−1)/M · d_pad/8``: every rank to every remote rank
hierarchical (exact)     ``L · 2(M−1)/M · ⌈⌈d/L⌉·b/8⌉ ≈ 2(M−1)/M · d·b/8``, b the narrowest of 2/4/8 bits that
                         holds the M-node sum (:func:`hierarchical_lane_bits`; 32 when none does)
node-majority (1-bit)    ``L · 2(M−1)/M · pad(⌈d/L⌉, 8M)/8 ≈ 2(M−1)/M · d/8``
=======================  ===================================================================================

The links of both levels run at once: a phase costs the slower of the NIC's and a rank's intra-node link;
the phases of a hierarchical topology run one after the other. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from lioncub import transports
from lioncub.optim.config import PRESETS, VoteConfig
from lioncub.planning.flat import (
    Collective,
    StepCost,
    Variant,
    charge,
    check_d,
    cost_fields,
    plan,
    resolve_config,
    ring,
    ring_bytes,
)
from lioncub.planning.machine import OPS, Cluster, Compute
from lioncub.transports import TOPOLOGIES

__all__ = [
    "LEVELS",
    "TOPOLOGIES",
    "ClusterPrediction",
    "Phase",
    "hierarchical_lane_bits",
    "nic_share",
    "predict_cluster",
    "topology_allowed",
    "topology_phases",
]

#: the level of a :class:`Phase`: inside each node, between the nodes, or the whole group at once
LEVELS = ("intra", "inter", "flat")


@dataclass(frozen=True)
class Phase:
    """One collective of a step on a :class:`Cluster`, as the model charges it (busiest node and rank).

    ``level``: ``"intra"`` (inside every node at once), ``"inter"`` (between the nodes) or ``"flat"`` (the
    whole group: α is the NIC's when there are several nodes). ``nic_sent``/``nic_recv``: bytes out of /
    into a node's NIC; ``intra_sent``/``intra_recv``: bytes a rank sends to / receives from the ranks of
    its own node; ``sent``/``recv``: all the bytes of a rank (what LionCub counts); ``messages``: α terms
    on the critical path; ``reduce_bytes``: bytes reduced locally (γ); ``count``: times per step.
    """

    op: str
    level: str
    messages: int
    nic_sent: float
    nic_recv: float
    intra_sent: float
    intra_recv: float
    sent: float
    recv: float
    reduce_bytes: float = 0.0
    count: float = 1.0

    def seconds(self, cluster: Cluster, compute: Compute) -> tuple[float, float, float]:
        """(latency, bandwidth, reduction) seconds per step. The links of both levels run at once, so the
        bandwidth term is the slower of the NIC's and a rank's intra-node link."""
        inter = self.level == "inter" or (self.level == "flat" and cluster.nnodes > 1)
        nic_net = cluster.flat if self.level == "flat" and cluster.flat is not None else cluster.inter
        alpha = (nic_net if inter else cluster.intra).alpha(self.op)
        nic = max(self.nic_sent, self.nic_recv) / nic_net.rate(self.op)
        local = max(self.intra_sent, self.intra_recv) / cluster.intra.rate(self.op)
        return (
            self.count * self.messages * alpha,
            self.count * max(nic, local),
            self.count * self.reduce_bytes * compute.reduce_s_per_byte,
        )


# ------------------------------------------------------------------------------------- flat, split


def split(c: Collective, m: int, ell: int) -> Phase:
    """A flat collective over M×L node-ordered ranks, its bytes split between the NIC and the node.

    A ring (allreduce) crosses each node boundary once, so a NIC carries one rank's ring traffic; a pairwise
    exchange (the 1-bit all-to-all and all-gather) sends each rank's slice to every remote rank, so a NIC
    carries ``L·(N−L)/N`` of a rank's vector; the server's root (rank 0, on node 0) takes ``N−L`` of its
    messages through its node's NIC.
    """
    n = m * ell
    if c.op.startswith("allreduce"):  # ring: 2(N−1) steps, each to the next rank
        nic = c.link_bytes if m > 1 else 0.0
        local = c.link_bytes if ell > 1 else 0.0
        return Phase(
            c.op, "flat", c.messages, nic, nic, local, local, c.sent, c.recv, c.reduce_bytes, c.count
        )
    if c.op in ("all_to_all", "all_gather"):  # pairwise: a slice of 1/N to each of the N−1 others
        slice_ = c.sent / (n - 1)
        nic, local = ell * (n - ell) * slice_, (ell - 1) * slice_
        return Phase(c.op, "flat", c.messages, nic, nic, local, local, c.sent, c.recv, count=c.count)
    each = c.link_bytes / (n - 1)  # gather_root / scatter_root: N−1 messages into or out of rank 0
    into = c.op == "gather_root"
    nic_root, nic_other = (n - ell) * each, (ell * each if m > 1 else 0.0)
    local_root, local_other = (ell - 1) * each, (each if ell > 1 else 0.0)
    return Phase(
        c.op,
        "flat",
        c.messages,
        nic_other if into else nic_root,
        nic_root if into else nic_other,
        local_other if into else local_root,
        local_root if into else local_other,
        c.sent,
        c.recv,
        count=c.count,
    )


def nic_share(op: str, nnodes: int, nproc_per_node: int) -> float:
    """Bytes through the busiest node's NIC (its busier direction) per byte one rank puts on its links, for
    the flat collective ``op`` over M×L node-ordered ranks, as :class:`Phase` splits it: 1 for a ring
    allreduce (it crosses each node boundary once), ``L·(N−L)/(N−1)`` for the pairwise all-to-all and
    all-gather, ``(N−L)/(N−1)`` for the root's side of gather/scatter; 0 on one node."""
    m, ell = nnodes, nproc_per_node
    n = m * ell
    if m == 1:
        return 0.0
    if op.startswith("allreduce"):
        return 1.0
    if op in ("all_to_all", "all_gather"):
        return ell * (n - ell) / (n - 1)
    if op in ("gather_root", "scatter_root"):
        return (n - ell) / (n - 1)
    raise ValueError(f"unknown collective {op!r}; known: {list(OPS)}")


# ------------------------------------------------------------------------ hierarchical, node-majority


def _at(level: str, c: Collective, ell: int) -> Phase:
    """A collective among the ranks of each node (``"intra"``) or among the peers of one local rank across
    the nodes (``"inter"``: the L ranks of a node share its NIC)."""
    nic = ell * c.link_bytes if level == "inter" else 0.0
    local = c.link_bytes if level == "intra" else 0.0
    return Phase(c.op, level, c.messages, nic, nic, local, local, c.sent, c.recv, c.reduce_bytes, c.count)


def _inside(node_bytes: int, gathered: int, d: int, ell: int) -> tuple[Phase, Phase]:
    """The intra-node allreduce of a rank's ``node_bytes`` (int8 at one byte per element of ``d``, else
    int32, charged at the fp32 rate) and the all-gather of its ``gathered`` bytes."""
    op = "allreduce_i8" if node_bytes == d else "allreduce_f32"
    each = (ell - 1) * gathered
    return (
        _at("intra", ring(op, ring_bytes(node_bytes, ell), ell), ell),
        _at("intra", Collective("all_gather", ell - 1, each, each, each), ell),
    )


def hierarchical_lane_bits(variant: Variant, nnodes: int, nproc_per_node: int) -> int | None:
    """Lane width of the hierarchical vote's inter-node sum
    (:meth:`lioncub.transports.Transport.hierarchical_lane_bits` for ``variant``); ``None``: int32 lanes."""
    config = resolve_config(variant)[1]
    return transports.FACTS[config.transport].hierarchical_lane_bits(config.bits, nnodes, nproc_per_node)


def _hierarchical_phases(
    config: VoteConfig, d: int, m: int, ell: int
) -> tuple[list[Phase], dict[str, float]]:
    """The exact hierarchical vote (``lioncub.collectives.hierarchical.HierarchicalVote``): intra-node
    allreduce of the ranks' integer values, inter-node ring allreduce of this local rank's slice (d/L
    elements) among the same-local-rank peers in the lanes of :func:`hierarchical_lane_bits`, intra-node
    all-gather of the summed slices."""
    facts, bits = transports.FACTS[config.transport], config.bits
    node_bytes, inter, gathered = facts.hierarchical_payloads(bits, d, m, ell)
    intra_sum, intra_gather = _inside(node_bytes, gathered, d, ell)
    phases = [intra_sum] if ell > 1 else []
    if m > 1:
        op = "allreduce_f32" if facts.hierarchical_lane_bits(bits, m, ell) is None else "allreduce_u8"
        phases.append(_at("inter", ring(op, ring_bytes(inter, m), m), ell))
    phases += [intra_gather] if ell > 1 else []
    k = -(-d // ell)
    work: dict[str, float] = {
        "elementwise_s_per_elem": 2 * d,
        "lane_pack_s_per_elem": k,
        "lane_unpack_s_per_elem": k,
    }
    if config.transport == "quantized":
        work["quantize_s_per_elem"] = d
    return phases, work


def _node_majority_phases(d: int, m: int, ell: int) -> tuple[list[Phase], dict[str, float]]:
    """The node-majority vote (``lioncub.collectives.hierarchical.NodeMajorityVote``): intra-node allreduce
    of the 0/1 votes, each node's majority, a 1-bit vote among the nodes on this local rank's slice (d/L
    elements, :func:`lioncub.planning.flat.plan`), intra-node all-gather (int8)."""
    node_bytes, k, gathered = transports.node_majority_payloads(d, m, ell)
    intra_sum, intra_gather = _inside(node_bytes, gathered, d, ell)
    among_nodes, _ = plan(PRESETS["1bit"], k, m)
    phases = [intra_sum] if ell > 1 else []
    phases += [_at("inter", c, ell) for c in among_nodes]
    phases += [intra_gather] if ell > 1 else []
    work: dict[str, float] = {
        "elementwise_s_per_elem": 2 * d,
        "pack_s_per_elem": k,
        "count_s_per_elem": transports.FACTS["1bit"].padded_numel(k, m),
        "unpack_s_per_elem": k,
    }
    return phases, work


# ------------------------------------------------------------------------------------------ topology


def topology_allowed(variant: Variant, topology: str, n_workers: int) -> tuple[bool, str]:
    """Whether ``variant`` can run as ``topology`` on N workers; ``(False, why)`` otherwise."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: allowed values are {list(TOPOLOGIES)}")
    _, config = resolve_config(variant)
    ok, why = config.capacity(n_workers)
    if not ok:
        return ok, why
    if topology in transports.FACTS[config.transport].topologies:
        return True, ""
    if topology == "hierarchical":
        votes = [k for k, c in PRESETS.items() if topology in transports.FACTS[c.transport].topologies]
        return False, (
            f"the {config.transport} transport has no hierarchical form; it applies to the votes "
            f"({', '.join(votes)})"
        )
    return False, "node-majority is a 1-bit vote among node majorities; it applies to the 1bit variant only"


def topology_phases(
    variant: Variant, d: int, nnodes: int, nproc_per_node: int, topology: str = "flat"
) -> tuple[list[Phase], dict[str, float]]:
    """The phases of one vote of ``d`` elements and its compute (:class:`Compute` field → elements)."""
    _, config = resolve_config(variant)
    m, ell = nnodes, nproc_per_node
    ok, why = topology_allowed(config, topology, m * ell)
    if not ok:
        raise ValueError(why)
    if topology == "flat" or m * ell == 1:
        colls, work = plan(config, d, m * ell)
        return [split(c, m, ell) for c in colls], work
    if topology == "hierarchical":
        return _hierarchical_phases(config, d, m, ell)
    return _node_majority_phases(d, m, ell)


#: the bytes of a :class:`ClusterPrediction` by level, summed over its phases' fields of the same names
class Layout(TypedDict):
    """:class:`ClusterPrediction`'s layout, as keyword arguments."""

    topology: str
    nnodes: int
    nproc_per_node: int


class LevelBytes(TypedDict):
    """:class:`ClusterPrediction`'s bytes per level (``nic_*``, ``intra_*``), as keyword arguments."""

    nic_sent: float
    nic_recv: float
    intra_sent: float
    intra_recv: float


@dataclass(frozen=True)
class ClusterPrediction(StepCost):
    """:class:`~lioncub.planning.flat.StepCost` of ``variant`` laid over a :class:`Cluster` as
    ``topology``. ``bytes_*``: all the bytes of the busiest rank; ``nic_*``: bytes through the busiest node's
    NIC (inter-node); ``intra_*``: bytes of the busiest rank inside its node (NaN when not ``allowed``)."""

    topology: str
    nnodes: int
    nproc_per_node: int
    nic_sent: float
    nic_recv: float
    intra_sent: float
    intra_recv: float
    phases: tuple[Phase, ...] = ()

    @property
    def n_workers(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def exact(self) -> bool:
        """Whether the topology computes the flat vote's result (node-majority is another estimator)."""
        return self.topology != "node-majority"


def predict_cluster(
    variant: Variant,
    d: int,
    cluster: Cluster,
    topology: str = "flat",
    compute: Compute | None = None,
    *,
    sync_every: int | None = None,
    sync_params: int | None = None,
    bucket_numel: int | None = None,
    local_steps: int | None = None,
) -> ClusterPrediction:
    """Predicted per-step cost of ``variant`` laid over ``cluster`` as ``topology`` (options as
    :func:`~lioncub.planning.flat.predict`, ``local_steps`` included; the momentum sync is a flat fp32 ring
    allreduce in every topology). With one rank per node and ``topology="flat"`` this is ``predict`` on the
    NIC's network."""
    name, config = resolve_config(variant)
    check_d(d)
    m, ell = cluster.nnodes, cluster.nproc_per_node
    layout = Layout(topology=topology, nnodes=m, nproc_per_node=ell)
    ok, why = topology_allowed(config, topology, m * ell)
    if not ok:
        nan = math.nan
        levels = LevelBytes(nic_sent=nan, nic_recv=nan, intra_sent=nan, intra_recv=nan)
        return ClusterPrediction(name, d, False, why, **cost_fields(None), **layout, **levels)
    compute = compute or Compute()
    step = charge(
        lambda size: topology_phases(config, size, m, ell, topology),
        lambda c: split(c, m, ell),
        lambda p: p.seconds(cluster, compute),
        d,
        m * ell,
        compute,
        sync_every=sync_every,
        sync_params=sync_params,
        bucket_numel=bucket_numel,
        local_steps=local_steps,
    )
    levels = LevelBytes(
        nic_sent=step.total("nic_sent"),
        nic_recv=step.total("nic_recv"),
        intra_sent=step.total("intra_sent"),
        intra_recv=step.total("intra_recv"),
    )
    return ClusterPrediction(name, d, True, "", **cost_fields(step), **layout, **levels, phases=step.items)
