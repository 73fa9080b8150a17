"""The progress display of a run: follows rank 0's ``log.jsonl`` while the ranks train."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from lioncub.rundir import SpecialFileError, open_run_file

__all__ = ["Progress"]


class Progress(threading.Thread):
    """Follows ``log.jsonl`` and shows steps, rate, loss and ETA (a rich bar on a terminal, else a line
    every 10 %). Rate and ETA come from the log's own training times (``time_s``), not from when the log
    is read; no line is printed for what is read after the run ended, or after its last evaluation was
    logged (rank 0's final validation line and the run's summary come last)."""

    def __init__(self, log_path: Path, label: str, start: int, total: int, stream: TextIO) -> None:
        super().__init__(daemon=True)
        self.log_path, self.label, self.start_step, self.total = log_path, label, start, total
        self.stream = stream
        self.done = threading.Event()

    def run(self) -> None:
        """Follow the log until :attr:`done` is set."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
        from rich.progress import Progress as RichProgress

        console = Console(file=self.stream)
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "{task.fields[rate]}  loss {task.fields[loss]}  {task.fields[val]}  ETA {task.fields[eta]}"
            ),
        ]
        pos, t0 = 0, time.monotonic()
        first: tuple[int, float] | None = None  # (step, time_s) of the first step record read
        next_line, ended = self.start_step, False
        with RichProgress(*columns, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task(
                self.label, total=self.total, completed=self.start_step, rate="-", loss="-", val="", eta="-"
            )
            while True:
                finished = self.done.is_set()
                if self.log_path.exists():
                    try:
                        fd = open_run_file(self.log_path, follow_symlinks=True)
                    except SpecialFileError:  # put there meanwhile: rank 0 refuses it too
                        return
                    with open(fd) as f:
                        f.seek(pos)
                        chunk = f.read()
                    complete = chunk[: chunk.rfind("\n") + 1]
                    pos += len(complete.encode())
                    records = [r for r in map(_record, complete.splitlines()) if r is not None]
                    # rank 0 prints its final validation line once it has logged the last evaluation (or
                    # a time budget's stop): no progress line after it
                    ended = ended or any(self._ended(r) for r in records)
                    for rec in records:
                        if rec["step"] <= self.start_step:
                            continue
                        if rec["kind"] == "eval" and "val_loss" in rec:
                            bar.update(task, val=f"val {rec['val_loss']:.4f}")
                            continue
                        if rec["kind"] != "step":
                            continue
                        rate, eta = _rate_and_eta(first, rec, self.total)
                        first = first or (rec["step"], rec.get("time_s", 0.0))
                        bar.update(task, completed=rec["step"], rate=rate, loss=f"{rec['loss']:.4f}", eta=eta)
                        if not console.is_terminal and not (finished or ended) and rec["step"] >= next_line:
                            print(
                                f"[train] {self.label} step {rec['step']}/{self.total} "
                                f"loss {rec['loss']:.4f} {rate}, ETA {eta}, "
                                f"{time.monotonic() - t0:.0f} s so far",
                                file=self.stream,
                                flush=True,
                            )
                            next_line = rec["step"] + max(1, self.total // 10)
                if finished:
                    return
                self.done.wait(0.5)

    def _ended(self, rec: dict[str, Any]) -> bool:
        """``rec`` says the training has ended: the evaluation at the last step, or a ``stop`` record."""
        return rec["kind"] == "stop" or (rec["kind"] == "eval" and rec["step"] >= self.total)


def _record(line: str) -> dict[str, Any] | None:
    """A log line as a record with a step number; None for anything else (a line a crash cut short, which
    the resumed run cuts off the log)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "kind" in rec else None


def _rate_and_eta(first: tuple[int, float] | None, rec: dict[str, Any], total: int) -> tuple[str, str]:
    """``("12.3 steps/s", "40 s")`` from the log's training time between the first step record seen and
    ``rec`` (``"-"`` until two steps are known)."""
    if first is None or rec["step"] <= first[0] or rec.get("time_s", 0.0) <= first[1]:
        return "-", "-"
    rate = (rec["step"] - first[0]) / (rec["time_s"] - first[1])
    return f"{rate:.2f} steps/s", f"{(total - rec['step']) / rate:.0f} s"
