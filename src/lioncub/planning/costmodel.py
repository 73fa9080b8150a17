r"""α–β–γ cost model of one optimizer step's communication for every Lion Cub / D-Lion transport: the
public names of the modules below, in one place.

Time of one collective = ``messages · α + wire_bytes / (bandwidth · efficiency) + γ · reduced_bytes`` with
(the Lion Cub paper §3.8, Thakur et al. 2005), for d parameters on N workers; the bytes per rank are
:meth:`VoteConfig.wire_bytes <lioncub.optim.config.VoteConfig.wire_bytes>` (the table of
:mod:`lioncub.transports`), carried by:

=======================  ====================================================================
transport                collectives (critical path)
=======================  ====================================================================
dense fp32 / bf16        ring allreduce: 2(N−1) α
int8 (sign sum, D-Lion   ring allreduce of int8: 2(N−1) α
avg), quantized 8-bit
p-bit lanes / quantized  uint8 ring allreduce: 2(N−1) α
2/4-bit
1-bit                    pairwise all-to-all, then all-gather: (N−1) α each
parameter server         N−1 messages into the root, then N−1 out of it (linear in N)
momentum sync every k    fp32 ring allreduce of d_sync (``2(N−1)/N · 4 d_sync`` bytes), amortised: ``/k``
=======================  ====================================================================

The bandwidth term charges the bytes that cross the busiest link direction (each rank's full-duplex link
for the ring and the pairwise exchanges, the root's link for the server). Compute is charged per element
with the costs of :class:`Compute` (quantize, pack, unpack, the 1-bit count, ...), on the critical path and
not overlapped with communication. A variant whose lanes could overflow for N workers (``4bit`` for
N ≥ 16, int8 for N > 127, ...: :func:`lioncub.transports.capacity`) is *not allowed*: its
:class:`Prediction` says why and carries NaN times.

============================================  ==========================================================
module                                        what
============================================  ==========================================================
:mod:`~lioncub.planning.machine`              :class:`Network`, :class:`OpCost`, :class:`Compute`,
                                              :class:`Cluster`: the machine a step is priced on
:mod:`~lioncub.planning.flat`                 a variant (preset name or ``VoteConfig``), its collectives
                                              on one level of links, :func:`predict`
:mod:`~lioncub.planning.nodes`                M nodes of L ranks: :class:`Phase` by level, the
                                              topologies, :func:`predict_cluster`
:mod:`~lioncub.planning.queries`              :func:`table`, :func:`winner`, :func:`crossover_bandwidth`,
                                              :func:`regimes`, :func:`speedups`, :func:`cluster_table`
:mod:`~lioncub.planning.calibration`          the calibration file: :class:`Calibration`,
                                              :func:`load_calibration`
============================================  ==========================================================

A calibration (``lioncub calibrate``, :mod:`lioncub.planning.measure`) measures α and the efficiency of
every collective separately (:class:`OpCost`), folds the local reduction into them
(``reduce_s_per_byte = 0``) and measures the compute costs of this CPU.

This module and those above do not import torch.
"""

from __future__ import annotations

from lioncub.planning.calibration import (
    CALIBRATION_VERSION,
    Calibration,
    calibration_from_json,
    load_calibration,
)
from lioncub.planning.flat import (
    Collective,
    Prediction,
    Variant,
    allowed,
    predict,
    resolve_config,
    wire_bytes,
)
from lioncub.planning.machine import (
    DEFAULT_CPU_COMPUTE,
    DEFAULT_INTRA_BANDWIDTH,
    DEFAULT_INTRA_LATENCY,
    OPS,
    TCP_EFFICIENCY,
    Cluster,
    Compute,
    Network,
    OpCost,
)
from lioncub.planning.nodes import (
    LEVELS,
    TOPOLOGIES,
    ClusterPrediction,
    Phase,
    hierarchical_lane_bits,
    nic_share,
    predict_cluster,
    topology_allowed,
    topology_phases,
)
from lioncub.planning.queries import cluster_table, crossover_bandwidth, regimes, speedups, table, winner
from lioncub.units import parse_bandwidth, parse_count, parse_duration

__all__ = [
    "CALIBRATION_VERSION",
    "DEFAULT_CPU_COMPUTE",
    "DEFAULT_INTRA_BANDWIDTH",
    "DEFAULT_INTRA_LATENCY",
    "LEVELS",
    "OPS",
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
    "Variant",
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
    "resolve_config",
    "speedups",
    "table",
    "topology_allowed",
    "topology_phases",
    "winner",
    "wire_bytes",
]
