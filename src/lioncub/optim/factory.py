"""The vote of a :class:`~lioncub.optim.config.VoteConfig` on a group: :func:`make_vote`."""

from __future__ import annotations

from typing import Literal, cast

import torch

from lioncub.collectives import (
    AverageVote,
    Comm,
    DenseMean,
    LaneVote,
    OneBitVote,
    QuantizedVote,
    ServerVote,
    SignSumVote,
    Vote,
    make_topology_vote,
)
from lioncub.optim.config import VoteConfig, check_workers

__all__ = ["make_vote"]


def make_vote(
    comm: Comm, config: VoteConfig, levels: tuple[Comm, Comm] | None = None, *, every_step: bool = True
) -> Vote:
    """The vote for ``config`` on ``comm`` (raises when N workers could overflow a lane: the message names
    ``bits``, the transport and the widths or presets that fit N, see
    :func:`lioncub.optim.config.check_workers`), laid over the nodes as ``config.topology`` with
    ``levels`` = (intra-node, inter-node) groups of this rank (:mod:`lioncub.collectives.hierarchical`).
    ``every_step=False`` (an outer rule of local steps, voting once per H steps): a dense vote keeps no
    exchange buffers between its votes, on the CPU too (:attr:`DenseMean.keep_buffers`)."""
    config.validate()
    if config.topology != "flat" and levels is None:
        raise ValueError(f"topology={config.topology!r} needs the (node, local) groups of this rank")
    try:
        flat = _flat_vote(comm, config, every_step)
    except ValueError as exc:
        try:
            check_workers(config, comm.world_size)  # an overflow for N workers: say which option to change
        except ValueError as named:
            raise named from exc
        raise

    def groups() -> tuple[Comm, Comm]:
        assert levels is not None, "checked above"
        return levels

    return make_topology_vote(config.topology, flat, groups)


def _flat_vote(comm: Comm, config: VoteConfig, every_step: bool) -> Vote:
    t, agg = config.transport, config.aggregation
    if t == "dense":
        wire = None if config.wire_dtype_name is None else getattr(torch, config.wire_dtype_name)
        return DenseMean(comm, wire, keep_buffers=None if every_step else False)
    if t == "1bit":
        return OneBitVote(comm, config.zero_vote)
    bits = config.bits if config.bits is not None else config.lane_bits(comm.world_size)
    if t == "lanes":
        return LaneVote(comm, cast(int, bits), config.zero_vote)
    if t == "int8":
        return AverageVote(comm) if agg == "average" else SignSumVote(comm)
    if t == "server":
        aggregation: Literal["average", "majority"] = "average" if agg == "average" else "majority"
        return ServerVote(comm, aggregation, root=config.server_root, zero_vote=config.zero_vote)
    return QuantizedVote(
        comm,
        config.quantizer or "l1",
        cast(int, bits),
        clip_multiple=config.clip_multiple,
        chunk_size=config.chunk_size,
        options=config.quantizer_options,
        seed=config.seed,
    )
