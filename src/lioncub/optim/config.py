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
import math
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

__all__ = ["PRESETS", "TRANSPORTS", "VoteConfig", "check_workers", "make_vote", "resolve_variant"]

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
        if self.transport in ("lanes", "quantized"):
            if isinstance(self.bits, bool) or self.bits not in (2, 4, 8, "auto"):
                raise ValueError(
                    f"bits={self.bits!r} must be 2, 4, 8 or 'auto' for transport={self.transport!r}"
                )
        elif self.bits not in _FIXED_BITS[self.transport] or isinstance(self.bits, bool):
            raise ValueError(
                f"bits={self.bits!r}: transport={self.transport!r} has a fixed width "
                f"(allowed: {_FIXED_BITS[self.transport]}); bits applies to transport 'lanes' or 'quantized'"
            )
        if self.transport != "quantized":
            for name in ("quantizer", "quantizer_options"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} applies only to transport='quantized', "
                        f"not transport={self.transport!r}"
                    )
        if self.wire_dtype not in _WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype={self.wire_dtype} must be None (the gradient's dtype), torch.float32, "
                "torch.bfloat16, torch.float16 or torch.float64"
            )
        if self.wire_dtype is not None and self.transport != "dense":
            raise ValueError(
                f"wire_dtype={self.wire_dtype} applies only to transport='dense', "
                f"not transport={self.transport!r}"
            )
        if isinstance(self.clip_multiple, bool) or not (
            isinstance(self.clip_multiple, (int, float)) and 0 < self.clip_multiple < math.inf
        ):
            raise ValueError(
                f"clip_multiple={self.clip_multiple!r} must be a finite number > 0 "
                "(authors' code: 2, paper: 1)"
            )
        if self.chunk_size is not None and not (_is_int(self.chunk_size) and self.chunk_size >= 1):
            raise ValueError(f"chunk_size={self.chunk_size!r} must be None (per tensor) or an int >= 1")
        if not isinstance(self.quantizer_options, dict):
            raise ValueError(f"quantizer_options={self.quantizer_options!r} must be a dict")
        if not (_is_int(self.server_root) and self.server_root >= 0):
            raise ValueError(f"server_root={self.server_root!r} must be an int >= 0 (a rank)")
        return self


#: transports whose lane width is fixed: the ``bits`` values they accept (``None``: not stated)
_FIXED_BITS: dict[str, tuple[int | None, ...]] = {
    "dense": (None,),
    "1bit": (None, 1),
    "int8": (None, 8),
    "server": (None, 1),
}

_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: explicit knobs that only the quantized transport reads
_QUANTIZED_KNOBS = ("quantizer", "clip_multiple", "chunk_size")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if not isinstance(variant, str) or variant not in PRESETS:
        raise ValueError(f"variant={variant!r} is not one of {sorted(PRESETS)} (LionCub also takes 'auto')")
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(changes) - {f.name for f in dataclasses.fields(VoteConfig)}
    if unknown:
        raise TypeError(
            f"unknown vote options: {sorted(unknown)}; "
            f"known: {sorted(f.name for f in dataclasses.fields(VoteConfig))}"
        )
    new_transport = changes.get("transport")
    if new_transport not in (None, PRESETS[variant].transport):
        # switching transport: the preset's quantizer and lane width belong to the old one
        changes.setdefault("quantizer", "l1" if new_transport == "quantized" else None)
        changes.setdefault("bits", {"quantized": 8, "lanes": 4}.get(new_transport))
    transport = changes.get("transport", PRESETS[variant].transport)
    if transport != "quantized":
        given = [k for k in _QUANTIZED_KNOBS if overrides.get(k) is not None]
        if given:
            raise ValueError(
                f"{', '.join(f'{k}={overrides[k]!r}' for k in given)}: applies only to the quantized vote "
                f"(variant '8bit', or transport='quantized'); variant={variant!r} has transport={transport!r}"
            )
    bits = overrides.get("bits")
    if (
        transport in _FIXED_BITS
        and bits is not None
        and (bits not in _FIXED_BITS[transport] or isinstance(bits, bool))
    ):
        raise ValueError(
            f"bits={bits!r}: variant={variant!r} has transport={transport!r}, whose width is "
            "fixed; bits applies to transport 'lanes' (variant '4bit') or 'quantized' (variant '8bit')"
        )
    return dataclasses.replace(PRESETS[variant], **changes).validate()


def make_vote(comm: Comm, config: VoteConfig, *, seed: int = 0) -> VoteAlgorithm:
    """The vote algorithm for ``config`` on ``comm`` (raises when N workers could overflow a lane: the
    message names ``bits``, the transport and the widths or presets that fit N, see :func:`check_workers`)."""
    config.validate()
    if not _is_int(seed):
        raise ValueError(f"seed={seed!r} must be an int")
    try:
        return _build_vote(comm, config, seed)
    except ValueError as exc:
        try:
            check_workers(config, comm.world_size)  # an overflow for N workers: say which option to change
        except ValueError as named:
            raise named from exc
        raise


def _build_vote(comm: Comm, config: VoteConfig, seed: int) -> VoteAlgorithm:
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


def check_workers(config: VoteConfig, n_workers: int) -> None:
    """Raise ``ValueError`` naming the transport, ``bits`` and the widths that work when ``config``'s integer
    sums could overflow for ``n_workers`` workers (the limits of :func:`lioncub.costmodel.allowed`)."""
    from lioncub import costmodel

    try:
        ok, why = costmodel.allowed(config, n_workers)
    except ValueError:
        return  # not a configuration the cost model knows: the caller's own error stands
    if ok:
        return
    widths = [
        b
        for b in (2, 4, 8)
        if config.transport in ("lanes", "quantized")
        and costmodel.allowed(dataclasses.replace(config, bits=b), n_workers)[0]
    ]
    if widths:
        fix = f"allowed for {n_workers} workers: bits in {widths} or 'auto'"
    else:
        fits = [name for name, preset in PRESETS.items() if costmodel.allowed(preset, n_workers)[0]]
        fix = f"no width of this transport fits {n_workers} workers; presets that do: {fits}"
    raise ValueError(
        f"bits={config.bits!r} with transport={config.transport!r} (aggregation={config.aggregation!r}) "
        f"cannot serve {n_workers} workers: {why}; {fix}"
    )
