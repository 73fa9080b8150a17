r"""What each transport puts on the wire, stated once: widths, the rule that keeps integer sums from
overflowing, and the bytes per rank. ``optim`` (validation of a :class:`~lioncub.optim.config.VoteConfig`),
``collectives`` (the vote classes), ``ops`` (packing, level budgets) and ``planning`` (the cost model) all
read these facts from here. Imports only :mod:`lioncub._validate` and not torch.

Each transport is one object of :data:`FACTS`, of its own class: its fixed facts are fields
(:class:`Transport`), what depends on N, ``bits`` or the aggregation are its methods (lane width,
capacity, padding, bytes). A caller chooses the object once (a vote class holds its own) and asks it;
nothing here branches on a transport's name.

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
``hierarchical`` (exact: node sums, then sums over the nodes in lanes of
:meth:`Transport.hierarchical_lane_bits`) or ``node-majority`` (the 1-bit vote of node majorities, another
estimator); see :mod:`lioncub.collectives.hierarchical`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lioncub._validate import check_int

__all__ = [
    "AGGREGATIONS",
    "FACTS",
    "LANE_BITS",
    "LANE_WIDTHS",
    "TOPOLOGIES",
    "TRANSPORTS",
    "ZERO_VOTES",
    "Bits",
    "DenseTransport",
    "Int8Transport",
    "LaneWidthTransport",
    "LanesTransport",
    "OneBitTransport",
    "QuantizedTransport",
    "ServerTransport",
    "Transport",
    "capacity",
    "check_lane_bits",
    "facts_of",
    "flat_wire_bytes",
    "int_bytes",
    "lane_bits",
    "lane_sum_fits",
    "level_budget",
    "max_lane_workers",
    "max_level_workers",
    "node_majority_level_bytes",
    "node_majority_payloads",
    "packed_size",
    "quantized_encoding",
    "quantized_levels",
    "server_down_bits",
]

#: every transport's name (:data:`FACTS`)
TRANSPORTS = ("dense", "1bit", "lanes", "int8", "quantized", "server")
#: how the workers' contributions are combined
AGGREGATIONS = ("mean", "majority", "average")
#: how a vote is laid over the ranks of several nodes
TOPOLOGIES = ("flat", "hierarchical", "node-majority")
#: how an exact zero of ``c`` votes in a one-bit vote (``VoteConfig(zero_vote=...)``), the default first
ZERO_VOTES = ("split", "plus")
#: the widths of a packed integer lane (a lane vote or a quantized vote takes 2, 4 or 8)
LANE_WIDTHS = (2, 4, 8)
#: the widths :mod:`lioncub.ops.packing` packs: :data:`LANE_WIDTHS` and the 1-bit votes
LANE_BITS = (1, 2, 4, 8)

Encoding = Literal["signed", "offset", "vote"]
#: a vote's ``bits`` setting: a width, ``"auto"`` (the narrowest that fits N) or ``None`` (the default)
Bits = int | str | None


# ------------------------------------------------------------------------------------------- capacity


def check_lane_bits(bits: int) -> None:
    """``ValueError`` unless ``bits`` is a packed lane's width (:data:`LANE_BITS`)."""
    if bits not in LANE_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed lane widths: {LANE_BITS}")


def packed_size(n: int, bits: int = 1) -> int:
    """Bytes holding ``n`` lanes of ``bits`` bits (1, 2, 4 or 8), 8/bits per byte."""
    check_lane_bits(bits)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    per_byte = 8 // bits
    return -(-n // per_byte)


def lane_sum_fits(n_workers: int, bits: int, max_lane_value: int) -> bool:
    """Whether N lanes each holding at most ``max_lane_value`` can be summed in a ``bits``-bit lane:
    exactly when ``n_workers · max_lane_value ≤ 2**bits − 1`` (the largest possible sum fits)."""
    check_lane_bits(bits)
    if n_workers < 1:
        raise ValueError(f"n_workers={n_workers} must be >= 1")
    if max_lane_value < 0:
        raise ValueError(f"max_lane_value={max_lane_value} must be >= 0")
    return n_workers * max_lane_value <= (1 << bits) - 1


def max_lane_workers(bits: int, max_lane_value: int) -> int:
    """The largest N for which :func:`lane_sum_fits` holds (``max_lane_value ≥ 1``)."""
    check_lane_bits(bits)
    if max_lane_value < 1:
        raise ValueError(f"max_lane_value={max_lane_value} must be >= 1")
    return ((1 << bits) - 1) // max_lane_value


def _budget(n_workers: int, bits: int, encoding: Encoding) -> tuple[int, int]:
    """``(s, max_n)``: the level budget of :func:`level_budget` (0 when none) and the most workers any
    budget serves at this width."""
    if encoding == "signed":
        top = (1 << (bits - 1)) - 1
        return top // n_workers, top
    top = (1 << bits) - 1
    if encoding == "offset":
        return top // (2 * n_workers), top // 2
    if encoding == "vote":
        return int(n_workers <= top), top
    raise ValueError(f"encoding={encoding!r} is not one of 'signed', 'offset', 'vote'")


def level_budget(n_workers: int, bits: int, encoding: Encoding = "signed") -> int:
    """The largest per-worker level ``s`` whose integer SUM over N workers cannot overflow ``bits`` bits.

    * ``"signed"``: two's-complement sum of levels in ``[−s, s]`` (the int8 allreduce of Lion Cub 8-bit):
      ``s = ⌊(2^(p−1) − 1)/N⌋``;
    * ``"offset"``: unsigned p-bit lanes holding ``q + s ∈ [0, 2s]``: ``s = ⌊(2^p − 1)/(2N)⌋``;
    * ``"vote"``: unsigned lanes holding 0/1 votes: 1 when ``N ≤ 2^p − 1``.

    Raises ``ValueError`` (naming N, p and the largest N that works, :func:`max_level_workers`) when the
    budget would be 0.
    """
    check_int("n_workers", n_workers, 1)
    check_int("bits", bits, 1)
    s, max_n = _budget(n_workers, bits, encoding)
    if s < 1:
        raise ValueError(
            f"no level budget: {bits}-bit {encoding} lanes summed over n_workers={n_workers} can overflow "
            f"even at 1 level; at most {max_n} workers are supported - use more bits"
        )
    return s


def max_level_workers(bits: int, encoding: Encoding = "signed") -> int:
    """The most workers for which :func:`level_budget` leaves at least one level at this width."""
    return _budget(1, bits, encoding)[1]


def quantized_encoding(bits: int) -> Encoding:
    """How a quantized vote's levels travel: signed int8 at 8 bits, offset lanes below."""
    return "signed" if bits == 8 else "offset"


def quantized_levels(bits: int, n_workers: int) -> int:
    """A quantized vote's level budget per worker (:func:`level_budget` in :func:`quantized_encoding`), 0
    where N workers overflow even one level."""
    return _budget(n_workers, bits, quantized_encoding(bits))[0]


def server_down_bits(aggregation: str, n_workers: int) -> int | None:
    """Lane width of the parameter server's reply for N workers (``None``: no width holds the count)."""
    if aggregation != "average":
        return 2  # majority: u + 1 ∈ {0, 1, 2}
    return next((b for b in LANE_WIDTHS if lane_sum_fits(n_workers + 1, b, 1)), None)


def int_bytes(max_abs: int) -> int:
    """Bytes per element of the integer sums of the node votes: int8 while ``|sum| ≤ 127``, else int32."""
    return 1 if max_abs <= 127 else 4


# ----------------------------------------------------------------------------------------- transports


@dataclass(frozen=True)
class Transport:
    """One transport: its fixed facts (fields) and what follows for N workers (methods).

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

    def lane_bits(self, bits: Bits, n_workers: int) -> int | None:
        """The lane width ``bits`` chooses for N workers: ``None`` for a transport without a choice (see
        :class:`LaneWidthTransport`)."""
        return None

    def capacity(self, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
        """Whether the integer lanes of a vote can hold its N-way sum; ``(False, why)`` otherwise."""
        return True, ""

    def padded_numel(self, d: int, n_workers: int) -> int:
        """Elements a flat vote of ``d`` elements over N workers exchanges (``d`` unless padded)."""
        return d

    def vote_values(self, bits: Bits, n_workers: int) -> tuple[int, int]:
        """(largest ``|value|`` one rank adds to a vote's exact integer sum, offset of its unsigned lane
        encoding): 0/1 votes ``(1, 0)``, signs ``(1, 1)``, quantizer levels ``(s, s)``."""
        return 1, 0

    def wire_bytes(
        self,
        d: int,
        n_workers: int,
        *,
        bits: Bits = None,
        aggregation: str = "majority",
        wire_bits: int = 32,
        rank: int = 0,
        root: int = 0,
    ) -> tuple[float, float]:
        """(sent, received) bytes of ``rank`` for one flat vote of ``d`` elements over N workers, as the vote
        classes count them (``wire_bits``: the dense wire's; ``root``: the parameter server's rank).
        Nothing travels for one worker; otherwise a ring allreduce sends and receives
        ``2(N−1)/N`` times the payload."""
        n = n_workers
        if n == 1:
            return 0.0, 0.0
        each = self._ring_bytes(d, n, 2 * (n - 1) / n, bits, wire_bits)
        return each, each

    def _ring_bytes(self, d: int, n: int, ring: float, bits: Bits, wire_bits: int) -> float:
        """``ring`` (``2(N−1)/N``) times the payload of a ring allreduce of ``d`` elements."""
        raise NotImplementedError(f"transport {self.name!r} states no ring payload")

    # -- the hierarchical topology (exact: node sums, then sums over the nodes) --------------------------

    def hierarchical_lane_bits(self, bits: Bits, nnodes: int, per_node: int) -> int | None:
        """Lane width of the hierarchical vote's inter-node sum: the narrowest of 2, 4, 8 bits that holds
        the M-node sum of offset-encoded node sums (``M·L·(max + offset) ≤ 2^b − 1``); ``None``: int32."""
        top, offset = self.vote_values(bits, nnodes * per_node)
        span = per_node * (top + offset)  # a node sum, offset-encoded: [0, span]
        return next((b for b in LANE_WIDTHS if span <= 255 and lane_sum_fits(nnodes, b, span)), None)

    def hierarchical_payloads(self, bits: Bits, d: int, nnodes: int, per_node: int) -> tuple[int, int, int]:
        """Bytes one rank puts into each collective of a hierarchical vote of ``d`` elements: (its ``d``
        integer values, allreduced inside the node: int8 while a node sum fits, else int32; its slice of
        ``⌈d/L⌉`` node sums, allreduced among the nodes in lanes of :meth:`hierarchical_lane_bits`, int32
        when none; its summed slice, all-gathered inside the node: int8 while the total fits, else int32)."""
        m, ell = nnodes, per_node
        top, _ = self.vote_values(bits, m * ell)
        k = -(-d // ell)
        width = self.hierarchical_lane_bits(bits, m, ell)
        inter = packed_size(k, width) if width is not None else 4 * k
        return d * int_bytes(ell * top), inter, k * int_bytes(m * ell * top)

    def hierarchical_level_bytes(self, bits: Bits, d: int, nnodes: int, per_node: int) -> tuple[float, float]:
        """Bytes one rank sends per hierarchical vote of ``d`` elements (intra-node, inter-node): the
        intra-node allreduce of the integer values and all-gather of the summed slices, and the inter-node
        allreduce of this rank's slice of ``⌈d/L⌉`` node sums (:meth:`hierarchical_payloads`)."""
        m, ell = nnodes, per_node
        node, inter, gathered = self.hierarchical_payloads(bits, d, m, ell)
        return 2 * (ell - 1) / ell * node + (ell - 1) * gathered, 2 * (m - 1) / m * inter


class DenseTransport(Transport):
    """The mean of the gradients, ``wire_bits`` per element, padded to a multiple of N (``⌈d/N⌉N``)."""

    def padded_numel(self, d: int, n_workers: int) -> int:
        n = n_workers
        return -(-d // n) * n

    def _ring_bytes(self, d: int, n: int, ring: float, bits: Bits, wire_bits: int) -> float:
        return ring * self.padded_numel(d, n) * wire_bits / 8


class OneBitTransport(Transport):
    """Packed 1-bit votes (all-to-all, then all-gather), padded to whole bytes per worker's slice
    (``⌈d/8N⌉8N``)."""

    def padded_numel(self, d: int, n_workers: int) -> int:
        n = n_workers
        return -(-d // (8 * n)) * 8 * n

    def _ring_bytes(self, d: int, n: int, ring: float, bits: Bits, wire_bits: int) -> float:
        return ring * self.padded_numel(d, n) / 8


class Int8Transport(Transport):
    """Signs summed in int8: at most 127 workers."""

    def capacity(self, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
        top = max_level_workers(8, "signed")
        if n_workers > top:
            return False, f"an int8 sum of {n_workers} signs can overflow (at most {top} workers)"
        return True, ""

    def vote_values(self, bits: Bits, n_workers: int) -> tuple[int, int]:
        return 1, 1

    def _ring_bytes(self, d: int, n: int, ring: float, bits: Bits, wire_bits: int) -> float:
        return ring * d


class LaneWidthTransport(Transport):
    """A transport whose ``bits`` chooses the width of its packed lanes among :data:`LANE_WIDTHS`."""

    def lane_bits(self, bits: Bits, n_workers: int) -> int | None:
        """The lane width for N workers: ``bits``, the default for ``None``, or for ``"auto"`` the narrowest
        that fits N (``None``: none does)."""
        if bits is None:
            return self.default_bits
        if bits != "auto":
            return int(bits)
        return self.auto_lane_bits(n_workers)

    def auto_lane_bits(self, n_workers: int) -> int | None:
        """The width ``bits="auto"`` takes for N workers (``None``: none fits)."""
        raise NotImplementedError

    def _ring_bytes(self, d: int, n: int, ring: float, bits: Bits, wire_bits: int) -> float:
        return ring * packed_size(d, self.lane_bits(bits, n) or 8)


class LanesTransport(LaneWidthTransport):
    """0/1 votes counted in p-bit lanes: at most ``2^p − 1`` workers."""

    def auto_lane_bits(self, n_workers: int) -> int | None:
        if n_workers == 1:
            return 8
        return next((b for b in LANE_WIDTHS if lane_sum_fits(n_workers, b, 1)), None)

    def capacity(self, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
        n = n_workers
        width = self.lane_bits(bits, n)
        if width is None or not lane_sum_fits(n, width, 1):
            what = "no lane width up to 8 bits" if width is None else f"{width}-bit lanes"
            top = (1 << (width or 8)) - 1
            return False, f"{what} cannot hold the vote count of {n} workers (at most {top} workers)"
        return True, ""


class QuantizedTransport(LaneWidthTransport):
    """Quantizer levels summed in signed int8 (8 bits) or offset p-bit lanes (:func:`quantized_levels`)."""

    def auto_lane_bits(self, n_workers: int) -> int | None:
        return next((b for b in LANE_WIDTHS if quantized_levels(b, n_workers) >= 1), 8)

    def capacity(self, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
        n = n_workers
        width = self.lane_bits(bits, n) or 8
        if quantized_levels(width, n) < 1:
            top = max_level_workers(width, quantized_encoding(width))
            return False, f"{width}-bit quantized levels summed over {n} workers can overflow (at most {top})"
        return True, ""

    def vote_values(self, bits: Bits, n_workers: int) -> tuple[int, int]:
        levels = quantized_levels(self.lane_bits(bits, n_workers) or 8, n_workers)
        return levels, levels


class ServerTransport(Transport):
    """The parameter server: 1-bit votes up to the root, its reply in lanes of :func:`server_down_bits`
    down; the root sends and receives N − 1 times a worker's bytes."""

    def capacity(self, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
        if server_down_bits(aggregation, n_workers) is None:
            return False, f"the server's count lanes cannot hold {n_workers} workers (at most 254)"
        return True, ""

    def wire_bytes(
        self,
        d: int,
        n_workers: int,
        *,
        bits: Bits = None,
        aggregation: str = "majority",
        wire_bits: int = 32,
        rank: int = 0,
        root: int = 0,
    ) -> tuple[float, float]:
        n = n_workers
        if n == 1:
            return 0.0, 0.0
        up, down = packed_size(d, 1), packed_size(d, server_down_bits(aggregation, n) or 8)
        return ((n - 1) * down, (n - 1) * up) if rank == root else (up, down)


FACTS: dict[str, Transport] = {
    "dense": DenseTransport("dense", ("mean",)),
    "1bit": OneBitTransport("1bit", ("majority",), fixed_bits=(None, 1), topologies=TOPOLOGIES),
    "lanes": LanesTransport(
        "lanes", ("majority",), LANE_WIDTHS, default_bits=4, topologies=("flat", "hierarchical")
    ),
    "int8": Int8Transport(
        "int8", ("majority", "average"), fixed_bits=(None, 8), topologies=("flat", "hierarchical")
    ),
    "quantized": QuantizedTransport(
        "quantized", ("majority",), LANE_WIDTHS, default_bits=8, topologies=("flat", "hierarchical")
    ),
    "server": ServerTransport("server", ("majority", "average"), fixed_bits=(None, 1)),
}


def facts_of(transport: str) -> Transport:
    """The transport named ``transport`` (:data:`FACTS`), or ``ValueError`` naming the transports."""
    try:
        return FACTS[transport]
    except (KeyError, TypeError):
        raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}") from None


# --------------------------------------------------------------- for a caller that holds only the name


def lane_bits(transport: str, bits: Bits, n_workers: int) -> int | None:
    """:meth:`Transport.lane_bits` of the transport named ``transport``."""
    return facts_of(transport).lane_bits(bits, n_workers)


def capacity(transport: str, aggregation: str, bits: Bits, n_workers: int) -> tuple[bool, str]:
    """:meth:`Transport.capacity` of the transport named ``transport``."""
    return facts_of(transport).capacity(aggregation, bits, n_workers)


def flat_wire_bytes(
    transport: str,
    aggregation: str,
    bits: Bits,
    d: int,
    n_workers: int,
    *,
    wire_bits: int = 32,
    rank: int = 0,
    root: int = 0,
) -> tuple[float, float]:
    """:meth:`Transport.wire_bytes` of the transport named ``transport``."""
    return facts_of(transport).wire_bytes(
        d, n_workers, bits=bits, aggregation=aggregation, wire_bits=wire_bits, rank=rank, root=root
    )


# ------------------------------------------------------------------------------- node-majority votes


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
    return 2 * (ell - 1) / ell * node + (ell - 1) * gathered, FACTS["1bit"].wire_bytes(k, m)[0]
