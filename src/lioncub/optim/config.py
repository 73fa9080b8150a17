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

from lioncub import transports
from lioncub._validate import Named, OptionError, is_int, is_number
from lioncub.transports import AGGREGATIONS, TOPOLOGIES, TRANSPORTS, ZERO_VOTES

__all__ = [
    "DEFAULT_OUTER",
    "DENSE_RULES",
    "DENSE_SGD_RULE",
    "DENSE_SIGN_RULE",
    "EXCHANGES",
    "INNER_MOMENTA",
    "OUTER_RULE_FACTS",
    "PRESETS",
    "SIGN_RULES",
    "TOPOLOGIES",
    "TRANSPORTS",
    "ZERO_VOTES",
    "VoteConfig",
    "capacity",
    "check_workers",
    "lane_bits",
    "resolve_variant",
    "server_down_bits",
    "variant_name",
]

#: implementations of the all-to-all / all-gather (:class:`lioncub.collectives.Comm`)
EXCHANGES = ("auto", "p2p", "native")
#: what each rank's inner momentum becomes at an outer step of local steps
#: (:class:`~lioncub.optim.local_steps.LocalSteps` ``inner_momentum``), the default first; here, without
#: torch, for ``lioncub cost`` and the run names (:mod:`lioncub.names`)
INNER_MOMENTA = ("reset", "keep", "average")


@dataclass(frozen=True)
class OuterFacts:
    """What an outer rule's name stands for, without torch (its step is
    :data:`lioncub.optim.outer.OUTER_RULES`'): ``sign``, a sign step (its lr scaled by H·lr, the outer
    betas (0.9, 0.96)); ``dense``, on the mean of the pseudo-gradients, a dense exchange (``variant="32bit"``
    or ``"16bit"``) instead of the variant's vote."""

    sign: bool
    dense: bool


#: the outer rules of local steps by name, the default first: the one table of their names, here without
#: torch, for the settings (``--outer``), the run names (:mod:`lioncub.names`) and ``lioncub cost``; every
#: rule of :data:`lioncub.optim.outer.OUTER_RULES` is one of these
OUTER_RULE_FACTS = {
    "vote": OuterFacts(sign=True, dense=False),  # each rank's outer momentum through the variant's vote
    "dsm": OuterFacts(sign=True, dense=True),  # the sign step on the mean (Yu et al. 2024)
    "diloco": OuterFacts(sign=False, dense=True),  # Nesterov SGD on the mean (Douillard et al. 2023)
}
#: the outer rule where none is given (a run name leaves it out)
DEFAULT_OUTER = next(iter(OUTER_RULE_FACTS))
#: the rules that take a sign step (their outer lr: :func:`lioncub.optim.local_steps.default_outer_lr`)
SIGN_RULES = tuple(name for name, facts in OUTER_RULE_FACTS.items() if facts.sign)
#: the rules on the mean of the pseudo-gradients (a dense exchange)
DENSE_RULES = tuple(name for name, facts in OUTER_RULE_FACTS.items() if facts.dense)
#: the sign step on the mean: what a vote on a dense exchange is (the sign of the mean)
DENSE_SIGN_RULE = next(name for name in DENSE_RULES if name in SIGN_RULES)
#: the dense rule that is not a sign step: DiLoCo's Nesterov SGD (torchft's DiLoCo is one)
DENSE_SGD_RULE = next(name for name in DENSE_RULES if name not in SIGN_RULES)
#: the transports whose votes are one bit (a zero must vote "+" or "−")
ONE_BIT_VOTES = ("1bit", "lanes", "server")
#: the dense transport's wire dtypes, by name, and their bits per element
_WIRE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "float64": 64}


@dataclass(frozen=True)
class VoteConfig:
    """How one step's local directions are combined (see the module docstring for the presets).

    ``wire_dtype`` (dense transport only): a ``torch`` floating dtype or its name (``"bfloat16"``);
    ``None`` sends the gradient's own dtype, as DDP. ``seed`` seeds a stochastic quantizer (``"qsgd"``),
    combined with the rank. ``exchange``: the all-to-all / all-gather implementation, ``"auto"``,
    ``"p2p"`` or ``"native"`` (:class:`lioncub.collectives.Comm`). ``topology``: how the vote is laid over
    nodes of several ranks — ``"flat"`` (every rank alike), ``"hierarchical"`` (exact, bitwise the flat
    result: :class:`lioncub.collectives.hierarchical.HierarchicalVote`) or ``"node-majority"`` (1-bit only,
    a different estimator: :class:`~lioncub.collectives.hierarchical.NodeMajorityVote`).

    ``zero_vote`` (the one-bit votes: 1bit, 4bit, dlion-mavo, server): how an exact zero of ``c`` votes.
    ``"split"`` (default): "+" on the ranks where rank + step is even, "−" on the others. An element that
    is zero on every rank (an embedding row no batch used, a padding row) then counts N/2 "+" votes for an
    even N and (N ± 1)/2 for an odd N: the votes whose ties are 0 (4bit, dlion-mavo, server-majority) hold
    it for an even N and give ±1 on alternate steps for an odd N; the 1-bit all-to-all vote (1bit), whose
    result is one bit, gives ±1 on alternate steps for every N (a tie alternates with the step's parity).
    Such an element moves by ∓lr and back, so it returns within rounding after every second step; with
    weight decay the pair drifts by lr²·wd every two steps (towards about +lr/2 after even steps). The
    other presets (8bit, 8bit-sign, dlion-avg, 32bit, 16bit) hold it at every N (``docs/local-steps.md``,
    "Coordinates no rank moves"). ``"plus"``: zeros vote "+", the papers' code, which moves such an element
    by −lr at every step (use it to reproduce their numbers). The same bytes travel either way.

    This module does not import torch.
    """

    transport: str = "quantized"
    aggregation: str = "majority"
    quantizer: str | None = "l1"
    bits: int | Literal["auto"] | None = 8
    wire_dtype: Any = None  # dense: None = the gradient's own dtype (as DDP)
    clip_multiple: float = 2.0
    chunk_size: int | None = None
    quantizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    server_root: int = 0
    seed: int = 0
    exchange: str = "auto"
    topology: str = "flat"
    zero_vote: str = "split"

    @property
    def wire_dtype_name(self) -> str | None:
        """``wire_dtype`` as a name (``"bfloat16"``), ``None`` for the gradient's own dtype."""
        return None if self.wire_dtype is None else str(self.wire_dtype).removeprefix("torch.")

    @property
    def wire_bits(self) -> int:
        """Bits per element the dense transport sends (32 for ``wire_dtype=None``: fp32 gradients)."""
        return _WIRE_BITS.get(self.wire_dtype_name or "float32", 32)

    def validate(self) -> VoteConfig:
        """This configuration, or ``ValueError`` naming the first bad knob and its allowed values."""
        from lioncub.ops import quantize  # torch: only when a configuration is checked for use

        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}")
        facts = transports.FACTS[self.transport]
        allowed = facts.aggregations
        if self.aggregation not in allowed:
            raise ValueError(
                f"aggregation={self.aggregation!r} is not available with transport={self.transport!r}; "
                f"allowed: {allowed}"
            )
        if self.transport == "quantized" and self.quantizer not in quantize.QUANTIZERS:
            names = sorted(quantize.QUANTIZERS)
            raise OptionError("VoteConfig", "quantizer", self.quantizer, f"is not one of {names}")
        if facts.widths:
            if isinstance(self.bits, bool) or self.bits not in (*facts.widths, "auto"):
                raise ValueError(
                    f"bits={self.bits!r} must be 2, 4, 8 or 'auto' for transport={self.transport!r}"
                )
        elif self.bits not in facts.fixed_bits or isinstance(self.bits, bool):
            raise ValueError(
                f"bits={self.bits!r}: transport={self.transport!r} has a fixed width "
                f"(allowed: {facts.fixed_bits}); bits applies to transport 'lanes' or 'quantized'"
            )
        if self.transport != "quantized":
            for name in ("quantizer", "quantizer_options"):
                if getattr(self, name):
                    raise OptionError(
                        "VoteConfig",
                        name,
                        getattr(self, name),
                        f"applies only to transport='quantized', not transport={self.transport!r}",
                    )
        if self.wire_dtype is not None and self.wire_dtype_name not in _WIRE_BITS:
            raise ValueError(
                f"wire_dtype={self.wire_dtype} must be None (the gradient's dtype), torch.float32, "
                "torch.bfloat16, torch.float16 or torch.float64"
            )
        if self.wire_dtype is not None and self.transport != "dense":
            raise ValueError(
                f"wire_dtype={self.wire_dtype} applies only to transport='dense', "
                f"not transport={self.transport!r}"
            )
        self._validate_knobs()
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r}: allowed values are {list(EXCHANGES)}")
        if self.topology not in TOPOLOGIES:
            auto = (
                " (topology='auto' is lioncub.planning.auto.auto_topology(params, variant, network=...), "
                "called before the optimizer: it returns the exact topology the cost model predicts faster)"
                if self.topology == "auto"
                else ""
            )
            raise OptionError(
                "VoteConfig",
                "topology",
                self.topology,
                f"allowed values are {list(TOPOLOGIES)}{auto}",
                sep=": ",
            )
        if self.topology == "node-majority" and self.topology not in facts.topologies:
            raise OptionError(
                "VoteConfig",
                "topology",
                self.topology,
                f"applies to the 1-bit vote (variant '1bit'), not to transport={self.transport!r}",
            )
        if self.topology not in facts.topologies:
            raise OptionError(
                "VoteConfig",
                "topology",
                self.topology,
                f"applies to the votes, not to transport={self.transport!r} (the dense presets leave the "
                "gradient allreduce to the backend; the parameter server is a star)",
            )
        return self

    def _validate_knobs(self) -> None:
        """:meth:`validate`'s checks of the numeric and per-transport knobs."""
        if not is_number(self.clip_multiple, gt=0):
            raise ValueError(
                f"clip_multiple={self.clip_multiple!r} must be a finite number > 0 "
                "(authors' code: 2, paper: 1)"
            )
        if self.chunk_size is not None and not (is_int(self.chunk_size) and self.chunk_size >= 1):
            raise ValueError(f"chunk_size={self.chunk_size!r} must be None (per tensor) or an int >= 1")
        if not isinstance(self.quantizer_options, dict):
            raise ValueError(f"quantizer_options={self.quantizer_options!r} must be a dict")
        if not is_int(self.server_root, 0):
            raise ValueError(f"server_root={self.server_root!r} must be an int >= 0 (a rank)")
        if not is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int")
        if self.zero_vote not in ZERO_VOTES:
            allowed = list(ZERO_VOTES)
            raise OptionError(
                "VoteConfig", "zero_vote", self.zero_vote, f"allowed values are {allowed}", sep=": "
            )
        if self.zero_vote != "split" and self.transport not in ONE_BIT_VOTES:
            one_bit = [name for name, p in PRESETS.items() if p.transport in ONE_BIT_VOTES]
            these = [name for name, p in PRESETS.items() if p.transport == self.transport]
            raise OptionError(
                "VoteConfig",
                "zero_vote",
                self.zero_vote,
                f"applies to the one-bit votes (transports {list(ONE_BIT_VOTES)}: variants "
                f"{', '.join(one_bit)}); transport={self.transport!r} (variant "
                f"{', '.join(these) or 'custom'}) carries an exact zero as 0",
            )

    def update_rule(self) -> dict[str, Any]:
        """What decides the update bit for bit, JSON-friendly: every knob but those that only change how the
        bytes travel (``exchange``, ``server_root``, and ``topology`` between ``"flat"`` and
        ``"hierarchical"``, which computes the flat vote exactly); ``node-majority`` is another estimator.
        Two configurations with equal rules give the same steps (a state of one resumes the other)."""
        facts = transports.FACTS.get(self.transport)
        bits = self.bits if self.bits is not None or facts is None else facts.default_bits
        return {
            "transport": self.transport,
            "aggregation": self.aggregation,
            "quantizer": self.quantizer,
            "bits": bits,
            "wire_dtype": self.wire_dtype_name,
            "clip_multiple": float(self.clip_multiple),
            "chunk_size": self.chunk_size,
            "quantizer_options": repr(sorted(self.quantizer_options.items())),
            "seed": self.seed if self.quantizer == "qsgd" else 0,
            "estimator": "node-majority" if self.topology == "node-majority" else "exact",
            "zero_vote": self.zero_vote if self.transport in ONE_BIT_VOTES else "none",
        }

    def lane_bits(self, n_workers: int) -> int | None:
        """The lane width this vote uses for N workers (``"lanes"``/``"quantized"``; ``None`` otherwise,
        or when no width up to 8 bits holds the sum): :func:`lioncub.transports.lane_bits`."""
        return transports.lane_bits(self.transport, self.bits, n_workers)

    def capacity(self, n_workers: int) -> tuple[bool, str]:
        """Whether this vote's integer lanes hold the N-way sum; ``(False, why)`` otherwise."""
        if not is_int(n_workers, 1):
            raise ValueError(f"n_workers={n_workers!r}: the number of workers must be an int >= 1")
        return transports.capacity(self.transport, self.aggregation, self.bits, n_workers)

    def wire_bytes(self, d: int, n_workers: int, rank: int = 0) -> tuple[float, float]:
        """(sent, received) bytes of ``rank`` for one flat vote of ``d`` elements over N workers."""
        return transports.flat_wire_bytes(
            self.transport,
            self.aggregation,
            self.bits,
            d,
            n_workers,
            wire_bits=self.wire_bits,
            rank=rank,
            root=self.server_root,
        )


#: explicit knobs that only the quantized transport reads
_QUANTIZED_KNOBS = ("quantizer", "clip_multiple", "chunk_size")


PRESETS: dict[str, VoteConfig] = {
    "32bit": VoteConfig("dense", "mean", None, None, None),
    "16bit": VoteConfig("dense", "mean", None, None, "bfloat16"),
    "1bit": VoteConfig("1bit", "majority", None, 1),
    "4bit": VoteConfig("lanes", "majority", None, 4),
    "8bit": VoteConfig("quantized", "majority", "l1", 8),
    "8bit-sign": VoteConfig("int8", "majority", None, 8),
    "dlion-mavo": VoteConfig("server", "majority", None, 1),
    "dlion-avg": VoteConfig("int8", "average", None, 8),
}


def variant_name(config: VoteConfig) -> str:
    """The name of ``config``: its preset's (``"1bit"``), with its topology when not flat
    (``"1bit@hierarchical"``, as ``lioncub compare`` names rows), else ``"custom"``."""
    for name, preset in PRESETS.items():
        if dataclasses.replace(config, topology="flat") == preset:
            return name if config.topology == "flat" else f"{name}@{config.topology}"
    return "custom"


def resolve_variant(variant: str, **overrides: Any) -> VoteConfig:
    """The preset ``variant`` with the non-``None`` ``overrides`` applied, validated."""
    if not isinstance(variant, str) or variant not in PRESETS:
        raise ValueError(
            f"variant={variant!r} is not one of {sorted(PRESETS)} (or a VoteConfig; variant='auto' is "
            "lioncub.planning.auto.auto_variant(params, network=...), called before the optimizer: it "
            "returns the preset the cost model predicts fastest)"
        )
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
        facts = transports.FACTS.get(new_transport)  # an unknown transport: validate() names it
        changes.setdefault("bits", None if facts is None else facts.default_bits)
    transport = changes.get("transport", PRESETS[variant].transport)
    if transport != "quantized":
        given = [k for k in _QUANTIZED_KNOBS if overrides.get(k) is not None]
        if given:  # the first is the subject, the others (not the command line's) follow it
            raise OptionError(
                "VoteConfig",
                given[0],
                overrides[given[0]],
                "applies only to the quantized vote (variant '8bit', or transport='quantized'); {variant} "
                f"has transport={transport!r}",
                sep="".join(f", {k}={overrides[k]!r}" for k in given[1:]) + ": ",
                variant=Named("LionCub", "variant", variant),
            )
    bits = overrides.get("bits")
    facts = transports.FACTS.get(transport)
    if (
        facts is not None
        and not facts.widths
        and bits is not None
        and (bits not in facts.fixed_bits or isinstance(bits, bool))
    ):
        raise ValueError(
            f"bits={bits!r}: variant={variant!r} has transport={transport!r}, whose width is "
            "fixed; bits applies to transport 'lanes' (variant '4bit') or 'quantized' (variant '8bit')"
        )
    return dataclasses.replace(PRESETS[variant], **changes).validate()


def lane_bits(config: Any, n: int) -> int | None:
    """The lane width the vote of ``config`` (anything with ``transport`` and ``bits``) uses for N workers
    (:func:`lioncub.transports.lane_bits`)."""
    return transports.lane_bits(config.transport, config.bits, n)


def server_down_bits(config: Any, n: int) -> int | None:
    """Lane width of the parameter server's reply for N workers (``None``: no width works)."""
    return transports.server_down_bits(config.aggregation, n)


def capacity(config: Any, n_workers: int) -> tuple[bool, str]:
    """Whether the integer lanes of ``config`` (a :class:`VoteConfig`, or anything with ``transport``,
    ``aggregation`` and ``bits``) can hold the N-way sum; ``(False, why)`` otherwise."""
    if not is_int(n_workers, 1):
        raise ValueError(f"n_workers={n_workers!r}: the number of workers must be an int >= 1")
    return transports.capacity(config.transport, config.aggregation, config.bits, n_workers)


def check_workers(config: VoteConfig, n_workers: int) -> None:
    """Raise ``ValueError`` naming the transport, ``bits`` and the widths or presets that work when
    ``config``'s integer sums could overflow for ``n_workers`` workers (see :func:`capacity`)."""
    ok, why = capacity(config, n_workers)
    if ok:
        return
    widths = [
        b
        for b in (2, 4, 8)
        if config.transport in ("lanes", "quantized")
        and capacity(dataclasses.replace(config, bits=b), n_workers)[0]
    ]
    if widths:
        fix = f"allowed for {n_workers} workers: bits in {widths} or 'auto'"
    else:
        fits = [name for name, preset in PRESETS.items() if capacity(preset, n_workers)[0]]
        fix = f"no width of this transport fits {n_workers} workers; presets that do: {fits}"
    raise ValueError(
        f"bits={config.bits!r} with transport={config.transport!r} (aggregation={config.aggregation!r}) "
        f"cannot serve {n_workers} workers: {why}; {fix}"
    )
