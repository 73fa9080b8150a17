"""Checkpoints of a data-parallel run whose ranks each keep their own optimizer state.

Layout under the run directory::

    checkpoints/step_00000200/meta.json     version, step, variant, world size, workload, seed
                             /model.pt      the model once (rank 0; replicas are identical)
                             /rank0.pt ...  per rank: optimizer state (own momentum, step counter and
                                            so the 1-bit tie-rule phase), RNG states, data position
    checkpoints/latest                      name of the newest complete checkpoint

A checkpoint is written into ``.tmp_step_...`` by all ranks and renamed into place by rank 0 only when
every rank's file is there, so a crash mid-write never leaves a checkpoint that looks complete; older
checkpoints than the newest ``keep`` are removed.

Resuming checks the variant and the world size. Another variant is always refused; another world size
is refused unless ``convert_momenta="average"``: every new rank then starts from the mean of the saved
ranks' momenta (for ``LionCub`` the momenta differ per rank; for the DDP baselines they are identical, so
the mean is exact), and its data order starts afresh at the saved step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CONVERSIONS",
    "VERSION",
    "CheckpointMeta",
    "check_compatible",
    "latest",
    "load_rank_state",
    "model_state",
    "restore_rng",
    "save",
]

VERSION = 1
CONVERSIONS = ("average",)


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
    _atomic_torch_save(state, tmp / f"rank{rank}.pt")
    if rank == 0:
        _atomic_torch_save(getattr(model, "module", model).state_dict(), tmp / "model.pt")
    barrier()
    if rank == 0:
        missing = [r for r in range(world_size) if not (tmp / f"rank{r}.pt").exists()]
        if missing:
            raise RuntimeError(f"checkpoint {tmp}: ranks {missing} wrote no state")
        doc = {"version": VERSION, "step": step, "world_size": world_size, **meta}
        (tmp / "meta.json").write_text(json.dumps(doc, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.part"
        pointer.write_text(name + "\n")
        os.replace(pointer, root / "latest")
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
        return torch.load(meta.path / f"rank{rank}.pt", weights_only=False)
    states = [torch.load(meta.path / f"rank{r}.pt", weights_only=False) for r in range(meta.world_size)]
    base = states[0]
    for index, param_state in base["optimizer"]["state"].items():
        if "exp_avg" in param_state:
            stacked = torch.stack([s["optimizer"]["state"][index]["exp_avg"] for s in states])
            param_state["exp_avg"] = stacked.mean(dim=0, dtype=torch.float64).to(param_state["exp_avg"].dtype)
    base["converted_from"] = meta.world_size
    return base


def model_state(meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The saved model weights."""
    return torch.load(meta.path / "model.pt", weights_only=True)


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states saved with this rank's state."""
    _set_rng_state(state["rng"])
