"""Which directories lioncub may write into and delete: it never loses a user's file.

* A **run directory** (``lioncub train --out``, ``lioncub compare``'s ``OUT/<variant>``) holds only what a
  run writes, and the plots of ``lioncub report``: :data:`RUN_ENTRIES`.
* A **compare directory** (``lioncub compare --out``) holds its report (:data:`COMPARE_ENTRIES`) and one
  run directory per variant.

lioncub writes into a directory only if it is new, empty, or marked as lioncub's: the marker file
:data:`MARKER` (written when lioncub creates or claims the directory), or — for runs written before the
marker existed — a ``config.json`` that lioncub wrote. It deletes only what it wrote, only when asked
(``--overwrite``), and never a directory that holds anything else: :func:`foreign_entries` names what is
in the way and the caller refuses. :func:`check_out_path` refuses what can never be an output directory:
``''``, ``/``, the working directory itself, a file, a path under a file, a place it cannot write to.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

__all__ = [
    "COMPARE_ENTRIES",
    "MARKER",
    "RUN_ENTRIES",
    "check_out_path",
    "claim",
    "foreign_entries",
    "fsync_dir",
    "is_marked",
    "remove_owned",
    "write_atomically",
]

#: the marker file lioncub writes into every directory it creates or claims (JSON: ``{"kind": ...}``)
MARKER = ".lioncub"
#: the plots ``lioncub report RUN_DIR`` writes into a run directory
_DIAG_PLOTS = ("diag_rates.png", "diag_momentum_std.png", "diag_update_shape.png")
#: what a run writes into its directory (names or ``fnmatch`` patterns)
RUN_ENTRIES = (
    MARKER,
    "config.json",
    "config.json.part",
    "config.next.json",
    "log.jsonl",
    "log.jsonl.part",
    "summary.json",
    "checkpoints",
    *_DIAG_PLOTS,
)
#: what ``lioncub compare`` writes into its output directory, besides the runs (one per variant)
COMPARE_ENTRIES = (
    MARKER,
    "summary.md",
    "summary.json",
    "val_loss_vs_step.png",
    "val_loss_vs_time.png",
    "step_time_split.png",
    "bytes_per_step.png",
    "diagnostics_vs_step.png",
)

_KINDS = {"run": RUN_ENTRIES, "compare": COMPARE_ENTRIES}


def check_out_path(path: Path | str, option: str = "--out") -> Path:
    """``path`` as a :class:`Path` if it can be an output directory; else ``ValueError`` naming ``option``
    and why: empty, ``/``, the working directory, an existing file or a path under one, or no write
    permission where it would be created."""
    text = str(path)
    if not text.strip():
        raise ValueError(f"{option} {text!r}: give a directory name (an empty path is the working directory)")
    p = Path(text).expanduser()
    resolved = p.resolve()
    if resolved == Path(resolved.anchor):
        raise ValueError(f"{option} {text}: the file system root cannot be a run directory")
    if resolved == Path.cwd().resolve():
        raise ValueError(
            f"{option} {text}: the working directory itself cannot be a run directory; name a new one"
        )
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {text}: exists and is not a directory")
    existing = next((q for q in (p, *p.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise ValueError(f"{option} {text}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {text}: {existing} is not writable by this user")
    return p


def is_marked(path: Path, kind: str = "run") -> bool:
    """Whether ``path`` is a directory lioncub made for a ``kind`` ("run" or "compare")."""
    marker = path / MARKER
    if marker.is_file():
        try:
            return json.loads(marker.read_text()).get("kind") == kind
        except (OSError, ValueError, AttributeError):
            return False
    # written before the marker existed: a run's config.json, a compare report's summary.json
    name, keys = (
        ("config.json", {"workload", "size", "variant", "steps"})
        if kind == "run"
        else ("summary.json", {"title", "rows"})
    )
    try:
        doc = json.loads((path / name).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and keys <= set(doc)


def foreign_entries(path: Path, kind: str = "run", *, subruns: bool = False) -> list[str]:
    """Names in ``path`` that lioncub did not write (sorted; ``[]`` for a missing or empty directory):
    in a marked ``kind`` directory (:func:`is_marked`) what such a directory would not hold, in an unmarked
    one everything. With ``subruns`` (a compare directory), subdirectories that are marked run
    directories, or empty, are lioncub's too."""
    if not path.is_dir():
        return []
    patterns = _KINDS[kind] if is_marked(path, kind) else ()  # unmarked: a name alike is still the user's
    out = []
    for entry in sorted(path.iterdir(), key=lambda e: e.name):
        if any(fnmatch.fnmatchcase(entry.name, pat) for pat in patterns):
            continue
        if _is_run_subdir(entry, subruns):
            continue
        out.append(entry.name)
    return out


def _is_run_subdir(entry: Path, subruns: bool) -> bool:
    """A compare directory's variant run: a real subdirectory, marked as a run or empty."""
    if not (subruns and entry.is_dir() and not entry.is_symlink()):
        return False
    return is_marked(entry, "run") or not any(entry.iterdir())


def claim(path: Path, kind: str = "run") -> None:
    """Create ``path`` (with its parents) if needed and write the marker. The caller has checked that the
    directory is new, empty or already lioncub's."""
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"kind": kind, "by": "lioncub"}) + "\n")


def remove_owned(path: Path, kind: str = "run", *, subruns: bool = False, keep_dir: bool = False) -> None:
    """Delete what lioncub wrote in ``path`` (``--overwrite``), then ``path`` itself unless ``keep_dir``.
    Raises ``ValueError`` naming the entries lioncub did not write, and deletes nothing, if there are any
    (and, with ``subruns``, in any run subdirectory)."""
    if not path.exists():
        return
    foreign = foreign_entries(path, kind, subruns=subruns)
    runs = [
        e for e in path.iterdir() if subruns and e.is_dir() and not e.is_symlink() and e.name not in foreign
    ]
    for run in runs:
        foreign += [f"{run.name}/{name}" for name in foreign_entries(run, "run")]
    if foreign:
        raise ValueError(
            f"{path} holds files lioncub did not write: {', '.join(foreign[:8])}"
            + (" …" if len(foreign) > 8 else "")
            + "; lioncub deletes only its own files: move them, or choose another --out"
        )
    for run in runs:
        remove_owned(run, "run")
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not keep_dir:
        path.rmdir()


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | str) -> None:
    """Write ``data`` (``str``: as UTF-8) to ``path`` so that a reader, even after a crash, finds the old
    file or the whole new one: a ``.part`` file beside it, fsynced, renamed over ``path``, then the
    directory fsynced."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
