"""``lioncub report RUN_DIR``: the vote diagnostics of a run (``lioncub train --diagnostics-every K``) as a
table and plots (:mod:`lioncub.report.diagnostics`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `lioncub train --out` directory")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")


def check_paths(run_dir: Path, out: Path | None) -> None:
    """Refuse a RUN_DIR that is no directory and an --out that cannot hold the PNGs, before any work."""
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR {run_dir}: not a directory (give a `lioncub train --out` directory)")
    log = run_dir / "log.jsonl"
    if log.is_file() and not os.access(log, os.R_OK):
        raise ValueError(f"RUN_DIR {run_dir}: {log} is not readable")
    target = out if out is not None else run_dir
    option = "--out" if out is not None else "RUN_DIR"
    existing = next((p for p in (target, *target.parents) if p.exists()), None)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{option} {target}: exists and is not a directory")
    if existing is None or not existing.is_dir():
        raise ValueError(f"{option} {target}: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{option} {target}: {existing} is not writable")


def run(args: argparse.Namespace) -> int:
    from lioncub.report import diagnostics as diag_report

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else None
    try:
        check_paths(run_dir, out)
        diag_report.print_table(run_dir)
        paths = diag_report.write_plots(run_dir, out)
    except json.JSONDecodeError as exc:
        print(
            f"lioncub report: error: RUN_DIR {run_dir}: a line of log.jsonl is not JSON: {exc}",
            file=sys.stderr,
        )
        return 2
    except (KeyError, TypeError) as exc:
        print(
            f"lioncub report: error: RUN_DIR {run_dir}: a diagnostics record lacks {exc} "
            "(was log.jsonl written by `lioncub train --diagnostics-every`?)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as exc:
        print(f"lioncub report: error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"plot {name}: {path}")
    return 0
