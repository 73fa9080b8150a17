"""``lioncub train``: train a workload with one variant on N ranks, optionally behind shaped links.

The driver writes ``RUN_DIR/config.json``, starts the ranks with ``lioncub launch`` (each runs
:mod:`lioncub.train.loop`), shows a progress bar fed by rank 0's ``log.jsonl`` and prints a summary.
Inside a job started by ``torchrun`` (``RANK`` set) it trains as that rank instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

EPILOG = """\
examples:
  lioncub train --workload gpt --size small --variant 8bit --nproc 4 --link 1gbit --steps 500 --out runs/g8
  lioncub train --out runs/g8 --resume --steps 800        # continue (and extend) a run
  torchrun --nproc-per-node 4 -m lioncub.cli train --workload gpt --size small --variant 1bit --out runs/x

Variants: 32bit (DDP + Lion), 16bit (DDP, bf16/fp16 gradients + Lion), and the LionCub presets 1bit, 4bit,
8bit, 8bit-sign, dlion-mavo, dlion-avg. Workload fields can be changed with --set, e.g. --set batch_size=8.
"""

#: options whose name differs from their TrainConfig field (the others are spelt alike)
OPTION_OF_FIELD = {"warmup_steps": "warmup"}


def add_run_arguments(parser: argparse.ArgumentParser, *, variant: bool = True) -> None:
    """Options shared by ``train`` and ``compare`` (all default to None: see :func:`config_from_args`)."""
    from lioncub.train.workloads import workload_names

    names = workload_names()
    parser.add_argument("--workload", choices=sorted(names), help="gpt (default) or cnn")
    parser.add_argument("--size", help=f"model/data size (default tiny): {names}")
    if variant:
        parser.add_argument("--variant", help="optimizer variant (default 8bit), see below")
    parser.add_argument("--nproc", type=int, metavar="N", help="ranks (default 1)")
    parser.add_argument("--link", metavar="RATE", help="shape every rank's link, e.g. 1gbit (root)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    parser.add_argument(
        "--warmup", type=int, metavar="STEPS", help="lr warm-up (default 10%% of steps, ≤ 100)"
    )
    parser.add_argument(
        "--min-lr-ratio", type=float, help="end of the cosine, fraction of peak (default 0.1)"
    )
    parser.add_argument("--eval-every", type=int, metavar="STEPS", help="validation interval (default 50)")
    parser.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="default 0: at the end only")
    parser.add_argument("--seed", type=int, help="model init and data order (default 0)")
    parser.add_argument("--data-mode", choices=["random", "shard"], help="per-rank data (default random)")
    parser.add_argument("--bucket-mb", type=float, help="LionCub bucket size in MiB (default 25)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto")
    parser.add_argument(
        "--momentum-sync",
        type=_sync_spec,
        metavar="WHICH",
        help="average momenta over the ranks: none (default), all, io, or comma-separated name patterns",
    )
    parser.add_argument("--sync-every", type=int, metavar="STEPS", help="momentum sync interval (default 10)")
    parser.add_argument("--quantizer", help="with --variant 8bit: l1 (default), l0, linf, lp, qsgd or log")
    parser.add_argument(
        "--diagnostics-every",
        type=int,
        metavar="STEPS",
        help="vote diagnostics (match/flip, ties, momentum spread, update shape) every STEPS (0: off)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="change a workload field"
    )
    parser.add_argument(
        "--nonfinite",
        choices=["skip", "raise"],
        help="NaN/Inf gradients on any rank: skip the step on every rank (default) or stop with an error",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        default=None,
        help="LionCub variants: start each DDP bucket's vote during the backward pass (bitwise the same "
        "result)",
    )
    parser.add_argument("--timeout", type=float, default=7200.0, metavar="SECONDS", help="per run")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a collective that gets no answer for this long fails the job, naming the rank, operation and "
        "step (default 600)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a rank fails, restart every rank from the last checkpoint, up to K times (default 0)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_arguments(parser)
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory (log, checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after STEP with a checkpoint (the lr schedule stays that of --steps); --resume goes on",
    )
    parser.add_argument(
        "--convert-momenta",
        choices=["average"],
        help="with --resume on another --nproc: start every rank from the mean of the saved momenta",
    )


def check_launch_options(restarts: int, collective_timeout_s: float) -> None:
    """``ValueError`` naming ``--restarts`` / ``--collective-timeout`` if out of range."""
    if not (isinstance(restarts, int) and restarts >= 0):
        raise ValueError(f"--restarts {restarts!r} must be an integer >= 0")
    if not (collective_timeout_s > 0 and math.isfinite(collective_timeout_s)):
        raise ValueError(f"--collective-timeout {collective_timeout_s!r} must be a number of seconds > 0")


def check_before_launch(config: Any, timeout_s: float | None) -> None:
    """Refuse, naming the option, what :class:`~lioncub.train.loop.TrainConfig` lets through and the ranks
    would only find after the launch: the link rate, ``--nproc`` under ``--link``, ``--timeout``,
    ``--bucket-mb``, ``--sync-every``, ``--diagnostics-every``, an empty ``--momentum-sync``, ``--warmup``
    beyond ``--steps``, ``--seed``, the ``--set`` values and the workload's data files."""
    from lioncub.launch import LaunchConfig
    from lioncub.train.workloads import check_workload
    from lioncub.units import parse_rate

    rate = None if config.link in (None, "loopback") else parse_rate(config.link)
    LaunchConfig(["-m", "lioncub.train.loop"], nproc=config.nproc, link_rate_bps=rate, timeout_s=timeout_s)
    bucket = config.bucket_mb
    if isinstance(bucket, bool) or not (isinstance(bucket, (int, float)) and 0 < bucket < math.inf):
        raise ValueError(f"--bucket-mb {bucket!r} must be a finite number of MiB > 0 (default 25)")
    for option, value, low in (
        ("--sync-every", config.sync_every, 1),
        ("--diagnostics-every", config.diagnostics_every, 0),
        ("--seed", config.seed, 0),
    ):
        if isinstance(value, bool) or not (isinstance(value, int) and value >= low):
            raise ValueError(f"{option} {value!r} must be an integer >= {low}")
    if not config.momentum_sync:
        raise ValueError(
            f"--momentum-sync {config.momentum_sync!r}: give none, all, io or comma-separated parameter-name "
            "patterns / param-group names"
        )
    if config.warmup_steps is not None and config.warmup_steps > config.steps:
        raise ValueError(
            f"--warmup {config.warmup_steps} must be at most --steps {config.steps} (the lr would never "
            "reach its peak)"
        )
    try:
        check_workload(config.workload, config.size, config.overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"--set {_format_set(config.overrides)}: {exc}" if config.overrides else str(exc)
        ) from None
    except OSError as exc:
        raise ValueError(f"--workload {config.workload} --size {config.size}: {exc}") from None


def _format_set(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={v!r}" for k, v in overrides.items())


def _sync_spec(text: str) -> str | list[str]:
    return text if text in ("none", "all", "io") else [t for t in text.split(",") if t]


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set batch_size=8")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def config_from_args(args: argparse.Namespace, base: Any = None) -> Any:
    """A :class:`~lioncub.train.loop.TrainConfig`: ``base`` (or the defaults) with every given option."""
    from lioncub.train.loop import TrainConfig

    doc = base.to_json() if base is not None else {}
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, OPTION_OF_FIELD.get(f.name, f.name), None)
        if value is not None and f.name != "overrides":
            doc[f.name] = value
    if args.set:
        doc["overrides"] = {**doc.get("overrides", {}), **_parse_set(args.set)}
    return TrainConfig.from_json(doc)


# -------------------------------------------------------------------------------------------- progress


class _Progress(threading.Thread):
    """Follows ``log.jsonl`` and shows steps, rate, loss and ETA (a rich bar on a terminal, else a line
    every 10 %)."""

    def __init__(self, log_path: Path, label: str, start: int, total: int, stream: TextIO) -> None:
        super().__init__(daemon=True)
        self.log_path, self.label, self.start_step, self.total = log_path, label, start, total
        self.stream = stream
        self.done = threading.Event()

    def run(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=self.stream)
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:.2f} steps/s  loss {task.fields[loss]}  {task.fields[val]}"),
            TimeRemainingColumn(),
        ]
        pos, t0, first = 0, time.monotonic(), None
        next_line = self.start_step
        with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task(
                self.label, total=self.total, completed=self.start_step, rate=0.0, loss="-", val=""
            )
            while True:
                finished = self.done.is_set()
                if self.log_path.exists():
                    with open(self.log_path) as f:
                        f.seek(pos)
                        chunk = f.read()
                    complete = chunk[: chunk.rfind("\n") + 1]
                    pos += len(complete.encode())
                    for line in complete.splitlines():
                        rec = json.loads(line)
                        if rec["step"] <= self.start_step:
                            continue
                        if rec["kind"] == "eval" and "val_loss" in rec:
                            bar.update(task, val=f"val {rec['val_loss']:.4f}")
                            continue
                        if rec["kind"] != "step":
                            continue
                        first = first or (rec["step"], time.monotonic())
                        done = rec["step"] - first[0]
                        rate = done / max(1e-9, time.monotonic() - first[1]) if done else 0.0
                        bar.update(task, completed=rec["step"], rate=rate, loss=f"{rec['loss']:.4f}")
                        if not console.is_terminal and rec["step"] >= next_line:
                            eta = (self.total - rec["step"]) / rate if rate else float("nan")
                            print(
                                f"[train] {self.label} step {rec['step']}/{self.total} "
                                f"loss {rec['loss']:.4f} {rate:.2f} steps/s, ETA {eta:.0f} s, "
                                f"{time.monotonic() - t0:.0f} s so far",
                                file=self.stream,
                                flush=True,
                            )
                            next_line = rec["step"] + max(1, self.total // 10)
                if finished:
                    return
                self.done.wait(0.5)


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class RunOutcome:
    """How a training run ended: the launcher's exit code and rank 0's summary (None if it failed)."""

    returncode: int
    message: str
    summary: dict[str, Any] | None


def prepare_run_dir(run_dir: Path, config: Any, *, resume: bool) -> Any:
    """Create ``run_dir`` with ``config.json``, or (``resume``) check it can continue; returns the config
    to run. Raises ``ValueError`` with the option to change."""
    from lioncub.train import checkpoint

    saved_path = run_dir / "config.json"
    if resume:
        if not saved_path.exists():
            raise ValueError(f"--resume: {run_dir} holds no run (no config.json)")
        meta = checkpoint.latest(run_dir)
        if meta is None:
            raise ValueError(
                f"--resume: {run_dir} has no complete checkpoint to resume from (delete the directory to "
                "start afresh)"
            )
        checkpoint.check_compatible(
            meta,
            variant=config.variant,
            world_size=config.nproc,
            workload=config.workload,
            size=config.size,
            seed=config.seed,
            convert_momenta=config.convert_momenta,
        )
        if config.stop_at is not None and config.stop_at <= meta.step:
            raise ValueError(f"--stop-at {config.stop_at}: the checkpoint is already at step {meta.step}")
        if meta.step >= config.steps:
            raise ValueError(
                f"--resume: the checkpoint is at step {meta.step}; pass --steps above it to go on"
            )
    elif saved_path.exists():
        raise ValueError(
            f"--out {run_dir} already holds a run; pass --resume to continue it, or choose another --out"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = saved_path.with_name("config.json.part")
    tmp.write_text(json.dumps(config.to_json(), indent=1) + "\n")
    os.replace(tmp, saved_path)
    return config


def run_training(
    config: Any,
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
    """Launch ``config.nproc`` ranks of :mod:`lioncub.train.loop` on ``run_dir`` (already prepared); a
    restart (``restarts``) reruns every rank, which resumes from the last checkpoint. ``env`` is added to
    the ranks' environment."""
    check_launch_options(restarts, collective_timeout_s)
    from lioncub.launch import LaunchConfig, launch
    from lioncub.train import checkpoint
    from lioncub.units import parse_rate

    err = err or sys.stderr
    rate = None if config.link in (None, "loopback") else parse_rate(config.link)
    meta = checkpoint.latest(run_dir)
    start = meta.step if meta is not None else 0
    cmd = [sys.executable, "-m", "lioncub.train.loop", str(run_dir)]
    bar = None
    if progress:
        bar = _Progress(run_dir / "log.jsonl", label or config.variant, start, config.steps, err)
        bar.start()
    try:
        rank_env = {"LIONCUB_PG_TIMEOUT": f"{collective_timeout_s:g}", **(env or {})}
        launch_config = LaunchConfig(
            cmd, nproc=config.nproc, link_rate_bps=rate, timeout_s=timeout_s, restarts=restarts, env=rank_env
        )
        result = launch(launch_config, out=out, err=err)
    finally:
        if bar is not None:
            bar.done.set()
            bar.join(timeout=5)
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
    return (
        f"{cfg['workload']}/{cfg['size']} {cfg['variant']}{'+overlap' if cfg.get('overlap') else ''} on "
        f"{summary['world_size']} rank(s), "
        f"{cfg['link']}: "
        f"{summary['steps_run']} steps, median step {ms('median_step_s')} (compute {ms('median_compute_s')}, "
        f"communication {ms('median_comm_s')}, apply {ms('median_apply_s')}), "
        f"{(summary.get('median_bytes_sent') or 0) / 1e6:.3f} MB sent per rank per step"
        + (f"; at step {final.get('step')}: {metrics}" if metrics else "")
    )


def _init_under_torchrun(backend: str) -> None:
    """``init_process_group`` from torchrun's environment. When the workers share the agent's TCPStore
    (torchrun's default), its keys outlive a restart (same port), and a restarted rank may read a peer's
    address from the previous attempt and fail with "Connection refused" (pytorch/pytorch#135712): the
    keys are put under a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``), which every worker of a
    restarted job shares."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("LIONCUB_PG_TIMEOUT", "600")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"lioncub/attempt_{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _run_as_rank(config: Any, run_dir: Path) -> int:
    import torch.distributed as dist

    from lioncub.train import loop

    if int(os.environ["RANK"]) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_json(), indent=1) + "\n")
    _init_under_torchrun("nccl" if loop._device(config).type == "cuda" else "gloo")
    try:
        summary = loop.train(config, run_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(format_summary(summary))
    return 0


def run(args: argparse.Namespace) -> int:
    from lioncub.train.loop import TrainConfig

    run_dir = Path(args.out)
    try:
        check_launch_options(args.restarts, args.collective_timeout)
        base = None
        if args.resume and (run_dir / "config.json").exists():
            base = TrainConfig.from_json(json.loads((run_dir / "config.json").read_text()))
            base.convert_momenta = base.stop_at = None  # asked for anew each time
        config = config_from_args(args, base)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            config.nproc = int(os.environ["WORLD_SIZE"])
            return _run_as_rank(config, run_dir)
        check_before_launch(config, args.timeout or None)
        config = prepare_run_dir(run_dir, config, resume=args.resume)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"lioncub train: error: {exc}", file=sys.stderr)
        return 2
    outcome = run_training(
        config,
        run_dir,
        timeout_s=args.timeout or None,
        progress=not args.no_progress,
        restarts=args.restarts,
        collective_timeout_s=args.collective_timeout,
    )
    if outcome.summary is None:
        print(f"lioncub train: {outcome.message}", file=sys.stderr)
        return outcome.returncode or 1
    print(format_summary(outcome.summary))
    print(f"log: {run_dir / 'log.jsonl'}  checkpoints: {run_dir / 'checkpoints'}")
    return 0


def remove_run(run_dir: Path) -> None:
    """Delete a run directory (``compare --overwrite``)."""
    shutil.rmtree(run_dir)
