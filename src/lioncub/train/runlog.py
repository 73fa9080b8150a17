"""``log.jsonl``, the record-per-line log of a run that rank 0 appends to: a record is written whole by one
``write`` of its line (:func:`append_record`); a crash or a full disk can still cut the last line short,
and a resumed run cuts the log back to its last whole record and says so (:func:`truncate_log`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lioncub.rundir import read_run_file, write_atomically

__all__ = ["append_record", "complete_records", "elapsed_at", "truncate_log"]


def append_record(out: int, rec: dict[str, Any]) -> None:
    """Append ``rec`` as one line to the log open as ``out`` (a descriptor opened for appending)."""
    data = (json.dumps(rec) + "\n").encode()
    while data:
        data = data[os.write(out, data) :]


def complete_records(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], int | None]:
    """The records of the JSONL log ``path`` up to the first line that is not a whole JSON record, and
    that line's number (None if every line is whole: a crash or a full disk can cut the last one short)."""
    lines = read_run_file(path, follow_symlinks=True).split(b"\n")
    out: list[tuple[bytes, dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            return out, number
        if number == len(lines) or not isinstance(rec, dict):  # no newline after it: cut short
            return out, number
        out.append((line, rec))
    return out, None


def truncate_log(path: Path, step: int, log: Callable[[str], None] = print) -> None:
    """Keep the records of steps ≤ ``step`` (a resumed run rewrites what came after its checkpoint); a log
    that ends mid-record is cut back to its last whole record, and ``log`` says so."""
    if not os.path.lexists(path):
        return
    records, cut = complete_records(path)
    if cut is not None:
        log(
            f"{path}: line {cut} is not a whole record (the run stopped while writing it: a crash or a full "
            "disk); the log is cut back to the last whole record before it"
        )
    kept = [line for line, rec in records if isinstance(rec.get("step"), int) and rec["step"] <= step]
    write_atomically(path, b"".join(line + b"\n" for line in kept))


def elapsed_at(path: Path, step: int) -> float:
    """The training time (``time_s``) the log records up to a resume at ``step`` (0 for a new run)."""
    if not path.exists() or not step:
        return 0.0
    times = [rec.get("time_s", 0.0) for _, rec in complete_records(path)[0]]
    return max((t for t in times if isinstance(t, (int, float))), default=0.0)
