"""Majority vote of 0/1 votes summed in packed p-bit lanes (:class:`LaneVote`, Lion Cub "4bit")."""

from __future__ import annotations

from typing import Literal

from lioncub import transports
from lioncub.collectives.base import Comm
from lioncub.collectives.formats import Decoded, LaneTable, PackedVotes, sign_int8
from lioncub.collectives.protocol import Pending
from lioncub.collectives.signvote import SignVote
from lioncub.ops import packing

__all__ = ["LaneVote", "auto_lane_bits"]


def auto_lane_bits(n_workers: int, max_lane_value: int = 1) -> int:
    """Narrowest lane width in (2, 4, 8) whose N-way SUM of values ≤ ``max_lane_value`` cannot overflow."""
    for bits in transports.LANE_WIDTHS:
        if packing.lane_sum_fits(n_workers, bits, max_lane_value):
            return bits
    packing.require_lane_sum_fits(n_workers, 8, max_lane_value, what="bits='auto'")
    raise AssertionError("unreachable")


class LaneVote(SignVote):
    """Majority vote of 0/1 votes summed in packed p-bit lanes (Lion Cub "4bit": p = 4).

    Each worker packs ``[c ≥ 0]`` into p-bit lanes (8/p per byte; :class:`~lioncub.collectives.formats.
    PackedVotes`); a uint8 allreduce SUM leaves the count of "+" votes in each lane, which cannot carry
    into its neighbour while ``N ≤ 2^p − 1``; the update is ``sign(2·count − N)`` (ties stay 0; correct for
    odd N), read through a lane table (:class:`~lioncub.collectives.formats.LaneTable`). ``bits="auto"``
    takes the narrowest lane that fits N. An exact zero of ``c`` votes by
    :meth:`~lioncub.collectives.signvote.SignVote.zeros_vote_plus`. Bytes per rank:
    ``2·(N−1)/N · d·p/8``.
    """

    name = "lanes"
    facts = transports.FACTS["lanes"]
    bits: int  # always a width here (set by the constructor)

    def __init__(self, comm: Comm, bits: int | Literal["auto"] = 4, zero_vote: str = "split") -> None:
        super().__init__(comm, zero_vote)
        n = comm.world_size
        if bits == "auto":
            bits = 8 if n == 1 else auto_lane_bits(n)
        if bits not in transports.LANE_WIDTHS:
            raise ValueError(f"bits={bits!r} for a lane vote must be 2, 4, 8 or 'auto'")
        packing.require_lane_sum_fits(n, bits, 1, what=f"{bits}-bit vote")
        self.bits = bits
        self.name = f"{bits}bit-vote"

    def payload_format(self):
        return None if self.comm.alone else PackedVotes(self.bits)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        if self.comm.alone:
            return Pending(lambda: Decoded(sign_int8(local)))
        lanes = packing.pack_lanes(self.votes(local, step), self.bits) if encoded is None else encoded
        handle = self.comm.all_reduce(lanes, f"{self.bits}-bit vote allreduce")
        table = LaneTable.signs(range(1 << self.bits), 2, -n)  # a lane counts "+" votes: sign(2·count − N)
        return Pending(lambda: LaneTable(handle.tensor(), self.bits, table, d))
