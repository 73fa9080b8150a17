"""The machine the cost model prices a step on (:mod:`lioncub.planning.costmodel`): the links
(:class:`Network`: α in seconds per message, rates in bytes/s, and per collective where measured), the
local compute (:class:`Compute`: seconds per element or byte) and nodes of several ranks (:class:`Cluster`:
a NIC per node and a link per rank inside it). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lioncub._validate import is_int

__all__ = [
    "DEFAULT_CPU_COMPUTE",
    "DEFAULT_INTRA_BANDWIDTH",
    "DEFAULT_INTRA_LATENCY",
    "OPS",
    "TCP_EFFICIENCY",
    "Cluster",
    "Compute",
    "Network",
    "OpCost",
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


#: Per-element costs measured with :func:`lioncub.planning.measure.measure_compute` (one thread, 4M
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


#: the link inside a node (NVLink-class) where none is given: rate and latency
DEFAULT_INTRA_BANDWIDTH = "400gbit"
DEFAULT_INTRA_LATENCY = "5us"


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
