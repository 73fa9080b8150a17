"""Distributed Lion's parameter server (:class:`ServerVote`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Literal

import torch

from lioncub import transports
from lioncub.collectives.base import Comm
from lioncub.collectives.formats import Decoded, LaneTable, PackedVotes, sign_int8
from lioncub.collectives.protocol import Pending, Result
from lioncub.collectives.signvote import SignVote
from lioncub.ops import kernels, native, packing

__all__ = ["ServerVote"]


class ServerVote(SignVote):
    """Distributed Lion's parameter server: every worker sends its packed 1-bit votes to ``root``
    (:class:`~lioncub.collectives.formats.PackedVotes`), which counts them and sends back the majority
    (2-bit lanes holding ``u + 1``, read through a :class:`~lioncub.collectives.formats.LaneTable`) or, for
    ``aggregation="average"``, the count (lanes wide enough for N) from which every rank forms
    ``(2·count − N)/N``. An exact zero of ``c`` votes by
    :meth:`~lioncub.collectives.signvote.SignVote.zeros_vote_plus`. Root's ingress carries ``(N−1)·d/8``
    bytes: the cost grows linearly with N.
    """

    name = "server"
    facts = transports.FACTS["server"]

    def __init__(
        self,
        comm: Comm,
        aggregation: Literal["majority", "average"] = "majority",
        root: int = 0,
        zero_vote: str = "split",
    ) -> None:
        super().__init__(comm, zero_vote)
        if aggregation not in ("majority", "average"):
            raise ValueError(f"aggregation={aggregation!r} is not one of 'majority', 'average'")
        if not 0 <= root < comm.world_size:
            raise ValueError(f"root={root} must be a rank in [0, {comm.world_size})")
        self.aggregation = aggregation
        self.root = root
        self.result = "vote" if aggregation == "majority" else "value"
        down = transports.server_down_bits(aggregation, comm.world_size)
        if down is None:  # no width holds the count: this raises, naming it
            packing.require_lane_sum_fits(comm.world_size + 1, 8, 1, what="the server's count lanes")
        assert down is not None, "require_lane_sum_fits raised"
        self.down_bits: int = down
        self.name = f"server-{aggregation}"

    def payload_format(self):
        return None if self.comm.alone else PackedVotes(1, 8)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        if self.comm.alone:
            signs = sign_int8(local)
            return Pending(
                lambda: Decoded(signs if self.aggregation == "majority" else signs.to(local.dtype))
            )
        up = (
            packing.pack_signs(local, zeros_vote_plus=self.zeros_vote_plus(step))
            if encoded is None
            else encoded
        )
        down = self.buffer(key, "down", packing.packed_size(d, self.down_bits), torch.uint8)
        receive = self._exchange(up, down, d, key)
        if self.aggregation == "majority":
            table = tuple(v - 1 for v in range(1 << self.down_bits))  # lanes hold u + 1

            def majority() -> Result:
                receive()
                return LaneTable(down, self.down_bits, table, d)

            return Pending(majority)

        def average() -> Result:
            receive()
            lanes = packing.unpack_lanes(down, self.down_bits, d).to(torch.int16)
            return Decoded((2 * lanes - n).to(local.dtype) / n)

        return Pending(average)

    def _exchange(
        self, up: torch.Tensor, down: torch.Tensor, d: int, key: Hashable | None
    ) -> Callable[[], None]:
        """Post the gather of ``up`` to the root; returns what receives ``down`` (the root counts and
        sends it first)."""
        n, r = self.world_size, self.comm.rank
        if r == self.root:
            inbox = self.buffer(key, "inbox", n * up.numel(), torch.uint8).view(n, up.numel())
            inbox[r].copy_(up)
            handle = self.comm.exchange_p2p([], [(j, inbox[j]) for j in range(n) if j != r], "server gather")
        else:
            handle = self.comm.exchange_p2p([(self.root, up)], [], "server gather")

        def receive() -> None:
            handle.wait()
            if r != self.root:
                self.comm.exchange_p2p([], [(self.root, down)], "server broadcast").wait()
                return
            if self.aggregation == "majority" and kernels.backend_for(inbox, down) == "cpu":
                native.server_majority(inbox, down, n_bits=d)  # count, sign, lanes in one pass
            else:
                count = packing.count_votes(inbox, d).to(torch.int16)
                lanes = (torch.sign(2 * count - n) + 1) if self.aggregation == "majority" else count
                down.copy_(packing.pack_lanes(lanes.to(torch.uint8), self.down_bits))
            self.comm.exchange_p2p([(j, down) for j in range(n) if j != r], [], "server broadcast").wait()

        return receive

    def wire_bytes(self, numel):
        return self.facts.wire_bytes(
            numel, self.world_size, aggregation=self.aggregation, rank=self.comm.rank, root=self.root
        )
