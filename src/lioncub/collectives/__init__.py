"""Vote algorithms over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA).

See :mod:`lioncub.collectives.votes` for the algorithms and their wire formats and
:mod:`lioncub.collectives.base` for byte accounting, timeouts and the pairwise exchanges.
"""

from lioncub.collectives.base import CollectiveError, Comm, CommCounter
from lioncub.collectives.hierarchical import (
    TOPOLOGIES,
    HierarchicalVote,
    NodeMajorityVote,
    make_topology_vote,
)
from lioncub.collectives.votes import (
    AverageVote,
    DenseMean,
    Encoding,
    LaneVote,
    OneBitVote,
    Pending,
    QuantizedVote,
    RawResult,
    ServerVote,
    SignSumVote,
    VoteAlgorithm,
    auto_lane_bits,
)

__all__ = [
    "TOPOLOGIES",
    "AverageVote",
    "CollectiveError",
    "Comm",
    "CommCounter",
    "DenseMean",
    "Encoding",
    "HierarchicalVote",
    "LaneVote",
    "NodeMajorityVote",
    "OneBitVote",
    "Pending",
    "QuantizedVote",
    "RawResult",
    "ServerVote",
    "SignSumVote",
    "VoteAlgorithm",
    "auto_lane_bits",
    "make_topology_vote",
]
