r"""α–β–γ cost model of one optimizer step's communication for every Lion Cub / D-Lion transport.

Time of one collective = ``messages · α + wire_bytes / (bandwidth · efficiency) + γ · reduced_bytes`` with
(the Lion Cub paper §3.8, Thakur et al. 2005), for d parameters on N workers:

=======================  ===============================  ============================================
transport                collectives (critical path)      bytes per rank (what the vote classes send)
=======================  ===============================  ============================================
dense fp32 / bf16        ring allreduce: 2(N−1) α          ``2(N−1)/N · d · 4`` (bf16: ``· 2``)
int8 (sign sum, D-Lion   ring allreduce: 2(N−1) α          ``2(N−1)/N · d``
avg), quantized 8-bit
p-bit lanes / quantized  uint8 ring allreduce: 2(N−1) α    ``2(N−1)/N · ⌈d·p/8⌉``
2/4-bit
1-bit                    pairwise all-to-all, then         ``2(N−1)/N · d_pad/8``, ``d_pad`` = d rounded
                         all-gather: (N−1) α each          up to a multiple of 8N
parameter server         N−1 messages into the root, then  root: in ``(N−1)·⌈d/8⌉``, out ``(N−1)·⌈d/4⌉``
                         N−1 out of it (linear in N)       (2-bit lanes back; average: count lanes)
momentum sync every k    fp32 ring allreduce of d_sync,    ``2(N−1)/N · 4 d_sync / k``
                         amortised: ``/k``
=======================  ===============================  ============================================

The bandwidth term charges the bytes that cross the busiest link direction (each rank's full-duplex link
for the ring and the pairwise exchanges, the root's link for the server). Compute is charged per element
with the costs of :class:`Compute` (quantize, pack, unpack, the 1-bit count, ...), on the critical path and
not overlapped with communication. A variant whose lanes could overflow for N workers (``4bit`` for
N ≥ 16, int8 for N > 127, ...) is *not allowed*: its :class:`Prediction` says why and carries NaN times.

A calibration (``lioncub calibrate``) measures α and the efficiency of every collective separately
(:class:`OpCost`), folds the local reduction into them (``reduce_s_per_byte = 0``) and measures the
compute costs of this CPU; :func:`load_calibration` reads it.

On M nodes of L ranks (:class:`Cluster`: α/β of each node's NIC and of each rank's link inside its node),
:func:`predict_cluster` splits every collective by level and charges the slower of the two (they run at
once) or, for the topologies of :mod:`lioncub.collectives.hierarchical`, the intra- and inter-node phases
one after the other. Per node's NIC and step:

=======================  ===================================================================================
flat ring allreduce      ``2(N−1)/N · B``: the ring over node-ordered ranks crosses each node boundary once
flat 1-bit               ``2·L·(N−L)/N · d_pad/8 = 2·L·(M−1)/M · d_pad/8``: every rank to every remote rank
hierarchical (exact)     ``L · 2(M−1)/M · ⌈⌈d/L⌉·b/8⌉ ≈ 2(M−1)/M · d·b/8``, b the narrowest of 2/4/8 bits that
                         holds the M-node sum (:func:`hierarchical_lane_bits`; 32 when none does)
node-majority (1-bit)    ``L · 2(M−1)/M · pad(⌈d/L⌉, 8M)/8 ≈ 2(M−1)/M · d/8``
=======================  ===================================================================================

This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lioncub._validate import is_int, is_number
from lioncub.optim.config import PRESETS, capacity, lane_bits, server_down_bits
from lioncub.units import parse_bandwidth, parse_count, parse_duration

__all__ = [
    "CALIBRATION_VERSION",
    "DEFAULT_CPU_COMPUTE",
    "LEVELS",
    "OPS",
    "PRESET_SCHEMES",
    "TCP_EFFICIENCY",
    "TOPOLOGIES",
    "Calibration",
    "Cluster",
    "ClusterPrediction",
    "Collective",
    "Compute",
    "Network",
    "OpCost",
    "Phase",
    "Prediction",
    "Scheme",
    "allowed",
    "calibration_from_json",
    "cluster_table",
    "crossover_bandwidth",
    "hierarchical_lane_bits",
    "load_calibration",
    "nic_share",
    "parse_bandwidth",
    "parse_count",
    "parse_duration",
    "predict",
    "predict_cluster",
    "regimes",
    "resolve_scheme",
    "speedups",
    "table",
    "topology_allowed",
    "topology_phases",
    "winner",
    "wire_bytes",
]

#: TCP payload per byte of line rate at MTU 1500 (1448 B of payload per 1514 B frame; docs/network.md).
TCP_EFFICIENCY = 1448 / 1514

#: collectives the transports use (keys of :attr:`Network.per_op` and of a calibration's ``per_op``)
OPS = (
    "allreduce_f32",  # ring allreduce of fp32 (dense 32-bit, momentum sync)
    "allreduce_bf16",  # ring allreduce of bf16 (dense 16-bit)
    "allreduce_i8",  # ring allreduce of int8 (sign sum, D-Lion avg, 8-bit quantized)
    "allreduce_u8",  # ring allreduce of uint8 lanes (p-bit votes and levels)
    "all_to_all",  # pairwise all-to-all (1-bit phase 1)
    "all_gather",  # pairwise all-gather (1-bit phase 2)
    "gather_root",  # every rank sends to the root (server ingress)
    "scatter_root",  # the root sends to every rank (server egress)
)


# ----------------------------------------------------------------------------------- machine model


@dataclass(frozen=True)
class OpCost:
    """Measured cost of one collective: α per message (s) and the payload rate as a fraction of the link.

    ``efficiency`` is the op's payload bytes/s divided by :attr:`Network.bandwidth_Bps`; it includes the
    protocol overhead, the library's own inefficiency and, for allreduces, the local reduction.
    """

    latency_s: float
    efficiency: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"OpCost.latency_s={self.latency_s!r} must be a finite number >= 0")
        if not (math.isfinite(self.efficiency) and self.efficiency > 0):
            raise ValueError(f"OpCost.efficiency={self.efficiency!r} must be a finite number > 0")


@dataclass(frozen=True)
class Network:
    """The links between the workers.

    Args:
        latency_s: α, seconds per message (one hop).
        bandwidth_Bps: each worker's link rate in bytes/s, each direction (1 Gbit/s → 125e6).
        efficiency: fraction of the link rate that carries payload (:data:`TCP_EFFICIENCY` for TCP at
            MTU 1500); payload moves at ``bandwidth_Bps · efficiency`` bytes/s.
        per_op: measured α and efficiency per collective (:data:`OPS`), overriding the two above.
    """

    latency_s: float
    bandwidth_Bps: float
    efficiency: float = 1.0
    per_op: Mapping[str, OpCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s={self.latency_s!r} must be a finite number of seconds >= 0")
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps={self.bandwidth_Bps!r} must be a finite number of bytes/s > 0")
        if not (math.isfinite(self.efficiency) and self.efficiency > 0):
            raise ValueError(f"efficiency={self.efficiency!r} must be a finite number > 0")
        unknown = set(self.per_op) - set(OPS)
        if unknown:
            raise ValueError(f"per_op has unknown collectives {sorted(unknown)}; known: {OPS}")

    @classmethod
    def from_rate(cls, rate_bps: float, latency_s: float, efficiency: float = TCP_EFFICIENCY) -> Network:
        """A network of ``rate_bps`` bits/s links (e.g. ``1e9``), α = ``latency_s`` seconds."""
        return cls(latency_s, rate_bps / 8, efficiency)

    def with_bandwidth(self, bandwidth_Bps: float) -> Network:
        """The same network (latencies, per-op efficiencies) with ``bandwidth_Bps`` bytes/s links."""
        return dataclasses.replace(self, bandwidth_Bps=bandwidth_Bps)

    def with_latency(self, latency_s: float) -> Network:
        """The same network with α = ``latency_s`` for every collective (per-op latencies dropped)."""
        per_op = {op: OpCost(latency_s, c.efficiency) for op, c in self.per_op.items()}
        return dataclasses.replace(self, latency_s=latency_s, per_op=per_op)

    def alpha(self, op: str) -> float:
        """Seconds per message of collective ``op``."""
        cost = self.per_op.get(op)
        return self.latency_s if cost is None else cost.latency_s

    def rate(self, op: str) -> float:
        """Payload bytes/s of collective ``op`` through one link direction."""
        cost = self.per_op.get(op)
        return self.bandwidth_Bps * (self.efficiency if cost is None else cost.efficiency)


@dataclass(frozen=True)
class Compute:
    """Local compute per step: seconds per element (``_s_per_elem``) or per byte (``_s_per_byte``).

    The defaults are 0 (a pure communication model); :data:`DEFAULT_CPU_COMPUTE` holds typical CPU values
    and a calibration measures them on the machine at hand.
    """

    quantize_s_per_elem: float = 0.0  #: L1 quantizer: fp32 → int8 levels
    elementwise_s_per_elem: float = 0.0  #: one simple pass: sign → int8, copy/scale, dtype cast
    pack_s_per_elem: float = 0.0  #: 1-bit: pack the votes ``c ≥ 0`` (per element of c)
    unpack_s_per_elem: float = 0.0  #: 1-bit: unpack packed signs to int8 ±1 (per element)
    count_s_per_elem: float = 0.0  #: 1-bit / server: unpack, count and repack votes (per vote counted)
    lane_pack_s_per_elem: float = 0.0  #: p-bit lanes: votes or offset levels into lanes (per element)
    lane_unpack_s_per_elem: float = 0.0  #: p-bit lanes: unpack the sums and take the sign (per element)
    reduce_s_per_byte: float = 0.0  #: γ: local reduction of an allreduce (0 when measured inside α/β)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Compute.{f.name}={value!r} must be a finite number >= 0")


#: Per-element costs measured with :func:`lioncub.planning.calibrate.measure_compute` (one thread, 4M
#: elements, N = 8)
#: on the project's 2-core AMD EPYC development VM; ``reduce_s_per_byte`` is an fp32 ``add_``. A rough
#: default for CPUs when no calibration is given.
DEFAULT_CPU_COMPUTE = Compute(
    quantize_s_per_elem=8e-10,
    elementwise_s_per_elem=4e-10,
    pack_s_per_elem=2e-10,
    unpack_s_per_elem=2e-10,
    count_s_per_elem=7e-10,
    lane_pack_s_per_elem=1.1e-9,
    lane_unpack_s_per_elem=1.7e-9,
    reduce_s_per_byte=5e-11,
)


# ------------------------------------------------------------------------------------------ schemes


@dataclass(frozen=True)
class Scheme:
    """What a variant puts on the wire (the cost-relevant part of a ``VoteConfig``).

    ``transport``: dense, 1bit, lanes, int8, quantized or server; ``bits``: lane width of lanes /
    quantized (2, 4, 8 or "auto"); ``wire_bits``: bits per element of a dense allreduce (32 or 16).
    """

    transport: str
    aggregation: str = "majority"
    bits: int | str | None = None
    wire_bits: int = 32

    def __post_init__(self) -> None:
        if self.transport not in ("dense", "1bit", "lanes", "int8", "quantized", "server"):
            raise ValueError(f"transport={self.transport!r} is not a known transport")
        if self.transport in ("lanes", "quantized") and self.bits not in (2, 4, 8, "auto", None):
            raise ValueError(f"bits={self.bits!r} must be 2, 4, 8 or 'auto' for {self.transport}")
        if self.transport == "dense" and self.wire_bits not in (16, 32, 64):
            raise ValueError(f"wire_bits={self.wire_bits!r} of a dense allreduce must be 16, 32 or 64")

    @classmethod
    def from_config(cls, config: Any) -> Scheme:
        """From a :class:`lioncub.optim.config.VoteConfig` (or anything with its attributes)."""
        transport = config.transport
        wire_bits = config.wire_bits
        bits = config.bits
        if transport == "lanes" and bits is None:
            bits = 4  # as make_vote
        elif transport == "quantized" and bits is None:
            bits = 8
        elif transport not in ("lanes", "quantized"):
            bits = None
        return cls(transport, config.aggregation, bits, wire_bits if transport == "dense" else 32)


#: The presets of :data:`lioncub.optim.config.PRESETS`, as schemes (derived: the presets are stated once).
PRESET_SCHEMES: dict[str, Scheme] = {name: Scheme.from_config(config) for name, config in PRESETS.items()}


def resolve_scheme(variant: str | Scheme | Any) -> tuple[str, Scheme]:
    """``(name, scheme)`` for a preset name, a :class:`Scheme` or a ``VoteConfig``."""
    if isinstance(variant, str):
        if variant not in PRESET_SCHEMES:
            raise ValueError(f"variant={variant!r} is not one of {list(PRESET_SCHEMES)}")
        return variant, PRESET_SCHEMES[variant]
    scheme = variant if isinstance(variant, Scheme) else Scheme.from_config(variant)
    name = next((k for k, s in PRESET_SCHEMES.items() if s == scheme), None)
    if name is None:
        name = f"{scheme.transport}-{scheme.aggregation}"
        name += f"-{scheme.bits}bit" if scheme.bits is not None else ""
        name += f"-{scheme.wire_bits}bit" if scheme.transport == "dense" else ""
    return name, scheme


def allowed(variant: str | Scheme | Any, n_workers: int) -> tuple[bool, str]:
    """Whether the variant's lanes can hold the N-way sum; ``(False, why)`` otherwise
    (:func:`lioncub.optim.config.capacity`)."""
    _, scheme = resolve_scheme(variant)
    return capacity(scheme, _check_n(n_workers))


def _check_n(n: int) -> int:
    if not is_int(n, 1):
        raise ValueError(f"n_workers={n!r}: the number of workers must be an int >= 1")
    return n


# -------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Collective:
    """One collective of a step, as the model charges it.

    ``messages``: α terms on the critical path; ``link_bytes``: bytes through the busiest link direction;
    ``sent``/``recv``: bytes of the busiest rank; ``reduce_bytes``: bytes reduced locally (γ);
    ``count``: times per step (buckets; ``1/k`` for an amortised sync).
    """

    op: str
    messages: int
    link_bytes: float
    sent: float
    recv: float
    reduce_bytes: float = 0.0
    count: float = 1.0

    def seconds(self, network: Network, compute: Compute) -> tuple[float, float, float]:
        """(latency, bandwidth, reduction) seconds per step."""
        return (
            self.count * self.messages * network.alpha(self.op),
            self.count * self.link_bytes / network.rate(self.op),
            self.count * self.reduce_bytes * compute.reduce_s_per_byte,
        )


def _packed(n: int, bits: int) -> int:
    per_byte = 8 // bits
    return -(-n // per_byte)


def _ring(op: str, nbytes: float, n: int) -> Collective:
    each = 2 * (n - 1) / n * nbytes
    return Collective(op, 2 * (n - 1), each, each, each, reduce_bytes=(n - 1) / n * nbytes)


def _plan(scheme: Scheme, d: int, n: int, rank: int = 0) -> tuple[list[Collective], dict[str, float]]:
    """The collectives of one vote of ``d`` elements and its compute (Compute field → elements)."""
    t = scheme.transport
    if n == 1:  # nothing travels; the votes still take a sign (the quantized vote still quantizes)
        work = {} if t == "dense" else {"elementwise_s_per_elem": d}
        if t == "quantized":
            work["quantize_s_per_elem"] = d
        return [], work
    if t == "dense":
        passes = 1 if scheme.wire_bits == 32 else 2  # copy/scale (+ cast back)
        op = {32: "allreduce_f32", 16: "allreduce_bf16"}.get(scheme.wire_bits, "allreduce_f32")
        padded = -(-d // n) * n  # LionCub's dense mean pads to a multiple of N (≤ N−1 elements more than DDP)
        return [_ring(op, padded * scheme.wire_bits / 8, n)], {"elementwise_s_per_elem": passes * d}
    if t == "int8":
        return [_ring("allreduce_i8", d, n)], {"elementwise_s_per_elem": 2 * d}
    if t in ("lanes", "quantized"):
        bits = lane_bits(scheme, n)
        assert bits is not None
        work: dict[str, float] = {}
        if t == "quantized":
            work["quantize_s_per_elem"] = d
        if t == "quantized" and bits == 8:
            work["elementwise_s_per_elem"] = d
            return [_ring("allreduce_i8", d, n)], work
        work["lane_pack_s_per_elem"] = d
        work["lane_unpack_s_per_elem"] = d
        return [_ring("allreduce_u8", _packed(d, bits), n)], work
    if t == "1bit":
        padded = -(-d // (8 * n)) * 8 * n  # bits
        each = (n - 1) / n * padded / 8
        phases = [Collective(op, n - 1, each, each, each) for op in ("all_to_all", "all_gather")]
        work = {
            "pack_s_per_elem": d,
            "count_s_per_elem": padded,  # N slices of padded/N votes, counted and the result packed
            "unpack_s_per_elem": d,
        }
        return phases, work
    # server: N−1 messages into the root, then N−1 out; the root's link is the bottleneck
    down_bits = server_down_bits(scheme, n)
    assert down_bits is not None
    up, down = _packed(d, 1), _packed(d, down_bits)
    root = rank == 0
    gather = Collective("gather_root", n - 1, (n - 1) * up, 0 if root else up, (n - 1) * up if root else 0)
    scatter = Collective(
        "scatter_root", n - 1, (n - 1) * down, (n - 1) * down if root else 0, 0 if root else down
    )
    work = {
        "pack_s_per_elem": d,
        "count_s_per_elem": n * up * 8,  # at the root: N workers' votes
        "lane_pack_s_per_elem": d,
        "lane_unpack_s_per_elem": d,
    }
    return [gather, scatter], work


def wire_bytes(variant: str | Scheme | Any, d: int, n_workers: int, rank: int = 0) -> tuple[float, float]:
    """(sent, received) bytes of ``rank`` for one vote of ``d`` elements (as the vote classes count)."""
    _, scheme = resolve_scheme(variant)
    ok, why = allowed(scheme, n_workers)
    if not ok:
        raise ValueError(why)
    colls, _ = _plan(scheme, d, _check_n(n_workers), rank)
    return sum(c.sent for c in colls), sum(c.recv for c in colls)


# ------------------------------------------------------------------------- nodes: two levels of links

#: how a vote is laid over M nodes of L ranks (``lioncub.collectives.hierarchical``)
TOPOLOGIES = ("flat", "hierarchical", "node-majority")
#: the link inside a node (NVLink-class) where none is given: rate and latency
DEFAULT_INTRA_BANDWIDTH = "400gbit"
DEFAULT_INTRA_LATENCY = "5us"
#: the level of a :class:`Phase`: inside each node, between the nodes, or the whole group at once
LEVELS = ("intra", "inter", "flat")
_HIERARCHICAL_TRANSPORTS = ("1bit", "lanes", "int8", "quantized")


@dataclass(frozen=True)
class Cluster:
    """M nodes of L ranks, ranks numbered node by node (rank = node·L + local, as torchrun numbers them).

    Args:
        nnodes: M.
        nproc_per_node: L.
        inter: each node's NIC to the other nodes (α per message, rate per direction), shared by its L ranks.
        intra: each rank's link to the ranks of its own node (NVLink, PCIe, shared memory), per direction.
        flat: optional: the NIC as the whole group's collectives use it (α per message and rate per op of
            the flat schemes over all M·L ranks, as ``lioncub calibrate --nnodes`` measures them; their
            flows through a NIC differ in number and pattern from the inter-node collectives'); default
            ``inter``.
    """

    nnodes: int
    nproc_per_node: int
    inter: Network
    intra: Network
    flat: Network | None = None

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node"):
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")

    @property
    def n_workers(self) -> int:
        return self.nnodes * self.nproc_per_node


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


def _flat_phases(scheme: Scheme, d: int, m: int, ell: int) -> tuple[list[Phase], dict[str, float]]:
    """The flat scheme over M×L node-ordered ranks: the collectives of :func:`_plan`, split by level
    (:func:`_split`)."""
    colls, work = _plan(scheme, d, m * ell)
    return [_split(c, m, ell) for c in colls], work


def _split(c: Collective, m: int, ell: int) -> Phase:
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


def _quantized_levels(scheme: Scheme, n: int) -> int:
    """Per-worker level budget of a quantized vote (as ``lioncub.optim.config``'s and the vote's)."""
    bits = lane_bits(scheme, n) or 8
    return 127 // n if bits == 8 else ((1 << bits) - 1) // (2 * n)


def _intra_ring(op: str, nbytes: float, ell: int) -> Phase:
    each = 2 * (ell - 1) / ell * nbytes
    return Phase(op, "intra", 2 * (ell - 1), 0.0, 0.0, each, each, each, each, (ell - 1) / ell * nbytes)


def _intra_gather(nbytes_each: float, ell: int) -> Phase:
    each = (ell - 1) * nbytes_each
    return Phase("all_gather", "intra", ell - 1, 0.0, 0.0, each, each, each, each)


def hierarchical_lane_bits(variant: str | Scheme | Any, nnodes: int, nproc_per_node: int) -> int | None:
    """Lane width of the hierarchical vote's inter-node sum: the narrowest of 2, 4, 8 bits that holds the
    M-node sum of offset-encoded node sums (``M·L·(max + offset) ≤ 2^b − 1``); ``None``: int32 lanes."""
    _, scheme = resolve_scheme(variant)
    m, ell = nnodes, nproc_per_node
    top, offset = _vote_values(scheme, m * ell)
    span = ell * (top + offset)
    return next((b for b in (2, 4, 8) if span <= 255 and m * span <= (1 << b) - 1), None)


def _vote_values(scheme: Scheme, n: int) -> tuple[int, int]:
    """(largest |value| one rank contributes, offset of its lane encoding) of a vote's integer sum."""
    if scheme.transport == "quantized":
        levels = _quantized_levels(scheme, n)
        return levels, levels
    if scheme.transport == "int8":  # signs in {−1, 0, 1}, offset to {0, 1, 2}
        return 1, 1
    return 1, 0  # 0/1 votes (1bit, lanes)


def _hierarchical_phases(scheme: Scheme, d: int, m: int, ell: int) -> tuple[list[Phase], dict[str, float]]:
    """The exact hierarchical vote (``lioncub.collectives.hierarchical.HierarchicalVote``): intra-node
    allreduce of the ranks' integer values (int8, int32 past 127), inter-node ring allreduce of this local
    rank's slice (d/L elements) among the same-local-rank peers in the lanes of
    :func:`hierarchical_lane_bits`, intra-node all-gather of the summed slices."""
    n = m * ell
    top, _ = _vote_values(scheme, n)
    node_item = 1 if ell * top <= 127 else 4
    total_item = 1 if n * top <= 127 else 4
    k = -(-d // ell)
    bits = hierarchical_lane_bits(scheme, m, ell)
    phases: list[Phase] = []
    if ell > 1:
        phases.append(_intra_ring("allreduce_i8" if node_item == 1 else "allreduce_f32", d * node_item, ell))
    if m > 1:
        lanes, op = (_packed(k, bits), "allreduce_u8") if bits is not None else (4 * k, "allreduce_f32")
        each = 2 * (m - 1) / m * lanes
        phases.append(
            Phase(op, "inter", 2 * (m - 1), ell * each, ell * each, 0.0, 0.0, each, each, (m - 1) / m * lanes)
        )
    if ell > 1:
        phases.append(_intra_gather(k * total_item, ell))
    work = {"elementwise_s_per_elem": 2 * d, "lane_pack_s_per_elem": k, "lane_unpack_s_per_elem": k}
    if scheme.transport == "quantized":
        work["quantize_s_per_elem"] = d
    return phases, work


def _node_majority_phases(d: int, m: int, ell: int) -> tuple[list[Phase], dict[str, float]]:
    """The node-majority vote (``lioncub.collectives.hierarchical.NodeMajorityVote``): intra-node allreduce
    of the 0/1 votes (int8), each node's majority, a 1-bit vote among the nodes on this local rank's slice
    (pairwise all-to-all and all-gather of d/L bits, padded to 8M), intra-node all-gather (int8)."""
    k = -(-d // ell)
    phases: list[Phase] = []
    if ell > 1:
        phases.append(
            _intra_ring("allreduce_i8" if ell <= 127 else "allreduce_f32", d * (1 if ell <= 127 else 4), ell)
        )
    padded = -(-k // (8 * m)) * 8 * m
    if m > 1:
        each = (m - 1) / m * padded / 8
        for op in ("all_to_all", "all_gather"):
            phases.append(Phase(op, "inter", m - 1, ell * each, ell * each, 0.0, 0.0, each, each))
    if ell > 1:
        phases.append(_intra_gather(k, ell))
    work = {
        "elementwise_s_per_elem": 2 * d,
        "pack_s_per_elem": k,
        "count_s_per_elem": padded,
        "unpack_s_per_elem": k,
    }
    return phases, work


def topology_allowed(variant: str | Scheme | Any, topology: str, n_workers: int) -> tuple[bool, str]:
    """Whether ``variant`` can run as ``topology`` on N workers; ``(False, why)`` otherwise."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: allowed values are {list(TOPOLOGIES)}")
    _, scheme = resolve_scheme(variant)
    ok, why = allowed(scheme, n_workers)
    if not ok:
        return ok, why
    if topology == "hierarchical" and scheme.transport not in _HIERARCHICAL_TRANSPORTS:
        return False, (
            f"the {scheme.transport} transport has no hierarchical form; it applies to the votes (1bit, "
            "4bit, 8bit, 8bit-sign, dlion-avg)"
        )
    if topology == "node-majority" and scheme.transport != "1bit":
        return (
            False,
            "node-majority is a 1-bit vote among node majorities; it applies to the 1bit variant only",
        )
    return True, ""


@dataclass(frozen=True)
class ClusterPrediction:
    """Predicted cost of one optimizer step's vote for one variant laid over a :class:`Cluster` as
    ``topology`` (seconds; bytes per step). ``bytes_*``: all the bytes of the busiest rank; ``nic_*``: bytes
    through the busiest node's NIC (inter-node); ``intra_*``: bytes of the busiest rank inside its node.
    NaN when not ``allowed`` (``reason`` says why)."""

    variant: str
    topology: str
    d: int
    nnodes: int
    nproc_per_node: int
    allowed: bool
    reason: str
    latency_s: float
    bandwidth_s: float
    compute_s: float
    sync_s: float
    bytes_sent: float
    bytes_recv: float
    nic_sent: float
    nic_recv: float
    intra_sent: float
    intra_recv: float
    phases: tuple[Phase, ...] = ()

    @property
    def n_workers(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s + self.compute_s

    @property
    def exact(self) -> bool:
        """Whether the topology computes the flat vote's result (node-majority is another estimator)."""
        return self.topology != "node-majority"


def topology_phases(
    variant: str | Scheme | Any, d: int, nnodes: int, nproc_per_node: int, topology: str = "flat"
) -> tuple[list[Phase], dict[str, float]]:
    """The phases of one vote of ``d`` elements and its compute (Compute field → elements)."""
    _, scheme = resolve_scheme(variant)
    m, ell = nnodes, nproc_per_node
    ok, why = topology_allowed(scheme, topology, m * ell)
    if not ok:
        raise ValueError(why)
    if topology == "flat" or m * ell == 1:
        return _flat_phases(scheme, d, m, ell)
    if topology == "hierarchical":
        return _hierarchical_phases(scheme, d, m, ell)
    return _node_majority_phases(d, m, ell)


def predict_cluster(
    variant: str | Scheme | Any,
    d: int,
    cluster: Cluster,
    topology: str = "flat",
    compute: Compute | None = None,
    *,
    sync_every: int | None = None,
    sync_params: int | None = None,
    bucket_numel: int | None = None,
) -> ClusterPrediction:
    """Predicted per-step cost of ``variant`` laid over ``cluster`` as ``topology`` (options as
    :func:`predict`; the momentum sync is a flat fp32 ring allreduce in every topology). With one rank per
    node and ``topology="flat"`` this is :func:`predict` on the NIC's network."""
    name, scheme = resolve_scheme(variant)
    if not is_int(d, 1):
        raise ValueError(f"d={d!r} must be an int >= 1 (parameters)")
    m, ell = cluster.nnodes, cluster.nproc_per_node
    n = m * ell
    compute = compute or Compute()
    ok, why = topology_allowed(scheme, topology, n)
    if not ok:
        nan = math.nan
        return ClusterPrediction(name, topology, d, m, ell, False, why, *([nan] * 10))
    if sync_params is not None and sync_every is None:
        raise ValueError(
            f"sync_params={sync_params!r} needs sync_every (how often those parameters are synchronised)"
        )
    if sync_params is not None and not is_int(sync_params, 0, d):
        raise ValueError(f"sync_params={sync_params!r} must be an int within [0, d={d}] (parameters)")
    if sync_every is not None and not is_int(sync_every, 1):
        raise ValueError(f"sync_every={sync_every!r} must be an int >= 1 (steps)")
    phases: list[Phase] = []
    compute_s = 0.0
    for size, count in _buckets(d, bucket_numel):
        bucket, work = topology_phases(scheme, size, m, ell, topology)
        phases += [dataclasses.replace(p, count=p.count * count) for p in bucket]
        compute_s += count * sum(getattr(compute, k) * v for k, v in work.items())
    sync: list[Phase] = []
    d_sync = d if sync_params is None else sync_params
    if sync_every is not None and n > 1 and d_sync:
        sync = [
            dataclasses.replace(_split(_ring("allreduce_f32", 4 * d_sync, n), m, ell), count=1 / sync_every)
        ]
    latency = bandwidth = sync_s = 0.0
    for i, p in enumerate(phases + sync):
        lat, bw, red = p.seconds(cluster, compute)
        latency, bandwidth, compute_s = latency + lat, bandwidth + bw, compute_s + red
        if i >= len(phases):
            sync_s += lat + bw + red
    every = phases + sync

    def total(attr: str) -> float:
        return sum(p.count * getattr(p, attr) for p in every)

    return ClusterPrediction(
        name, topology, d, m, ell, True, "", latency, bandwidth, compute_s, sync_s,
        total("sent"), total("recv"), total("nic_sent"), total("nic_recv"), total("intra_sent"),
        total("intra_recv"), tuple(every),
    )  # fmt: skip


def cluster_table(
    d: int,
    cluster: Cluster,
    compute: Compute | None = None,
    variants: Iterable[str | Scheme | Any] | None = None,
    topologies: Iterable[str] = TOPOLOGIES,
    **options: Any,
) -> list[ClusterPrediction]:
    """Predictions for every variant (default: every preset) × topology, in that order."""
    return [
        predict_cluster(v, d, cluster, t, compute, **options)
        for v in (PRESET_SCHEMES if variants is None else variants)
        for t in topologies
    ]


# --------------------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one optimizer step's vote for one variant (seconds; bytes per rank per step).

    ``total_s = latency_s + bandwidth_s + compute_s``; ``sync_s`` is the part of it due to the amortised
    momentum sync. Bytes are those of the busiest rank (the server's root). A variant that is not
    ``allowed`` for N workers has NaN times and bytes and ``reason`` says why.
    """

    variant: str
    d: int
    n_workers: int
    allowed: bool
    reason: str
    latency_s: float
    bandwidth_s: float
    compute_s: float
    sync_s: float
    bytes_sent: float
    bytes_recv: float
    collectives: tuple[Collective, ...] = ()

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s + self.compute_s

    @property
    def communication_s(self) -> float:
        return self.latency_s + self.bandwidth_s


def _buckets(d: int, bucket_numel: int | None) -> list[tuple[int, int]]:
    """(elements, how many) of the buckets a flat vector of d elements is split into."""
    if bucket_numel is None:
        return [(d, 1)]
    if not is_int(bucket_numel, 1):
        raise ValueError(f"bucket_numel={bucket_numel!r} must be None (one bucket) or an int >= 1")
    if bucket_numel >= d:
        return [(d, 1)]
    full, rest = divmod(d, bucket_numel)
    return [(bucket_numel, full)] + ([(rest, 1)] if rest else [])


def predict(
    variant: str | Scheme | Any,
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    *,
    sync_every: int | None = None,
    sync_params: int | None = None,
    bucket_numel: int | None = None,
) -> Prediction:
    """Predicted per-step cost of ``variant`` (preset name, :class:`Scheme` or ``VoteConfig``).

    Args:
        d: parameters voted on per step.
        n_workers: N.
        network: α, link rate and efficiencies.
        compute: local per-element costs (default: none).
        sync_every: k, synchronise the momentum (fp32 allreduce) every k steps (None: never).
        sync_params: parameters synchronised (default: all d).
        bucket_numel: the vector travels in buckets of this many elements (LionCub's ``bucket_mb``); each
            bucket pays its own latency (and 1-bit padding). None: one bucket.
    """
    name, scheme = resolve_scheme(variant)
    n = _check_n(n_workers)
    if not is_int(d, 1):
        raise ValueError(f"d={d!r} must be an int >= 1 (parameters)")
    compute = compute or Compute()
    ok, why = allowed(scheme, n)
    if not ok:
        nan = math.nan
        return Prediction(name, d, n, False, why, nan, nan, nan, nan, nan, nan)
    colls: list[Collective] = []
    compute_s = 0.0
    for size, count in _buckets(d, bucket_numel):
        bucket_colls, work = _plan(scheme, size, n)
        colls += [dataclasses.replace(c, count=c.count * count) for c in bucket_colls]
        compute_s += count * sum(getattr(compute, k) * v for k, v in work.items())
    sync: list[Collective] = []
    if sync_params is not None:
        if sync_every is None:
            raise ValueError(
                f"sync_params={sync_params!r} needs sync_every (how often those parameters are synchronised)"
            )
        if not is_int(sync_params, 0, d):
            raise ValueError(f"sync_params={sync_params!r} must be an int within [0, d={d}] (parameters)")
    if sync_every is not None:
        if not is_int(sync_every, 1):
            raise ValueError(f"sync_every={sync_every!r} must be an int >= 1 (steps)")
        d_sync = d if sync_params is None else sync_params
        if n > 1 and d_sync:
            sync = [dataclasses.replace(_ring("allreduce_f32", 4 * d_sync, n), count=1 / sync_every)]
    latency = bandwidth = sync_s = 0.0
    for i, c in enumerate(colls + sync):
        lat, bw, red = c.seconds(network, compute)
        latency += lat
        bandwidth += bw
        compute_s += red
        if i >= len(colls):
            sync_s += lat + bw + red
    everything = colls + sync
    return Prediction(
        name,
        d,
        n,
        True,
        "",
        latency,
        bandwidth,
        compute_s,
        sync_s,
        sum(c.count * c.sent for c in everything),
        sum(c.count * c.recv for c in everything),
        tuple(everything),
    )


def table(
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    variants: Iterable[str | Scheme | Any] | None = None,
    **options: Any,
) -> list[Prediction]:
    """Predictions for ``variants`` (default: every preset, in order); ``options`` as :func:`predict`."""
    return [
        predict(v, d, n_workers, network, compute, **options)
        for v in (PRESET_SCHEMES if variants is None else variants)
    ]


def winner(
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    variants: Iterable[str | Scheme | Any] | None = None,
    **options: Any,
) -> Prediction:
    """The allowed variant with the smallest predicted ``total_s`` (the first one on a tie)."""
    every = table(d, n_workers, network, compute, variants, **options)
    rows = [p for p in every if p.allowed]
    if not rows:
        why = "; ".join(f"{p.variant}: {p.reason}" for p in every)
        fits = [name for name in PRESET_SCHEMES if allowed(name, n_workers)[0]]
        raise ValueError(
            f"no variant is allowed for N={n_workers} ({why}); presets that allow N={n_workers}: {fits}"
        )
    return min(rows, key=lambda p: p.total_s)


def _as_network(latency: float | Network) -> Network:
    if isinstance(latency, Network):
        return latency
    return Network(float(latency), 1.0, 1.0)


def crossover_bandwidth(
    a: str | Scheme | Any,
    b: str | Scheme | Any,
    d: int,
    n_workers: int,
    latency: float | Network,
    compute: Compute | None = None,
    **options: Any,
) -> float | None:
    """Link rate (bytes/s) at which ``a`` and ``b`` cost the same, or None if they never do.

    Every prediction is ``K + W/B`` in the link rate B, so the crossing is ``B = −ΔW/ΔK``. ``latency`` is α
    in seconds or a :class:`Network` (whose latencies and efficiencies are kept; its rate is ignored).
    Raises ``ValueError`` if either variant is not allowed for N workers.
    """
    net = _as_network(latency).with_bandwidth(1.0)
    pa = predict(a, d, n_workers, net, compute, **options)
    pb = predict(b, d, n_workers, net, compute, **options)
    for p in (pa, pb):
        if not p.allowed:
            raise ValueError(f"{p.variant} is not allowed for N={n_workers}: {p.reason}")
    ka, kb = pa.latency_s + pa.compute_s, pb.latency_s + pb.compute_s
    dk = ka - kb
    dw = pa.bandwidth_s - pb.bandwidth_s  # at B = 1 byte/s, bandwidth_s is W
    if abs(dk) <= 1e-12 * max(ka, kb) or abs(dw) <= 1e-12 * max(pa.bandwidth_s, pb.bandwidth_s):
        return None  # equal up to rounding: parallel lines never cross
    rate = -dw / dk
    return rate if rate > 0 and math.isfinite(rate) else None


def regimes(
    d: int,
    n_workers: int,
    latency: float | Network,
    compute: Compute | None = None,
    variants: Iterable[str | Scheme | Any] | None = None,
    lo_Bps: float = 10e6 / 8,
    hi_Bps: float = 400e9 / 8,
    **options: Any,
) -> list[tuple[float, float, str]]:
    """The winner over link rates ``[lo_Bps, hi_Bps]`` (bytes/s): ``[(from, to, variant), ...]``."""
    net = _as_network(latency)
    names = [p.variant for p in table(d, n_workers, net, compute, variants, **options) if p.allowed]
    schemes = {resolve_scheme(v)[0]: v for v in (PRESET_SCHEMES if variants is None else variants)}
    cuts = {lo_Bps, hi_Bps}
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            rate = crossover_bandwidth(schemes[x], schemes[y], d, n_workers, net, compute, **options)
            if rate is not None and lo_Bps < rate < hi_Bps:
                cuts.add(rate)
    edges = sorted(cuts)
    out: list[tuple[float, float, str]] = []
    for lo, hi in itertools.pairwise(edges):
        mid = math.sqrt(lo * hi)
        best = winner(d, n_workers, net.with_bandwidth(mid), compute, schemes.values(), **options).variant
        if out and out[-1][2] == best:
            out[-1] = (out[-1][0], hi, best)
        else:
            out.append((lo, hi, best))
    return out


# -------------------------------------------------------------------------------------- calibration

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What ``lioncub calibrate`` measured: the network (with per-op fits) and the compute costs.

    A calibration of M nodes of L ranks (``nnodes`` set, ``intra`` not None) has two levels: ``network``
    is a node's NIC to the other nodes (the rate of all its ranks together) and ``intra`` a rank's link to
    the ranks of its own node; :meth:`cluster` lays them out as a :class:`Cluster`. Otherwise ``network``
    is each rank's own link and ``intra`` is None.
    """

    network: Network
    compute: Compute
    world_size: int
    link_bps: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    intra: Network | None = None
    nnodes: int | None = None
    intra_link_bps: float | None = None
    flat: Network | None = None

    def __post_init__(self) -> None:
        if (self.intra is None) != (self.nnodes is None):
            raise ValueError("Calibration: intra and nnodes go together (a two-level calibration has both)")
        if self.nnodes is not None and not (
            is_int(self.nnodes, 2) and self.world_size % self.nnodes == 0 and self.world_size > self.nnodes
        ):
            raise ValueError(
                f"Calibration: nnodes={self.nnodes!r} must be an int >= 2 dividing world_size="
                f"{self.world_size} into nodes of at least 2 ranks"
            )

    @property
    def nproc_per_node(self) -> int | None:
        return None if self.nnodes is None else self.world_size // self.nnodes

    def cluster(self, nnodes: int | None = None, nproc_per_node: int | None = None) -> Cluster:
        """The two levels as a :class:`Cluster` of ``nnodes`` × ``nproc_per_node`` (default: the layout
        calibrated). Needs a two-level calibration."""
        if self.intra is None or self.nnodes is None:
            raise ValueError(
                "this calibration has one level (a link per rank); calibrate on nodes of several ranks "
                "(`lioncub calibrate --nnodes M --nproc-per-node L`) for both levels"
            )
        return Cluster(
            self.nnodes if nnodes is None else nnodes,
            int(self.nproc_per_node) if nproc_per_node is None else nproc_per_node,
            self.network,
            self.intra,
            self.flat,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (``raw`` entries such as fit details are kept)."""
        doc = dict(self.raw)
        doc.update(
            version=CALIBRATION_VERSION,
            world_size=self.world_size,
            link_bps=self.link_bps,
            network=_network_json(self.network),
        )
        doc["per_op"] = _per_op_json(doc.get("per_op", {}), self.network)
        if self.intra is not None:
            doc.update(
                nnodes=self.nnodes,
                intra_link_bps=self.intra_link_bps,
                intra_network=_network_json(self.intra),
            )
            doc["intra_per_op"] = _per_op_json(doc.get("intra_per_op", {}), self.intra)
        if self.flat is not None:
            doc["flat_network"] = _network_json(self.flat)
            doc["flat_per_op"] = _per_op_json(doc.get("flat_per_op", {}), self.flat)
        doc["compute"] = dataclasses.asdict(self.compute)
        return doc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")


def _network_json(network: Network) -> dict[str, float]:
    return {
        "latency_s": network.latency_s,
        "bandwidth_Bps": network.bandwidth_Bps,
        "efficiency": network.efficiency,
    }


def _per_op_json(fits: Any, network: Network) -> dict[str, dict[str, Any]]:
    """The per-op fit details of ``fits`` with each op's α and efficiency from ``network``."""
    per_op = {k: dict(v) for k, v in dict(fits).items()}
    for op, cost in network.per_op.items():
        per_op.setdefault(op, {}).update(latency_s=cost.latency_s, efficiency=cost.efficiency)
    return per_op


def _network_from_json(doc: Mapping[str, Any], net_key: str, ops_key: str, where: str) -> Network:
    net = doc.get(net_key)
    if not isinstance(net, Mapping):
        raise ValueError(f"{where}: {net_key!r} must be an object with latency_s and bandwidth_Bps")
    per_op: dict[str, OpCost] = {}
    for op, fit in dict(doc.get(ops_key) or {}).items():
        if op not in OPS:
            continue  # written by a newer calibrate: not used by this model
        if not isinstance(fit, Mapping):
            raise ValueError(f"{where}: {ops_key}[{op!r}] must be an object")
        if fit.get("ok", True) is False:
            continue  # the fit failed (e.g. a slope <= 0): fall back to the network's values
        per_op[op] = OpCost(
            _number(fit, "latency_s", f"{where}: {ops_key}[{op!r}]"),
            _number(fit, "efficiency", f"{where}: {ops_key}[{op!r}]", positive=True),
        )
    return Network(
        _number(net, "latency_s", f"{where}: {net_key}"),
        _number(net, "bandwidth_Bps", f"{where}: {net_key}", positive=True),
        _number(net, "efficiency", f"{where}: {net_key}", positive=True) if "efficiency" in net else 1.0,
        per_op,
    )


def _number(doc: Mapping[str, Any], key: str, where: str, *, positive: bool = False) -> float:
    value = doc.get(key)
    if not is_number(value):
        raise ValueError(f"{where}: {key!r} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {key!r} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def calibration_from_json(doc: Mapping[str, Any], where: str = "calibration") -> Calibration:
    """Validate and read a calibration document (see :func:`load_calibration`)."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected a JSON object")
    if doc.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"{where}: version {doc.get('version')!r} is not {CALIBRATION_VERSION}")
    network = _network_from_json(doc, "network", "per_op", where)
    comp = doc.get("compute") or {}
    if not isinstance(comp, Mapping):
        raise ValueError(f"{where}: 'compute' must be an object")
    known = {f.name for f in dataclasses.fields(Compute)}
    compute = Compute(**{k: _number(comp, k, f"{where}: compute") for k in comp if k in known})
    world = doc.get("world_size")
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"{where}: 'world_size' must be an int >= 1, got {world!r}")
    link = doc.get("link_bps")
    link_bps = None if link is None else _number(doc, "link_bps", where, positive=True)
    if doc.get("nnodes") is None:
        return Calibration(network, compute, world, link_bps, dict(doc))
    nnodes = doc["nnodes"]
    if not (is_int(nnodes, 2) and world % nnodes == 0 and world > nnodes):
        raise ValueError(
            f"{where}: 'nnodes' must be an int >= 2 dividing world_size={world} into nodes of at least 2 "
            f"ranks, got {nnodes!r}"
        )
    intra = _network_from_json(doc, "intra_network", "intra_per_op", where)
    intra_link = doc.get("intra_link_bps")
    intra_bps = None if intra_link is None else _number(doc, "intra_link_bps", where, positive=True)
    flat = _network_from_json(doc, "flat_network", "flat_per_op", where) if "flat_network" in doc else None
    return Calibration(network, compute, world, link_bps, dict(doc), intra, nnodes, intra_bps, flat)


def load_calibration(path: str | Path) -> Calibration:
    """Read a JSON file written by ``lioncub calibrate`` (raises ``ValueError`` naming the file)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration {path} is not valid JSON: {exc}") from None
    return calibration_from_json(doc, str(path))


def speedups(rows: Sequence[Prediction], baseline: str = "32bit") -> dict[str, float]:
    """``baseline``'s total time / each allowed variant's (empty if the baseline is not among ``rows``)."""
    base = next((p for p in rows if p.variant == baseline and p.allowed), None)
    if base is None:
        return {}
    return {p.variant: base.total_s / p.total_s for p in rows if p.allowed and p.total_s > 0}
