"""``lioncub train``: train a workload with one variant on N ranks, optionally behind shaped links.

The driver (:mod:`lioncub.train.driver`) takes the run directory's writer lock and writes
``RUN_DIR/config.json`` (:mod:`lioncub.train.prepare`), starts the ranks with ``lioncub launch`` (each runs
:mod:`lioncub.train.rank`), shows a progress bar fed by rank 0's ``log.jsonl`` and prints a summary.
Inside a job started by ``torchrun`` or ``lioncub launch`` (``RANK`` set) it trains as that rank instead
(:func:`lioncub.train.rank.run_rank`), rank 0 taking the lock and making the same checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lioncub.cli.options import add_run_arguments, config_for_name, config_from_args, train_run

EPILOG = """\
examples:
  lioncub train --workload gpt --size small --variant 8bit --nproc 4 --link 1gbit --steps 500 --out runs/g8
  lioncub train --variant 1bit --nnodes 2 --nproc-per-node 2 --link 100mbit --out runs/n2x2  # 2 nodes × 2
  lioncub train --out runs/g8 --resume --steps 800        # continue (and extend) a run
  torchrun --nproc-per-node 4 -m lioncub.cli train --workload gpt --size small --variant 1bit --out runs/x
  lioncub train --variant 1bit --local-steps 16 --nproc 4 --link 20mbit --steps 512 --eval-every 32 \\
      --out runs/h16                   # a 1-bit vote every 16 local steps (docs/local-steps.md)
  lioncub train --variant auto --nproc 4 --link 2mbit --steps 512 --out runs/auto
                                       # a pilot of 1bit chooses: 1bit, 1bit/h4 or 1bit/h16
  lioncub train --variant 32bit --local-steps 16 --outer diloco --nproc 4 --link 20mbit --steps 512 \\
      --out runs/diloco                # DiLoCo: fp32 mean of the pseudo-gradients, Nesterov outer step

Variants: 32bit (DDP + Lion), 16bit (DDP, bf16/fp16 gradients + Lion), and the LionCub presets
{presets}. Workload fields can be changed with --set, e.g. --set batch_size=8.
"""


AUTO_HELP = "auto: a pilot of 1bit measures compute and communication, then trains 1bit or 1bit/hH"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lioncub.cli.auto import AUTO
    from lioncub.optim import PRESETS
    from lioncub.train.config import BASELINES

    parser.epilog = EPILOG.format(presets=", ".join(p for p in PRESETS if p not in BASELINES))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_arguments(parser, "train", extra={"variant": (AUTO, AUTO_HELP)})
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory (log, checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")


def _inside_a_job() -> bool:
    """This process is a rank of a job that torchrun or ``lioncub launch`` started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: argparse.Namespace) -> int:
    from lioncub.cli.auto import AUTO, check_candidates, resolve
    from lioncub.rundir import check_out_path
    from lioncub.train.config import check_auto, check_start
    from lioncub.train.driver import check_before_launch, check_launch_options, format_summary
    from lioncub.train.prepare import load_saved_config, prepare_run_dir
    from lioncub.train.runfiles import DEEPEST

    try:
        run_dir = check_out_path(args.out, below=len(DEEPEST))
        check_launch_options(args.restarts, args.collective_timeout, args.fault_tolerant)
        auto = args.variant == AUTO
        if auto:
            check_auto(vars(args), resume=args.resume, inside_job=_inside_a_job())
        base = load_saved_config(run_dir) if args.resume else None
        if base is not None:
            base.run.convert_momenta = base.run.stop_at = None  # asked for anew each time

        def config_of(name: str) -> Any:  # a run --variant auto may choose
            return config_for_name(args, name, f"--variant auto (it may choose {name})")

        config = check_candidates(config_of) if auto else config_from_args(args, base)
        check_start(config, resume=args.resume, inside_job=_inside_a_job())
        if _inside_a_job():
            from lioncub.train.rank import run_rank

            return run_rank(config, run_dir, driven=False, resume=args.resume)
        check_before_launch(config, args.timeout or None, args.max_nproc)
        if auto:
            config = resolve(args, config_of, "--variant auto", "lioncub train")
            if isinstance(config, int):
                return config
        config, lock = prepare_run_dir(run_dir, config, resume=args.resume)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"lioncub train: error: {exc}", file=sys.stderr)
        return 2
    outcome = train_run(args, config, run_dir, lock)
    if outcome.summary is None:
        print(
            f"lioncub train: failed (exit code {outcome.returncode}; the launcher said why above)",
            file=sys.stderr,
        )
        return outcome.returncode or 1
    from lioncub.report import text  # the summary in lines that fit the terminal (or COLUMNS, or 100)

    text.print_wrapped(text.console(sys.stdout), format_summary(outcome.summary))
    sys.stdout.flush()
    if config.cluster.fault_tolerant:
        print(f"log: {run_dir / 'log.jsonl'}  the groups' logs: {run_dir / 'groups'}")
    else:
        print(f"log: {run_dir / 'log.jsonl'}  checkpoints: {run_dir / 'checkpoints'}")
    return 0
