"""Lion Cub's 1-bit compressed allreduce for the majority vote (:class:`OneBitVote`)."""

from __future__ import annotations

import torch

from lioncub import transports
from lioncub.collectives.base import Handle
from lioncub.collectives.formats import Decoded, PackedSigns, PackedVotes, sign_int8
from lioncub.collectives.protocol import Pending
from lioncub.collectives.signvote import SignVote
from lioncub.ops import kernels, packing

__all__ = ["OneBitVote"]


class OneBitVote(SignVote):
    """Lion Cub's 1-bit compressed allreduce for the majority vote.

    1. votes ``b = [c > 0]`` padded with "+" to a multiple of ``8·N``, packed 8 per byte, split in N
       slices (:class:`~lioncub.collectives.formats.PackedVotes`, written by the fused contribution);
    2. all-to-all: rank r receives slice r of every worker;
    3. rank r counts the "+" votes of its slice; a tie (``2·count = N``) becomes +1 on odd steps and −1 on
       even steps (the same on every rank);
    4. the slice's result is packed and all-gathered
       (:class:`~lioncub.collectives.formats.PackedSigns`: ``int8`` ±1, never 0).

    An exact zero of ``c`` votes by :meth:`~lioncub.collectives.signvote.SignVote.zeros_vote_plus`. Bytes
    per rank: ``2·(N−1)/N · d_pad / 8`` (``d_pad``: d rounded up to a multiple of 8N).
    """

    name = "1bit"
    facts = transports.FACTS["1bit"]

    def payload_format(self):
        return None if self.comm.alone else PackedVotes(1, 8 * self.world_size)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n = self.world_size
        d = local.numel()
        if self.comm.alone:
            return Pending(lambda: Decoded(sign_int8(local)))
        nbytes = -(-d // (8 * n)) * n  # padded bits / 8
        if encoded is None:
            zeros = self.zeros_vote_plus(step)
            packed = packing.pack_signs(local, pad_to=8 * n, out=self.payload(key, d), zeros_vote_plus=zeros)
        else:
            packed = encoded
        recv = self.buffer(key, "recv", nbytes, torch.uint8)
        slice_bytes = nbytes // n
        handle = self.comm.all_to_all(
            recv.view(n, slice_bytes), packed.view(n, slice_bytes), "1-bit all-to-all"
        )
        tie_positive = step % 2 == 1
        gathered = self.buffer(key, "gathered", nbytes, torch.uint8).view(n, slice_bytes)
        phase2: list[Handle] = []

        def middle() -> None:  # count this rank's slice, post the all-gather of its result
            handle.wait()
            rows = recv.view(n, slice_bytes)
            if kernels.backend_for(rows) != "torch":  # GPU, CPU: unpack, count, tie rule, repack in one pass
                mine = kernels.majority_pack(
                    rows, tie_positive, n_workers=n, out=self.buffer(key, "mine", slice_bytes, torch.uint8)
                )
            else:
                mine = packing.pack_majority(packing.count_votes(rows, slice_bytes * 8), n, tie_positive)
            phase2.append(self.comm.all_gather(gathered, mine, "1-bit all-gather"))

        def finish() -> PackedSigns:
            phase2[0].wait()
            return PackedSigns(gathered.view(-1), d, self.buffer(key, "result", d, torch.int8))

        return Pending(finish, middle=middle)
