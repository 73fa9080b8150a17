"""Votes over an int8 allreduce of ``sign(c)``: the sign of the sum (:class:`SignSumVote`, Lion Cub "8bit
w/o L1") and the mean of the signs (:class:`AverageVote`, Distributed Lion Avg)."""

from __future__ import annotations

from lioncub import transports
from lioncub.collectives.base import Comm
from lioncub.collectives.formats import Decoded, Int8Signs, MeanOfSigns, SignOfSum, sign_int8
from lioncub.collectives.protocol import Pending
from lioncub.collectives.signvote import SignVote
from lioncub.ops import quantize

__all__ = ["AverageVote", "SignSumVote"]


class SignSumVote(SignVote):
    """Direct allreduce of ``sign(c)`` in int8 (:class:`~lioncub.collectives.formats.Int8Signs`) and the
    sign of the sum (:class:`~lioncub.collectives.formats.SignOfSum`). Exact zeros count 0 and ties stay 0.
    Needs ``N ≤ 127``. Bytes per rank: ``2·(N−1)/N · d``."""

    name = "int8-sign"
    facts = transports.FACTS["int8"]

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm)
        quantize.level_budget(comm.world_size, 8, "signed")  # raises beyond 127 workers

    def payload_format(self):
        return None if self.comm.alone else Int8Signs()

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        signs = sign_int8(local) if encoded is None else encoded
        if self.comm.alone:
            return Pending(lambda: Decoded(signs))
        handle = self.comm.all_reduce(signs, "int8 sign allreduce")
        return Pending(lambda: SignOfSum(handle.tensor()))


class AverageVote(SignSumVote):
    """Distributed Lion averaging: ``Σ_i sign(c_i) / N`` (values in {−1, −1+2/N, …, 1}) over an int8
    allreduce (:class:`~lioncub.collectives.formats.MeanOfSigns`). Result: in the dtype of ``local``."""

    name = "dlion-avg"
    result = "value"

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        signs = sign_int8(local) if encoded is None else encoded
        n = self.world_size
        if self.comm.alone:
            return Pending(lambda: Decoded(signs.to(local.dtype)))
        handle = self.comm.all_reduce(signs, "int8 sign allreduce (average)")
        out = self.buffer(key, "average", local.numel(), local.dtype)  # reused: no fresh pages per step
        return Pending(lambda: MeanOfSigns(handle.tensor(), n, out))
