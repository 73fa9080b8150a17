"""The files of a training run directory that :mod:`lioncub.rundir` needs by name, registered with it when
this module is imported (by :mod:`lioncub.train`); torch-free.

What a run directory of lioncub before the record held (a marker without a list) is adopted by exact name
(:func:`lioncub.rundir.register_legacy`): :data:`V1_RUN_FILES` and the checkpoints lioncub writes
(``checkpoints/latest``, ``step_NNNNNNNN/`` with its ``meta.json`` and the files it lists, an unfinished
``.tmp_step_NNNNNNNN/``), and only when its ``config.json`` parses as lioncub's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lioncub.rundir import Record, read_run_file, register_legacy, regular_file
from lioncub.rundir.files import file_sha256, real_dir

__all__ = ["DEEPEST", "NEXT_CONFIG", "V1_RUN_FILES", "meta_files"]

#: the longest path lioncub writes below a run directory: a rank's checkpoint file while it is written
DEEPEST = "/checkpoints/.tmp_step_00000000/rank99999.pt.sha256.part"
#: the configuration a resumed run trains with until it succeeds (then it becomes ``config.json``)
NEXT_CONFIG = "config.next.json"
#: what a run directory of lioncub before the record always held, with the plots ``lioncub report`` then
#: wrote into it (:mod:`lioncub.report.diagnostics`)
V1_RUN_FILES = (
    "config.json",
    "config.json.part",
    NEXT_CONFIG,
    NEXT_CONFIG + ".part",
    "log.jsonl",
    "log.jsonl.part",
    "summary.json",
    "diag_rates.png",
    "diag_momentum_std.png",
    "diag_update_shape.png",
)
_STEP = re.compile(r"step_\d{8}")
_TMP_STEP = re.compile(r"\.tmp_step_\d{8}")
_CHECKPOINT_FILE = re.compile(r"(model|rank\d+)\.pt")
_IN_STEP = re.compile(r"(shards/)?[^/]+")  # a checkpoint's file, or one torch.distributed.checkpoint wrote
_TMP_FILE = re.compile(r"((model|rank\d+)\.pt(\.sha256)?|meta\.json)(\.part)?")


def meta_files(step_dir: Path) -> list[str]:
    """The files a checkpoint's ``meta.json`` lists, in its directory or its ``shards/`` ([] if it cannot be
    read)."""
    try:
        names = json.loads(read_run_file(step_dir / "meta.json", follow_symlinks=True)).get("sha256", {})
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(names, dict):
        return []
    return [n for n in names if isinstance(n, str) and _IN_STEP.fullmatch(n) and ".." not in n]


def _lioncub_config(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a regular ``config.json`` that parses as one lioncub writes (validated as
    a :class:`~lioncub.train.config.TrainConfig`, which imports torch: only for a marker of before the
    record)."""
    path = run_dir / "config.json"
    if not regular_file(path):
        return False
    from lioncub.train.config import TrainConfig

    try:
        doc = json.loads(read_run_file(path, follow_symlinks=True))
        TrainConfig.from_json(doc)
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    return isinstance(doc, dict)


def _adopt_checkpoints(run_dir: Path, rec: Record) -> None:
    """Add ``config.json``'s SHA-256 and the checkpoints of an old run directory to ``rec``."""
    rec.files["config.json"] = [str(file_sha256(run_dir / "config.json"))]
    root = run_dir / "checkpoints"
    if not real_dir(root):
        return
    rec.dirs.add("checkpoints")
    rec.files.update({f"checkpoints/{n}": [] for n in ("latest", "latest.part") if regular_file(root / n)})
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        sub = Path(entry.path)
        if real_dir(sub) and _STEP.fullmatch(entry.name):
            names = ["meta.json", *(n for n in meta_files(sub) if _CHECKPOINT_FILE.fullmatch(n))]
        elif real_dir(sub) and _TMP_STEP.fullmatch(entry.name):
            names = [e.name for e in os.scandir(sub) if _TMP_FILE.fullmatch(e.name)]
        else:
            continue
        rec.dirs.add(f"checkpoints/{entry.name}")
        rec.files.update({f"checkpoints/{entry.name}/{n}": [] for n in names if regular_file(sub / n)})


register_legacy("run", V1_RUN_FILES, gate=_lioncub_config, extend=_adopt_checkpoints)
