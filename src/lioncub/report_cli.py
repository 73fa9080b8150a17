"""``lioncub report RUN_DIR``: the vote diagnostics of a run (``lioncub train --diagnostics-every K``) as a
table and plots (:mod:`lioncub.train.diag_report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `lioncub train --out` directory")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")


def run(args: argparse.Namespace) -> int:
    from lioncub.train import diag_report

    try:
        diag_report.print_table(Path(args.run_dir))
        paths = diag_report.write_plots(Path(args.run_dir), Path(args.out) if args.out else None)
    except ValueError as exc:
        print(f"lioncub report: error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"plot {name}: {path}")
    return 0
