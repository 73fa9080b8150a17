"""What a training run is: :class:`TrainConfig` (every option of ``lioncub train``, validated once) and
:func:`lr_factor`, the learning-rate schedule (linear warm-up, then a cosine)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lioncub.optim import PRESETS
from lioncub.optim.lioncub import NONFINITE_MODES
from lioncub.train import checkpoint
from lioncub.train.workloads import CNNWorkload, GPTWorkload, workload_names

__all__ = ["BASELINES", "TrainConfig", "format_overrides", "lr_factor"]

#: variants trained as DDP + Lion, as users run today (gradient allreduce in fp32 / 16-bit)
BASELINES = ("32bit", "16bit")


@dataclass
class TrainConfig:
    """One training run. ``overrides`` replace workload fields (e.g. ``{"batch_size": 8}``)."""

    workload: str = "gpt"
    size: str = "tiny"
    variant: str = "8bit"
    steps: int = 200
    warmup_steps: int | None = None  # None: 10 % of the steps, at most 100
    min_lr_ratio: float = 0.1  # the cosine ends at this fraction of each group's peak lr
    eval_every: int = 50  # 0: only at the end
    checkpoint_every: int = 0  # 0: only at the end
    seed: int = 0
    data_mode: str = "random"
    bucket_mb: float = 25.0
    device: str = "auto"  # "auto": cuda if available (NCCL), else cpu (gloo)
    overrides: dict[str, Any] = field(default_factory=dict)
    convert_momenta: str | None = None
    stop_at: int | None = None  # stop after this step with a checkpoint, keeping the schedule of `steps`
    momentum_sync: str | list[str] = "none"  # LionCub: "none", "all", "io" or name patterns / group names
    sync_every: int = 10
    diagnostics_every: int = 0  # LionCub: vote diagnostics every k steps into log.jsonl ("diag" records)
    quantizer: str | None = None  # LionCub: the quantizer of the "8bit" preset (l1, l0, linf, lp, qsgd, log)
    topology: str = (
        "flat"  # LionCub's vote over nodes: flat, hierarchical (exact), node-majority (1bit), auto
    )
    nonfinite: str = "skip"  # NaN/Inf gradients on any rank: "skip" the step on every rank, or "raise"
    overlap: bool = False  # LionCub: start each DDP bucket's vote during the backward (a comm hook)
    # recorded for the report; the launcher applies them
    nproc: int = 1  # the world size (with nnodes: nnodes × ranks per node)
    link: str = "loopback"  # each rank's link, or with nnodes each node's NIC
    nnodes: int | None = None  # None: one emulated node per rank; M: M nodes of nproc / M ranks (torchrun)
    intra_link: str | None = None  # with nnodes: the shaping of each node's loopback (None: unshaped)

    def __post_init__(self) -> None:
        names = workload_names()
        if self.workload not in names:
            raise ValueError(f"--workload {self.workload!r}: allowed values are {sorted(names)}")
        if self.size not in names[self.workload]:
            raise ValueError(
                f"--size {self.size!r}: allowed values for {self.workload} are {names[self.workload]}"
            )
        fields = {f.name for f in dataclasses.fields({"gpt": GPTWorkload, "cnn": CNNWorkload}[self.workload])}
        fields -= {"size", "rank", "world_size", "seed", "data_mode", "device"}  # set by the run itself
        unknown = sorted(set(self.overrides) - fields)
        if unknown:
            raise ValueError(
                f"--set {', '.join(unknown)}: not a field of the {self.workload} workload; "
                f"fields: {sorted(fields)}"
            )
        allowed = sorted({*PRESETS, *BASELINES})
        if self.variant not in allowed:
            raise ValueError(f"--variant {self.variant!r}: allowed values are {allowed}")
        for name in ("steps", "eval_every", "checkpoint_every", "nproc"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name in ("steps", "nproc") else 0):
                raise ValueError(
                    f"--{name.replace('_', '-')} {value!r} must be an integer >= "
                    f"{1 if name in ('steps', 'nproc') else 0}"
                )
        self._check_nodes()
        if self.warmup_steps is not None and not (
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0
        ):
            raise ValueError(f"--warmup {self.warmup_steps!r} must be an integer >= 0")
        if self.stop_at is not None and not (
            isinstance(self.stop_at, int) and 1 <= self.stop_at <= self.steps
        ):
            raise ValueError(
                f"--stop-at {self.stop_at!r} must be an integer within [1, --steps {self.steps}]"
            )
        voting_only = {"--diagnostics-every": self.diagnostics_every, "--momentum-sync": self.momentum_sync}
        for option, value in voting_only.items():
            if value not in (0, "none") and self.variant in BASELINES:
                raise ValueError(
                    f"{option} {value!r}: --variant {self.variant} keeps one global momentum and does not "
                    "vote; it applies to the voting variants"
                )
        if not isinstance(self.overlap, bool):
            raise ValueError(f"--overlap {self.overlap!r} must be true or false")
        if self.overlap and self.variant in BASELINES:
            raise ValueError(
                f"--overlap: --variant {self.variant} is DDP + Lion, which always overlaps its gradient "
                "allreduce with the backward pass; --overlap applies to the LionCub variants"
            )
        if self.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"--nonfinite {self.nonfinite!r}: allowed values are {list(NONFINITE_MODES)}")
        if self.quantizer is not None:
            from lioncub.ops.quantize import QUANTIZERS

            if self.quantizer not in QUANTIZERS:
                raise ValueError(f"--quantizer {self.quantizer!r}: allowed values are {sorted(QUANTIZERS)}")
            if self.variant != "8bit":
                raise ValueError(f"--quantizer: only --variant 8bit quantizes (this run is {self.variant})")
        if self.topology != "flat":
            if self.variant in BASELINES:
                raise ValueError(
                    f"--topology {self.topology}: --variant {self.variant} is DDP + Lion (the backend's "
                    "allreduce); --topology applies to the LionCub votes"
                )
            from lioncub.optim.config import resolve_variant

            try:  # auto: the cost model's exact choice (flat or hierarchical), made when the run starts
                topology = "hierarchical" if self.topology == "auto" else self.topology
                if self.topology not in ("auto", "flat", "hierarchical", "node-majority"):
                    raise ValueError(
                        f"topology={self.topology!r}: allowed values are "
                        "['flat', 'hierarchical', 'node-majority', 'auto']"
                    )
                resolve_variant(self.variant, quantizer=self.quantizer, topology=topology)
            except ValueError as exc:
                raise ValueError(f"--topology {self.topology}: {exc}") from None
            if self.overlap:
                raise ValueError(f"--topology {self.topology}: --overlap votes flat (use --topology flat)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio!r} must be within [0, 1]")
        if self.data_mode not in ("random", "shard"):
            raise ValueError(f"--data-mode {self.data_mode!r}: allowed values are ['random', 'shard']")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: allowed values are ['auto', 'cpu', 'cuda']")
        if self.convert_momenta not in (None, *checkpoint.CONVERSIONS):
            raise ValueError(
                f"--convert-momenta {self.convert_momenta!r}: allowed values are "
                f"{list(checkpoint.CONVERSIONS)}"
            )

    def _check_nodes(self) -> None:
        """``nnodes`` divides ``nproc``, needs a link; ``intra_link`` needs ``nnodes``."""
        if self.nnodes is None:
            if self.intra_link is not None:
                raise ValueError(
                    f"--intra-link {self.intra_link}: applies only with --nnodes M --nproc-per-node L"
                )
            return
        if not (isinstance(self.nnodes, int) and self.nnodes >= 1) or self.nproc % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes!r} must be an integer >= 1 that divides the {self.nproc} ranks "
                "(give --nnodes M --nproc-per-node L)"
            )
        if self.link in (None, "loopback"):
            raise ValueError(
                f"--nnodes {self.nnodes}: emulates nodes behind shaped NICs and needs --link RATE (root); "
                "without a link use --nproc N"
            )

    @property
    def nproc_per_node(self) -> int:
        """Ranks per node: ``nproc / nnodes``, or 1 (one emulated node per rank)."""
        return self.nproc // self.nnodes if self.nnodes else 1

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        for name in ("nnodes", "intra_link"):  # absent when unused: the documents of earlier runs stay equal
            if doc[name] is None:
                del doc[name]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of every group's peak lr at optimizer step ``step`` (1-based, ``1 <= step <= steps``).

    The peak is at step ``p = max(warmup, 1)``: the last warm-up step, or the first step without warm-up.

    * ``step <= warmup``: linear warm-up, ``step / warmup`` (``1/warmup, 2/warmup, ..., 1``);
    * ``step >= p``: a cosine from 1 at step ``p`` down to ``min_ratio`` at step ``steps``::

          progress = (step - p) / max(1, steps - p)            # 0 at p, 1 at steps
          factor = min_ratio + (1 - min_ratio) * (1 + cos(pi * min(1, progress))) / 2

    So without warm-up the first step trains at the peak lr and only the last one at ``min_ratio`` (a
    single step, ``steps == 1``, is at the peak); with warm-up the cosine starts from its last step. A pure
    function of the step: a resumed run gets the same lr bit for bit.
    """
    if step <= warmup:
        return step / warmup
    peak = max(warmup, 1)
    progress = (step - peak) / max(1, steps - peak)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def format_overrides(overrides: dict[str, Any]) -> str:
    """``--set`` values as the user would type them (``batch_size=8 dropout=0.1``)."""
    return " ".join(f"{k}={v!r}" for k, v in overrides.items())
