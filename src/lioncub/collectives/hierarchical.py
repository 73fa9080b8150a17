"""Votes over nodes of several ranks: M nodes × L ranks, a fast link inside a node, one NIC per node.

A flat vote treats the N = M·L ranks alike, so a node's NIC carries the traffic of all its L ranks (the
1-bit all-to-all sends each rank's bits to every remote rank). The two algorithms here use the
2-D layout (a ``("node", "local")`` device mesh: rank = node·L + local):

:class:`HierarchicalVote` — **exact**: bitwise the flat vote of the same preset. Every vote of the
flat algorithms is a function of an exact integer sum over the ranks — the count of "+" votes
(``1bit``, ``4bit``), the sum of signs (``8bit-sign``, ``dlion-avg``), the sum of quantizer levels
(``8bit`` and the other quantized votes, with the level budget of the global N) — so the sum may be
formed in any grouping:

1. intra-node allreduce SUM of this rank's integer values (int8 or int32, exact);
2. local rank ℓ takes slice ℓ of the node sum (d/L elements) and sums it over the nodes with the peers of
   the same local rank, offset-encoded in the narrowest p-bit lanes that hold the M-node sum
   (:meth:`lioncub.transports.Transport.hierarchical_lane_bits`), or int32 where none does;
3. intra-node all-gather of the summed slices; the flat algorithm's final rule (sign, tie rule,
   ÷N) makes the update.

Inter-node bytes per node: ``2·(M−1)/M · d·p/8`` — better than the flat 1-bit vote's
``2·L·(M−1)/M · d/8`` only when ``p < L``.

:class:`NodeMajorityVote` — a **different estimator**, for the 1-bit vote: each node takes the exact
majority of its L ranks (ties by the alternating rule), then the nodes hold a 1-bit vote
(:class:`~lioncub.collectives.onebit.OneBitVote` among same-local-rank peers on slice ℓ), and the
slices are all-gathered in the node. Inter-node bytes per node ``2·(M−1)/M · d/8``: L× fewer than
flat, but a majority of node majorities is not the global majority.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from lioncub import transports
from lioncub.collectives.base import Comm, Handle
from lioncub.collectives.formats import Decoded, sign_int8
from lioncub.collectives.lanes import LaneVote
from lioncub.collectives.onebit import OneBitVote
from lioncub.collectives.protocol import Pending, Vote
from lioncub.collectives.quantized import QuantizedVote
from lioncub.collectives.signsum import AverageVote, SignSumVote
from lioncub.collectives.signvote import SignVote
from lioncub.ops import packing

__all__ = ["HierarchicalVote", "NodeMajorityVote", "make_topology_vote"]


def _check_layout(flat: Comm, intra: Comm, inter: Comm) -> tuple[int, int]:
    """(M nodes, L ranks per node); the flat rank must be node·L + local."""
    m, ell = inter.world_size, intra.world_size
    if m * ell != flat.world_size or flat.rank != inter.rank * ell + intra.rank:
        raise ValueError(
            f"rank {flat.rank}: the ('node', 'local') mesh of {m}×{ell} ranks does not lay out the vote's "
            f"group of {flat.world_size} ranks node by node (rank = node·L + local; here node "
            f"{inter.rank}, local {intra.rank})"
        )
    return m, ell


def _slice(values: torch.Tensor, ell: int, index: int) -> tuple[torch.Tensor, int]:
    """Slice ``index`` of ``ell`` of ``values`` (1-D, length d): ``k = ⌈d / L⌉`` elements from
    ``index·k``, zero-padded past d (a view when it needs no padding); returns (slice, k)."""
    d = values.numel()
    k = -(-d // ell)
    lo, hi = min(index * k, d), min((index + 1) * k, d)
    if hi - lo == k:
        return values[lo:hi], k
    padded = torch.zeros(k, dtype=values.dtype, device=values.device)
    padded[: hi - lo] = values[lo:hi]
    return padded, k


def _int_dtype(max_abs: int) -> torch.dtype:
    return torch.int8 if transports.int_bytes(max_abs) == 1 else torch.int32


@dataclass
class _InterSum:
    """The inter-node sum a hierarchical vote's middle posted: its handle, the tensor it sums in place
    (the packed lanes, or the int32 node sums) and the length ``k`` of this rank's slice."""

    handle: Handle
    sums: torch.Tensor
    k: int


class HierarchicalVote(SignVote):
    """The flat vote ``flat`` (a :class:`OneBitVote`, :class:`LaneVote`, :class:`SignSumVote`,
    :class:`AverageVote` or :class:`QuantizedVote` on the whole group), computed node by node with the
    same result bit for bit (see the module docstring).

    Args:
        flat: the flat algorithm: its per-rank values and final rule are used, its wire is not.
        intra: this node's ranks (the mesh's ``"local"`` dimension).
        inter: the ranks of the same local rank on every node (the mesh's ``"node"`` dimension).
    """

    def __init__(self, flat: Vote, intra: Comm, inter: Comm) -> None:
        super().__init__(flat.comm)
        if not isinstance(flat, (OneBitVote, LaneVote, SignSumVote, QuantizedVote)):
            raise ValueError(
                f"topology='hierarchical' applies to the votes (1bit, 4bit, 8bit, 8bit-sign, dlion-avg and "
                f"the quantized votes), not to {type(flat).__name__}"
            )
        self.flat, self.intra, self.inter = flat, intra, inter
        self.nodes, self.per_node = _check_layout(flat.comm, intra, inter)
        self.result = flat.result
        self.name = f"hierarchical-{flat.name}"
        facts, bits = flat.facts, flat.bits
        assert facts is not None  # the flat votes above each have their transport
        #: the largest |value| one rank contributes, and the offset of its unsigned lane encoding
        self.max_value, self.offset = facts.vote_values(bits, self.world_size)
        self.lane_bits = facts.hierarchical_lane_bits(bits, self.nodes, self.per_node)
        self._transport = (facts, bits)

    def _values(self, local: torch.Tensor, segments: Sequence[int] | None, step: int) -> torch.Tensor:
        """This rank's integer contribution (int8): the flat algorithm's vote, sign or level."""
        if isinstance(self.flat, QuantizedVote):
            return self.flat.levels_of(local, segments)
        if isinstance(self.flat, (OneBitVote, LaneVote)):
            return self.flat.votes(local, step).view(torch.int8)
        return sign_int8(local)

    def _final(
        self, total: torch.Tensor, local: torch.Tensor, step: int, key: Hashable | None
    ) -> torch.Tensor:
        """The flat algorithm's update from the exact sum ``total`` over all N ranks."""
        n = self.world_size
        if isinstance(self.flat, OneBitVote):
            return packing.majority_signs(total, n, step % 2 == 1)
        if isinstance(self.flat, LaneVote):
            return packing.margin_signs(total, n)
        if isinstance(self.flat, AverageVote):
            out = self.buffer(key, "average", local.numel(), local.dtype)
            return out.copy_(total).div_(n)
        return torch.sign(total).to(torch.int8)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        d, m, ell = local.numel(), self.nodes, self.per_node
        values = self._values(local, segments, step)
        node_sum = values.to(_int_dtype(ell * self.max_value))
        first = self.intra.all_reduce(node_sum, "hierarchical vote: intra-node sum")
        total_dtype = _int_dtype(self.world_size * self.max_value)
        sent: list[_InterSum] = []  # what middle posted, for finish

        def middle() -> None:  # this rank's slice of the node sum, summed over the nodes
            first.wait()
            mine, k = _slice(node_sum, ell, self.intra.rank)
            if self.lane_bits is not None:
                # offset-encoded node sums, in [0, span ≤ 255]: from int8 sums, uint8 arithmetic wraps to them
                if mine.dtype == torch.int8:
                    encoded = mine.view(torch.uint8)
                    if self.offset:
                        encoded = encoded.add(ell * self.offset)
                else:
                    encoded = (mine.to(torch.int16) + ell * self.offset).to(torch.uint8)
                lanes = packing.pack_lanes(encoded, self.lane_bits)
                handle = self.inter.all_reduce(
                    lanes, f"hierarchical vote: {self.lane_bits}-bit inter-node sum"
                )
                sent.append(_InterSum(handle, lanes, k))
            else:
                wide = mine.to(torch.int32)
                handle = self.inter.all_reduce(wide, "hierarchical vote: int32 inter-node sum")
                sent.append(_InterSum(handle, wide, k))

        def finish() -> Decoded:
            inter = sent[0]
            inter.handle.wait()
            k = inter.k
            if self.lane_bits is not None:
                summed = packing.unpack_lanes(inter.sums, self.lane_bits, k)
                if self.offset and total_dtype == torch.int8:  # the total lies in int8: uint8 wraps to it
                    summed = summed.sub(m * ell * self.offset).view(torch.int8)
                elif self.offset:
                    summed = summed.to(torch.int32) - m * ell * self.offset
            else:
                summed = inter.sums
            gathered = torch.empty(ell, k, dtype=total_dtype, device=local.device)
            self.intra.all_gather(
                gathered, summed.to(total_dtype), "hierarchical vote: intra-node all-gather"
            ).wait()
            return Decoded(self._final(gathered.reshape(-1)[:d], local, step, key))

        return Pending(finish, middle=middle)

    def wire_bytes(self, numel: int) -> tuple[float, float]:
        """(sent, received) bytes per rank: intra-node and inter-node together (see :meth:`level_bytes`)."""
        intra, inter = self.level_bytes(numel)
        return intra + inter, intra + inter

    def level_bytes(self, numel: int) -> tuple[float, float]:
        """Bytes one rank sends per vote (intra-node, inter-node):
        :meth:`lioncub.transports.Transport.hierarchical_level_bytes`."""
        facts, bits = self._transport
        return facts.hierarchical_level_bytes(bits, numel, self.nodes, self.per_node)


class NodeMajorityVote(SignVote):
    """Each node's exact majority of its ranks' 1-bit votes (``c > 0``, exact zeros by
    :meth:`~lioncub.collectives.signvote.SignVote.zeros_vote_plus`; ties by the alternating rule),
    then a 1-bit vote among the nodes (:class:`OneBitVote` on the ``inter`` group, slice by slice), then an
    intra-node all-gather. Result: int8 ±1. A different estimator from the global majority (module
    docstring)."""

    name = "node-majority-1bit"

    def __init__(self, flat: Comm, intra: Comm, inter: Comm, zero_vote: str = "split") -> None:
        super().__init__(flat, zero_vote)
        self.intra, self.inter = intra, inter
        self.nodes, self.per_node = _check_layout(flat, intra, inter)
        self.among_nodes = OneBitVote(inter)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        d, ell = local.numel(), self.per_node
        counts = self.votes(local, step).view(torch.int8).to(_int_dtype(ell))
        first = self.intra.all_reduce(counts, "node-majority vote: intra-node count")
        among: list[tuple[Pending, int]] = []  # the vote among the nodes middle started, its slice's length

        def middle() -> None:
            first.wait()
            mine, k = _slice(counts, ell, self.intra.rank)
            node_vote = packing.majority_signs(mine, ell, step % 2 == 1).to(torch.float32)
            pending: Pending = self.among_nodes.start(node_vote, step=step)
            among.append((pending, k))
            pending.advance()

        def finish() -> Decoded:
            pending, k = among[0]
            mine = pending.wait()
            gathered = torch.empty(ell, k, dtype=torch.int8, device=local.device)
            self.intra.all_gather(gathered, mine, "node-majority vote: intra-node all-gather").wait()
            return Decoded(gathered.reshape(-1)[:d].clone())

        return Pending(finish, middle=middle)

    def wire_bytes(self, numel: int) -> tuple[float, float]:
        intra, inter = self.level_bytes(numel)
        return intra + inter, intra + inter

    def level_bytes(self, numel: int) -> tuple[float, float]:
        """Bytes one rank sends per vote (intra-node, inter-node):
        :func:`lioncub.transports.node_majority_level_bytes`."""
        return transports.node_majority_level_bytes(numel, self.nodes, self.per_node)


def make_topology_vote(topology: str, flat: Vote, groups: Callable[[], tuple[Comm, Comm]]) -> Vote:
    """``flat`` laid over the nodes as ``topology`` (``"flat"``: itself); ``groups()`` gives the
    (intra-node, inter-node) groups of this rank."""
    if topology not in transports.TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: allowed values are {list(transports.TOPOLOGIES)}")
    if topology == "flat":
        return flat
    intra, inter = groups()
    if topology == "hierarchical":
        return HierarchicalVote(flat, intra, inter)
    if not isinstance(flat, OneBitVote):
        raise ValueError(
            f"topology='node-majority' applies to the 1-bit vote (variant '1bit'), not to {flat.name!r}"
        )
    return NodeMajorityVote(flat.comm, intra, inter, flat.zero_vote)
