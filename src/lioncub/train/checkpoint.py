"""Checkpoints of a data-parallel run whose ranks each keep their own optimizer state.

Layout under the run directory::

    checkpoints/step_00000200/meta.json     version, step, variant, world size, workload, seed
                             /model.pt      the model once (rank 0; replicas are identical)
                             /rank0.pt ...  per rank: optimizer state (own momentum, step counter and
                                            so the 1-bit tie-rule phase), RNG states, data position
    checkpoints/latest                      name of the newest complete checkpoint

A checkpoint is written into ``.tmp_step_...`` by all ranks (each file: temporary name, fsync, rename)
and renamed into place by rank 0 only when every rank's file is there; ``latest`` then moves to it (again
written, fsynced and renamed), and only after that are checkpoints older than the newest ``keep``
removed, so a crash at any point leaves the previous checkpoint intact and never one that looks complete.
``meta.json`` records the format version and the SHA-256 of every file; loading verifies the hash before
it unpickles anything and loads with ``torch.load(weights_only=True)`` (tensors and plain containers only),
so a truncated or corrupted file raises :class:`CorruptCheckpointError` (naming the file and the
previous checkpoint) and never leaves a half-loaded state.

Resuming checks the variant and the world size. Another variant is always refused; another world size
is refused unless ``convert_momenta="average"``: every new rank then starts from the mean of the saved
ranks' momenta (for ``LionCub`` the momenta differ per rank; for the DDP baselines they are identical, so
the mean is exact), and its data order starts afresh at the saved step.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lioncub.train.rundir import fsync_dir, write_atomically

__all__ = [
    "CONVERSIONS",
    "VERSION",
    "CheckpointMeta",
    "CorruptCheckpointError",
    "check_compatible",
    "latest",
    "load_rank_state",
    "model_state",
    "restore_rng",
    "save",
]

VERSION = 2  # 2: SHA-256 of every file in meta.json, numpy RNG state as tensors (weights_only loading)
CONVERSIONS = ("average",)


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or altered (its SHA-256 is not the one recorded)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``meta.json`` records about a checkpoint."""

    path: Path
    step: int
    variant: str
    world_size: int
    workload: str
    size: str
    seed: int
    sha256: dict[str, str] = field(default_factory=dict, repr=False)  # file name -> SHA-256 (hex)


def _rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> str:
    """``torch.save`` ``obj`` atomically to ``path``; returns the SHA-256 (hex) of the bytes written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    write_atomically(path, data)
    return hashlib.sha256(data).hexdigest()


def _verified_load(meta: CheckpointMeta, name: str) -> Any:
    """``torch.load(weights_only=True)`` of ``meta.path / name`` after checking its SHA-256."""
    path = meta.path / name
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CorruptCheckpointError(
            f"checkpoint {meta.path}: cannot read {name} ({err}){_previous(meta)}"
        ) from None
    want = meta.sha256.get(name)
    got = hashlib.sha256(data).hexdigest()
    if want is None or got != want:
        raise CorruptCheckpointError(
            f"checkpoint {meta.path}: {name} is truncated or corrupted ({len(data)} bytes, SHA-256 "
            f"{got[:12]}… but meta.json records {str(want)[:12]}…); nothing was loaded{_previous(meta)}"
        )
    return torch.load(io.BytesIO(data), weights_only=True)


def _previous(meta: CheckpointMeta) -> str:
    older = sorted(p.name for p in meta.path.parent.glob("step_*") if p.is_dir() and p.name < meta.path.name)
    if not older:
        return ""
    return (
        f". The previous checkpoint {older[-1]} is intact if its files verify: write its name into "
        f"{meta.path.parent / 'latest'} to resume from it"
    )


def save(
    run_dir: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_state: dict[str, Any],
    meta: dict[str, Any],
    barrier: Callable[[], None],
    keep: int = 2,
) -> Path:
    """Write this rank's part of the checkpoint of ``step`` (collective: every rank calls it).

    ``meta`` must hold ``variant``, ``workload``, ``size`` and ``seed``; ``barrier`` synchronises the
    ranks (e.g. ``torch.distributed.barrier``). Returns the final checkpoint directory.
    """
    root = run_dir / "checkpoints"
    name = f"step_{step:08d}"
    tmp, final = root / f".tmp_{name}", root / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    state = {"optimizer": optimizer.state_dict(), "rng": _rng_state(), "data": data_state, "rank": rank}
    digest = _atomic_torch_save(state, tmp / f"rank{rank}.pt")
    write_atomically(tmp / f"rank{rank}.pt.sha256", digest.encode())
    if rank == 0:
        digest = _atomic_torch_save(getattr(model, "module", model).state_dict(), tmp / "model.pt")
        write_atomically(tmp / "model.pt.sha256", digest.encode())
    barrier()
    if rank == 0:
        missing = [r for r in range(world_size) if not (tmp / f"rank{r}.pt.sha256").exists()]
        if missing:
            raise RuntimeError(f"checkpoint {tmp}: ranks {missing} wrote no state")
        hashes = {}
        for side in sorted(tmp.glob("*.sha256")):
            hashes[side.name.removesuffix(".sha256")] = side.read_text().strip()
            side.unlink()
        doc = {"version": VERSION, "step": step, "world_size": world_size, **meta, "sha256": hashes}
        write_atomically(tmp / "meta.json", (json.dumps(doc, indent=1) + "\n").encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        write_atomically(root / "latest", (name + "\n").encode())
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def latest(run_dir: Path) -> CheckpointMeta | None:
    """The newest complete checkpoint of ``run_dir`` (None if there is none)."""
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    try:
        doc = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"checkpoint {path} is unreadable ({err}); remove {pointer} to start afresh"
        ) from err
    if doc.get("version") != VERSION:
        raise ValueError(f"checkpoint {path} has version {doc.get('version')}, this lioncub reads {VERSION}")
    return CheckpointMeta(
        path,
        int(doc["step"]),
        doc["variant"],
        int(doc["world_size"]),
        doc["workload"],
        doc["size"],
        doc["seed"],
        dict(doc["sha256"]),
    )


def check_compatible(
    meta: CheckpointMeta,
    *,
    variant: str,
    world_size: int,
    workload: str,
    size: str,
    seed: int,
    convert_momenta: str | None,
) -> None:
    """Raise ``ValueError`` (naming the option to change) unless the run can resume from ``meta``."""
    if convert_momenta is not None and convert_momenta not in CONVERSIONS:
        raise ValueError(f"--convert-momenta {convert_momenta!r}: allowed values are {list(CONVERSIONS)}")
    if (workload, size, seed) != (meta.workload, meta.size, meta.seed):
        raise ValueError(
            f"checkpoint {meta.path} is of --workload {meta.workload} --size {meta.size} --seed {meta.seed}; "
            f"this run is --workload {workload} --size {size} --seed {seed}"
        )
    if variant != meta.variant:
        raise ValueError(
            f"checkpoint {meta.path} was written by --variant {meta.variant}; this run is "
            f"--variant {variant}. Momenta of one variant do not carry over to another: resume with "
            "the same variant"
        )
    if world_size != meta.world_size and convert_momenta is None:
        raise ValueError(
            f"checkpoint {meta.path} was written by {meta.world_size} ranks; this run has {world_size}. "
            "Every rank's momentum is its own: resume with --nproc "
            f"{meta.world_size}, or pass --convert-momenta average to start every rank from their mean"
        )


def load_rank_state(meta: CheckpointMeta, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's saved state; with another world size, the mean of all saved momenta (see module doc)."""
    if world_size == meta.world_size:
        return _verified_load(meta, f"rank{rank}.pt")
    states = [_verified_load(meta, f"rank{r}.pt") for r in range(meta.world_size)]
    base = states[0]
    for index, param_state in base["optimizer"]["state"].items():
        if "exp_avg" in param_state:
            stacked = torch.stack([s["optimizer"]["state"][index]["exp_avg"] for s in states])
            param_state["exp_avg"] = stacked.mean(dim=0, dtype=torch.float64).to(param_state["exp_avg"].dtype)
    base["converted_from"] = meta.world_size
    return base


def model_state(meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The saved model weights."""
    return _verified_load(meta, "model.pt")


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states saved with this rank's state."""
    _set_rng_state(state["rng"])
