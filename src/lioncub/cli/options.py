"""Options that ``lioncub train`` and ``lioncub compare`` share, written from their descriptions -- the
settings of a run (:data:`lioncub.train.config.SETTINGS`) and how it is launched (:class:`LaunchOptions`)
-- and how they become a :class:`~lioncub.train.config.TrainConfig`. Where ``lioncub launch``, ``cost`` or
``calibrate`` take the same option (``--nproc``, ``--nnodes``, ``--nproc-per-node``, ``--link``,
``--intra-link``, ``--timeout``, ``--collective-timeout``, ``--restarts``, ``--local-steps``,
``--inner-momentum``), its flag comes from the same description (:func:`add_flag`; the setting's
``commands`` name them); a name that means different things to different commands is in
:data:`DISTINCT`, with why.

Each flag's type, choices, metavar and help come from its description, its help ends with the default.
A setting's flag defaults to None here, so that ``--resume`` tells an option given from one left out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lioncub.launch.config import DEFAULT_TIMEOUT_S
from lioncub.train.settings import Described, described, setting, whole_number
from lioncub.train.shared import SHARED

__all__ = [
    "LaunchOptions",
    "add_flag",
    "add_run_arguments",
    "config_from_args",
    "parse_set",
    "real_number",
    "train_run",
    "whole_number",
]


def real_number(
    allowed: str, low: float, high: float = math.inf, *, low_open: bool
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``(low, high]`` (``low_open``) or ``[low, high]``;
    ``allowed`` words the range in the messages (e.g. ``"a number in (0, 1]"``)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        inside = (value > low if low_open else value >= low) and value <= high and math.isfinite(value)
        if not inside:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return convert


@dataclass
class LaunchOptions:
    """How ``lioncub train`` and ``lioncub compare`` start and watch a run's ranks: not settings of the run
    (a resume may change them; :func:`lioncub.train.driver.check_launch_options` checks them)."""

    nproc_per_node: int | None = setting(
        None, low=1, parse=whole_number(1), metavar="L", help="with --nnodes: ranks on each node",
        commands=("train", "compare", "launch", "cost", "calibrate"),
    )  # fmt: skip
    max_nproc: int | None = setting(
        None,
        metavar="N",
        default_text="as many as 80% of the available memory holds",
        help="allow up to N ranks",
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT_S, metavar="SECONDS", commands=("train", "compare", "launch", "calibrate"),
        help="stop the job (train, compare: each run) after this long, restarts included; 0: no limit",
    )  # fmt: skip
    collective_timeout: float = setting(
        600.0, metavar="SECONDS", commands=("train", "compare", "launch", "calibrate"),
        default_text="600; launch: unset, each process group's own",
        help="a collective that gets no answer for this long fails the job, naming the rank, operation and "
        "step (LIONCUB_PG_TIMEOUT for the ranks; train, calibrate: their process group's timeout too)",
    )  # fmt: skip
    restarts: int = setting(
        0, metavar="K", commands=("train", "compare", "launch"),
        help="after a rank fails, restart every rank (train, compare: from the last checkpoint), up to K "
        "times",
    )  # fmt: skip
    no_progress: bool = setting(False, help="no progress bar")


#: the flags of :class:`LaunchOptions`
LAUNCH: dict[str, Described] = described({"launch": LaunchOptions})
#: the flags that several commands declare each their own way, and why: one name, different things. Every
#: other flag of more than one command is one description, in :data:`LAUNCH` or
#: :data:`lioncub.train.config.SETTINGS`, added by :func:`add_flag` (``tests/test_flags.py`` holds to it)
DISTINCT: dict[str, str] = {
    "--out": "what each command writes: train's run directory, compare's report directory, calibrate's "
    "JSON file, report's directory of PNGs",
    "--warmup": "train's warm-up steps of the lr schedule; calibrate's untimed runs per size",
    "--variants": "compare's runs to train (run names: 1bit/h16, auto); cost's presets to price "
    "(preset@topology)",
    "--bucket-mb": "train's LionCub buckets (> 0, the optimizer's); cost's modelled buckets, where 0 prices "
    "one bucket",
    "--sync-every": "train's momentum sync interval (default 10, for --momentum-sync); cost's turns the "
    "modelled sync on (no default: none)",
}
#: the title of each group of flags in ``--help``
GROUPS = {
    "run": "the run",
    "optimizer": "the optimizer",
    "cluster": "ranks and links",
    "launch": "the launch",
}


def _help(d: Described) -> str:
    """``d``'s help with its default, escaped for argparse."""
    s, default = d.setting, d.default
    if s.default_text is not None:
        shown = s.default_text
    elif default is None or default is False or default == {}:
        shown = ""
    else:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    return (s.help + (f" (default {shown})" if shown else "")).replace("%", "%%")


@functools.cache
def _parser(parse: Any) -> Any:
    """A setting's ``parse`` as an argparse ``type`` whose ``ValueError`` message reaches the user (one per
    ``parse``: every command's flag has the same type)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add(
    group: Any,
    d: Described,
    *,
    given_only: bool,
    extra: tuple[str, str] | None = None,
    aliases: tuple[str, ...] = (),
) -> None:
    """The flag of ``d`` in ``group`` (and its ``aliases``); its default None where ``given_only``;
    ``extra``: a choice the command resolves itself, and its help."""
    s = d.setting
    options: dict[str, Any] = {"dest": d.name, "help": _help(d) + (f"; {extra[1]}" if extra else "")}
    default = None if given_only else d.default
    if d.kind is bool:
        options.update(action="store_true", default=default)
    elif d.kind is dict:  # --set FIELD=VALUE, repeated (parse_set)
        options.update(action="append", metavar=s.metavar)
    else:
        options.update(type=_parser(s.parse) if s.parse else d.kind, metavar=s.metavar, default=default)
        if s.choices is not None:
            options["choices"] = [*s.choices, *extra[:1]] if extra else list(s.choices)
    group.add_argument(d.flag, *aliases, **options)


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    command: str,
    aliases: tuple[str, ...] = (),
    *,
    given_only: bool = False,
) -> None:
    """The flag of the launch option or setting ``name`` (:data:`LAUNCH`, the torch-free
    :data:`lioncub.train.shared.SHARED`, else :data:`lioncub.train.config.SETTINGS`) in ``parser`` of
    ``command`` (``launch``, ``cost``, ``calibrate``), with its default (None where ``given_only``, for a
    command that tells an option given from one left out): the one declaration of an option several
    commands take."""
    d = LAUNCH.get(name) or SHARED.get(name)
    if d is None:
        from lioncub.train.config import SETTINGS

        d = SETTINGS[name]
    assert command in d.setting.commands, f"{d.flag} is not an option of {command}: add it to its commands"
    _add(parser, d, given_only=given_only, aliases=aliases)


def add_run_arguments(
    parser: argparse.ArgumentParser, command: str, extra: dict[str, tuple[str, str]] | None = None
) -> None:
    """The flags of ``command`` (``train`` or ``compare``): every setting it takes, grouped by part, then
    the launch options. ``extra``: by setting, a choice the command resolves before the configuration
    exists (``{"variant": ("auto", help)}``)."""
    from lioncub.train.config import SETTINGS

    groups: dict[str, Any] = {}
    for d in [*SETTINGS.values(), *LAUNCH.values()]:
        if command in d.setting.commands:
            if d.part not in groups:
                groups[d.part] = parser.add_argument_group(GROUPS[d.part])
            _add(groups[d.part], d, given_only=d.name in SETTINGS, extra=(extra or {}).get(d.name))


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items as ``{field: value}`` (a value is JSON where it parses as JSON)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set batch_size=8")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def node_layout(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """``(nnodes, nproc)`` from ``--nnodes M --nproc-per-node L`` (``(None, None)`` when not given), or a
    ``ValueError`` naming the option: --nnodes needs --nproc-per-node and excludes --nproc."""
    nnodes, per_node = getattr(args, "nnodes", None), getattr(args, "nproc_per_node", None)
    if nnodes is None:
        if per_node is not None:
            raise ValueError(
                f"--nproc-per-node {per_node}: applies only with --nnodes M (M emulated nodes of L ranks); "
                "for N ranks, each with its own link, use --nproc N"
            )
        return None, None
    if per_node is None:
        raise ValueError(f"--nnodes {nnodes}: needs --nproc-per-node L, the ranks on each node")
    if args.nproc is not None:
        raise ValueError(
            f"--nproc {args.nproc} with --nnodes {nnodes}: give either --nproc N (N ranks, each its own "
            "node) or --nnodes M --nproc-per-node L (M nodes of L ranks)"
        )
    for option, value in (("--nnodes", nnodes), ("--nproc-per-node", per_node)):
        if value < 1:
            raise ValueError(f"{option} {value} must be an integer >= 1")
    return nnodes, nnodes * per_node


def config_from_args(args: argparse.Namespace, base: Any = None) -> Any:
    """A :class:`~lioncub.train.config.TrainConfig`: ``base`` (or the defaults) with every setting given
    in ``args`` (``--nnodes M --nproc-per-node L`` become ``nnodes = M``, ``nproc = M·L``; ``--nproc N``
    alone, one node per rank; with ``--local-steps H`` and no ``--eval-every``, the evaluation interval of a
    new run is the multiple of H nearest the default)."""
    from lioncub.train.config import SETTINGS, TrainConfig

    nnodes, nproc = node_layout(args)
    values: dict[str, Any] = base.flat() if base is not None else {}
    if nnodes is None and getattr(args, "nproc", None) is not None:  # one node per rank, whatever base had
        values.pop("nnodes", None)
        values.pop("intra_link", None)
    given = {name: getattr(args, name, None) for name in SETTINGS if name != "overrides"}
    if nnodes is not None:
        given.update(nnodes=nnodes, nproc=nproc)
    values.update({name: value for name, value in given.items() if value is not None})
    h = values.get("local_steps")
    if h and base is None and given["eval_every"] is None:  # evaluations where the replicas agree
        values["eval_every"] = h * max(1, round(SETTINGS["eval_every"].default / h))
    if getattr(args, "overrides", None):
        values["overrides"] = {**values.get("overrides", {}), **parse_set(args.overrides)}
    return TrainConfig.from_values(values)


def config_for_name(args: argparse.Namespace, name: str, what: str) -> Any:
    """The :class:`~lioncub.train.config.TrainConfig` of the run ``name`` (:mod:`lioncub.names`:
    ``1bit``, ``1bit/h16``, ...) with the options of ``args``: those only a vote every step takes (a
    setting's ``per_step``) left out for a DDP baseline or local steps, those only local steps take
    (``local``) for a vote every step, ``--zero-vote`` for a vote that is not one-bit. ``ValueError``
    prefixed by ``what`` (the option that named the run: ``--variants 1bit/h4``)."""
    from lioncub.names import parse_run_name
    from lioncub.train.config import BASELINES, SETTINGS, OptimizerConfig

    fields = parse_run_name(name)
    options = {**vars(args), **fields}
    per_step = [n for n, d in SETTINGS.items() if d.setting.per_step]  # for a vote every step
    if fields["variant"] in BASELINES or "local_steps" in fields:  # no vote every step
        options.update(dict.fromkeys(per_step))
        options.update({k: v for k, v in fields.items() if k in per_step})
    if "local_steps" not in fields:  # what only local steps take
        options.update(dict.fromkeys(n for n, d in SETTINGS.items() if d.setting.local))
    if not OptimizerConfig(variant=fields["variant"]).one_bit and "zero_vote" not in fields:
        options["zero_vote"] = None  # --zero-vote: for the one-bit votes (a name's /plus is checked)
    if options.get("time_budget_s") is not None:  # the pilot plans the steps: until then, a whole window
        h = fields.get("local_steps", 1)
        options["steps"] = h * max(1, math.ceil((options.get("warmup_steps") or 0) / h))
    try:
        return config_from_args(argparse.Namespace(**options))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def train_run(
    args: argparse.Namespace, config: Any, run_dir: Any, lock: Any, label: str | None = None
) -> Any:
    """:func:`lioncub.train.driver.run_training` of ``config`` in ``run_dir`` with the launch options of
    ``args`` (``--timeout``, ``--no-progress``, ``--restarts``, ``--collective-timeout``); ``lock``, the run
    directory's writer lock, is released when the run has ended. A ``--fault-tolerant`` run:
    :func:`lioncub.train.fault_tolerant.run_fault_tolerant`."""
    from lioncub.train.driver import run_training
    from lioncub.train.fault_tolerant import run_fault_tolerant

    try:
        return (run_fault_tolerant if config.cluster.fault_tolerant else run_training)(
            config,
            run_dir,
            timeout_s=args.timeout or None,
            progress=not args.no_progress,
            label=label,
            restarts=args.restarts,
            collective_timeout_s=args.collective_timeout,
        )
    finally:
        lock.release()


def run_pilot(args: argparse.Namespace, pilot: Any, label: str, command: str) -> list[dict[str, Any]] | int:
    """Train ``pilot`` (a :class:`~lioncub.train.config.TrainConfig`) in a scratch directory, removed
    after, with the launch options of ``args``; its step records in order, or its exit status if it
    failed (``command`` names the tool in the message)."""
    import sys
    import tempfile
    from pathlib import Path

    from lioncub.train.prepare import prepare_run_dir
    from lioncub.train.runlog import complete_records

    with tempfile.TemporaryDirectory(prefix="lioncub-pilot-") as scratch:
        pilot_dir = Path(scratch) / "pilot"
        pilot, lock = prepare_run_dir(pilot_dir, pilot, resume=False)
        print(f"{label}: a pilot of {pilot.run.steps} steps", file=sys.stderr, flush=True)
        outcome = train_run(args, pilot, pilot_dir, lock, f"{label} pilot")
        if outcome.summary is None:
            print(f"{command}: the pilot of {label} failed (exit code {outcome.returncode})", file=sys.stderr)
            return outcome.returncode or 1
        records = complete_records(pilot_dir / "log.jsonl")[0]
    return [rec for _, rec in records if rec.get("kind") == "step"]
