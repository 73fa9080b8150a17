"""The training loop of one rank: a workload, an optimizer variant, a JSONL log and checkpoints.

Read it top to bottom: :func:`build_optimizer` (the variant: DDP baselines or ``LionCub``), then
:func:`train` (the loop: set-up and resume, the step, its record, evaluation and checkpoints). What a run
is comes from :mod:`lioncub.train.config` (:class:`~lioncub.train.config.TrainConfig`, the lr schedule
:func:`~lioncub.train.config.lr_factor`); a rank joins its job and calls :func:`train` in
:mod:`lioncub.train.rank`, which is what ``lioncub train`` launches on every rank.

Variants. ``"32bit"`` is what users run today: ``DistributedDataParallel`` (bucketed fp32 gradient
allreduce overlapped with the backward pass) + :class:`~lioncub.optim.Lion`; ``"16bit"`` the same with
DDP's bf16 compression hook (fp16 where the backend cannot allreduce bf16). Every other variant is a
:class:`~lioncub.optim.LionCub` preset; the model is still wrapped in DDP (initial broadcast, buffer
sync) with its gradient allreduce skipped (:func:`lioncub.optim.ddp.skip_gradient_allreduce`), or, with
``overlap``, replaced by the vote itself (:meth:`~lioncub.optim.LionCub.overlap_with`). With
``local_steps`` H every variant is a ``LionCub`` with :class:`~lioncub.optim.LocalSteps` (``32bit`` and
``16bit``: its dense exchange, for ``dsm`` and ``diloco``): each rank steps alone and the ranks meet every
H steps, so a step record's ``bytes_sent`` and ``comm_s`` are 0 but at the outer steps.

Step time split (seconds, rank 0, in every ``step`` record of ``log.jsonl``):

* ``compute_s``: forward + backward. For the DDP baselines the backward also waits for the gradient
  allreduce it overlaps; ``compute_s`` is then the forward + backward time measured without
  communication (``model.no_sync()``, median of 3 passes before training) and the rest of the measured
  forward + backward is ``comm_s``.
* ``encode_s`` / ``exchange_s``: ``LionCub``'s quantize/pack and its wait for the exchange (incl.
  unpack); ``comm_s`` = ``encode_s + exchange_s`` for the vote variants. With ``overlap`` the quantize/pack
  and the first phases run during the backward (``overlapped_s``, inside ``compute_s``), and ``comm_s``
  is what the step still waits for.
* ``apply_s``: the optimizer's arithmetic (local direction, update, momentum).
* ``step_s``: the whole step; ``time_s``: the training wall time so far (evaluation and checkpoints
  excluded). ``bytes_sent``/``bytes_recv``: this rank's bytes handed to the collectives in the step.

On emulated nodes (``--nnodes``) a ``step`` record also holds ``nic_bytes`` (sent through a node's NIC)
and ``intra_bytes`` (sent by a rank inside its node): :mod:`lioncub.train.nodebytes`.

With ``--fsdp`` (:mod:`lioncub.train.sharding`) each node shards the model over its ranks with FSDP2 instead
of DDP and the ``LionCub`` votes between the nodes on each rank's shard (the mesh's ``"replicate"`` groups):
``nic_bytes`` is L × a rank's vote bytes (each rank's shard crosses the NIC), ``intra_bytes`` FSDP2's
all-gathers and reduce-scatter; the ranks of node 0 evaluate (the forward gathers the shards);
``model.pt`` is the gathered whole model, and a checkpoint's model and optimizer state for a resume are
written by torch.distributed.checkpoint, each rank its shard (:func:`lioncub.train.checkpoint.load_shards`).
The DDP baselines with ``--fsdp`` are HSDP + ``Lion`` (FSDP2 all-reduces the gradient shards between the
nodes, inside the backward: their ``comm_s`` is in ``compute_s``).

``eval`` records hold ``val_loss`` (and ``val_acc``) at ``eval_every`` steps and at the end; rank 0
evaluates (the replicas are identical) while the others wait. With ``diagnostics_every`` a ``diag``
record holds :mod:`lioncub.optim.diagnostics` overall and per parameter tensor. ``summary.json``'s
``memory``: the bytes of parameters, gradients and optimizer state one rank holds and its peak RSS, the
largest over the ranks (:mod:`lioncub.train.memory`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lioncub.ops.quantize import max_abs
from lioncub.optim import Lion, LionCub
from lioncub.optim.ddp import (
    GradientTraffic,
    compressed_allreduce_dtype,
    count_gradient_allreduce,
    skip_gradient_allreduce,
)
from lioncub.optim.engine import PhaseClock
from lioncub.optim.step_check import NonFiniteGradientError
from lioncub.planning import costmodel
from lioncub.planning.auto import DEFAULT_LATENCY_S, choose_topology
from lioncub.rundir import is_marked, open_append, record, write_atomically, write_owned
from lioncub.train import checkpoint, sharding
from lioncub.train.budget import GUARD_FACTOR, budget_summary, over_budget
from lioncub.train.config import BASELINES, CUDA_UNDER_EMULATION, TrainConfig, emulates_links, lr_factor
from lioncub.train.memory import gradient_bytes, largest_over_ranks, rank_memory
from lioncub.train.nodebytes import flat_shares, node_bytes
from lioncub.train.runlog import append_record, elapsed_at, truncate_log
from lioncub.train.workloads import Workload, make_workload
from lioncub.units import parse_rate

__all__ = [
    "PROGRESS",
    "OptimizerSetup",
    "build_optimizer",
    "device_for",
    "seed_rank",
    "step_record",
    "summarize",
    "train",
    "where",
]

# ----------------------------------------------------------------------------------------- optimizer


@dataclass
class OptimizerSetup:
    """What :func:`build_optimizer` sets up: the variant's optimizer, the model it steps, and for the DDP
    baselines the meter of their gradient allreduce."""

    opt: torch.optim.Optimizer
    model: torch.nn.Module  # DDP-wrapped when world size > 1
    traffic: GradientTraffic | None  # DDP baselines: bytes of the gradient allreduce


def _topology(config: TrainConfig, model: torch.nn.Module) -> str:
    """The vote's topology, with ``"auto"`` resolved by :func:`lioncub.planning.auto.choose_topology` for the
    emulated cluster (``--link`` per node NIC, ``--intra-link`` or an NVLink-class link inside a node);
    on loopback there is nothing to choose between: flat."""
    opt, cluster = config.optimizer, config.cluster
    if opt.topology != "auto":
        return opt.topology
    nnodes = cluster.nnodes or cluster.nproc
    if cluster.link == "loopback" or nnodes == 1 or nnodes == cluster.nproc:
        choice, reason = "flat", "topology='auto' chose 'flat': one rank per node or no emulated network"
    else:
        latency = costmodel.parse_duration(costmodel.DEFAULT_INTRA_LATENCY)
        inter = costmodel.Network.from_rate(parse_rate(cluster.link), DEFAULT_LATENCY_S)
        intra_rate = parse_rate(cluster.intra_link or costmodel.DEFAULT_INTRA_BANDWIDTH, "--intra-link")
        nodes = costmodel.Cluster(
            nnodes, cluster.nproc // nnodes, inter, costmodel.Network.from_rate(intra_rate, latency)
        )
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        choice, reason = choose_topology(opt.variant, d, nodes, bucket_numel=int(opt.bucket_mb * 2**20) // 4)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[lioncub] {reason}", flush=True)
    return choice


def build_optimizer(
    config: TrainConfig,
    wl: Workload,
    model: torch.nn.Module,
    world_size: int,
    process_group: Any = None,
) -> OptimizerSetup:
    """Wrap ``model`` in DDP (world size > 1) and build the variant's optimizer over the workload's groups;
    ``process_group``: what a ``LionCub`` votes over (default: the global group; a replica group's
    :class:`~lioncub.collectives.GroupComm` in a fault-tolerant run, with ``world_size`` 1; with ``--fsdp``
    the nodes' mesh, ``model`` sharded over it and not wrapped in DDP; a replica group of several ranks: a
    :class:`~lioncub.optim.topology.VoteMesh`)."""
    options, fsdp = config.optimizer, config.cluster.fsdp
    ddp: DistributedDataParallel | None = None
    if world_size > 1 and not fsdp:  # sharded (--fsdp): FSDP2 already reduce-scatters inside the node
        # overlapped votes travel in DDP's buckets: --bucket-mb sizes them (DDP's default otherwise)
        ddp = DistributedDataParallel(
            model,
            device_ids=[wl.device.index] if wl.device.type == "cuda" else None,
            bucket_cap_mb=options.bucket_mb if options.overlap else None,
        )
        model = ddp
    groups = wl.param_groups(model)
    if options.variant in BASELINES and options.local_steps is None:
        traffic: GradientTraffic | None = None
        if world_size > 1:
            wire = _wire(options.variant, wl.device)
            if fsdp:  # HSDP: FSDP2 all-reduces each gradient shard between the nodes
                cluster = config.cluster
                traffic = sharding.hsdp_traffic(model, cluster.nnodes or 1, cluster.nproc_per_node, wire)
            else:
                assert ddp is not None
                traffic = count_gradient_allreduce(ddp, wire)
        return OptimizerSetup(Lion(groups, betas=wl.betas), model, traffic)
    parts = options.build("flat" if fsdp else _topology(config, model))
    opt = LionCub(
        groups,
        betas=wl.betas,
        variant=parts.lioncub_variant,  # local steps' dsm / diloco on a baseline: the dense exchange
        bucket_mb=options.bucket_mb,
        momentum_sync=parts.momentum_sync,
        model=getattr(model, "module", model),
        checks=parts.checks,
        diagnostics_every=options.diagnostics_every,
        local_steps=parts.local_steps,
        process_group=process_group,
    )
    if ddp is not None and options.overlap:
        opt.overlap_with(ddp)  # the votes start during the backward
    elif ddp is not None:
        skip_gradient_allreduce(ddp)
    return OptimizerSetup(opt, model, None)


def _wire(variant: str, device: torch.device) -> torch.dtype:
    """The dtype of a DDP baseline's gradient reduction: fp32 (``32bit``), else bf16 where the backend can
    reduce it (fp16 otherwise)."""
    return torch.float32 if variant == "32bit" else compressed_allreduce_dtype(device=device)


def _compute_baseline(model: DistributedDataParallel, wl: Workload, step: int) -> float:
    """Median forward + backward time without communication (DDP ``no_sync``); leaves no trace: the
    gradients are dropped, the buffers (BatchNorm statistics) put back and the RNG (dropout) too."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    times = []
    devices = [wl.device] if wl.device.type == "cuda" else []
    clock = PhaseClock(wl.device)  # on a GPU: after the queued work, not its launch
    with torch.random.fork_rng(devices=devices), model.no_sync():
        for _ in range(4):
            dist.barrier()  # all ranks compute at once, competing for the cores as in a training step
            t0 = clock()
            wl.loss(model, wl.train_batch(step)).backward()
            times.append(clock() - t0)
    wl.sampler.position = step  # train_batch moved the position; the data state must not change
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    return statistics.median(times[1:])


# ---------------------------------------------------------------------------------------------- loop

#: the optimizer step this process is on (None before the first), for the line of an interrupted rank
PROGRESS: dict[str, int | None] = {"step": None}


def where() -> str:
    """Where this rank is: ``at step 7``, or ``before the first step``."""
    step = PROGRESS["step"]
    return "before the first step" if step is None else f"at step {step}"


def device_for(config: TrainConfig) -> torch.device:
    """The device this rank trains on: ``cuda:LOCAL_RANK`` (``--device cuda``, or ``auto`` with CUDA and
    no emulated link), else the CPU. Behind emulated links (``--link``, ``--nnodes``) ``auto`` takes the
    CPU and ``cuda`` is refused (:data:`lioncub.train.config.CUDA_UNDER_EMULATION`): NCCL would bypass the
    links inside the host. A local rank without a GPU of its own (``LOCAL_RANK`` >= the GPUs visible) is
    refused naming the ranks per node and the GPUs (:func:`lioncub.train.driver.gpu_shortage`)."""
    device, emulated = config.run.device, emulates_links(config)
    if device == "cuda" and emulated:
        raise ValueError(CUDA_UNDER_EMULATION.format(link=config.cluster.link))
    if device == "cuda" or (device == "auto" and not emulated and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is available")
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:
            from lioncub.train.driver import gpu_shortage

            ranks = os.environ.get("LOCAL_WORLD_SIZE", str(local + 1))
            where = f"--nproc / --nproc-per-node {ranks} (this is local rank {local})"
            raise ValueError(gpu_shortage(device, where, count))
        return torch.device("cuda", local)
    return torch.device("cpu")


_SEED_TAG = 0x5EED  # keeps these seeds apart from the data streams' (seed, rank, step) keys


def seed_rank(seed: int, rank: int, *more: int) -> None:
    """Seed this rank's global generators -- torch's CPU generator (dropout's on the CPU) and every CUDA
    device's, ``random``'s and numpy's -- from ``(seed, rank, *more)`` alone: every run of a seed draws
    the same numbers, and each rank its own (the key is hashed: no collisions such as seed + rank)."""
    words = np.random.SeedSequence([_SEED_TAG, seed, rank, *more]).generate_state(4)  # uint32
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))  # also every CUDA device (lazily if not started)
    random.seed(int(words[2]) << 32 | int(words[3]))
    np.random.seed(words)


@dataclass
class _Rank:
    """What one rank's loop works with, as :func:`_set_up` set it up."""

    config: TrainConfig
    run_dir: Path
    rank: int
    world: int
    wl: Workload
    setup: OptimizerSetup
    start: int  # the step the run resumes after (0: a new run)
    compute_ref: float | None  # DDP baselines: forward + backward without communication (s)
    log: Callable[[str], None]
    shares: tuple[float, float] | None = None  # on emulated nodes: a flat step's NIC and in-node shares
    ring_shares: tuple[float, float] = (0.0, 0.0)  # ... and those of a flat ring allreduce
    budget_stop: int | None = None  # the step the time budget's guard stopped the run at
    gradients: int | None = None  # bytes of the gradients after this process's first backward
    fsdp_intra: float = 0.0  # --fsdp: the bytes a rank sends for FSDP2 inside its node per step


def train(config: TrainConfig, run_dir: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) the training of ``config`` on this rank of the initialised process group; rank 0
    writes ``log.jsonl`` and ``summary.json`` in ``run_dir``. Returns the summary.

    The global generators (dropout) are seeded from ``(seed, rank)`` (:func:`seed_rank`) and a resumed run
    restores the checkpoint's, so a run is a function of its seed and a resumed one equals the
    uninterrupted one."""
    r = _set_up(config, run_dir, log)
    log_path = run_dir / "log.jsonl"
    elapsed = elapsed_at(log_path, r.start) if r.rank == 0 else 0.0
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    out = open_append(log_path) if r.rank == 0 else os.open(os.devnull, os.O_WRONLY)
    try:
        for step in range(r.start + 1, config.run.steps + 1):
            PROGRESS["step"] = step
            rec = _train_step(r, step, elapsed)
            elapsed = rec["time_s"]
            records.append(rec)
            append_record(out, rec)
            if _after_step(r, out, step, elapsed, evals):
                break
    finally:
        os.close(out)
    model = r.setup.model
    params = sum(p.numel() for p in model.parameters())
    memory = largest_over_ranks(rank_memory(model, [r.setup.opt], r.gradients or 0), r.wl.device)
    summary = summarize(config, r.world, params, r.wl.info(), records, evals, r.compute_ref, memory)
    if config.run.time_budget_s is not None:  # lioncub compare --time-budget
        summary["time_budget"] = budget_summary(config, records, r.budget_stop)
    if r.rank == 0:
        text = json.dumps(summary, indent=1) + "\n"
        if is_marked(run_dir):
            write_owned(run_dir, "summary.json", text)  # recorded, never written through a link
        else:
            write_atomically(run_dir / "summary.json", text)
    return summary


def _set_up(config: TrainConfig, run_dir: Path, log: Callable[[str], None]) -> _Rank:
    """Build the workload, the model and the optimizer of this rank; on a resume, load the checkpoint and
    cut ``log.jsonl`` back to its step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = config.run
    wl = make_workload(
        run.workload,
        run.size,
        rank=rank,
        world_size=world,
        seed=run.seed,
        data_mode=run.data_mode,
        device=device,
        **run.overrides,
    )
    model = wl.build_model()
    seed_rank(run.seed, rank)  # dropout draws from the global generators
    resume = checkpoint.latest(run_dir)
    state = None
    fsdp = config.cluster.fsdp
    if resume is not None:
        checkpoint.check_compatible(
            resume,
            variant=config.optimizer.variant,
            world_size=world,
            workload=run.workload,
            size=run.size,
            seed=run.seed,
            convert_momenta=run.convert_momenta,
            local_steps=config.optimizer.local_steps,
        )
        if not fsdp:  # a sharded run's model is in its shards (loaded below)
            model.load_state_dict(checkpoint.model_state(resume))
        state = checkpoint.load_rank_state(resume, rank, world)
    mesh = _shard(config, model, device)  # --fsdp: each node shards the model over its ranks
    setup = build_optimizer(config, wl, model, world, process_group=mesh)
    for group in setup.opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    start = resume.step if resume is not None else 0
    if state is not None and resume is not None:
        same_world = world == resume.world_size
        if fsdp:  # the model's and the optimizer's shards (torch.distributed.checkpoint)
            checkpoint.load_shards(resume, setup.model, setup.opt)
        elif isinstance(setup.opt, LionCub):
            setup.opt.load_state_dict(state["optimizer"], allow_world_size_change=not same_world)
        else:
            setup.opt.load_state_dict(state["optimizer"])
        wl.load_state_dict(state["data"], strict=same_world)
    wl.sampler.position = start
    # the sharded baseline's all-reduce runs inside FSDP2's backward, whose gradient sync is not skipped
    # here (FSDP2 would keep the unsharded gradients for the next backward): its compute_s holds it
    ddp = setup.model if setup.traffic is not None and not fsdp else None
    assert ddp is None or isinstance(ddp, DistributedDataParallel)  # a baseline's traffic: DDP's
    compute_ref = _compute_baseline(ddp, wl, start) if ddp is not None else None
    if state is not None and "converted_from" in state:  # rank 0's RNG states: each rank draws its own
        seed_rank(run.seed, rank, start)
    elif state is not None:  # after everything in the setup that may draw random numbers
        checkpoint.restore_rng(state)
    if rank == 0:
        if is_marked(run_dir):
            record(run_dir, files=["log.jsonl", "log.jsonl.part"])  # before it is created
        truncate_log(run_dir / "log.jsonl", start, log)
        if resume is not None:
            log(f"resumed from {resume.path} at step {start}")
    shares, ring = None, (0.0, 0.0)
    if config.cluster.nnodes:  # where the bytes go: lioncub.train.nodebytes
        vote = config.optimizer.build().lioncub_variant  # flat_shares: its flat vote
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        nodes = (config.cluster.nnodes, config.cluster.nproc_per_node)
        shares, ring = flat_shares(vote, d, *nodes), flat_shares("32bit", d, *nodes)
    r = _Rank(config, run_dir, rank, world, wl, setup, start, compute_ref, log, shares, ring)
    if fsdp:  # every rank's vote crosses its node's NIC (its voters are in the other nodes)
        r.shares = (float(config.cluster.nproc_per_node), 0.0)
        wire = _reduce_dtype(config, device) or torch.float32
        r.fsdp_intra = float(sharding.fsdp_intra_bytes(model, config.cluster.nproc_per_node, wire.itemsize))
    return r


def _reduce_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """A sharded run's gradient reduction dtype: a DDP baseline's wire (HSDP), else FSDP2's default."""
    opt = config.optimizer
    return _wire(opt.variant, device) if opt.variant in BASELINES and opt.local_steps is None else None


def _shard(config: TrainConfig, model: torch.nn.Module, device: torch.device) -> Any:
    """With ``--fsdp``: the nodes' mesh (:func:`lioncub.train.sharding.node_mesh`), ``model`` sharded over
    each node's ranks -- a DDP baseline over the whole mesh (HSDP) -- and the vote between the nodes on
    the shards; else ``None``. Collective."""
    cluster = config.cluster
    if not cluster.fsdp:
        return None
    mesh = sharding.node_mesh(cluster.nnodes or 1, cluster.nproc_per_node, device)
    reduce = _reduce_dtype(config, device)
    sharding.shard_model(model, mesh, replicate=reduce is not None, reduce_dtype=reduce)
    return mesh


def _train_step(r: _Rank, step: int, elapsed: float) -> dict[str, Any]:
    """One optimizer step at the lr of the schedule; its ``step`` record (``time_s``: ``elapsed`` + this
    step, ``loss``: the mean training loss of the ranks)."""
    run, setup = r.config.run, r.setup
    factor = lr_factor(step, run.steps, run.warmup, run.min_lr_ratio)
    for group in setup.opt.param_groups:
        group["lr"] = group["initial_lr"] * factor
    clock = PhaseClock(r.wl.device)  # on a GPU: the compute and the step as done, not as launched
    t0 = clock()
    loss = r.wl.loss(setup.model, r.wl.train_batch(step - 1))
    loss.backward()
    if r.gradients is None:  # once: every backward of the run allocates the same gradients
        r.gradients = gradient_bytes(setup.model)
    t1 = clock()
    skipped = _optimizer_step(setup, r.config.optimizer.nonfinite, step)
    setup.opt.zero_grad(set_to_none=True)
    t2 = clock()
    rec = step_record(setup, step, t1 - t0, t2 - t1, r.compute_ref)
    if r.shares is not None:
        last = setup.opt.comm_stats()["last"] if isinstance(setup.opt, LionCub) else {}
        rec.update(
            node_bytes(last, rec["bytes_sent"], r.shares, r.config.cluster.nproc_per_node, r.ring_shares)
        )
        rec["intra_bytes"] += r.fsdp_intra
    rec["skipped"] = skipped
    if skipped and r.config.optimizer.local_steps is not None:  # each rank's inner steps are its own
        r.log(
            f"step {step} skipped on rank {r.rank}: non-finite gradients (--nonfinite skip; with local steps "
            "a rank's inner step is its own, an outer step's is every rank's)"
        )
    elif skipped and r.rank == 0:
        r.log(f"step {step} skipped on every rank: non-finite gradients (--nonfinite skip)")
    rec["time_s"] = elapsed + rec["step_s"]
    loss_sum = loss.detach().float().reshape(1)
    dist.all_reduce(loss_sum)  # outside the timed region: the mean training loss of the ranks
    rec["loss"] = float(loss_sum) / r.world
    rec["lr"] = setup.opt.param_groups[0]["lr"]
    return rec


def _after_step(r: _Rank, out: Any, step: int, elapsed: float, evals: list[dict[str, Any]]) -> bool:
    """The step's diagnostics, evaluation and checkpoint, as due; True if the run stops here
    (``stop_at``)."""
    run = r.config.run
    diag = getattr(r.setup.opt, "last_diagnostics", None)
    if diag is not None and diag[0] == step:
        layers = {k: v for k, v in diag[1].items() if k != "overall"}
        append_record(out, {"kind": "diag", "step": step, "overall": diag[1]["overall"], "layers": layers})
    guard = _over_budget(r, step, elapsed)
    if guard:
        r.budget_stop = step
        append_record(out, {"kind": "stop", "step": step, "time_s": elapsed, "reason": "time budget"})
        if r.rank == 0:
            r.log(
                f"stopping after step {step} of {run.steps}: {elapsed:.1f} s of training is past "
                f"{GUARD_FACTOR:g} × the time budget of {run.time_budget_s:g} s (the pilot's step time was "
                "too short)"
            )
    if step == run.steps or guard or (run.eval_every and step % run.eval_every == 0):
        shards = r.config.cluster.nproc_per_node if r.config.cluster.fsdp else 0
        ev = _evaluate(r.wl, r.setup.model, r.rank, step, elapsed, shards)
        evals.append(ev)
        append_record(out, ev)
    stop = step == run.stop_at or guard
    if stop or step == run.steps or (run.checkpoint_every and step % run.checkpoint_every == 0):
        meta = {
            "variant": r.config.optimizer.variant,
            "workload": run.workload,
            "size": run.size,
            "seed": run.seed,
        }
        whole, sharded = None, None
        if r.config.cluster.fsdp:  # model.pt the whole model; the shards for a resume (each rank its own)
            whole = sharding.full_model_state(r.setup.model)
            sharded = sharding.sharded_state(r.setup.model, r.setup.opt)
        checkpoint.save(
            r.run_dir,
            step=step,
            rank=r.rank,
            world_size=r.world,
            model=r.setup.model,
            optimizer=r.setup.opt,
            data_state=r.wl.state_dict(),
            meta=meta,
            barrier=dist.barrier,
            model_state=whole,
            shards=sharded,
        )
    return stop


def _over_budget(r: _Rank, step: int, elapsed: float) -> bool:
    """The time budget's guard (:func:`lioncub.train.budget.over_budget`), decided by rank 0 on its training
    time and broadcast at every window's end (outside the timed step): the same answer on every rank."""
    if r.config.run.time_budget_s is None or not over_budget(r.config, step, float("inf")):
        return False  # no budget, or no stop possible after this step
    flag = torch.tensor([int(r.rank == 0 and over_budget(r.config, step, elapsed))], device=r.wl.device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _optimizer_step(o: OptimizerSetup, nonfinite: str, step: int) -> int:
    """``o.opt.step()``; returns 1 if the step was skipped for non-finite gradients (0 otherwise).
    :class:`LionCub` decides with its ranks (one all-gather); the DDP baselines' gradients are already the
    same allreduced mean on every rank, so each rank checks its own and all take the same decision."""
    if isinstance(o.opt, LionCub):
        o.opt.step()
        return int(o.opt.comm_stats()["last"]["skipped_steps"])
    grads = [p.grad for g in o.opt.param_groups for p in g["params"] if p.grad is not None]
    shards = [g.to_local() for g in grads if isinstance(g, DTensor)]  # HSDP (--fsdp): each rank its shard
    if shards:
        grads = shards
    peaks = torch.stack([max_abs(g).float() for g in grads]) if grads else None
    finite = peaks is None or bool(torch.isfinite(peaks).all())
    if shards:  # a node's ranks hold different shards: every rank takes the same decision
        flag = torch.tensor([int(not finite)], dtype=torch.int32, device=grads[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        finite = not flag.item()
    if finite:
        o.opt.step()
        return 0
    if nonfinite == "raise":
        raise NonFiniteGradientError(
            f"rank {dist.get_rank()}: non-finite gradients (NaN or Inf) at step {step}; nothing was applied "
            "(--nonfinite raise)"
        )
    return 1


def step_record(
    o: OptimizerSetup, step: int, fwd_bwd: float, opt_s: float, compute_ref: float | None
) -> dict:
    """The ``step`` record of ``step``: its time split (``fwd_bwd``: forward + backward, ``opt_s``: the
    optimizer step, seconds) and the bytes the optimizer (or DDP's meter) handed to the collectives."""
    rec: dict[str, Any] = {"kind": "step", "step": step, "step_s": fwd_bwd + opt_s}
    if isinstance(o.opt, LionCub):
        last = o.opt.comm_stats()["last"]
        rec.update(
            compute_s=fwd_bwd,
            encode_s=last["encode_s"],
            exchange_s=last["exchange_s"],
            comm_s=last["communication_s"],
            overlapped_s=last["overlapped_s"],
            apply_s=last["direction_s"] + last["apply_s"],
            bytes_sent=last["bytes_sent"],
            bytes_recv=last["bytes_recv"],
            collectives=last["collectives"],
        )
        return rec
    sent, recv, colls = o.traffic.take() if o.traffic is not None else (0.0, 0.0, 0)
    compute = fwd_bwd if compute_ref is None else min(fwd_bwd, compute_ref)
    rec.update(
        compute_s=compute,
        encode_s=0.0,
        exchange_s=fwd_bwd - compute,
        comm_s=fwd_bwd - compute,
        apply_s=opt_s,
        bytes_sent=sent,
        bytes_recv=recv,
        collectives=colls,
    )
    return rec


def _evaluate(
    wl: Workload, model: torch.nn.Module, rank: int, step: int, elapsed: float, shards: int = 0
) -> dict[str, Any]:
    """The ``eval`` record of ``step``: rank 0 evaluates (a model sharded over ``shards`` ranks per node:
    the ranks of node 0, whose forward gathers their shards, freed again after it), the others wait."""
    ev: dict[str, Any] = {"kind": "eval", "step": step, "time_s": elapsed}
    if rank < max(shards, 1):
        ev.update(wl.evaluate(model))
    if shards:
        sharding.reshard(model)
    dist.barrier()  # the others wait here, not inside the next step's timed collectives
    return ev


def summarize(
    config: TrainConfig,
    world: int,
    params: int,
    info: dict[str, Any],
    records: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    compute_ref: float | None,
    memory: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``summary.json`` of a run: its configuration, ``params`` and the workload's ``info``, the medians
    (and means) of the step records' times and bytes, the last ``eval`` record with a ``val_loss``, and
    ``memory``: the bytes one rank holds (:mod:`lioncub.train.memory`)."""

    def med(key: str) -> float | None:
        vals = [r[key] for r in records if key in r]
        return statistics.median(vals) if vals else None

    def mean(key: str) -> float | None:  # local steps: per inner step, the outer steps included
        vals = [r[key] for r in records if key in r]
        return statistics.fmean(vals) if vals else None

    last_eval = next((e for e in reversed(evals) if "val_loss" in e), None)
    return {
        "config": config.to_json(),
        "world_size": world,
        "params": params,
        "info": {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))},
        "steps_run": len(records),
        "skipped_steps": sum(r.get("skipped", 0) for r in records),
        "median_step_s": med("step_s"),
        "median_compute_s": med("compute_s"),
        "median_comm_s": med("comm_s"),
        "median_apply_s": med("apply_s"),
        "median_overlapped_s": med("overlapped_s"),
        "median_bytes_sent": med("bytes_sent"),
        **{f"mean_{key}": mean(key) for key in ("step_s", "compute_s", "comm_s", "apply_s", "bytes_sent")},
        "compute_reference_s": compute_ref,
        "final": last_eval,
        "memory": memory,
    }
