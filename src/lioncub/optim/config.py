"""Presets of :class:`~lioncub.optim.lioncub.LionCub` and the explicit knobs behind them.

A variant is a combination of four knobs (optax-style: each preset is a recipe, not a copy):

* ``transport`` — how the workers' contributions travel: ``"dense"`` (gradient allreduce),
  ``"1bit"`` (all-to-all + all-gather of packed votes), ``"lanes"`` (0/1 votes in p-bit lanes),
  ``"int8"`` (int8 allreduce of signs), ``"quantized"`` (quantizer levels), ``"server"`` (gather to a
  parameter server and send back);
* ``aggregation`` — ``"mean"`` (of gradients: global Lion), ``"majority"`` (sign of the vote sum) or
  ``"average"`` (mean of the signs: Distributed Lion Avg);
* ``quantizer`` — for ``transport="quantized"``: ``"l1"``, ``"l0"``, ``"linf"``, ``"lp"``, ``"qsgd"``,
  ``"log"`` or ``"sign"``;
* ``bits`` — lane width of ``"lanes"`` / ``"quantized"`` (2, 4, 8 or ``"auto"``); the wire dtype of
  ``"dense"`` is ``wire_dtype``.

========================  =========  ===========  =========  ====  =====================================
preset                    transport  aggregation  quantizer  bits  paper
========================  =========  ===========  =========  ====  =====================================
``"32bit"``               dense      mean         —          32    Lion (32bit): DDP + Lion
``"16bit"``               dense      mean         —          16    Lion (16bit): bf16 gradient allreduce
``"1bit"``                1bit       majority     —          1     Lion Cub (1bit)
``"4bit"``                lanes      majority     —          4     Lion Cub (4bit)
``"8bit"``                quantized  majority     l1         8     Lion Cub (8bit)
``"8bit-sign"``           int8       majority     —          8     Lion Cub (8bit, w/o L1)
``"dlion-mavo"``          server     majority     —          1↑2↓  D-Lion (MaVo), parameter server
``"dlion-avg"``           int8       average      —          8     D-Lion (Avg)
========================  =========  ===========  =========  ====  =====================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lioncub import quantize
from lioncub.collectives import (
    AverageVote,
    Comm,
    DenseMean,
    LaneVote,
    OneBitVote,
    QuantizedVote,
    ServerVote,
    SignSumVote,
    VoteAlgorithm,
)

__all__ = ["PRESETS", "TRANSPORTS", "VoteConfig", "make_vote", "resolve_variant"]

TRANSPORTS = ("dense", "1bit", "lanes", "int8", "quantized", "server")
AGGREGATIONS = ("mean", "majority", "average")


@dataclass(frozen=True)
class VoteConfig:
    """How one step's local directions are combined (see the module docstring for the presets)."""

    transport: str = "quantized"
    aggregation: str = "majority"
    quantizer: str | None = "l1"
    bits: int | Literal["auto"] | None = 8
    wire_dtype: torch.dtype | None = None  # dense: None = the gradient's own dtype (as DDP)
    clip_multiple: float = 2.0
    chunk_size: int | None = None
    quantizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    server_root: int = 0

    def validate(self) -> VoteConfig:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}")
        allowed = {
            "dense": ("mean",),
            "1bit": ("majority",),
            "lanes": ("majority",),
            "int8": ("majority", "average"),
            "quantized": ("majority",),
            "server": ("majority", "average"),
        }[self.transport]
        if self.aggregation not in allowed:
            raise ValueError(
                f"aggregation={self.aggregation!r} is not available with transport={self.transport!r}; "
                f"allowed: {allowed}"
            )
        if self.transport == "quantized" and self.quantizer not in quantize.QUANTIZERS:
            raise ValueError(f"quantizer={self.quantizer!r} is not one of {sorted(quantize.QUANTIZERS)}")
        if self.transport in ("lanes", "quantized") and self.bits not in (2, 4, 8, "auto"):
            raise ValueError(f"bits={self.bits!r} must be 2, 4, 8 or 'auto' for transport={self.transport!r}")
        return self


PRESETS: dict[str, VoteConfig] = {
    "32bit": VoteConfig("dense", "mean", None, None, None),
    "16bit": VoteConfig("dense", "mean", None, None, torch.bfloat16),
    "1bit": VoteConfig("1bit", "majority", None, 1),
    "4bit": VoteConfig("lanes", "majority", None, 4),
    "8bit": VoteConfig("quantized", "majority", "l1", 8),
    "8bit-sign": VoteConfig("int8", "majority", None, 8),
    "dlion-mavo": VoteConfig("server", "majority", None, 1),
    "dlion-avg": VoteConfig("int8", "average", None, 8),
}


def resolve_variant(variant: str, **overrides: Any) -> VoteConfig:
    """The preset ``variant`` with the non-``None`` ``overrides`` applied, validated."""
    if variant not in PRESETS:
        raise ValueError(f"variant={variant!r} is not one of {sorted(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(changes) - {f.name for f in dataclasses.fields(VoteConfig)}
    if unknown:
        raise TypeError(f"unknown vote options: {sorted(unknown)}")
    new_transport = changes.get("transport")
    if new_transport not in (None, PRESETS[variant].transport):
        # switching transport: the preset's quantizer and lane width belong to the old one
        changes.setdefault("quantizer", "l1" if new_transport == "quantized" else None)
        changes.setdefault("bits", {"quantized": 8, "lanes": 4}.get(new_transport))
    return dataclasses.replace(PRESETS[variant], **changes).validate()


def make_vote(comm: Comm, config: VoteConfig, *, seed: int = 0) -> VoteAlgorithm:
    """The vote algorithm for ``config`` on ``comm`` (raises when N workers could overflow a lane)."""
    config.validate()
    t, agg = config.transport, config.aggregation
    if t == "dense":
        return DenseMean(comm, config.wire_dtype)
    if t == "1bit":
        return OneBitVote(comm)
    if t == "lanes":
        return LaneVote(comm, config.bits if config.bits is not None else 4)
    if t == "int8":
        return AverageVote(comm) if agg == "average" else SignSumVote(comm)
    if t == "server":
        return ServerVote(comm, "average" if agg == "average" else "majority", root=config.server_root)
    return QuantizedVote(
        comm,
        config.quantizer or "l1",
        config.bits if config.bits is not None else 8,
        clip_multiple=config.clip_multiple,
        chunk_size=config.chunk_size,
        options=config.quantizer_options,
        seed=seed,
    )
