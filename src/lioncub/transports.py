r"""What each transport puts on the wire, stated once: widths, the rule that keeps integer sums from
overflowing, and the bytes per rank. ``optim`` (validation of a :class:`~lioncub.optim.config.VoteConfig`),
``collectives`` (the vote classes) and ``planning`` (the cost model) all read these facts from here.
Imports nothing of lioncub and not torch.

=============  ====================  ==============  =================================================
transport      aggregations          lane widths     bytes one rank sends (and receives) per vote of d
=============  ====================  ==============  =================================================
``dense``      mean                  —               ``2(N−1)/N · ⌈d/N⌉N · wire_bits/8``
``1bit``       majority              1               ``2(N−1)/N · ⌈d/8N⌉8N / 8``
``lanes``      majority              2, 4 (def.), 8  ``2(N−1)/N · ⌈d·p/8⌉``
``int8``       majority, average     8               ``2(N−1)/N · d``
``quantized``  majority              2, 4, 8 (def.)  ``2(N−1)/N · ⌈d·p/8⌉``
``server``     majority, average     1 up, p down    worker: ``⌈d/8⌉`` up, ``⌈d·p/8⌉`` down; root: N−1 ×
=============  ====================  ==============  =================================================

**Capacity.** An integer lane of ``p`` bits summed over N workers, each contributing at most ``v``, cannot
overflow exactly when ``N·v ≤ 2^p − 1`` (:func:`lane_sum_fits`). From that rule: a lane vote holds 0/1
votes (``v = 1``); a quantized vote gives each worker the level budget ``s`` of :func:`level_budget`
(signed int8: ``s = ⌊127/N⌋``; offset p-bit lanes: ``s = ⌊(2^p − 1)/2N⌋``); the parameter server sends
back ``u + 1 ∈ {0, 1, 2}`` (majority, 2-bit lanes) or the vote count (average, the narrowest lane that
holds ``N + 1`` values).

**Topologies.** How a vote is laid over nodes of several ranks: ``flat`` (every rank alike),
``hierarchical`` (exact: node sums, then sums over the nodes in lanes of :func:`hierarchical_lane_bits`)
or ``node-majority`` (the 1-bit vote of node majorities, another estimator); see
:mod:`lioncub.collectives.hierarchical`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AGGREGATIONS",
    "LANE_WIDTHS",
    "TOPOLOGIES",
    "TRANSPORTS",
    "Transport",
    "capacity",
    "flat_wire_bytes",
    "hierarchical_lane_bits",
    "hierarchical_level_bytes",
    "hierarchical_payloads",
    "lane_bits",
    "lane_sum_fits",
    "level_budget",
    "max_lane_workers",
    "node_majority_level_bytes",
    "node_majority_payloads",
    "packed_size",
    "padded_numel",
    "server_down_bits",
    "vote_values",
]

#: every transport's name (:data:`FACTS`)
TRANSPORTS = ("dense", "1bit", "lanes", "int8", "quantized", "server")
#: how the workers' contributions are combined
AGGREGATIONS = ("mean", "majority", "average")
#: how a vote is laid over the ranks of several nodes
TOPOLOGIES = ("flat", "hierarchical", "node-majority")
#: the widths of a packed integer lane (a lane vote or a quantized vote takes 2, 4 or 8)
LANE_WIDTHS = (2, 4, 8)

Encoding = Literal["signed", "offset", "vote"]


@dataclass(frozen=True)
class Transport:
    """The fixed facts of one transport.

    Attributes:
        name: its key in :data:`FACTS`.
        aggregations: the aggregations it can carry.
        widths: the lane widths ``bits`` may choose (``()``: the width is fixed).
        fixed_bits: the ``bits`` values accepted when the width is fixed (``None``: not stated).
        default_bits: the width when ``bits`` is not given (lanes 4, quantized 8; ``None`` when fixed).
        topologies: how it can be laid over nodes.
    """

    name: str
    aggregations: tuple[str, ...]
    widths: tuple[int, ...] = ()
    fixed_bits: tuple[int | None, ...] = (None,)
    default_bits: int | None = None
    topologies: tuple[str, ...] = ("flat",)


FACTS: dict[str, Transport] = {
    "dense": Transport("dense", ("mean",)),
    "1bit": Transport("1bit", ("majority",), fixed_bits=(None, 1), topologies=TOPOLOGIES),
    "lanes": Transport(
        "lanes", ("majority",), LANE_WIDTHS, default_bits=4, topologies=("flat", "hierarchical")
    ),
    "int8": Transport(
        "int8", ("majority", "average"), fixed_bits=(None, 8), topologies=("flat", "hierarchical")
    ),
    "quantized": Transport(
        "quantized", ("majority",), LANE_WIDTHS, default_bits=8, topologies=("flat", "hierarchical")
    ),
    "server": Transport("server", ("majority", "average"), fixed_bits=(None, 1)),
}


# ------------------------------------------------------------------------------------------- capacity


def packed_size(n: int, bits: int = 1) -> int:
    """Bytes holding ``n`` lanes of ``bits`` bits (1, 2, 4 or 8), 8/bits per byte."""
    per_byte = 8 // bits
    return -(-n // per_byte)


def lane_sum_fits(n_workers: int, bits: int, max_lane_value: int) -> bool:
    """Whether N lanes each holding at most ``max_lane_value`` can be summed in a ``bits``-bit lane:
    exactly when ``n_workers · max_lane_value ≤ 2**bits − 1`` (the largest possible sum fits)."""
    return n_workers * max_lane_value <= (1 << bits) - 1


def max_lane_workers(bits: int, max_lane_value: int) -> int:
    """The largest N for which :func:`lane_sum_fits` holds (``max_lane_value ≥ 1``)."""
    return ((1 << bits) - 1) // max_lane_value


def level_budget(n_workers: int, bits: int, encoding: Encoding = "signed") -> tuple[int, int]:
    """``(s, max_n)``: the largest per-worker level ``s`` whose integer SUM over N workers cannot overflow
    ``bits`` bits (0 when none), and the most workers any budget serves at this width.

    * ``"signed"``: two's-complement sum of levels in ``[−s, s]``: ``s = ⌊(2^(p−1) − 1)/N⌋``;
    * ``"offset"``: unsigned lanes holding ``q + s ∈ [0, 2s]``: ``s = ⌊(2^p − 1)/(2N)⌋``;
    * ``"vote"``: unsigned lanes holding 0/1 votes: 1 when ``N ≤ 2^p − 1``."""
    if encoding == "signed":
        top = (1 << (bits - 1)) - 1
        return top // n_workers, top
    top = (1 << bits) - 1
    if encoding == "offset":
        return top // (2 * n_workers), top // 2
    if encoding == "vote":
        return int(n_workers <= top), top
    raise ValueError(f"encoding={encoding!r} is not one of 'signed', 'offset', 'vote'")


def quantized_levels(bits: int, n_workers: int) -> int:
    """A quantized vote's level budget per worker (0: overflow): signed int8 for 8 bits, offset lanes
    below."""
    return level_budget(n_workers, bits, "signed" if bits == 8 else "offset")[0]


def lane_bits(transport: str, bits: int | str | None, n_workers: int) -> int | None:
    """The lane width a ``"lanes"`` or ``"quantized"`` vote uses for N workers (``None`` for the other
    transports, or when ``bits="auto"`` finds no width: a lane vote past 255 workers). ``bits=None``
    means the transport's default width."""
    if transport not in ("lanes", "quantized"):
        return None
    if bits is None:
        return FACTS[transport].default_bits
    if bits != "auto":
        return int(bits)
    if transport == "lanes":
        if n_workers == 1:
            return 8
        return next((b for b in LANE_WIDTHS if lane_sum_fits(n_workers, b, 1)), None)
    return next((b for b in LANE_WIDTHS if quantized_levels(b, n_workers) >= 1), 8)


def server_down_bits(aggregation: str, n_workers: int) -> int | None:
    """Lane width of the parameter server's reply for N workers (``None``: no width holds the count)."""
    if aggregation != "average":
        return 2  # majority: u + 1 ∈ {0, 1, 2}
    return next((b for b in LANE_WIDTHS if lane_sum_fits(n_workers + 1, b, 1)), None)


def capacity(transport: str, aggregation: str, bits: int | str | None, n_workers: int) -> tuple[bool, str]:
    """Whether the integer lanes of a vote can hold its N-way sum; ``(False, why)`` otherwise."""
    n = n_workers
    if transport == "lanes":
        width = lane_bits(transport, bits, n)
        if width is None or not lane_sum_fits(n, width, 1):
            what = "no lane width up to 8 bits" if width is None else f"{width}-bit lanes"
            top = (1 << (width or 8)) - 1
            return False, f"{what} cannot hold the vote count of {n} workers (at most {top} workers)"
    elif transport == "int8" and not level_budget(n, 8, "signed")[0]:
        return False, f"an int8 sum of {n} signs can overflow (at most 127 workers)"
    elif transport == "quantized":
        width = lane_bits(transport, bits, n) or 8
        if quantized_levels(width, n) < 1:
            top = level_budget(n, width, "signed" if width == 8 else "offset")[1]
            return False, f"{width}-bit quantized levels summed over {n} workers can overflow (at most {top})"
    elif transport == "server" and server_down_bits(aggregation, n) is None:
        return False, f"the server's count lanes cannot hold {n} workers (at most 254)"
    return True, ""


# ----------------------------------------------------------------------------------------- wire bytes


def padded_numel(transport: str, d: int, n_workers: int) -> int:
    """Elements a flat vote of ``d`` elements over N workers exchanges: the dense mean pads to a multiple
    of N (``⌈d/N⌉N``), the 1-bit vote to whole bytes per worker's slice (``⌈d/8N⌉8N``); the others ``d``."""
    n = n_workers
    if transport == "dense":
        return -(-d // n) * n
    if transport == "1bit":
        return -(-d // (8 * n)) * 8 * n
    return d


def flat_wire_bytes(
    transport: str,
    aggregation: str,
    bits: int | str | None,
    d: int,
    n_workers: int,
    *,
    wire_bits: int = 32,
    rank: int = 0,
    root: int = 0,
) -> tuple[float, float]:
    """(sent, received) bytes of ``rank`` for one flat vote of ``d`` elements over N workers (as the vote
    classes count them; ``root``: the parameter server's rank). Nothing travels for one worker."""
    n = n_workers
    if n == 1:
        return 0.0, 0.0
    ring = 2 * (n - 1) / n
    if transport == "dense":
        each = ring * padded_numel(transport, d, n) * wire_bits / 8
    elif transport == "1bit":
        each = ring * padded_numel(transport, d, n) / 8
    elif transport in ("lanes", "quantized"):
        each = ring * packed_size(d, lane_bits(transport, bits, n) or 8)
    elif transport == "int8":
        each = ring * d
    elif transport == "server":
        up, down = packed_size(d, 1), packed_size(d, server_down_bits(aggregation, n) or 8)
        return ((n - 1) * down, (n - 1) * up) if rank == root else (up, down)
    else:
        raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")
    return each, each


def vote_values(transport: str, bits: int | str | None, n_workers: int) -> tuple[int, int]:
    """(largest ``|value|`` one rank adds to a vote's exact integer sum, offset of its unsigned lane
    encoding): 0/1 votes ``(1, 0)``, signs ``(1, 1)``, quantizer levels ``(s, s)``."""
    if transport == "quantized":
        levels = quantized_levels(lane_bits(transport, bits, n_workers) or 8, n_workers)
        return levels, levels
    if transport == "int8":
        return 1, 1
    return 1, 0


def int_bytes(max_abs: int) -> int:
    """Bytes per element of the integer sums of the node votes: int8 while ``|sum| ≤ 127``, else int32."""
    return 1 if max_abs <= 127 else 4


def hierarchical_lane_bits(transport: str, bits: int | str | None, nnodes: int, per_node: int) -> int | None:
    """Lane width of the hierarchical vote's inter-node sum: the narrowest of 2, 4, 8 bits that holds the
    M-node sum of offset-encoded node sums (``M·L·(max + offset) ≤ 2^b − 1``); ``None``: int32."""
    top, offset = vote_values(transport, bits, nnodes * per_node)
    span = per_node * (top + offset)  # a node sum, offset-encoded: [0, span]
    return next((b for b in LANE_WIDTHS if span <= 255 and lane_sum_fits(nnodes, b, span)), None)


def hierarchical_payloads(
    transport: str, bits: int | str | None, d: int, nnodes: int, per_node: int
) -> tuple[int, int, int]:
    """Bytes one rank puts into each collective of a hierarchical vote of ``d`` elements: (its ``d``
    integer values, allreduced inside the node: int8 while a node sum fits, else int32; its slice of
    ``⌈d/L⌉`` node sums, allreduced among the nodes in lanes of :func:`hierarchical_lane_bits`, int32
    when none; its summed slice, all-gathered inside the node: int8 while the total fits, else int32)."""
    m, ell = nnodes, per_node
    top, _ = vote_values(transport, bits, m * ell)
    k = -(-d // ell)
    width = hierarchical_lane_bits(transport, bits, m, ell)
    inter = packed_size(k, width) if width is not None else 4 * k
    return d * int_bytes(ell * top), inter, k * int_bytes(m * ell * top)


def hierarchical_level_bytes(
    transport: str, bits: int | str | None, d: int, nnodes: int, per_node: int
) -> tuple[float, float]:
    """Bytes one rank sends per hierarchical vote of ``d`` elements (intra-node, inter-node): the
    intra-node allreduce of the integer values and all-gather of the summed slices, and the inter-node
    allreduce of this rank's slice of ``⌈d/L⌉`` node sums (:func:`hierarchical_payloads`)."""
    m, ell = nnodes, per_node
    node, inter, gathered = hierarchical_payloads(transport, bits, d, m, ell)
    return 2 * (ell - 1) / ell * node + (ell - 1) * gathered, 2 * (m - 1) / m * inter


def node_majority_payloads(d: int, nnodes: int, per_node: int) -> tuple[int, int, int]:
    """What one rank puts into each step of a node-majority vote of ``d`` elements: (bytes of its ``d``
    0/1 votes, counted inside the node: int8 while L ≤ 127, else int32; the elements of its slice,
    ``⌈d/L⌉``, voted on among the nodes by a 1-bit vote; bytes of its slice of node majorities (int8),
    all-gathered inside the node)."""
    k = -(-d // per_node)
    return d * int_bytes(per_node), k, k


def node_majority_level_bytes(d: int, nnodes: int, per_node: int) -> tuple[float, float]:
    """Bytes one rank sends per node-majority vote of ``d`` elements (intra-node, inter-node): the
    intra-node count (int8) and all-gather, and a 1-bit vote of ``⌈d/L⌉`` elements among the nodes
    (:func:`node_majority_payloads`)."""
    m, ell = nnodes, per_node
    node, k, gathered = node_majority_payloads(d, m, ell)
    return 2 * (ell - 1) / ell * node + (ell - 1) * gathered, flat_wire_bytes("1bit", "majority", None, k, m)[
        0
    ]
