"""``lioncub compare``: train several variants on the same workload, seed, data and link, one after
another, and write a report: a table of step time and its split, speedup over ``32bit``, bytes per step,
validation loss at equal steps and time to a target loss, and PNG plots (:mod:`lioncub.report.runs`).
With ``--time-budget SECONDS`` the runs get equal training time instead of equal steps: a pilot of each
measures its step time and it trains the steps that fit (:mod:`lioncub.train.budget`); the table then
shows each run's steps and validation loss at the budget.

Layout: ``OUT/<variant>/`` holds each run (as ``lioncub train --out``), ``OUT/`` the report.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lioncub.cli.options import add_run_arguments, config_for_name, train_run
from lioncub.names import FSDP_SUFFIX, OVERLAP_SUFFIX

if TYPE_CHECKING:
    from lioncub.train.config import TrainConfig

DEFAULT_VARIANTS = "32bit,16bit,1bit,4bit,8bit"

EPILOG = """\
examples:
  lioncub compare --workload gpt --size small --nproc 4 --link 100mbit --steps 300 --out runs/cmp
  lioncub compare --variants 32bit,1bit --nnodes 2 --nproc-per-node 2 --link 100mbit --out runs/nodes
  lioncub compare --variants 32bit,1bit --steps 50 --out runs/quick       # 1 rank, loopback, tiny GPT
  lioncub compare --out runs/cmp --report-only --target-loss 2.2           # redo the report
  lioncub compare --variants 32bit,1bit,1bit+overlap --nproc 4 --link 1gbit --out runs/ov  # overlap
  lioncub compare --variants 32bit,1bit,1bit/h16 --nproc 4 --link 2mbit --time-budget 600 --out runs/t
      # equal training time: each run the steps its own step time fits in 600 s

Runs that finished before are reused when their configuration is the same (--overwrite trains them
again); a finished report lists OUT/summary.md, OUT/summary.json and the PNG plots. --diagnostics-every
and --momentum-sync/--sync-every apply to the variants that vote every step (not to the DDP baselines, nor
to runs with local steps); with diagnostics the report adds OUT/diagnostics_vs_step.png (match, flip, tie
rate, momentum spread per variant).
A LionCub variant named NAME+overlap (or every LionCub variant, with --overlap) starts its votes during the
backward pass (DDP communication hook; bitwise the same training as NAME). NAME@hierarchical votes node by
node (bitwise NAME's training, other bytes per NIC) and 1bit@node-majority takes the majority of the
nodes' majorities (another estimator); with --nnodes M --nproc-per-node L, e.g.
  lioncub compare --variants 32bit,1bit,1bit@hierarchical,1bit@node-majority --nnodes 2 --nproc-per-node 2 \\
      --link 100mbit --out runs/topo
Local steps (docs/local-steps.md): NAME/hH votes every H steps -- 1bit/h16, 8bit/h16; dsm/h16 and
diloco/h16 average the pseudo-gradients in fp32 (diloco-16bit/h16: bf16); /lrX sets the outer lr,
/bB1:B2 the outer betas, and /keep or /average the inner momentum at an outer step (default: reset), e.g.
  lioncub compare --variants 32bit,1bit,1bit/h16,1bit/h16/lr2,diloco/h16,diloco/h16/keep --nproc 4 \\
      --link 20mbit --steps 512 --eval-every 32 --out runs/local
The row auto measures the per-step 1bit vote's compute and communication in a short pilot and trains
the schedule the cost rule picks: 1bit, 1bit/h4 or 1bit/h16 (docs/local-steps.md, 'Choosing H'), e.g.
  lioncub compare --variants 1bit,auto --nproc 4 --link 2mbit --time-budget 300 --out runs/auto
A one-bit vote named NAME/plus (1bit/plus, 1bit/h16/plus) votes + for an exact zero, the papers' rule
(--zero-vote plus, for every one-bit row).
With --fault-tolerant every row runs between replica groups on torchft's lighthouse, under one --kill/--rejoin
schedule, and torchft-diloco/hH is torchft's own DiLoCo there (docs/fault-tolerance.md), e.g.
  lioncub compare --variants 1bit,1bit/h4,torchft-diloco/h4 --nproc 4 --fault-tolerant --kill 1@64 \\
      --rejoin 1@128 --steps 192 --out runs/ft
A run named NAME+fsdp (or every row, with --fsdp) shards the model inside each node of --nnodes M
--nproc-per-node L (L >= 2) with FSDP2 and votes between the nodes on the shards (docs/shards.md), e.g.
  lioncub compare --variants 1bit,1bit+fsdp --nnodes 2 --nproc-per-node 2 --link 1gbit --out runs/fsdp
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_arguments(parser, "compare")
    parser.add_argument(
        "--variants",
        help=f"comma-separated, in order (default {DEFAULT_VARIANTS}; with --report-only: the runs in OUT)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="report directory (runs inside)")
    parser.add_argument("--target-loss", type=float, help="validation loss for 'time to target'")
    parser.add_argument("--overwrite", action="store_true", help="train runs again even if finished")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report from OUT")


#: what a run of ``--time-budget`` sets after its pilot (``eval_every`` too, without ``--eval-every``)
PLANNED = ("steps", "pilot_steps", "pilot_step_s")


def _finished(run_dir: Path, config: TrainConfig, eval_given: bool = True) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``config`` that lioncub wrote; with a time
    budget, of ``config`` but for what its pilot planned (:data:`PLANNED`; ``eval_every`` unless
    ``eval_given``)."""
    from lioncub.train.prepare import finished_run

    found = finished_run(run_dir)
    if found is None:
        return False
    from lioncub.train.config import TrainConfig

    try:  # the settings it ran (a flat config.json of an earlier lioncub too)
        saved, doc = TrainConfig.from_json(found[0]).flat(), config.flat()
    except (ValueError, TypeError):
        return False
    if config.run.time_budget_s is not None:
        planned = PLANNED if eval_given else (*PLANNED, "eval_every")
        saved, doc = ({k: v for k, v in d.items() if k not in planned} for d in (saved, doc))
    return saved == doc


def _config(args: argparse.Namespace, variant: str) -> TrainConfig:
    """The configuration of the compared run ``variant`` (:func:`~lioncub.cli.options.config_for_name`);
    for ``auto``, that of its pilot, the per-step ``1bit`` vote, until the pilot has chosen
    (:mod:`lioncub.cli.auto`)."""
    from lioncub.cli.auto import AUTO, check_candidates

    if variant == AUTO:
        return check_candidates(functools.partial(_auto_config, args))
    return config_for_name(args, variant, f"--variants {variant}")


def _auto_config(args: argparse.Namespace, name: str) -> TrainConfig:
    """The configuration of ``name``, a run ``auto`` may choose."""
    return config_for_name(args, name, f"--variants auto (it may choose {name})")


def _reusable(args: argparse.Namespace, variant: str, run_dir: Path, config: TrainConfig) -> bool:
    """``run_dir`` holds a finished run of ``variant`` that need not train again (:func:`_finished`); for
    ``auto``, a run ``auto`` chose whose configuration is the one this compare gives its choice."""
    from lioncub.cli.auto import AUTO

    eval_given = args.eval_every is not None
    if args.overwrite:
        return False
    if variant != AUTO:
        return _finished(run_dir, config, eval_given)
    from lioncub.names import run_label
    from lioncub.train.config import TrainConfig
    from lioncub.train.prepare import finished_run

    found = finished_run(run_dir)
    try:
        saved = TrainConfig.from_json(found[0]) if found is not None else None
    except (ValueError, TypeError):
        return False
    if saved is None or saved.run.chosen_by != AUTO:
        return False
    run = saved.run
    chosen = run_label({k: v for k, v in saved.flat().items() if k != "chosen_by"})
    expected = _auto_config(args, chosen).replace(
        chosen_by=run.chosen_by, auto_compute_s=run.auto_compute_s, auto_vote_s=run.auto_vote_s
    )
    return _finished(run_dir, expected, eval_given)


def _check_budget(args: argparse.Namespace) -> None:
    """``--time-budget`` and the options it does not go with; ``ValueError`` naming them."""
    from lioncub.train.config import SETTINGS
    from lioncub.train.settings import check_value

    budget = args.time_budget_s
    check_value(SETTINGS["time_budget_s"], budget)
    if args.report_only:
        raise ValueError(
            f"--time-budget {budget:g} with --report-only: the report reads each run's budget from OUT"
        )
    if args.steps is not None:
        raise ValueError(
            f"--time-budget {budget:g} with --steps {args.steps}: the budget sets each run's steps (what its "
            "own step time fits); give one of them"
        )
    if args.diagnostics_every:
        raise ValueError(
            f"--diagnostics-every {args.diagnostics_every} with --time-budget {budget:g}: the diagnostics "
            "every K steps would count in the runs' time but not in their pilots'; compare by time without "
            "them"
        )


def _runs_in(out: Path) -> list[str]:
    """The variants whose runs ``out`` holds (run directories lioncub marked, with a log), in the order of
    its last report (else by name)."""
    import json

    from lioncub.names import name_of_run_dir
    from lioncub.rundir import is_marked, read_run_file

    present = []
    if out.is_dir():
        dirs = [d for d in sorted(out.iterdir()) if d.is_dir() and not d.is_symlink()]
        present = [name_of_run_dir(d.name) for d in dirs if is_marked(d) and (d / "log.jsonl").is_file()]
    try:
        rows = json.loads(read_run_file(out / "summary.json", follow_symlinks=True))["rows"]
        order = [name_of_run_dir(Path(r["run_dir"]).name) for r in rows]
    except (OSError, ValueError, KeyError, TypeError):
        order = []
    return [v for v in order if v in present] + [v for v in present if v not in order]


def _variants(args: argparse.Namespace, out: Path) -> list[str]:
    """The runs to compare, in order: ``--variants``, or with ``--report-only`` the runs in ``out``
    (default :data:`DEFAULT_VARIANTS`); ``ValueError`` if a name is not understood or given twice (whether
    its options go together is :func:`_config`'s check)."""
    from lioncub.cli.auto import AUTO, PILOT_VARIANT
    from lioncub.names import PEER_VARIANTS, parse_run_name
    from lioncub.optim import PRESETS
    from lioncub.train.config import BASELINES
    from lioncub.transports import TOPOLOGIES

    given = args.variants
    if given is None:
        given = (",".join(_runs_in(out)) if args.report_only else "") or DEFAULT_VARIANTS
    variants = [v.strip() for v in given.split(",") if v.strip()]
    allowed = list(PRESETS)
    grammar = (
        f"give distinct names from {allowed}; a LionCub variant may carry {OVERLAP_SUFFIX!r} (e.g. "
        f"1bit{OVERLAP_SUFFIX}: its vote overlapped with the backward pass; 32bit/16bit, DDP, always "
        f"overlap) or @TOPOLOGY (e.g. 1bit@hierarchical, 1bit@node-majority; topologies {list(TOPOLOGIES)}); "
        "local steps: NAME/hH[/lrX][/bB1:B2][/keep|/average] (1bit/h16, 8bit/h16/lr2, dsm/h16, diloco/h16, "
        "diloco/h16/keep, diloco-16bit/h16); the one-bit votes' zero rule: NAME[...]/plus (1bit/plus); "
        f"sharded inside each node: NAME{FSDP_SUFFIX} (1bit{FSDP_SUFFIX}, 1bit/h4{FSDP_SUFFIX}); "
        "auto: a pilot of 1bit measures compute and communication, and the run votes every step or every H "
        "steps as the schedule rule chooses; torchft's own DiLoCo between replica groups, with "
        f"--fault-tolerant: {', '.join(f'{p}/hH' for p in PEER_VARIANTS)}"
    )
    for v in variants:
        if v == AUTO:  # the pilot's run until it has chosen
            continue
        try:
            fields = parse_run_name(v)
        except ValueError as exc:
            raise ValueError(f"--variants {given!r}: {exc}; {grammar}") from None
        peer = fields["variant"] in PEER_VARIANTS
        if peer and "local_steps" not in fields:
            raise ValueError(
                f"--variants {given!r}: {v!r}: torchft's DiLoCo synchronises every H steps: name it {v}/hH "
                f"(e.g. {v}/h4)"
            )
        if peer and not args.fault_tolerant:
            raise ValueError(
                f"--variants {given!r}: {v!r} runs torchft's DiLoCo between replica groups on torchft's "
                "Manager (as `lioncub train --variant torchft-diloco --local-steps H --fault-tolerant`): add "
                "--fault-tolerant, and every row runs fault-tolerant under the same --kill/--rejoin schedule"
            )
        bad = (fields["variant"] not in allowed and not peer) or fields.get(
            "topology", "flat"
        ) not in TOPOLOGIES
        bad |= fields.get("overlap", False) and fields["variant"] in BASELINES
        if bad:
            raise ValueError(f"--variants {given!r}: {v!r} is not understood; {grammar}")
        if "local_steps" in fields and fields["variant"] in BASELINES and "outer" not in fields:
            wire = "" if fields["variant"] == "32bit" else f"-{fields['variant']}"
            rest = v.partition("/")[2]
            raise ValueError(
                f"--variants {given!r}: {v!r}: local steps on {fields['variant']} take the sign of the mean "
                f"pseudo-gradient: name it dsm{wire}/{rest} (or diloco{wire}/{rest})"
            )
    if not variants or len(set(variants)) != len(variants):
        raise ValueError(f"--variants {given!r}: {grammar}")
    from lioncub.train.config import OptimizerConfig

    if getattr(args, "zero_vote", None) and not any(
        OptimizerConfig(variant=parse_run_name(PILOT_VARIANT if v == AUTO else v)["variant"]).one_bit
        for v in variants
    ):
        one_bit = ", ".join(name for name in PRESETS if OptimizerConfig(variant=name).one_bit)
        raise ValueError(
            f"--zero-vote {args.zero_vote}: applies to the one-bit votes ({one_bit}); no run in "
            f"--variants {given!r} is one"
        )
    if getattr(args, "inner_momentum", None) and not any(
        v == AUTO or "local_steps" in parse_run_name(v) for v in variants
    ):
        raise ValueError(
            f"--inner-momentum {args.inner_momentum}: applies only with --local-steps: runs named NAME/hH in "
            "--variants (e.g. 1bit/h16); none is given"
        )
    return variants


def _check_runs(
    args: argparse.Namespace,
    out: Path,
    variants: list[str],
    configs: list[TrainConfig],
    run_dirs: list[Path],
) -> None:
    """Every check before anything is trained, written or deleted: the runs' options and launch, and
    that ``out`` and each run directory hold only lioncub's files (a run to redo, only with
    ``--overwrite``). ``ValueError`` naming what to change."""
    from lioncub.rundir import survey
    from lioncub.train.driver import check_before_launch, check_launch_options

    for config in configs:
        check_before_launch(config, args.timeout or None, args.max_nproc)
    check_launch_options(args.restarts, args.collective_timeout, args.fault_tolerant)
    _check_out(out)
    for variant, config, run_dir in zip(variants, configs, run_dirs, strict=True):
        if _reusable(args, variant, run_dir, config):
            continue
        found = survey(run_dir, "run")
        if found.foreign:
            raise ValueError(
                f"{run_dir} holds files lioncub did not write ({', '.join(found.foreign[:5])}); lioncub "
                "deletes only its own files: move them, or choose another --out"
            )
        if found.owned and not args.overwrite:
            raise ValueError(
                f"{run_dir} holds another or an unfinished run; pass --overwrite to train it again, "
                "or choose another --out"
            )


def _check_out(out: Path) -> None:
    """``ValueError`` if ``out`` holds anything but lioncub's report and run directories."""
    from lioncub.rundir import foreign_entries

    foreign = foreign_entries(out, "compare", subruns=True)
    if foreign:
        raise ValueError(
            f"--out {out} holds files lioncub did not write ({', '.join(foreign[:5])}); give a new "
            "or empty directory, or one a previous `lioncub compare` wrote"
        )


def _train(
    args: argparse.Namespace, variants: list[str], configs: list[TrainConfig], run_dirs: list[Path]
) -> int:
    """Train every variant whose finished run cannot be reused, one after another (each under its run
    directory's writer lock); the exit status of the first that fails (0 if none does)."""
    from lioncub.cli import auto
    from lioncub.cli.auto import AUTO
    from lioncub.train.driver import format_summary
    from lioncub.train.prepare import prepare_run_dir

    for i, (config, run_dir) in enumerate(zip(configs, run_dirs, strict=True)):
        label = f"[{i + 1}/{len(variants)}] {variants[i]}"
        if _reusable(args, variants[i], run_dir, config):
            print(f"{label}: reusing the finished run in {run_dir}", file=sys.stderr)
            continue
        if variants[i] == AUTO:
            try:
                chosen = auto.resolve(
                    args,
                    functools.partial(_auto_config, args),
                    label,
                    "lioncub compare",
                )
            except ValueError as exc:
                print(f"lioncub compare: error: --variants {AUTO}: {exc}", file=sys.stderr)
                return 2
            if isinstance(chosen, int):
                return chosen
            config = chosen
        if config.run.time_budget_s is not None:
            try:
                planned = _plan(args, config, label)
            except ValueError as exc:
                print(f"lioncub compare: error: --variants {variants[i]}: {exc}", file=sys.stderr)
                return 2
            if isinstance(planned, int):
                return planned
            config = planned
        try:  # --overwrite: lioncub's own run is deleted first (refused if anything else is there)
            config, lock = prepare_run_dir(run_dir, config, resume=False, replace=args.overwrite)
        except ValueError as exc:
            print(f"lioncub compare: error: {exc}", file=sys.stderr)
            return 2
        print(f"{label}: training in {run_dir}", file=sys.stderr, flush=True)
        outcome = train_run(args, config, run_dir, lock, label)
        if outcome.summary is None:
            print(
                f"lioncub compare: {variants[i]} failed (exit code {outcome.returncode}; the launcher "
                "said why above)",
                file=sys.stderr,
            )
            return outcome.returncode or 1
        _say(f"{label}: {format_summary(outcome.summary)}")
    return 0


def _say(line: str) -> None:
    """``line`` on stderr in short lines (:func:`lioncub.report.text.wrap`: the terminal's width, else
    ``COLUMNS``, else :data:`lioncub.report.text.LOG_WIDTH`)."""
    from lioncub.report import text

    text.print_wrapped(text.console(sys.stderr), line)
    sys.stderr.flush()


def _plan(args: argparse.Namespace, config: TrainConfig, label: str) -> TrainConfig | int:
    """``config`` planned for ``--time-budget`` (:mod:`lioncub.train.budget`): its pilot trains in a
    scratch directory, removed after, and its step times set the steps. The planned configuration, or the
    pilot's exit status if it failed; ``ValueError`` if the plan cannot run (nothing fits the budget)."""
    from lioncub.cli.options import run_pilot
    from lioncub.train import budget
    from lioncub.train.driver import check_before_launch

    records = run_pilot(args, budget.pilot_config(config), label, "lioncub compare")
    if isinstance(records, int):
        return records
    times = [rec["step_s"] for rec in records]
    planned = budget.planned_config(config, args.time_budget_s, times, eval_given=args.eval_every is not None)
    check_before_launch(planned, args.timeout or None, args.max_nproc)
    run, first = planned.run, budget.period(config) + 1
    assert run.pilot_step_s is not None, "planned_config sets the pilot's step time"
    _say(
        f"{label}: {run.pilot_step_s * 1e3:.1f} ms per step in the pilot (its steps {first}-"
        f"{run.pilot_steps}): {run.steps} steps fit {run.time_budget_s:g} s, evaluated every "
        f"{run.eval_every}"
    )
    return planned


def _report(args: argparse.Namespace, out: Path, run_dirs: list[Path]) -> int:
    """Write and print the comparison of the runs in ``run_dirs`` into ``out`` (whose lock the caller
    holds), every file recorded as lioncub's."""
    from lioncub.report import runs as report
    from lioncub.rundir import claim, write_owned

    missing = [str(d) for d in run_dirs if not (d / "log.jsonl").exists()]
    if missing:
        print(f"lioncub compare: error: no runs in {', '.join(missing)}", file=sys.stderr)
        return 2
    claim(out, "compare")
    rep = report.make_report(
        run_dirs, out, target_loss=args.target_loss, write=lambda name, data: write_owned(out, name, data)
    )
    report.print_table(rep)
    print(f"report: {out / 'summary.md'}")
    for name, path in rep.plots.items():
        print(f"plot {name}: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``lioncub compare``: check everything, take ``--out``'s writer lock, train the variants, write and
    print the report."""
    import lioncub.report.files  # noqa: F401  (an old compare directory's files, registered with lioncub.rundir)
    from lioncub.names import run_dir_name
    from lioncub.rundir import check_out_path, claim, lock_writer
    from lioncub.train.runfiles import DEEPEST

    try:
        out = check_out_path(args.out, below=len(DEEPEST))
        variants = _variants(args, out)
        check_out_path(out, below=len(DEEPEST) + 1 + max(len(os.fsencode(v)) for v in variants))
        if args.target_loss is not None and not 0 < args.target_loss < math.inf:
            raise ValueError(f"--target-loss {args.target_loss!r} must be a finite validation loss > 0")
        if args.time_budget_s is not None:
            _check_budget(args)
        run_dirs = [out / run_dir_name(v) for v in variants]
        if args.report_only:
            _check_out(out)
            missing = [str(d) for d in run_dirs if not (d / "log.jsonl").exists()]
            if missing:
                raise ValueError(f"no runs in {', '.join(missing)}")
        else:
            configs = [_config(args, v) for v in variants]
            _check_runs(args, out, variants, configs, run_dirs)
        lock = lock_writer(out)
    except (ValueError, TypeError) as exc:
        print(f"lioncub compare: error: {exc}", file=sys.stderr)
        return 2
    try:
        if not args.report_only:
            claim(out, "compare")
            rc = _train(args, variants, configs, run_dirs)
            if rc:
                return rc
        return _report(args, out, run_dirs)
    except ValueError as exc:  # a file of the user's appeared meanwhile, where lioncub writes
        print(f"lioncub compare: error: {exc}", file=sys.stderr)
        return 2
    finally:
        lock.release()
