"""``lioncub report RUN_DIR``: a run's summary (speed, bytes, loss, fault-tolerance events:
:mod:`lioncub.report.summary`) and, when it logged them (``lioncub train --diagnostics-every K``), its vote
diagnostics as a table and plots (:mod:`lioncub.report.diagnostics`). The plots go into the run directory,
or ``--out DIR``:
a new or empty directory (then lioncub's, :mod:`lioncub.rundir`), or one lioncub made for plots or a run;
never over a file lioncub did not write. No torch is imported (``tests/test_layers.py`` runs it with torch
blocked)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `lioncub train --out` directory")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")


def check_paths(run_dir: Path, out: Path | None) -> None:
    """Refuse a RUN_DIR that is no directory and an --out that cannot hold the PNGs, before any work; a FIFO,
    socket or device where report reads (the log, the config, the record) too."""
    from lioncub.rundir import MARKER, refuse_special

    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR {run_dir}: not a directory (give a `lioncub train --out` directory)")
    for path in (run_dir / "log.jsonl", run_dir / "config.json"):
        refuse_special(path, follow_symlinks=True)
    refuse_special((out if out is not None else run_dir) / MARKER)
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


def _store(run_dir: Path, out: Path | None, plots: dict[str, bytes]) -> dict[str, Path]:
    """Write the PNGs into ``out`` -- a new or empty directory (marked as lioncub's plots), or one lioncub
    made for plots or a run -- or, without ``out``, into ``run_dir`` if lioncub made it; each file
    recorded as lioncub's, never over a file it did not write, under the directory's writer lock.
    ``ValueError`` naming the option otherwise."""
    # the files of an old plots or run directory, registered with lioncub.rundir when imported
    import lioncub.report.files
    import lioncub.train.runfiles  # noqa: F401
    from lioncub.rundir import claim, is_marked, lock_writer, write_owned

    target, option = (out, "--out") if out is not None else (run_dir, "RUN_DIR")
    if not (is_marked(target, "run") or is_marked(target, "plots")):
        if out is None:
            raise ValueError(
                f"RUN_DIR {run_dir}: lioncub did not mark it as a run directory (no .lioncub), so it writes "
                "nothing into it; pass --out DIR for the plots"
            )
        if target.is_dir() and any(target.iterdir()):
            raise ValueError(
                f"--out {target} holds files lioncub did not write; lioncub writes plots only into a new or "
                "empty directory, or one it made for plots or a run: choose another --out"
            )
    lock = lock_writer(target, option)
    try:
        if not is_marked(target, "run"):
            claim(target, "plots")
        for name, data in plots.items():
            write_owned(target, f"{name}.png", data)
    finally:
        lock.release()
    return {name: target / f"{name}.png" for name in plots}


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else None
    paths: dict[str, Path] = {}
    try:
        check_paths(run_dir, out)
        from lioncub.report import diagnostics as diag_report  # matplotlib: after the quick checks
        from lioncub.report import summary, text

        console = text.console()
        try:
            lines, unusable = summary.run_summary(run_dir), None
        except ValueError as exc:  # no config.json or no step: the diagnostics alone, if any
            lines, unusable = [], exc
        diags = diag_report.load_diagnostics(run_dir, required=False)
        if unusable is not None and not diags:
            raise unusable
        for line in lines:
            text.print_wrapped(console, line)
        if not diags:
            text.print_wrapped(
                console, "no vote diagnostics in its log (`lioncub train --diagnostics-every K` logs them)"
            )
            return 0
        diag_report.print_table(run_dir, console)
        with tempfile.TemporaryDirectory(prefix="lioncub-report-") as tmp:
            drawn = diag_report.write_plots(run_dir, Path(tmp))  # drawn apart, then stored as lioncub's
            paths = _store(run_dir, out, {name: path.read_bytes() for name, path in drawn.items()})
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
