"""What a training run is: :class:`TrainConfig` (every setting of ``lioncub train``, validated once) in three
parts -- :class:`RunConfig` (what is trained, on which data, for how long), :class:`OptimizerConfig` (the
variant and its options) and :class:`ClusterConfig` (the ranks and links the launcher sets up); the lr
schedule is :mod:`lioncub.train.lr`'s (``lr_factor``, here too).

Every field is one setting, described where it is declared (:func:`lioncub.train.settings.setting`: help,
allowed values from their owner, range, flag, version); :data:`SETTINGS` is that table, from which the flags
of ``lioncub train`` and ``lioncub compare`` (:mod:`lioncub.cli.options`), the JSON on disk and the checks
follow. On disk (``config.json``, and ``summary.json``'s ``config``) a configuration is nested by part
(:meth:`TrainConfig.to_json`, version 2); the flat objects of earlier runs load unchanged
(:meth:`TrainConfig.from_json`): a one-bit run's flat ``config.json`` written before ``zero_vote`` existed
lacks the key, ran the papers' rule, ``"plus"``, and resumes with it.

The checks (:meth:`TrainConfig.__post_init__`): each value against its description, the rules that cross
settings of a run, then the optimizer's own checks -- by building its objects where the loop builds them,
:func:`lioncub.train.parts.optimizer_parts` -- whose messages name the flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lioncub._validate import is_int
from lioncub.integrations.torchft import MOMENTA_ON_HEAL
from lioncub.launch.config import DEVICES
from lioncub.names import BASELINES, PEER_VARIANTS, config_version
from lioncub.ops.quantize import QUANTIZERS
from lioncub.optim.config import (
    DEFAULT_OUTER,
    DENSE_SGD_RULE,
    DENSE_SIGN_RULE,
    INNER_MOMENTA,
    ONE_BIT_VOTES,
    OUTER_RULE_FACTS,
    PRESETS,
    SIGN_RULES,
    ZERO_VOTES,
    VoteConfig,
)
from lioncub.optim.local_steps import LocalSteps, default_outer_lr
from lioncub.optim.step_check import NONFINITE_MODES, Checks
from lioncub.train import shared
from lioncub.train.data import MODES
from lioncub.train.fault_settings import check_fault_tolerant
from lioncub.train.fsdp_settings import check_fsdp
from lioncub.train.lr import lr_factor
from lioncub.train.parts import OptimizerParts, optimizer_parts
from lioncub.train.settings import Described, check_value, described, flat_document, nest, setting
from lioncub.train.settings import spell as spell_value
from lioncub.train.workloads import workload_class, workload_names
from lioncub.transports import TOPOLOGIES

__all__ = [
    "BASELINES",
    "CHOSEN_BY",
    "CONVERSIONS",
    "CUDA_UNDER_EMULATION",
    "MAX_SEED",
    "SETTINGS",
    "VARIANTS",
    "ClusterConfig",
    "OptimizerConfig",
    "RunConfig",
    "TrainConfig",
    "betas_spec",
    "check_auto",
    "check_start",
    "emulates_links",
    "fault_list",
    "format_overrides",
    "lr_factor",
    "sync_spec",
]

#: every --variant: the LionCub presets (with the DDP baselines) and the peers' optimizers
VARIANTS = (*PRESETS, *PEER_VARIANTS)
#: how a resume on another world size starts every rank's momenta (``--convert-momenta``; see
#: :mod:`lioncub.train.checkpoint`)
CONVERSIONS = ("average",)
#: what may have chosen a run's variant and local steps (``chosen_by``): ``lioncub train --variant auto``
#: and the ``lioncub compare`` row ``auto`` (:mod:`lioncub.cli.auto`)
CHOSEN_BY = ("auto",)
#: the largest ``--seed``: torch's generators take 64-bit seeds
MAX_SEED = 2**63 - 1


def sync_spec(text: str) -> str | list[str]:
    """``--momentum-sync``'s text: a word of ``MomentumSync`` (none, all, io) or a list of name patterns."""
    return text if text in ("none", "all", "io") else [t for t in text.split(",") if t]


def fault_list(text: str) -> list[str]:
    """``--kill`` / ``--rejoin``: comma-separated ``G@STEP`` items (checked with the run's groups and
    steps by :func:`lioncub.launch.groups.parse_faults`)."""
    return [item.strip() for item in text.split(",")]  # an empty item (``1@20,``): parse_faults refuses it


def betas_spec(text: str) -> list[float]:
    """``--outer-betas``'s text, ``B1,B2``: two numbers (``LocalSteps`` checks their range)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"{text!r}: give two numbers B1,B2, e.g. 0.9,0.99")
    try:
        return [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"{text!r}: give two numbers B1,B2, e.g. 0.9,0.99") from None


def _one_bit(variant: Any) -> bool:
    return variant in PRESETS and PRESETS[variant].transport in ONE_BIT_VOTES


def _papers_zero_rule(values: Mapping[str, Any]) -> str:
    """``zero_vote`` of a run whose ``config.json`` lacks it: a one-bit run written before the setting
    existed ran the papers' rule; the other variants have no zero rule (the default)."""
    return "plus" if _one_bit(values["variant"]) else VoteConfig.zero_vote


def _earlier_outer_betas(values: Mapping[str, Any]) -> list[float] | None:
    """``outer_betas`` of a run whose ``config.json`` (version < 3) lacks it: the sign rules' betas were
    (0.9, 0.99) then, so the run resumes with them; DiLoCo's default did not change."""
    sign_rule = values.get("local_steps") and values.get("outer") in SIGN_RULES
    return [0.9, 0.99] if sign_rule else None


_SIZES = "; ".join(f"{name}: {', '.join(sizes)}" for name, sizes in workload_names().items())
_OUTER_LRS = "vote, dsm min(1, √(8/H)); diloco 0.7"


@dataclass
class RunConfig:
    """What is trained, on which data and for how long."""

    workload: str = setting("gpt", choices=workload_names(), help="gpt (a character-level decoder) or cnn")
    size: str = setting("tiny", metavar="SIZE", help=f"the workload's model and data size ({_SIZES})")
    overrides: dict[str, Any] = setting(
        {}, flag="--set", metavar="FIELD=VALUE", help="change a workload field, e.g. --set batch_size=8"
    )
    seed: int = setting(
        0, low=0, high=MAX_SEED, high_text=f"2**63 - 1 = {MAX_SEED} (a generator's seed)",
        help="model initialisation, data order and dropout",
    )  # fmt: skip
    data_mode: str = setting(
        "random", choices=MODES, help="each rank's data: its own random order (random) or a disjoint shard"
    )
    device: str = setting(
        "auto", choices=DEVICES,
        help="auto: CUDA if available (NCCL) and no link is emulated, else the CPU (gloo); cuda is refused "
        "behind emulated links",
    )  # fmt: skip
    steps: int = setting(200, low=1, help="optimizer steps; the lr schedule ends at the last one")
    warmup_steps: int | None = setting(
        None, flag="--warmup", metavar="STEPS", low=0, default_text="10% of the steps, at most 100",
        help="linear lr warm-up steps",
    )  # fmt: skip
    min_lr_ratio: float = setting(
        0.1, low=0, high=1, metavar="X", help="the cosine ends at this fraction of each param group's peak lr"
    )
    eval_every: int = setting(
        50, low=0, metavar="STEPS", default_text="50; with --local-steps H the multiple of H nearest it",
        help="validation every STEPS steps and at the end; 0: only at the end",
    )  # fmt: skip
    checkpoint_every: int = setting(
        0,
        low=0,
        metavar="STEPS",
        help="a checkpoint every STEPS steps; 0: only at the end",
    )
    stop_at: int | None = setting(
        None, commands=("train",), metavar="STEP",
        help="stop after STEP with a checkpoint (the lr schedule stays that of --steps); --resume goes on",
    )  # fmt: skip
    convert_momenta: str | None = setting(
        None, commands=("train",), choices=CONVERSIONS,
        help="with --resume on another --nproc: start every rank from the mean of the saved momenta",
    )  # fmt: skip
    time_budget_s: float | None = setting(
        None, flag="--time-budget", commands=("compare",), metavar="SECONDS", low=0, above=True,
        unit="seconds", ft_why="the time budget's pilot and guard are collectives of a fixed world",
        help="instead of --steps: each run trains the steps its own step time fits in SECONDS of training, "
        "measured by a short pilot of it (docs/local-steps.md, 'Equal time')",
    )  # fmt: skip
    pilot_steps: int | None = setting(
        None,
        commands=(),
        low=1,
        help="with time_budget_s: the steps of the pilot that measured the step time",
    )
    pilot_step_s: float | None = setting(
        None, commands=(), low=0, above=True, unit="seconds",
        help="with time_budget_s: the pilot's mean step time (s) that steps was planned from",
    )  # fmt: skip
    chosen_by: str | None = setting(
        None, commands=(), choices=CHOSEN_BY,
        help="auto: --variant auto chose the variant and local steps from a pilot of the per-step 1bit vote "
        "(its median compute auto_compute_s and communication auto_vote_s; lioncub.cli.auto)",
    )  # fmt: skip
    auto_compute_s: float | None = setting(
        None, commands=(), low=0, above=True, unit="seconds",
        help="with chosen_by auto: the pilot's median compute per step (forward, backward, optimizer)",
    )  # fmt: skip
    auto_vote_s: float | None = setting(
        None, commands=(), low=0, unit="seconds",
        help="with chosen_by auto: the pilot's median communication of one 1-bit vote",
    )  # fmt: skip

    @property
    def warmup(self) -> int:
        """The warm-up steps in effect (``warmup_steps``, or its default)."""
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps


@dataclass
class OptimizerConfig:
    """The optimizer variant and its options."""

    variant: str = setting(
        "8bit", commands=("train",), choices=VARIANTS,
        help="32bit / 16bit (DDP + Lion), a LionCub preset (below), or torchft-diloco (torchft's own DiLoCo, "
        "with --fault-tolerant --local-steps H)",
    )  # fmt: skip
    quantizer: str | None = setting(
        None, owner="VoteConfig", choices=QUANTIZERS,
        default_text=f"the preset's, {PRESETS['8bit'].quantizer}", help="the quantizer of --variant 8bit",
    )  # fmt: skip
    topology: str = setting(
        VoteConfig.topology, owner="VoteConfig", choices=(*TOPOLOGIES, "auto"),
        dense_why=" (the backend's allreduce)",
        help="the LionCub vote over nodes: hierarchical is exact, node-majority (1bit) another estimator, "
        "auto the cost model's exact choice when the run starts",
    )  # fmt: skip
    bucket_mb: float = setting(
        25.0, owner="LionCub", metavar="MB", help="LionCub's bucket size in MiB; with --overlap, DDP's"
    )
    momentum_sync: str | list[str] = setting(
        "none", parse=sync_spec, metavar="WHICH", dense_why=", which keeps one global momentum",
        per_step=True,
        help="average momenta over the ranks: none, all, io, or comma-separated name patterns / param-group "
        "names",
    )  # fmt: skip
    sync_every: int = setting(
        10, owner="MomentumSync", knob="every", metavar="STEPS", per_step=True,
        help="the momentum sync interval",
    )  # fmt: skip
    diagnostics_every: int = setting(
        0, owner="LionCub", metavar="STEPS", dense_why=", which does not vote", per_step=True,
        ft_why="the diagnostics gather over a fixed world",
        help="vote diagnostics (match/flip, ties, momentum spread, update shape) into log.jsonl every STEPS "
        "steps; 0: off",
    )  # fmt: skip
    nonfinite: str = setting(
        Checks.nonfinite, owner="Checks", choices=NONFINITE_MODES,
        help="NaN/Inf gradients on any rank: skip the step on every rank, or raise (stop with an error)",
    )  # fmt: skip
    overlap: bool = setting(
        False, dense_why=", which always overlaps its gradient allreduce with the backward pass",
        per_step=True, ft_why="the vote runs between groups after the backward pass, not in DDP's buckets",
        help="LionCub variants: start each DDP bucket's vote during the backward pass (bitwise the same "
        "result)",
    )  # fmt: skip
    zero_vote: str = setting(
        VoteConfig.zero_vote, owner="VoteConfig", choices=ZERO_VOTES, absent=_papers_zero_rule,
        help="the one-bit votes: an exact zero votes + on half the ranks (split) or always (plus: the "
        "papers' rule)",
    )  # fmt: skip
    local_steps: int | None = shared.field("local_steps")
    outer: str = setting(
        LocalSteps.outer, commands=("train",), owner="LocalSteps", choices=OUTER_RULE_FACTS, local=True,
        help="with --local-steps: the outer rule; vote takes the variant's vote, dsm and diloco average the "
        "pseudo-gradients (--variant 32bit or 16bit)",
    )  # fmt: skip
    outer_lr: float | None = setting(
        None, commands=("train",), owner="LocalSteps", metavar="X", local=True, default_text=_OUTER_LRS,
        help="with --local-steps: vote, dsm: X·H·lr per outer step; diloco: X",
    )  # fmt: skip
    outer_betas: list[float] | None = setting(
        None, commands=("train",), owner="LocalSteps", parse=betas_spec, metavar="B1,B2", local=True,
        since=3, absent=_earlier_outer_betas, default_text="vote, dsm 0.9,0.96; diloco μ 0.9",
        help="with --local-steps: the outer momentum's betas (diloco: B1 is Nesterov's μ, B2 unused)",
    )  # fmt: skip
    inner_momentum: str = shared.field("inner_momentum")

    def __post_init__(self) -> None:
        if self.local_steps is not None and self.variant in BASELINES and self.outer == DEFAULT_OUTER:
            self.outer = DENSE_SIGN_RULE  # a vote on the dense mean is its sign: dsm (docs/local-steps.md)
        if self.variant in PEER_VARIANTS:  # torchft's DiLoCo: averaged outer step, each worker's momenta kept
            self.outer = DENSE_SGD_RULE if self.outer == DEFAULT_OUTER else self.outer
            self.inner_momentum = "keep" if self.inner_momentum == INNER_MOMENTA[0] else self.inner_momentum

    @property
    def one_bit(self) -> bool:
        """The variant's vote is one bit per element (``zero_vote`` applies)."""
        return _one_bit(self.variant)

    def build(self, topology: str | None = None) -> OptimizerParts:
        """The optimizer's objects of these settings, checked, their errors in flags
        (:func:`lioncub.train.parts.optimizer_parts`); ``topology``: the one ``--topology auto`` chose."""
        return optimizer_parts(self, SETTINGS, topology)


@dataclass
class ClusterConfig:
    """Where the ranks run: recorded for the report and the resume checks; the launcher applies it."""

    nproc: int = shared.field("nproc")
    link: str = shared.field("link")
    nnodes: int | None = shared.field("nnodes")
    intra_link: str | None = shared.field("intra_link")
    fault_tolerant: bool = setting(
        False,
        help="every rank (with --nnodes every node) a replica group on torchft (docs/fault-tolerance.md): a "
        "group that dies is left out at the next quorum, one that (re)joins heals from a live peer (the ft "
        "extra, docs/install.md)",
    )
    fsdp: bool = setting(
        False,
        help="with --nnodes M --nproc-per-node L (L >= 2): each node shards the model over its ranks with "
        "FSDP2 and the nodes vote on each rank's shard (docs/shards.md; 32bit/16bit: HSDP + Lion)",
    )  # fmt: skip
    kill: list[str] = setting(
        [], parse=fault_list, metavar="G@STEP,...", ft_only=True,
        help="with --fault-tolerant: SIGKILL group G once it has finished step STEP",
    )  # fmt: skip
    rejoin: list[str] = setting(
        [], parse=fault_list, metavar="G@STEP,...", ft_only=True,
        help="with --fault-tolerant: start group G again once the job has finished step STEP; it heals "
        "from a live peer and joins (with local steps: at the next window)",
    )  # fmt: skip
    lighthouse: str | None = setting(
        None, metavar="URL", default_text="one started for the job", ft_only=True,
        help="with --fault-tolerant: the torchft lighthouse to join (http://HOST:PORT)",
    )  # fmt: skip
    momentum_on_heal: str = setting(
        "peer", choices=MOMENTA_ON_HEAL, ft_only=True,
        help="with --fault-tolerant: a healed group's momenta, the peer's copy or zeros",
    )  # fmt: skip

    @property
    def replica_groups(self) -> int:
        """The replica groups of a fault-tolerant run: one per node with ``--nnodes``, else one per rank."""
        return self.nnodes or self.nproc

    @property
    def nproc_per_node(self) -> int:
        """Ranks per node: ``nproc / nnodes``, or 1 (one emulated node per rank)."""
        return self.nproc // self.nnodes if self.nnodes else 1


#: every setting of a run, by name, in the order of the parts: the table the flags, the JSON and the
#: checks follow
SETTINGS: dict[str, Described] = described(
    {"run": RunConfig, "optimizer": OptimizerConfig, "cluster": ClusterConfig}
)


def spell(name: str, value: Any) -> str:
    """Setting ``name`` with ``value`` as the command line gives it (``--outer dsm``)."""
    return spell_value(SETTINGS[name], value)


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
        values = self.flat()
        for name, d in SETTINGS.items():
            check_value(d, values[name])
        _check_what(self)
        _check_run(self)
        _check_per_variant(self)
        check_fsdp(self)
        self.optimizer.build()  # the optimizer's own checks

    def flat(self) -> dict[str, Any]:
        """Every setting by name (the parts merged)."""
        return {name: getattr(getattr(self, d.part), name) for name, d in SETTINGS.items()}

    def to_json(self) -> dict[str, Any]:
        """The nested ``config.json`` object: ``{"version": 2, "run": {...}, "optimizer": {...},
        "cluster": {...}}``, every setting in its part."""
        parts = dataclasses.asdict(self)  # copies of the lists and dicts
        return nest({name: parts[d.part][name] for name, d in SETTINGS.items()}, SETTINGS)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TrainConfig:
        """The configuration of a ``config.json`` object, nested or flat (unknown keys are ignored, missing
        ones take their defaults: :func:`lioncub.train.settings.flat_document`), validated. Before version
        3 the sign rules' outer lr was 1 at every H: such a run keeps it where today's default differs."""
        values = flat_document(doc, SETTINGS)
        h, outer = values.get("local_steps"), values.get("outer")
        earlier = config_version(doc) < 3 and values.get("outer_lr") is None and outer in SIGN_RULES
        if earlier and isinstance(outer, str) and is_int(h, 1) and default_outer_lr(outer, h) != 1.0:
            values["outer_lr"] = 1.0
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The configuration of ``values`` (settings by name; the others take their defaults), validated."""
        unknown = sorted(set(values) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown settings {unknown}; known: {list(SETTINGS)}")
        parts: dict[str, dict[str, Any]] = {"run": {}, "optimizer": {}, "cluster": {}}
        for name, value in values.items():
            parts[SETTINGS[name].part][name] = value
        return cls(
            RunConfig(**parts["run"]),
            OptimizerConfig(**parts["optimizer"]),
            ClusterConfig(**parts["cluster"]),
        )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with the settings ``changes`` (by name), validated."""
        return TrainConfig.from_values({**self.flat(), **changes})


def _check_what(config: TrainConfig) -> None:
    """The workload's size and ``--set`` fields."""
    run = config.run
    sizes = workload_names()[run.workload]
    if run.size not in sizes:
        raise ValueError(f"--size {run.size!r}: allowed values for {run.workload} are {sizes}")
    fields = {f.name for f in dataclasses.fields(workload_class(run.workload))}
    fields -= {"size", "rank", "world_size", "seed", "data_mode", "device"}  # set by the run itself
    unknown = sorted(set(run.overrides) - fields)
    if unknown:
        raise ValueError(
            f"--set {', '.join(unknown)}: not a field of the {run.workload} workload; "
            f"fields: {sorted(fields)}"
        )


def _check_run(config: TrainConfig) -> None:
    """The rules across a run's settings: nodes and links, ``--stop-at``, ``--warmup``, the pilot's
    fields, ``--momentum-sync``'s form, ``--device cuda``."""
    run, cluster, opt = config.run, config.cluster, config.optimizer
    if cluster.nnodes is None and cluster.intra_link is not None:
        raise ValueError(
            f"--intra-link {cluster.intra_link}: applies only with --nnodes M --nproc-per-node L"
        )
    if cluster.nnodes is not None:
        if not (isinstance(cluster.nnodes, int) and cluster.nnodes >= 1) or cluster.nproc % cluster.nnodes:
            raise ValueError(
                f"--nnodes {cluster.nnodes!r} must be an integer >= 1 that divides the {cluster.nproc} ranks "
                "(give --nnodes M --nproc-per-node L)"
            )
        if not emulates_links(config):
            raise ValueError(
                f"--nnodes {cluster.nnodes}: emulates nodes behind shaped NICs and needs --link RATE (root); "
                "without a link use --nproc N"
            )
    if run.stop_at is not None and not (isinstance(run.stop_at, int) and 1 <= run.stop_at <= run.steps):
        raise ValueError(f"--stop-at {run.stop_at!r} must be an integer within [1, --steps {run.steps}]")
    if run.warmup_steps is not None and run.warmup_steps > run.steps:
        raise ValueError(
            f"--warmup {run.warmup_steps} must be at most --steps {run.steps} (the lr would never reach "
            "its peak)"
        )
    if run.time_budget_s is None and (run.pilot_steps is not None or run.pilot_step_s is not None):
        raise ValueError("pilot_steps, pilot_step_s: apply only with time_budget_s (--time-budget)")
    auto = (run.chosen_by, run.auto_compute_s, run.auto_vote_s)
    if any(v is not None for v in auto) and not all(v is not None for v in auto):
        raise ValueError("chosen_by, auto_compute_s, auto_vote_s: go together (what --variant auto measured)")
    sync = opt.momentum_sync
    if not sync or (isinstance(sync, list) and not all(isinstance(p, str) and p for p in sync)):
        raise ValueError(
            f"--momentum-sync {opt.momentum_sync!r}: give none, all, io or comma-separated parameter-name "
            "patterns / param-group names"
        )
    if run.device == "cuda" and emulates_links(config):
        raise ValueError(CUDA_UNDER_EMULATION.format(link=cluster.link))
    check_fault_tolerant(config)


def _check_per_variant(config: TrainConfig) -> None:
    """What the DDP baselines do not take (each setting's ``dense_why``), what only local steps take
    (``local``), and what local steps do not take beyond the optimizer's own rules: ``--overlap``,
    ``--steps`` and ``--eval-every`` between outer steps, ``--topology`` with ``--overlap``."""
    opt, values = config.optimizer, config.flat()
    changed = [(n, d) for n, d in SETTINGS.items() if values[n] != d.default]
    ft = config.cluster.fault_tolerant
    for name, d in changed:
        if d.setting.ft_only and not ft:
            raise ValueError(f"{d.flag}: applies only with --fault-tolerant")
        if d.setting.ft_why and ft:
            raise ValueError(f"{spell(name, values[name])} with --fault-tolerant: {d.setting.ft_why}")
        if d.setting.dense_why and opt.variant in PEER_VARIANTS and name != "inner_momentum":
            raise ValueError(
                f"{spell(name, values[name])}: --variant {opt.variant} is torchft's DiLoCo, which does not "
                f"vote; {d.flag} applies to the LionCub variants"
            )
        if d.setting.dense_why and opt.variant in BASELINES:
            raise ValueError(
                f"{spell(name, values[name])}: --variant {opt.variant} is DDP + Lion{d.setting.dense_why}; "
                f"{d.flag} applies to the LionCub variants"
            )
        if d.setting.local and opt.local_steps is None:
            raise ValueError(f"{d.flag}: applies only with --local-steps H")
    if opt.overlap and opt.topology != "flat":
        raise ValueError(f"--topology {opt.topology}: --overlap votes flat (use --topology flat)")
    h = opt.local_steps
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        return  # none, or LocalSteps names it
    if opt.overlap:
        raise ValueError(
            f"--overlap with --local-steps {h}: the ranks vote every {h} steps; the outer step runs in the "
            "optimizer step, with no vote in the backward pass to overlap; drop --overlap"
        )
    for name in ("steps", "eval_every"):
        if values[name] % h:
            raise ValueError(
                f"{spell(name, values[name])} with --local-steps {h}: must be a multiple of {h}, where the "
                "ranks hold the same parameters (between outer steps each rank has its own replica)"
            )


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


def check_start(config: TrainConfig, *, resume: bool, inside_job: bool) -> None:
    """How a run of ``config`` starts, beside what it is (:class:`TrainConfig`'s checks): ``resume`` its
    checkpoints, or train as a rank of a job torchrun or ``lioncub launch`` started (``inside_job``).
    ``ValueError`` naming the option: a fault-tolerant run is never a rank of such a job (it resumes as
    any run: :mod:`lioncub.train.replica_group`)."""
    if not config.cluster.fault_tolerant:
        return
    if inside_job:
        raise ValueError(
            "--fault-tolerant inside a job of torchrun or `lioncub launch`: lioncub train starts the replica "
            "groups itself; in your own script use lioncub.integrations.torchft.ReplicaGroup"
        )


def check_auto(given: Mapping[str, Any], *, resume: bool, inside_job: bool) -> None:
    """``--variant auto`` (what ``chosen_by`` records, :data:`CHOSEN_BY`) with the settings ``given`` (by
    name; None: not given), before any configuration exists: the pilot chooses the variant, H and the
    outer rule's defaults, when a run starts from the command line. ``ValueError`` naming the option."""
    if resume:
        raise ValueError(
            "--variant auto with --resume: the run chose its variant when it started (config.json); "
            "resume without --variant"
        )
    if inside_job:
        raise ValueError(
            "--variant auto: chosen by a pilot that `lioncub train` launches before the run; inside a job "
            "of torchrun or `lioncub launch` give the variant (lioncub.planning.auto.auto_variant chooses "
            "it in your own script)"
        )
    if given.get("fsdp"):
        raise ValueError(
            "--variant auto with --fsdp: the pilot's choice is not built for sharded runs; give the variant "
            "(e.g. 1bit or 1bit --local-steps 4)"
        )
    outer = given.get("outer")
    if outer not in (None, DEFAULT_OUTER):
        raise ValueError(
            f"--variant auto with {spell('outer', outer)}: auto chooses among 1-bit votes (outer rule "
            f"{DEFAULT_OUTER}); for {outer} give --variant 32bit --local-steps H --outer {outer}"
        )
    if given.get("local_steps") is not None:
        raise ValueError(
            f"--variant auto with {spell('local_steps', given['local_steps'])}: auto chooses H (or a vote "
            "every step); give one of them"
        )


def emulates_links(config: TrainConfig) -> bool:
    """Whether the run's ranks sit behind links the launcher emulates (``--link RATE``, ``--nnodes``)."""
    return config.cluster.link not in (None, "loopback")
