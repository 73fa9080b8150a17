"""What a training run is: :class:`TrainConfig` (every option of ``lioncub train``, validated once) in three
parts -- :class:`RunConfig` (what is trained, on which data, for how long), :class:`OptimizerConfig` (the
variant and its options) and :class:`ClusterConfig` (the ranks and links the launcher sets up) -- and
:func:`lr_factor`, the learning-rate schedule (linear warm-up, then a cosine).

On disk (``config.json``, and ``summary.json``'s ``config``) a configuration is one flat JSON object,
field name to value, as every lioncub version has written it (:meth:`TrainConfig.to_json`); run
directories written before the configuration had parts load unchanged (:meth:`TrainConfig.from_json`). A
one-bit run's ``config.json`` written before ``zero_vote`` existed lacks the key: it ran the papers' rule,
``"plus"``, and resumes with it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lioncub._validate import is_int, is_number
from lioncub.optim import PRESETS, resolve_variant
from lioncub.optim.config import ONE_BIT_VOTES, ZERO_VOTES
from lioncub.optim.local_steps import INNER_MOMENTA, OUTER_RULES
from lioncub.optim.step_check import NONFINITE_MODES
from lioncub.train.workloads import CNNWorkload, GPTWorkload, workload_names

__all__ = [
    "BASELINES",
    "CONVERSIONS",
    "CUDA_UNDER_EMULATION",
    "JSON_KEYS",
    "ClusterConfig",
    "OptimizerConfig",
    "RunConfig",
    "TrainConfig",
    "emulates_links",
    "format_overrides",
    "lr_factor",
]

#: variants trained as DDP + Lion, as users run today (gradient allreduce in fp32 / 16-bit)
BASELINES = ("32bit", "16bit")
#: how a resume on another world size starts every rank's momenta (``--convert-momenta``; see
#: :mod:`lioncub.train.checkpoint`)
CONVERSIONS = ("average",)


@dataclass
class RunConfig:
    """What is trained, on which data and for how long."""

    workload: str = "gpt"
    """``gpt`` (the character-level nanoGPT-style decoder) or ``cnn`` (a small ResNet) (``--workload``)."""
    size: str = "tiny"
    """The workload's size, e.g. ``tiny``, ``small``, ``medium`` for the GPT (``--size``)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Workload fields replaced, e.g. ``{"batch_size": 8}`` (``--set batch_size=8``)."""
    seed: int = 0
    """Model initialisation, data order and dropout (``--seed``)."""
    data_mode: str = "random"
    """``random``: each rank its own random order of the training set; ``shard``: disjoint shards."""
    device: str = "auto"
    """``auto``: CUDA if available (NCCL) and no link is emulated, else the CPU (gloo); or ``cpu``,
    ``cuda`` (``--device``; ``cuda`` is refused behind emulated links)."""
    steps: int = 200
    """Optimizer steps; the lr schedule ends at the last one (``--steps``)."""
    warmup_steps: int | None = None
    """Linear lr warm-up steps; None: 10 % of the steps, at most 100 (``--warmup``)."""
    min_lr_ratio: float = 0.1
    """The cosine ends at this fraction of each param group's peak lr (``--min-lr-ratio``)."""
    eval_every: int = 50
    """Validation every this many steps, and at the end; 0: only at the end (``--eval-every``)."""
    checkpoint_every: int = 0
    """A checkpoint every this many steps; 0: only at the end (``--checkpoint-every``)."""
    stop_at: int | None = None
    """Stop after this step with a checkpoint, keeping the lr schedule of ``steps`` (``--stop-at``)."""
    convert_momenta: str | None = None
    """A resume on another world size: ``average`` starts every rank from the mean of the saved momenta."""
    time_budget_s: float | None = None
    """``lioncub compare --time-budget``: the training seconds (``time_s``, the steps' own time) that
    ``steps`` was planned to fill (:mod:`lioncub.train.budget`); the run stops at a window's end once it is
    far past them. None: no budget."""
    pilot_steps: int | None = None
    """With ``time_budget_s``: the steps of the pilot run that measured the step time."""
    pilot_step_s: float | None = None
    """With ``time_budget_s``: the pilot's mean step time (s) that ``steps`` was planned from."""

    @property
    def warmup(self) -> int:
        """The warm-up steps in effect (``warmup_steps``, or its default)."""
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps


@dataclass
class OptimizerConfig:
    """The optimizer variant and its options."""

    variant: str = "8bit"
    """``32bit`` / ``16bit`` (DDP + Lion) or a LionCub preset: 1bit, 4bit, 8bit, ... (``--variant``)."""
    quantizer: str | None = None
    """The quantizer of the ``8bit`` preset: l1 (None: the preset's), l0, linf, lp, qsgd, log."""
    topology: str = "flat"
    """LionCub's vote over the nodes: flat, hierarchical (exact), node-majority (1bit), auto."""
    bucket_mb: float = 25.0
    """LionCub's bucket size in MiB; with ``overlap``, DDP's (``--bucket-mb``)."""
    momentum_sync: str | list[str] = "none"
    """LionCub: momenta averaged over the ranks: none, all, io, or name patterns / param-group names."""
    sync_every: int = 10
    """LionCub: the momentum sync interval in steps (``--sync-every``)."""
    diagnostics_every: int = 0
    """LionCub: vote diagnostics into ``log.jsonl`` (``diag`` records) every this many steps; 0: off."""
    nonfinite: str = "skip"
    """NaN/Inf gradients on any rank: ``skip`` the step on every rank, or ``raise``."""
    overlap: bool = False
    """LionCub: start each DDP bucket's vote during the backward pass (a communication hook)."""
    zero_vote: str = "split"
    """The one-bit votes (1bit, 4bit, dlion-mavo): an exact zero votes + on half the ranks (``split``) or
    always + (``plus``, the papers' rule) (``--zero-vote``)."""
    local_steps: int | None = None
    """H local steps per rank, then one outer step (:mod:`lioncub.optim.local_steps`); None: a vote every
    step (``--local-steps``)."""
    outer: str = "vote"
    """With ``local_steps``: ``vote`` (the variant's vote; with 32bit/16bit that is ``dsm``), ``dsm`` or
    ``diloco`` (``--outer``)."""
    outer_lr: float | None = None
    """With ``local_steps``: the outer lr (vote, dsm: times H · lr; diloco: as is); None: the rule's
    default (``--outer-lr``)."""
    inner_momentum: str = "reset"
    """With ``local_steps``: the inner momentum at an outer step: reset, keep or average."""

    @property
    def one_bit(self) -> bool:
        """The variant's vote is one bit per element (``zero_vote`` applies)."""
        return self.variant in PRESETS and resolve_variant(self.variant).transport in ONE_BIT_VOTES


@dataclass
class ClusterConfig:
    """Where the ranks run: recorded for the report and the resume checks; the launcher applies it."""

    nproc: int = 1
    """The world size (with ``nnodes``: nodes × ranks per node)."""
    link: str = "loopback"
    """Each rank's link, or with ``nnodes`` each node's NIC, e.g. ``1gbit`` (``--link``)."""
    nnodes: int | None = None
    """None: one emulated node per rank; M: M nodes of ``nproc / M`` ranks, each node a torchrun agent."""
    intra_link: str | None = None
    """With ``nnodes``: the shaping of each node's loopback; None: unshaped (``--intra-link``)."""

    @property
    def nproc_per_node(self) -> int:
        """Ranks per node: ``nproc / nnodes``, or 1 (one emulated node per rank)."""
        return self.nproc // self.nnodes if self.nnodes else 1


#: the keys of ``config.json``, in the order they are written (the flat format of every lioncub version)
JSON_KEYS = (
    "workload", "size", "variant", "steps", "warmup_steps", "min_lr_ratio", "eval_every", "checkpoint_every",
    "seed", "data_mode", "bucket_mb", "device", "overrides", "convert_momenta", "stop_at", "momentum_sync",
    "sync_every", "diagnostics_every", "quantizer", "topology", "nonfinite", "overlap", "nproc", "link",
    "nnodes", "intra_link", "zero_vote", "local_steps", "outer", "outer_lr", "inner_momentum",
    "time_budget_s", "pilot_steps", "pilot_step_s",
)  # fmt: skip
#: the part of a :class:`TrainConfig` each field of ``config.json`` belongs to
PART_OF = {
    f.name: part
    for part, cls in (("run", RunConfig), ("optimizer", OptimizerConfig), ("cluster", ClusterConfig))
    for f in dataclasses.fields(cls)
}


@dataclass
class TrainConfig:
    """One training run, validated as a whole (the checks cross the parts): ``ValueError`` naming the
    option at fault."""

    run: RunConfig = field(default_factory=RunConfig)
    """What is trained, on which data and for how long."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer variant and its options."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The ranks, nodes and links."""

    def __post_init__(self) -> None:
        self._check_what()
        self._check_counts()
        self._check_nodes()
        self._check_warmup_and_stop()
        self._check_budget()
        self._check_vote_options()
        self._check_local_steps()
        self._check_choices()

    def _check_what(self) -> None:
        """The workload, its size and ``--set`` fields, the variant."""
        run, names = self.run, workload_names()
        if run.workload not in names:
            raise ValueError(f"--workload {run.workload!r}: allowed values are {sorted(names)}")
        if run.size not in names[run.workload]:
            raise ValueError(
                f"--size {run.size!r}: allowed values for {run.workload} are {names[run.workload]}"
            )
        fields = {f.name for f in dataclasses.fields({"gpt": GPTWorkload, "cnn": CNNWorkload}[run.workload])}
        fields -= {"size", "rank", "world_size", "seed", "data_mode", "device"}  # set by the run itself
        unknown = sorted(set(run.overrides) - fields)
        if unknown:
            raise ValueError(
                f"--set {', '.join(unknown)}: not a field of the {run.workload} workload; "
                f"fields: {sorted(fields)}"
            )
        allowed = sorted({*PRESETS, *BASELINES})
        if self.optimizer.variant not in allowed:
            raise ValueError(f"--variant {self.optimizer.variant!r}: allowed values are {allowed}")

    def _check_counts(self) -> None:
        for name, value in (
            ("steps", self.run.steps),
            ("eval_every", self.run.eval_every),
            ("checkpoint_every", self.run.checkpoint_every),
            ("nproc", self.cluster.nproc),
        ):
            if not isinstance(value, int) or value < (1 if name in ("steps", "nproc") else 0):
                raise ValueError(
                    f"--{name.replace('_', '-')} {value!r} must be an integer >= "
                    f"{1 if name in ('steps', 'nproc') else 0}"
                )

    def _check_nodes(self) -> None:
        """``nnodes`` divides ``nproc``, needs a link; ``intra_link`` needs ``nnodes``."""
        cluster = self.cluster
        if cluster.nnodes is None:
            if cluster.intra_link is not None:
                raise ValueError(
                    f"--intra-link {cluster.intra_link}: applies only with --nnodes M --nproc-per-node L"
                )
            return
        if not (isinstance(cluster.nnodes, int) and cluster.nnodes >= 1) or cluster.nproc % cluster.nnodes:
            raise ValueError(
                f"--nnodes {cluster.nnodes!r} must be an integer >= 1 that divides the {cluster.nproc} ranks "
                "(give --nnodes M --nproc-per-node L)"
            )
        if cluster.link in (None, "loopback"):
            raise ValueError(
                f"--nnodes {cluster.nnodes}: emulates nodes behind shaped NICs and needs --link RATE (root); "
                "without a link use --nproc N"
            )

    def _check_warmup_and_stop(self) -> None:
        run = self.run
        if run.warmup_steps is not None and not (isinstance(run.warmup_steps, int) and run.warmup_steps >= 0):
            raise ValueError(f"--warmup {run.warmup_steps!r} must be an integer >= 0")
        if run.stop_at is not None and not (isinstance(run.stop_at, int) and 1 <= run.stop_at <= run.steps):
            raise ValueError(f"--stop-at {run.stop_at!r} must be an integer within [1, --steps {run.steps}]")

    def _check_budget(self) -> None:
        """``time_budget_s`` (``--time-budget``) and what its pilot measured (``lioncub compare``)."""
        run = self.run
        if run.time_budget_s is None:
            if run.pilot_steps is not None or run.pilot_step_s is not None:
                raise ValueError("pilot_steps, pilot_step_s: apply only with time_budget_s (--time-budget)")
            return
        if not is_number(run.time_budget_s, gt=0):
            raise ValueError(f"--time-budget {run.time_budget_s!r} must be a finite number of seconds > 0")
        if run.pilot_steps is not None and not is_int(run.pilot_steps, 1):
            raise ValueError(f"pilot_steps {run.pilot_steps!r} must be an integer >= 1")
        if run.pilot_step_s is not None and not is_number(run.pilot_step_s, gt=0):
            raise ValueError(f"pilot_step_s {run.pilot_step_s!r} must be a finite number of seconds > 0")

    def _check_vote_options(self) -> None:
        """What only the LionCub votes have: diagnostics, momentum sync, overlap, quantizer, topology."""
        opt = self.optimizer
        voting_only = {"--diagnostics-every": opt.diagnostics_every, "--momentum-sync": opt.momentum_sync}
        for option, value in voting_only.items():
            if value not in (0, "none") and opt.variant in BASELINES:
                raise ValueError(
                    f"{option} {value!r}: --variant {opt.variant} keeps one global momentum and does not "
                    "vote; it applies to the voting variants"
                )
        if not isinstance(opt.overlap, bool):
            raise ValueError(f"--overlap {opt.overlap!r} must be true or false")
        if opt.overlap and opt.variant in BASELINES:
            raise ValueError(
                f"--overlap: --variant {opt.variant} is DDP + Lion, which always overlaps its gradient "
                "allreduce with the backward pass; --overlap applies to the LionCub variants"
            )
        if opt.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"--nonfinite {opt.nonfinite!r}: allowed values are {list(NONFINITE_MODES)}")
        if opt.quantizer is not None:
            from lioncub.ops.quantize import QUANTIZERS

            if opt.quantizer not in QUANTIZERS:
                raise ValueError(f"--quantizer {opt.quantizer!r}: allowed values are {sorted(QUANTIZERS)}")
            if opt.variant != "8bit":
                raise ValueError(f"--quantizer: only --variant 8bit quantizes (this run is {opt.variant})")
        if opt.topology != "flat":
            self._check_topology()

    def _check_local_steps(self) -> None:
        """``--zero-vote``; ``--local-steps`` and its options (a vote with 32bit/16bit becomes ``dsm``)."""
        opt, run = self.optimizer, self.run
        if opt.zero_vote not in ZERO_VOTES:
            raise ValueError(f"--zero-vote {opt.zero_vote!r}: allowed values are {list(ZERO_VOTES)}")
        if opt.zero_vote != "split" and not opt.one_bit:
            raise ValueError(
                f"--zero-vote {opt.zero_vote}: --variant {opt.variant} carries an exact zero as 0; "
                "--zero-vote applies to the one-bit votes (1bit, 4bit, dlion-mavo)"
            )
        if opt.local_steps is None:
            given = {"--outer": opt.outer != "vote", "--outer-lr": opt.outer_lr is not None}
            given["--inner-momentum"] = opt.inner_momentum != "reset"
            for option in (o for o, set_ in given.items() if set_):
                raise ValueError(f"{option}: applies only with --local-steps H")
            return
        h = opt.local_steps
        if not (isinstance(h, int) and not isinstance(h, bool) and h >= 1):
            raise ValueError(f"--local-steps {h!r} must be an integer >= 1 (inner steps per outer step)")
        if opt.outer not in OUTER_RULES:
            raise ValueError(f"--outer {opt.outer!r}: allowed values are {list(OUTER_RULES)}")
        if opt.variant in BASELINES and opt.outer == "vote":
            opt.outer = "dsm"  # the dense variants' outer step: the sign of the mean (docs/local-steps.md)
        if opt.outer != "vote" and opt.variant not in BASELINES:
            raise ValueError(
                f"--outer {opt.outer}: averages the pseudo-gradients in fp32 or bf16: use --variant 32bit or "
                f"16bit, not {opt.variant} (--outer vote takes the variant's vote)"
            )
        if opt.outer_lr is not None and not (
            isinstance(opt.outer_lr, (int, float)) and math.isfinite(opt.outer_lr) and opt.outer_lr > 0
        ):
            raise ValueError(f"--outer-lr {opt.outer_lr!r} must be a finite number > 0")
        if opt.inner_momentum not in INNER_MOMENTA:
            raise ValueError(
                f"--inner-momentum {opt.inner_momentum!r}: allowed values are {list(INNER_MOMENTA)}"
            )
        fixes = {  # each option's own way out (the ranks meet only at the outer steps)
            "--momentum-sync": "the ranks' inner momenta are local between outer steps; --inner-momentum "
            "average averages them at each outer step",
            "--diagnostics-every": "the vote diagnostics describe a vote every step; drop "
            "--diagnostics-every (or --local-steps, for the per-step vote)",
            "--overlap": "the outer step runs in the optimizer step, with no vote in the backward pass to "
            "overlap; drop --overlap",
        }
        refused = {
            "--momentum-sync": opt.momentum_sync not in ("none", None),
            "--diagnostics-every": bool(opt.diagnostics_every),
            "--overlap": opt.overlap,
        }
        for option in (o for o, on in refused.items() if on):
            raise ValueError(
                f"{option} with --local-steps {h}: the ranks vote every {h} steps; {fixes[option]}"
            )
        for option, value in (("--steps", run.steps), ("--eval-every", run.eval_every)):
            if value % h:
                raise ValueError(
                    f"{option} {value} with --local-steps {h}: must be a multiple of {h}, where the ranks "
                    "hold the same parameters (between outer steps each rank has its own replica)"
                )

    def _check_topology(self) -> None:
        opt = self.optimizer
        if opt.variant in BASELINES:
            raise ValueError(
                f"--topology {opt.topology}: --variant {opt.variant} is DDP + Lion (the backend's "
                "allreduce); --topology applies to the LionCub votes"
            )
        try:  # auto: the cost model's exact choice (flat or hierarchical), made when the run starts
            topology = "hierarchical" if opt.topology == "auto" else opt.topology
            if opt.topology not in ("auto", "flat", "hierarchical", "node-majority"):
                raise ValueError(
                    f"topology={opt.topology!r}: allowed values are "
                    "['flat', 'hierarchical', 'node-majority', 'auto']"
                )
            resolve_variant(opt.variant, quantizer=opt.quantizer, topology=topology)
        except ValueError as exc:
            raise ValueError(f"--topology {opt.topology}: {exc}") from None
        if opt.overlap:
            raise ValueError(f"--topology {opt.topology}: --overlap votes flat (use --topology flat)")

    def _check_choices(self) -> None:
        run = self.run
        if not 0.0 <= run.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio {run.min_lr_ratio!r} must be within [0, 1]")
        if run.data_mode not in ("random", "shard"):
            raise ValueError(f"--data-mode {run.data_mode!r}: allowed values are ['random', 'shard']")
        if run.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {run.device!r}: allowed values are ['auto', 'cpu', 'cuda']")
        if run.device == "cuda" and emulates_links(self):
            raise ValueError(CUDA_UNDER_EMULATION.format(link=self.cluster.link))
        if run.convert_momenta not in (None, *CONVERSIONS):
            raise ValueError(
                f"--convert-momenta {run.convert_momenta!r}: allowed values are {list(CONVERSIONS)}"
            )

    def to_json(self) -> dict[str, Any]:
        """The flat ``config.json`` object: :data:`JSON_KEYS` in order; ``nnodes``, ``intra_link``, the
        local steps' and the time budget's keys only when set, ``zero_vote`` only for the one-bit variants
        (so that the documents of runs without them stay as they were)."""
        parts = {name: dataclasses.asdict(getattr(self, name)) for name in ("run", "optimizer", "cluster")}
        doc = {key: parts[PART_OF[key]][key] for key in JSON_KEYS}
        unset = {
            "nnodes": doc["nnodes"] is None,
            "intra_link": doc["intra_link"] is None,
            "zero_vote": not self.optimizer.one_bit,
            **dict.fromkeys(
                ("local_steps", "outer", "outer_lr", "inner_momentum"), doc["local_steps"] is None
            ),
            **dict.fromkeys(("time_budget_s", "pilot_steps", "pilot_step_s"), doc["time_budget_s"] is None),
        }
        return {key: value for key, value in doc.items() if not unset.get(key, False)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TrainConfig:
        """The configuration of a flat ``config.json`` object (unknown keys are ignored, missing ones take
        their defaults), validated."""
        values: dict[str, dict[str, Any]] = {"run": {}, "optimizer": {}, "cluster": {}}
        for key, value in doc.items():
            if key in PART_OF:
                values[PART_OF[key]][key] = value
        if "zero_vote" not in doc and OptimizerConfig(**values["optimizer"]).one_bit:
            values["optimizer"]["zero_vote"] = "plus"  # written before zero_vote: the papers' rule
        return cls(
            RunConfig(**values["run"]),
            OptimizerConfig(**values["optimizer"]),
            ClusterConfig(**values["cluster"]),
        )


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


#: why ``--device cuda`` is refused behind emulated links (:func:`emulates_links`)
CUDA_UNDER_EMULATION = (
    "--device cuda with --link {link}: the emulated links shape the network namespaces' traffic, but NCCL "
    "finds every rank on one host and sends through NVLink/PCIe peer-to-peer or shared memory instead, so "
    "the step times would be the GPU interconnect's, not the link's (and with --nnodes the ranks of the "
    "emulated nodes would also share GPUs). Emulate links with --device cpu (gloo crosses them), or run "
    "real nodes with torchrun and lioncub train"
)


def emulates_links(config: TrainConfig) -> bool:
    """Whether the run's ranks sit behind links the launcher emulates (``--link RATE``, ``--nnodes``)."""
    return config.cluster.link not in (None, "loopback")
