"""The driver of a training run: the checks made before anything is written or launched, the run directory
(``config.json``, ``log.jsonl``, ``summary.json``, ``checkpoints/``), the launch of the ranks of
:mod:`lioncub.train.rank` with a progress display (:mod:`lioncub.train.progress`), and the summary line.

``lioncub train`` and ``lioncub compare`` are thin command lines over this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lioncub._validate import is_int, is_number
from lioncub.train.config import TrainConfig, format_overrides
from lioncub.train.progress import Progress
from lioncub.train.rundir import (
    check_out_path,
    claim,
    foreign_entries,
    is_marked,
    remove_owned,
    write_atomically,
)

__all__ = [
    "RANK_MODULE",
    "RunOutcome",
    "check_before_launch",
    "check_launch_options",
    "check_resume",
    "estimate_params",
    "format_summary",
    "make_launch_config",
    "max_ranks",
    "prepare_run_dir",
    "run_training",
    "write_config",
]

#: what every rank runs: ``python -m lioncub.train.rank RUN_DIR [CONFIG]``
RANK_MODULE = "lioncub.train.rank"


def check_launch_options(restarts: int, collective_timeout_s: float) -> None:
    """``ValueError`` naming ``--restarts`` / ``--collective-timeout`` if out of range."""
    if not (isinstance(restarts, int) and restarts >= 0):
        raise ValueError(f"--restarts {restarts!r} must be an integer >= 0")
    if not (collective_timeout_s > 0 and math.isfinite(collective_timeout_s)):
        raise ValueError(f"--collective-timeout {collective_timeout_s!r} must be a number of seconds > 0")


#: memory one rank needs besides its model: torch, gloo, the data (measured: ~0.4 GiB for the tiny GPT)
RANK_BASE_BYTES = 600 * 2**20
#: bytes per model parameter on a rank: weights, gradient, momentum, DDP's bucket, vote buffers (fp32)
RANK_BYTES_PER_PARAM = 24


def estimate_params(workload: str, values: dict[str, Any]) -> int:
    """A rough parameter count of a workload with these field ``values`` (the GPT's blocks, embeddings and
    head; 0 for the CNN, whose size the rank base covers)."""
    if workload != "gpt":
        return 0
    d, layers = values["n_embd"], values["n_layer"]
    vocab = 50257 if values["tokenizer"] == "gpt2" else 256
    return 12 * layers * d * d + (1 if values["tie_embeddings"] else 2) * vocab * d + values["block_size"] * d


def max_ranks(rank_bytes: int) -> int:
    """How many ranks of ``rank_bytes`` fit in 80 % of this machine's available memory (at least 1)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, int(0.8 * available) // rank_bytes)


def check_before_launch(config: TrainConfig, timeout_s: float | None, max_nproc: int | None = None) -> None:
    """Refuse, naming the option, what :class:`~lioncub.train.config.TrainConfig` lets through and the ranks
    would only find after the launch: the link rate and the privileges ``--link`` needs, ``--nproc`` beyond
    what the machine's memory holds (``max_nproc`` overrides the bound from :func:`max_ranks`) or under
    ``--link``, ``--timeout``, ``--bucket-mb``, ``--sync-every``, ``--diagnostics-every``, an empty
    ``--momentum-sync``, ``--warmup`` beyond ``--steps``, ``--seed``, the ``--set`` values and the workload's
    data (files, optional packages, sizes)."""
    from lioncub.launch import PrivilegeError, check_privileges
    from lioncub.train.workloads import check_workload

    make_launch_config(config, ["-m", RANK_MODULE], timeout_s)  # validates the launch options
    run, opt, cluster = config.run, config.optimizer, config.cluster
    if cluster.link not in (None, "loopback"):
        try:
            check_privileges()
        except PrivilegeError as exc:
            raise ValueError(f"--link {cluster.link}: {exc}") from None
    if max_nproc is not None and not is_int(max_nproc, 1):
        raise ValueError(f"--max-nproc {max_nproc!r} must be an integer >= 1")
    bucket = opt.bucket_mb
    if not is_number(bucket, gt=0):
        raise ValueError(f"--bucket-mb {bucket!r} must be a finite number of MiB > 0 (default 25)")
    for option, value, low in (
        ("--sync-every", opt.sync_every, 1),
        ("--diagnostics-every", opt.diagnostics_every, 0),
        ("--seed", run.seed, 0),
    ):
        if not is_int(value, low):
            raise ValueError(f"{option} {value!r} must be an integer >= {low}")
    if not opt.momentum_sync:
        raise ValueError(
            f"--momentum-sync {opt.momentum_sync!r}: give none, all, io or comma-separated parameter-name "
            "patterns / param-group names"
        )
    if run.warmup_steps is not None and run.warmup_steps > run.steps:
        raise ValueError(
            f"--warmup {run.warmup_steps} must be at most --steps {run.steps} (the lr would never "
            "reach its peak)"
        )
    try:
        values = check_workload(run.workload, run.size, run.overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"--set {format_overrides(run.overrides)}: {exc}" if run.overrides else str(exc)
        ) from None
    except OSError as exc:
        raise ValueError(f"--workload {run.workload} --size {run.size}: {exc}") from None
    rank_bytes = RANK_BASE_BYTES + RANK_BYTES_PER_PARAM * estimate_params(run.workload, values)
    limit = max_nproc if max_nproc is not None else max_ranks(rank_bytes)
    if cluster.nproc > limit:
        why = (
            f"above --max-nproc {max_nproc}"
            if max_nproc is not None
            else f"this machine's available memory holds about {limit} ranks of "
            f"~{rank_bytes / 2**30:.2f} GiB ({run.workload}/{run.size})"
        )
        raise ValueError(
            f"--nproc {cluster.nproc}: {why}; more would make the kernel kill processes (perhaps not ours). "
            "Pass --max-nproc N to allow N ranks on purpose"
        )


def make_launch_config(
    config: TrainConfig,
    cmd: list[str],
    timeout_s: float | None,
    *,
    restarts: int = 0,
    env: dict[str, str] | None = None,
) -> Any:
    """The :class:`~lioncub.launch.LaunchConfig` that runs ``cmd`` on the ranks of ``config.cluster``:
    ``nproc`` ranks, or ``nnodes`` emulated nodes of ``nproc_per_node`` ranks (``ValueError`` naming the
    option if invalid)."""
    from lioncub.launch import LaunchConfig
    from lioncub.units import parse_rate

    rate = None if config.cluster.link in (None, "loopback") else parse_rate(config.cluster.link)
    intra = (
        None if config.cluster.intra_link is None else parse_rate(config.cluster.intra_link, "--intra-link")
    )
    layout: dict[str, Any] = {"nproc": config.cluster.nproc}
    if config.cluster.nnodes is not None:
        layout = {
            "nnodes": config.cluster.nnodes,
            "nproc_per_node": config.cluster.nproc_per_node,
            "intra_link_rate_bps": intra,
        }
    return LaunchConfig(
        cmd, link_rate_bps=rate, timeout_s=timeout_s, restarts=restarts, env=dict(env or {}), **layout
    )


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class RunOutcome:
    """How a training run ended: the launcher's exit code and rank 0's summary (None if it failed)."""

    returncode: int
    message: str
    summary: dict[str, Any] | None


#: what a resumed run keeps from the run it continues, besides what its checkpoint records and
#: :func:`lioncub.train.checkpoint.check_compatible` checks (workload, size, seed, variant, ranks)
FROZEN_ON_RESUME = ("data_mode", "overrides", "quantizer")
#: the configuration a resumed run trains with until it succeeds (then it becomes ``config.json``)
NEXT_CONFIG = "config.next.json"


def check_resume(saved: TrainConfig, config: TrainConfig, run_dir: Path) -> None:
    """``ValueError`` naming the option if ``config`` changes what a resumed run must keep
    (:data:`FROZEN_ON_RESUME`) from ``saved``, the configuration in ``run_dir``."""
    saved_doc, doc = saved.to_json(), config.to_json()
    for name in FROZEN_ON_RESUME:
        old, new = saved_doc[name], doc[name]
        if old == new:
            continue
        if name == "overrides":
            keys = sorted(k for k in {*old, *new} if old.get(k, "(default)") != new.get(k, "(default)"))
            asked = " ".join(f"{k}={new[k]!r}" if k in new else f"{k} (its default)" for k in keys)
            was = " ".join(f"{k}={old[k]!r}" if k in old else f"{k} at its default" for k in keys)
            raise ValueError(
                f"--resume: --set {asked}: the run in {run_dir} has {was}; a resumed run keeps its workload "
                "fields (start a new --out to change them)"
            )
        option = {"data_mode": "--data-mode"}.get(name, f"--{name}")
        raise ValueError(
            f"--resume: {option} {new!r}: the run in {run_dir} has {option} {old!r}; a resumed run keeps it "
            "(start a new --out to change it)"
        )


def prepare_run_dir(run_dir: Path, config: TrainConfig, *, resume: bool) -> TrainConfig:
    """Check that ``run_dir`` may hold this run (:mod:`lioncub.train.rundir`) and, for a new run, create it
    with ``config.json``; for ``resume``, check it can continue and write the new configuration to
    :data:`NEXT_CONFIG` (it replaces ``config.json`` once the run succeeds, so a failed resume leaves the
    run as it was). Returns the config to run. Raises ``ValueError`` naming the option to change; nothing
    is written before every check has passed."""
    from lioncub.train import checkpoint

    check_out_path(run_dir)
    saved_path = run_dir / "config.json"
    if resume:
        if not saved_path.exists() or not is_marked(run_dir):
            raise ValueError(f"--resume: {run_dir} holds no lioncub run (no config.json written by lioncub)")
        meta = checkpoint.latest(run_dir)
        if meta is None:
            raise ValueError(
                f"--resume: {run_dir} has no complete checkpoint to resume from (delete the directory to "
                "start afresh)"
            )
        check_resume(TrainConfig.from_json(json.loads(saved_path.read_text())), config, run_dir)
        checkpoint.check_compatible(
            meta,
            variant=config.optimizer.variant,
            world_size=config.cluster.nproc,
            workload=config.run.workload,
            size=config.run.size,
            seed=config.run.seed,
            convert_momenta=config.run.convert_momenta,
        )
        if config.run.stop_at is not None and config.run.stop_at <= meta.step:
            raise ValueError(f"--stop-at {config.run.stop_at}: the checkpoint is already at step {meta.step}")
        if meta.step >= config.run.steps:
            raise ValueError(
                f"--resume: the checkpoint is at step {meta.step}; pass --steps above it to go on"
            )
        write_config(run_dir / NEXT_CONFIG, config)
        return config
    if config.run.convert_momenta is not None:
        raise ValueError(
            f"--convert-momenta {config.run.convert_momenta}: applies only with --resume (a new run has no "
            "momenta to convert)"
        )
    if is_marked(run_dir) and saved_path.exists():
        raise ValueError(
            f"--out {run_dir} already holds a run; pass --resume to continue it, or choose another --out"
        )
    foreign = foreign_entries(run_dir)
    if foreign:
        raise ValueError(
            f"--out {run_dir} holds files lioncub did not write ({', '.join(foreign[:5])}"
            + (" …" if len(foreign) > 5 else "")
            + "); give a new or empty directory"
        )
    claim(run_dir)
    write_config(saved_path, config)
    return config


def write_config(path: Path, config: TrainConfig) -> None:
    """Write ``config`` to ``path`` as ``config.json`` (atomically)."""
    write_atomically(path, json.dumps(config.to_json(), indent=1) + "\n")


def run_training(
    config: TrainConfig,
    run_dir: Path,
    *,
    timeout_s: float | None = 7200.0,
    progress: bool = True,
    label: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    restarts: int = 0,
    collective_timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> RunOutcome:
    """Launch the ranks of :mod:`lioncub.train.rank` on ``run_dir`` (already prepared); a
    restart (``restarts``) reruns every rank, which resumes from the last checkpoint. ``env`` is added to
    the ranks' environment."""
    check_launch_options(restarts, collective_timeout_s)
    from lioncub.launch import launch
    from lioncub.train import checkpoint

    err = err or sys.stderr
    meta = checkpoint.latest(run_dir)
    start = meta.step if meta is not None else 0
    next_config = run_dir / NEXT_CONFIG  # a resume: its configuration becomes config.json on success
    cmd = [sys.executable, "-m", RANK_MODULE, str(run_dir)]
    if next_config.exists():
        cmd.append(str(next_config))
    bar = None
    if progress:
        bar = Progress(run_dir / "log.jsonl", label or config.optimizer.variant, start, config.run.steps, err)
        bar.start()
    try:
        rank_env = {"LIONCUB_PG_TIMEOUT": f"{collective_timeout_s:g}", **(env or {})}
        launch_config = make_launch_config(config, cmd, timeout_s, restarts=restarts, env=rank_env)
        result = launch(launch_config, out=out, err=err)
    finally:
        if bar is not None:
            bar.done.set()
            bar.join(timeout=5)
    if next_config.exists():
        if result.ok:
            os.replace(next_config, run_dir / "config.json")
        else:
            next_config.unlink()  # the run goes on from its previous configuration and checkpoints
    elif not result.ok and checkpoint.latest(run_dir) is None:
        with contextlib.suppress(ValueError):  # files of the user's appeared meanwhile: leave it all
            remove_owned(run_dir, keep_dir=True)  # a new run that left nothing to resume: rerun it as it was
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if result.ok and summary_path.exists() else None
    return RunOutcome(result.returncode, result.message, summary)


def format_summary(summary: dict[str, Any]) -> str:
    """One paragraph: step time and its split, bytes per step, final validation metrics."""

    def ms(key: str) -> str:
        value = summary.get(key)
        return "-" if value is None else f"{value * 1e3:.1f} ms"

    final = summary.get("final") or {}
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in final.items() if k.startswith("val_"))
    cfg = summary["config"]
    where = f"{summary['world_size']} rank(s), {cfg['link']}"
    if cfg.get("nnodes"):
        inside = f", {cfg['intra_link']} inside a node" if cfg.get("intra_link") else ""
        per_node = summary["world_size"] // cfg["nnodes"]
        where = f"{cfg['nnodes']} nodes × {per_node} ranks, {cfg['link']} NICs{inside}"
    return (
        f"{cfg['workload']}/{cfg['size']} {cfg['variant']}"
        f"{'@' + cfg['topology'] if cfg.get('topology', 'flat') != 'flat' else ''}"
        f"{'+overlap' if cfg.get('overlap') else ''} on "
        f"{where}: "
        f"{summary['steps_run']} steps, median step {ms('median_step_s')} (compute {ms('median_compute_s')}, "
        f"communication {ms('median_comm_s')}, apply {ms('median_apply_s')}), "
        f"{(summary.get('median_bytes_sent') or 0) / 1e6:.3f} MB sent per rank per step"
        + (f"; at step {final.get('step')}: {metrics}" if metrics else "")
    )
