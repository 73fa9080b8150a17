"""Votes over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA), one module per algorithm.

* :mod:`~lioncub.collectives.base` — :class:`Comm`: exchanges with byte accounting and bounded waits
  (:class:`GroupComm`: on a process-group object whose members change);
* :mod:`~lioncub.collectives.protocol` — the protocol every vote follows (:class:`Vote`, :class:`Ballot`);
* :mod:`~lioncub.collectives.formats` — the payloads and results the votes share on the wire;
* :mod:`~lioncub.collectives.signvote` — the contribution and apply of every vote on signs;
* the votes: :mod:`~lioncub.collectives.onebit` (1-bit all-to-all), :mod:`~lioncub.collectives.lanes`
  (p-bit lanes), :mod:`~lioncub.collectives.signsum` (int8 signs: sum and average),
  :mod:`~lioncub.collectives.quantized` (quantizer levels), :mod:`~lioncub.collectives.server`
  (parameter server), :mod:`~lioncub.collectives.dense` (the gradient mean of the baselines),
  :mod:`~lioncub.collectives.hierarchical` (over nodes of several ranks).

=====================  =========================================================  =====================
class                  wire                                                       result
=====================  =========================================================  =====================
:class:`OneBitVote`    votes ``c ≥ 0`` packed 8/byte; all-to-all of slices, local  ``int8`` ±1 (ties
                       count + tie rule, all-gather of packed slice results        alternate +1/−1)
:class:`LaneVote`      0/1 votes in p-bit lanes, uint8 allreduce SUM              ``sign(2·count − N)``
:class:`SignSumVote`   ``sign(c)`` as int8, allreduce SUM                          ``sign(Σ sign c_i)``
:class:`QuantizedVote` quantizer levels (int8, or offset p-bit lanes), SUM         ``sign(Σ q_i)``
:class:`AverageVote`   ``sign(c)`` as int8, allreduce SUM                          ``Σ sign c_i / N``
:class:`ServerVote`    packed votes to rank 0, count there, 2-bit (majority) or    majority or average
                       count lanes (average) sent back
:class:`DenseMean`     gradient in fp32/bf16/fp16, ÷N, reduce-scatter + gather    the mean gradient
=====================  =========================================================  =====================

With ``N = 1`` there is nothing to exchange and every sign vote is ``sign(c)`` (plain Lion), unless the
votes were built under :func:`~lioncub.collectives.base.exchange_when_alone` (then they run their
collectives over the group of one, as the GPU check does). Non-finite
``c`` (the optimizer skips such steps before voting) still gives a defined, in-range result: a one-bit
vote of NaN is "−" (``NaN ≥ 0`` is false) and of ±Inf is ±; ``sign(NaN)`` is 0 on the int8 paths and for
``N = 1``; a quantized vote abstains (levels 0) on a tensor or chunk holding NaN or ±Inf (see
:mod:`lioncub.ops.quantize`). :class:`DenseMean` is a mean and propagates NaN and Inf.
"""

from lioncub.collectives.base import (
    Backend,
    CollectiveError,
    Comm,
    CommCounter,
    GroupComm,
    exchange_when_alone,
)
from lioncub.collectives.dense import DenseMean
from lioncub.collectives.hierarchical import HierarchicalVote, NodeMajorityVote, make_topology_vote
from lioncub.collectives.lanes import LaneVote, auto_lane_bits
from lioncub.collectives.onebit import OneBitVote
from lioncub.collectives.protocol import Ballot, Hyper, ParamState, Pending, Result, Vote
from lioncub.collectives.quantized import QuantizedVote
from lioncub.collectives.server import ServerVote
from lioncub.collectives.signsum import AverageVote, SignSumVote
from lioncub.collectives.signvote import SignVote, flat_views

__all__ = [
    "AverageVote",
    "Backend",
    "Ballot",
    "CollectiveError",
    "Comm",
    "CommCounter",
    "DenseMean",
    "GroupComm",
    "HierarchicalVote",
    "Hyper",
    "LaneVote",
    "NodeMajorityVote",
    "OneBitVote",
    "ParamState",
    "Pending",
    "QuantizedVote",
    "Result",
    "ServerVote",
    "SignSumVote",
    "SignVote",
    "Vote",
    "auto_lane_bits",
    "exchange_when_alone",
    "flat_views",
    "make_topology_vote",
]
