"""The settings of a run sharded inside each node (``lioncub train --fsdp``, docs/shards.md "From the
command line"), checked with the rest of :class:`lioncub.train.config.TrainConfig`'s checks. Torch-free."""

from __future__ import annotations

from typing import Any

__all__ = ["check_fsdp"]


def check_fsdp(config: Any) -> None:
    """``config`` (a :class:`~lioncub.train.config.TrainConfig`) with ``--fsdp``: ``ValueError`` naming the
    flag and what is allowed for what the sharded run does not take -- no ``--nnodes M --nproc-per-node L``
    with L >= 2, ``--overlap``, a ``--topology`` other than flat (``auto`` is flat there), ``--diagnostics-
    every``, ``--convert-momenta``."""
    cluster, opt = config.cluster, config.optimizer
    if not cluster.fsdp:
        return
    if cluster.nnodes is None or cluster.nproc_per_node < 2:
        per_node = cluster.nproc_per_node
        given = "without --nnodes" if cluster.nnodes is None else f"with --nproc-per-node {per_node}"
        raise ValueError(
            f"--fsdp {given}: each emulated node shards the model over its ranks; give --nnodes M "
            "--nproc-per-node L with L >= 2 (and --link RATE)"
        )
    if opt.overlap:
        raise ValueError(
            "--fsdp with --overlap: the vote on shards runs in the optimizer step (--overlap hooks DDP's "
            "buckets, which a sharded model has not); drop --overlap"
        )
    if opt.topology not in ("flat", "auto"):
        raise ValueError(
            f"--fsdp with --topology {opt.topology}: the vote on shards is flat between the nodes (one "
            "voter per node and shard); allowed: --topology flat or auto"
        )
    if opt.diagnostics_every:
        raise ValueError(
            f"--fsdp with --diagnostics-every {opt.diagnostics_every}: the vote diagnostics are per-tensor "
            "statistics and a rank holds shards; allowed: --diagnostics-every 0"
        )
    if config.run.convert_momenta is not None:
        raise ValueError(
            f"--fsdp with --convert-momenta {config.run.convert_momenta}: each node's momenta are its own "
            "voter's; resume a sharded run with the same --nnodes and --nproc-per-node"
        )
