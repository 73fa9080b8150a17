"""The driver of a training run: the checks made before anything is written or launched, the launch of the
ranks of :mod:`lioncub.train.rank` on a run directory made ready by :mod:`lioncub.train.prepare` (under
its writer's lock) with a progress display (:mod:`lioncub.train.progress`), and the summary line.

``lioncub train`` and ``lioncub compare`` are thin command lines over this module.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lioncub import env
from lioncub._validate import is_int
from lioncub.names import PEER_VARIANTS, config_entries, run_label
from lioncub.rundir import SpecialFileError, read_run_file
from lioncub.train.config import BASELINES, TrainConfig, format_overrides
from lioncub.train.prepare import NEXT_CONFIG, finish_run
from lioncub.train.progress import Progress

__all__ = [
    "RANK_MODULE",
    "RunOutcome",
    "available_bytes",
    "check_before_launch",
    "check_devices",
    "check_lanes",
    "check_launch_options",
    "check_run_options",
    "estimate_params",
    "format_fault_tolerance",
    "format_summary",
    "gpu_shortage",
    "make_launch_config",
    "max_ranks",
    "progress_title",
    "run_training",
]

#: what every rank runs: ``python -m lioncub.train.rank RUN_DIR [CONFIG]``
RANK_MODULE = "lioncub.train.rank"


def check_launch_options(restarts: int, collective_timeout_s: float, fault_tolerant: bool = False) -> None:
    """``ValueError`` naming ``--restarts`` / ``--collective-timeout`` if out of range (with
    ``--fault-tolerant`` a restart relaunches a job that lost every group: the same bounds)."""
    if not (isinstance(restarts, int) and restarts >= 0):
        raise ValueError(f"--restarts {restarts!r} must be an integer >= 0")
    if not (collective_timeout_s > 0 and math.isfinite(collective_timeout_s)):
        raise ValueError(f"--collective-timeout {collective_timeout_s!r} must be a number of seconds > 0")


#: memory one rank needs besides its model: torch, gloo, the data (measured: ~0.4 GiB for the tiny GPT)
RANK_BASE_BYTES = 600 * 2**20
#: bytes per model parameter on a rank: weights, gradient, momentum, DDP's bucket, vote buffers (fp32)
RANK_BYTES_PER_PARAM = 24
#: and with local steps: the window's anchor, the outer momentum and the pseudo-gradient (fp32)
LOCAL_STEPS_BYTES_PER_PARAM = 12
#: with ``--fsdp``: the whole model a rank builds before ``fully_shard`` keeps its shard (fp32 weights)
FSDP_BUILD_BYTES_PER_PARAM = 4


def estimate_params(workload: str, values: dict[str, Any]) -> int:
    """A rough parameter count of a workload with these field ``values`` (the GPT's blocks, embeddings and
    head; 0 for the CNN, whose size the rank base covers)."""
    if workload != "gpt":
        return 0
    d, layers = values["n_embd"], values["n_layer"]
    vocab = 50257 if values["tokenizer"] == "gpt2" else 256
    return 12 * layers * d * d + (1 if values["tie_embeddings"] else 2) * vocab * d + values["block_size"] * d


def available_bytes() -> int:
    """This machine's available memory (``MemAvailable``, else the physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_memory(config: TrainConfig, params: int) -> int:
    """Bytes one rank of ``config``'s run needs for a model of ``params`` parameters: the interpreter and
    data, and per parameter its weights, gradient, momentum and buffers (fp32) -- a 1/L share of them with
    ``--fsdp`` over a node's L ranks, plus the whole model each rank builds before sharding it."""
    per_param = RANK_BYTES_PER_PARAM + (LOCAL_STEPS_BYTES_PER_PARAM if config.optimizer.local_steps else 0)
    if config.cluster.fsdp:
        share = per_param / config.cluster.nproc_per_node
        return RANK_BASE_BYTES + int(params * (FSDP_BUILD_BYTES_PER_PARAM + share))
    return RANK_BASE_BYTES + per_param * params


def max_ranks(rank_bytes: int) -> int:
    """How many ranks of ``rank_bytes`` fit in 80 % of this machine's available memory (0: not one)."""
    return int(0.8 * available_bytes()) // rank_bytes


def check_run_options(config: TrainConfig) -> dict[str, Any]:
    """Refuse, naming the option, what :class:`~lioncub.train.config.TrainConfig` lets through and a rank
    would only find once it runs: the ``--set`` values and the workload's data (files, optional packages,
    sizes). A rank of a job (``torchrun``) checks this and :func:`check_lanes` itself. Returns the
    workload's field values."""
    from lioncub.train.workloads import check_workload

    run = config.run
    try:
        return check_workload(run.workload, run.size, run.overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"--set {format_overrides(run.overrides)}: {exc}" if run.overrides else str(exc)
        ) from None
    except OSError as exc:
        raise ValueError(f"--workload {run.workload} --size {run.size}: {exc}") from None


def check_lanes(config: TrainConfig) -> None:
    """``ValueError`` if the variant's integer lanes cannot hold the vote's sum over ``nproc`` ranks (what
    the optimizer would refuse inside every rank), naming the variants that can."""
    from lioncub.optim.config import PRESETS, capacity, check_workers

    opt, n = config.optimizer, config.cluster.nproc
    if opt.variant in BASELINES or opt.variant in PEER_VARIANTS:
        return
    try:
        check_workers(opt.build().vote, n)  # the lanes: the same at every topology
    except ValueError as exc:
        fits = [name for name, preset in PRESETS.items() if name in BASELINES or capacity(preset, n)[0]]
        fix = "" if "presets that do" in str(exc) else f"; the variants that serve {n} ranks: {fits}"
        raise ValueError(f"--variant {opt.variant} with {n} ranks: {exc}{fix}") from None


def gpu_shortage(device: str, ranks: str, gpus: int) -> str:
    """Why ``ranks`` (``--nproc 4``) on one machine cannot each take a GPU of their own under ``--device
    device``: the machine has ``gpus`` visible."""
    return (
        f"{ranks} with --device {device}: each rank of a machine trains on a CUDA device of its own "
        f"(cuda:LOCAL_RANK) and {gpus} {'is' if gpus == 1 else 'are'} visible here; start at most {gpus} "
        "rank(s) per machine, or train on the CPU with --device cpu"
    )


def check_devices(config: TrainConfig) -> None:
    """Refuse, naming the option, ranks that would find no GPU of their own: ``--device cuda`` on a machine
    without CUDA, and ``--nproc`` above the CUDA devices visible under ``--device cuda`` or ``auto`` (each
    rank takes ``cuda:LOCAL_RANK``: rank ``nproc - 1`` would fail with "invalid device ordinal"). Runs
    that train on the CPU whatever the machine has are not checked: ``--device cpu``, emulated links
    (``auto`` takes the CPU there, ``cuda`` is refused) and ``--fault-tolerant`` (its groups run on the
    CPU; ``cuda`` is refused)."""
    import torch

    from lioncub.train.config import emulates_links

    device, nproc = config.run.device, config.cluster.nproc
    if device == "cpu" or emulates_links(config) or config.cluster.fault_tolerant:
        return
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise ValueError(
            "--device cuda: no CUDA device is available on this machine; use --device cpu (or auto)"
        )
    gpus = torch.cuda.device_count() if available else 0
    if gpus and nproc > gpus:
        raise ValueError(gpu_shortage(device, f"--nproc {nproc}", gpus))


def check_before_launch(config: TrainConfig, timeout_s: float | None, max_nproc: int | None = None) -> None:
    """Refuse, naming the option, what a launch of ``config`` would only find once it started: the launch
    options, the link rate and the privileges ``--link`` needs, ranks without a GPU of their own
    (:func:`check_devices`), ``--nproc`` beyond what the machine's memory holds (even a single rank;
    ``max_nproc`` replaces the bound from :func:`max_ranks`), the torchft package of ``--fault-tolerant``
    and its ``--lighthouse`` (its ``/status`` page read within 3 s), and all that
    :func:`check_run_options` and :func:`check_lanes` check.

    The last of a run's checks, each stage in one place: argparse, each flag's type and choices
    (:mod:`lioncub.cli.options`, from the settings' descriptions); what a configuration is, whether it
    comes from the command line, a ``config.json`` or Python: :class:`~lioncub.train.config.TrainConfig`'s
    checks -- each value, the rules across settings, the optimizer's own objects
    (:meth:`~lioncub.train.config.OptimizerConfig.build`); how it starts (a resume, a rank of someone
    else's job, ``--variant auto``): :func:`~lioncub.train.config.check_start` and
    :func:`~lioncub.train.config.check_auto`; the launch options that are no setting (``--restarts``,
    ``--collective-timeout``): :func:`check_launch_options`; and here, the machine: what the environment
    has (privileges, GPUs, memory, packages, the workload's data)."""
    from lioncub.launch import PrivilegeError, check_privileges

    make_launch_config(config, ["-m", RANK_MODULE], timeout_s)  # validates the launch options
    check_devices(config)
    run, cluster = config.run, config.cluster
    if cluster.link not in (None, "loopback"):
        try:
            check_privileges()
        except PrivilegeError as exc:
            raise ValueError(f"--link {cluster.link}: {exc}") from None
    if max_nproc is not None and not is_int(max_nproc, 1):
        raise ValueError(f"--max-nproc {max_nproc!r} must be an integer >= 1")
    values = check_run_options(config)
    if config.cluster.fault_tolerant:
        import importlib.util

        if importlib.util.find_spec("torchft") is None:
            raise ValueError(
                "--fault-tolerant: needs the torchft package, which is not installed: pip install "
                "'.[ft]' in a clone of lioncub, or its wheel with [ft] (Linux x86-64; docs/install.md)"
            )
        if cluster.lighthouse is not None:
            from lioncub.launch.groups import probe_lighthouse

            why = probe_lighthouse(cluster.lighthouse)
            if why is not None:
                raise ValueError(
                    f"--lighthouse {cluster.lighthouse}: no torchft lighthouse answers there ({why}); start "
                    "one (python -m lioncub.launch.groups lighthouse HOST:PORT), or leave --lighthouse out "
                    "and the launcher starts one for the job"
                )
    rank_bytes = rank_memory(config, estimate_params(run.workload, values))
    limit = max_nproc if max_nproc is not None else max_ranks(rank_bytes)
    if cluster.nproc <= limit:
        check_lanes(config)
        return
    model = f"{run.workload}/{run.size}" + (f" {format_overrides(run.overrides)}" if run.overrides else "")
    if max_nproc is not None:
        why = f"above --max-nproc {max_nproc}"
    elif limit == 0:
        why = (
            f"a single rank needs ~{rank_bytes / 2**30:.2f} GiB ({model}), more than 80 % of this machine's "
            f"available memory (~{available_bytes() / 2**30:.1f} GiB)"
        )
    else:
        each = f"~{rank_bytes / 2**30:.2f} GiB ({model})"
        why = f"this machine's available memory holds about {limit} ranks of {each}"
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
    from lioncub.launch.preload import MODULES
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
        cmd,
        link_rate_bps=rate,
        timeout_s=timeout_s,
        restarts=restarts,
        env=dict(env or {}),
        preload=(*MODULES, "lioncub.train.loop") if preload_ranks(config, cmd) else (),
        preload_device=config.run.device,
        **layout,
    )


def preload_ranks(config: TrainConfig, cmd: list[str]) -> bool:
    """Whether the ranks start as forks of an interpreter that imported torch once
    (:mod:`lioncub.launch.preload`): for the rank module under ``--nproc`` (on loopback or behind links)
    and ``--nnodes`` (torchrun's agents and the ranks they start, :mod:`lioncub.launch.workers`; a
    fault-tolerant run's launcher forks every process itself), unless ``LIONCUB_PRELOAD=0`` or the ranks
    may use a GPU (:func:`lioncub.launch.preload.gpu_refusal`: ``--device cpu``, or ``auto`` on a machine
    without one)."""
    from lioncub.launch.preload import gpu_refusal

    if env.text("LIONCUB_PRELOAD") == "0" or cmd[1:3] != ["-m", RANK_MODULE]:
        return False
    return gpu_refusal(config.run.device) is None


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class RunOutcome:
    """How a training run ended: the launcher's exit code and rank 0's summary (None if it failed)."""

    returncode: int
    message: str
    summary: dict[str, Any] | None


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
    """Launch the ranks of :mod:`lioncub.train.rank` on ``run_dir``, made ready by
    :func:`lioncub.train.prepare.prepare_run_dir` (the caller holds its lock until this returns); a restart
    (``restarts``) reruns every rank, which resumes from the last checkpoint. ``env`` is added to the
    ranks' environment. Ends with :func:`lioncub.train.prepare.finish_run`."""
    check_launch_options(restarts, collective_timeout_s)
    from lioncub.launch import launch
    from lioncub.train import checkpoint

    err = err or sys.stderr
    try:
        meta = checkpoint.latest(run_dir)
    except ValueError:
        meta = None
    start = meta.step if meta is not None else 0
    next_config = run_dir / NEXT_CONFIG  # a resume: its configuration becomes config.json on success
    cmd = [sys.executable, "-m", RANK_MODULE, str(run_dir)]
    if next_config.exists():
        cmd.append(str(next_config))
    bar = None
    if progress:
        bar = Progress(run_dir / "log.jsonl", progress_title(config, label), start, config.run.steps, err)
        bar.start()
    try:
        rank_env = {"LIONCUB_PG_TIMEOUT": f"{collective_timeout_s:g}", **(env or {})}
        launch_config = make_launch_config(config, cmd, timeout_s, restarts=restarts, env=rank_env)
        result = launch(launch_config, out=out, err=err)
    finally:
        if bar is not None:
            bar.done.set()
            bar.join(timeout=5)
    try:
        finish_run(run_dir, result.ok)
    except OSError as exc:  # e.g. a full disk: the directory stays as the ranks left it, and can be resumed
        print(f"lioncub: could not finish {run_dir} ({exc}); it stays as the ranks left it", file=err)
    summary_path, summary = run_dir / "summary.json", None
    try:
        if result.ok and summary_path.exists():
            summary = json.loads(read_run_file(summary_path, follow_symlinks=True))
    except SpecialFileError as exc:  # put there meanwhile: no summary
        print(f"lioncub: {exc}", file=err)
    return RunOutcome(result.returncode, result.message, summary)


def progress_title(config: TrainConfig, label: str | None = None) -> str:
    """The progress bar's title: ``label`` (compare's row name) or the run's name (``1bit/h16``, not the
    bare variant)."""
    return label or run_label(config.flat())


def format_summary(summary: dict[str, Any]) -> str:
    """One paragraph: step time and its split, bytes per step, final validation metrics."""

    cfg = config_entries(summary["config"])
    # local steps: the mean per inner step (most steps send nothing; the medians would hide the outer step)
    stat = "mean" if cfg.get("local_steps") and "mean_step_s" in summary else "median"

    def ms(key: str) -> str:
        value = summary.get(f"{stat}_{key}")
        return "-" if value is None else f"{value * 1e3:.1f} ms"

    final = summary.get("final") or {}
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in final.items() if k.startswith("val_"))
    where = f"{summary['world_size']} rank(s), {cfg['link']}"
    if cfg.get("nnodes"):
        inside = f", {cfg['intra_link']} inside a node" if cfg.get("intra_link") else ""
        per_node = summary["world_size"] // cfg["nnodes"]
        where = f"{cfg['nnodes']} nodes × {per_node} ranks, {cfg['link']} NICs{inside}"
    return (
        f"{cfg['workload']}/{cfg['size']} {run_label(cfg)} on {where}: "
        f"{summary['steps_run']} steps, {stat} step {ms('step_s')} (compute {ms('compute_s')}, "
        f"communication {ms('comm_s')}, apply {ms('apply_s')}), "
        f"{(summary.get(f'{stat}_bytes_sent') or 0) / 1e6:.3f} MB sent per rank per step"
        + (f"; at step {final.get('step')}: {metrics}" if metrics else "")
        + _budget_line(summary.get("time_budget"))
        + format_fault_tolerance(summary.get("fault_tolerance"), cfg.get("stop_at"))
    )


def format_fault_tolerance(entry: dict[str, Any] | None, stop_at: int | None = None) -> str:
    """A fault-tolerant run's part of the summary line (:mod:`lioncub.train.fault_tolerant`): ``; 40 steps
    with 3 groups, 20 with 2; 1 heal (group 1 at step 35 from g0: 0.9 MB in 0.06 s); the replicas of groups
    0, 1, 2 were bitwise equal at the end`` ("" without one); of a run stopped by ``--stop-at S``: ``... at
    step S (--stop-at)``."""
    if not entry:
        return ""
    counts = ", ".join(
        f"{n} step{'s' if n != 1 else ''} with {k} group{'s' if k != '1' else ''}"
        for k, n in entry["participants"].items()
    )
    text = f"; fault-tolerant: {counts}"
    if entry["skipped_steps"]:
        text += f", {entry['skipped_steps']} skipped (not committed)"
    heals = entry["heals"]
    if heals:
        shown = "; ".join(
            f"group {h['group']} at step {h['step']} from {h['source']}: {h['nbytes'] / 1e6:.1f} MB in "
            f"{h['seconds']:.2f} s"
            for h in heals
        )
        text += f"; {len(heals)} heal{'s' if len(heals) != 1 else ''} ({shown})"
    finished = entry["groups_finished"]
    groups = ", ".join(map(str, finished))
    when = "the end" if stop_at is None else f"step {stop_at} (--stop-at)"
    if entry["replicas_equal"] and len(finished) == 1:
        return text + f"; group {groups} alone finished at {when} (no replica to compare with)"
    return text + (
        f"; the replicas of groups {groups} were bitwise equal at {when}"
        if entry["replicas_equal"]
        else f"; the replicas were NOT equal at {when} (groups finished: {groups or 'none'})"
    )


def _budget_line(budget: dict[str, Any] | None) -> str:
    """A run of ``lioncub compare --time-budget``: its budget, plan and measured training time."""
    if not budget:
        return ""
    pilot = budget.get("pilot_step_s")
    text = f"; time budget {budget['budget_s']:g} s: {budget['planned_steps']} steps planned"
    text += f" (the pilot: {pilot * 1e3:.1f} ms per step)" if pilot else ""
    if budget.get("wall_s") is not None:
        text += f", {budget['steps_run']} trained in {budget['wall_s']:.1f} s"
    return text + (" (stopped: far over the budget)" if budget.get("stopped_at") else "")
