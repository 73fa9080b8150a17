"""What the ``lioncub train`` tests share: the tiny workload's options, a run in-process, its log records
and the bytes each variant sends per step (closed form in the parameter count)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lioncub import cli
from lioncub.optim.step_check import STEP_CHECK_WORDS

#: the tiny GPT, validated on 8 windows (its default: 128; an evaluation of 32 windows took 3x a step's CPU
#: on batches of 4): the checks compare runs of the same settings with each other, or count steps,
#: evaluations and bytes; no check depends on how many windows a loss averages
TINY = ["--workload", "gpt", "--size", "tiny", "--set", "eval_windows=8", "--no-progress"]


def train(out: Path, *extra: str) -> int:
    """``lioncub train`` on the tiny GPT into ``out``; its exit status."""
    return cli.main(["train", *TINY, "--out", str(out), *extra])


def records(run_dir: Path, kind: str) -> list[dict]:
    """The records of ``kind`` (``step``, ``eval``, ...) in ``run_dir/log.jsonl``, in order."""
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def expected_bytes(variant: str, d: int, n: int) -> float:
    """Bytes one rank sends per step (the optimizer's own formula, one bucket of d fp32 parameters)."""
    ring = 2 * (n - 1) / n
    if variant == "32bit":
        return ring * 4 * d
    if variant == "16bit":
        return ring * 2 * d
    return (n - 1) * 4 * STEP_CHECK_WORDS + vote_bytes(variant, d, n)  # LionCub: and the step check


def vote_bytes(variant: str, d: int, n: int) -> float:
    """Bytes one rank sends for the vote alone, one bucket of d parameters on n ranks."""
    ring = 2 * (n - 1) / n
    if variant == "1bit":
        return ring * math.ceil(d / (8 * n)) * 8 * n / 8
    if variant == "4bit":
        return ring * math.ceil(d / 2)
    if variant in ("8bit", "8bit-sign", "dlion-avg"):
        return ring * d
    assert variant == "dlion-mavo"  # rank 0 is the server: 2-bit results to the other n - 1 ranks
    return (n - 1) * math.ceil(d / 4)
