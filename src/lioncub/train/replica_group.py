"""One replica group of a fault-tolerant run (``lioncub train --fault-tolerant``): the training loop of a
process that votes with the other groups through :class:`lioncub.integrations.torchft.ReplicaGroup`.

:func:`lioncub.launch.groups.launch_groups` starts it as ``python -m lioncub.train.replica_group RUN_DIR
[CONFIG]`` with ``LIONCUB_GROUP`` (its index G), ``LIONCUB_GROUP_LIFE`` (0, or k at its k-th rejoin),
``LIONCUB_LIGHTHOUSE`` and ``LIONCUB_GROUP_HOST``; with ``--nnodes`` each of a group's L ranks, with
``RANK``/``WORLD_SIZE``/``MASTER_*`` of the group's own world. Read it top to bottom in :func:`run_group`:

1. The workload (data shard G·L + ℓ of ``--nproc`` for rank ℓ of group G), the model (every group builds
   the same one from the seed; in a group of several ranks wrapped in DDP over them) and the variant's
   ``LionCub`` over the group's :class:`~lioncub.collectives.GroupComm` (with L > 1 over
   ``VoteMesh(group.comm, the group's world, broadcast="caller")``, each rank voting on its share of whole
   tensors, ``opt.shares``, broadcast to the group after the commit; with ``--fsdp`` the model
   sharded over the group's own ``(1, L)`` mesh and ``LionCub`` over ``VoteMesh(group.comm, mesh)``, each
   rank voting on its shards), attached to the ``ReplicaGroup``. The group's rank 0 writes its files. The
   loop's position (the last step finished and the training seconds so far) is state a healing group takes
   from its peer.
2. Each step: at a commit boundary (every step; with local steps each window's first) the group first
   waits for a group the schedule starts again (``--rejoin``, so that a rerun of a schedule gives the same
   bits; this wait is not training time), then ``begin()`` (the quorum, a heal), the forward and backward
   pass, ``step()`` (the vote over the quorum; applied only if committed). Its ``step`` record has
   ``participants`` (the quorum's size), ``quorum_s`` (the quorum and any heal, inside ``step_s``) and
   ``committed``. With local steps the records of a window are written at its end, when its commit is
   known.
3. After step STEP of a ``--kill G@STEP`` the group writes a ``hold`` record and waits to be SIGKILLed by
   the launcher (a death at a known point: reruns give the same bits).
4. Evaluation at ``--eval-every`` steps and at the end, by every group on its own replica (equal where the
   groups are: the merged log says whether they were); its record comes before the window's step
   records, which the launcher's schedule reads. At the end ``groups/gG.end.json``: the digest of
   the parameters, the heals, the steps committed and skipped.
5. Checkpoints (``--checkpoint-every K``, ``--stop-at``; docs/fault-tolerance.md, "Checkpoints, resume,
   restarts"): after a committed step that is due (K | step, ``--stop-at``, the last step), every rank of
   every group in the quorum writes its own part -- its optimizer state (momenta, step, generator, outer
   state), RNG states, data and loop position, torchft's committed count -- and the first participant
   also ``model.pt`` (the parameters, equal in every participant after a commit; with ``--fsdp`` each part
   holds its rank's shards of the parameters and of the optimizer state, in the heal's portable form, and
   ``model.pt`` is gathered by the first participant's ranks together); serialised in the step,
   written by a background thread (:class:`_Writer`), completed by the first participant once every
   participant's part is there (:func:`lioncub.train.checkpoint.complete_parts`). A group started by a
   launch over a checkpoint (a resume, a restart) loads its own part (:meth:`_GroupLoop.restore`); one
   absent from the checkpoint starts afresh and heals from the others at the first quorum.
6. What it never does: train alone after another group finished the run (a straggler back too late:
   :meth:`_GroupLoop.check_alone` stops it, before it writes a step or ``model.pt``), start again and
   train alone from scratch (:meth:`_GroupLoop.check_joined`), vote at a step whose heal failed (it sits
   it out: ``left_out`` records), or wait for a rejoin whose start died (the driver's ended marks).

:mod:`lioncub.train.fault_tolerant` launches the groups and merges their logs into the run's.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import logging
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lioncub import env
from lioncub.integrations.torchft import (
    DiLoCoGroup,
    Heal,
    ReplicaGroup,
    ReplicaGroupError,
    from_storable,
    lighthouse_status,
    load_portable,
    portable_state,
    storable,
)
from lioncub.integrations.torchft import params_digest as tensors_digest
from lioncub.launch.groups import Fault, Resumed, parse_faults, schedule_after
from lioncub.launch.preload import end_rank
from lioncub.names import PEER_VARIANTS
from lioncub.optim import Lion, LionCub, VoteMesh
from lioncub.optim.engine import PhaseClock
from lioncub.rundir import open_append, write_atomically
from lioncub.train import checkpoint, loop, sharding
from lioncub.train.config import TrainConfig
from lioncub.train.lr import lr_factor
from lioncub.train.memory import gradient_bytes, largest_over_ranks, rank_memory, tensor_bytes
from lioncub.train.rank import PG_TIMEOUT_S, interrupt_as_one_line, run_of
from lioncub.train.runlog import append_record
from lioncub.train.workloads import Workload, make_workload

__all__ = [
    "MODEL_FILE",
    "checkpoint_steps",
    "cut_name",
    "end_name",
    "ended_name",
    "group_files",
    "log_name",
    "main",
    "params_digest",
    "ready_name",
    "run_group",
]


#: the final model's ``state_dict`` (``torch.save``), written by the first participant of the last quorum
MODEL_FILE = "model.pt"


def log_name(group: int) -> str:
    """Group ``group``'s log in the run directory."""
    return f"groups/g{group}.jsonl"


def cut_name(group: int) -> str:
    """Where the records of group ``group``'s log after a checkpoint go when a launch over it (a resume, a
    restart) cuts the log back to it: kept, not deleted."""
    return f"groups/g{group}.cut.jsonl"


def end_name(group: int) -> str:
    """What group ``group`` writes when it finished the run."""
    return f"groups/g{group}.end.json"


def ready_name(group: int, life: int) -> str:
    """The mark group ``group`` leaves when it started (``life`` 0) or started again and is about to join
    the next quorum."""
    return f"groups/g{group}.ready{life}"


def ended_name(group: int, life: int) -> str:
    """The mark the launcher's driver leaves when life ``life`` of group ``group`` ended (its exit code):
    the groups waiting for it to start again (``--rejoin``) go on without it."""
    return f"groups/g{group}.ended{life}"


def group_files(groups: int, faults: list[Fault]) -> list[str]:
    """Every file the groups of a run write, and the driver's marks of their ends (recorded before the
    launch)."""
    files = [
        name
        for g in range(groups)
        for name in (log_name(g), log_name(g) + ".part", cut_name(g), end_name(g), end_name(g) + ".part")
    ]
    files += [MODEL_FILE, MODEL_FILE + ".part"]
    lives = {g: 0 for g in range(groups)}
    for f in faults:
        if f.kind == "rejoin":
            lives[f.group] += 1
    marks = [
        mark(g, life)
        for g in range(groups)
        for life in range(lives[g] + 1)
        for mark in (ready_name, ended_name)
    ]
    return files + [name for mark in marks for name in (mark, mark + ".part")]


def checkpoint_steps(config: TrainConfig) -> list[int]:
    """The steps after which a fault-tolerant run writes a checkpoint (if the step was committed): every
    ``--checkpoint-every`` K steps, ``--stop-at``, and the last step when K is given ([] without K and
    ``--stop-at``)."""
    run = config.run
    steps = (
        list(range(run.checkpoint_every, run.steps + 1, run.checkpoint_every)) if run.checkpoint_every else []
    )
    steps += [run.stop_at] if run.stop_at is not None else []
    steps += [run.steps] if steps else []
    return sorted(set(steps))


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order (FSDP2's: of this rank's local shards): equal digests,
    bitwise equal replicas (shards)."""
    return tensors_digest([p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()])


def _local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """The local shards of a model sharded by FSDP2 (every parameter a ``DTensor``), in parameter order:
    views of its storage (copying into them writes the parameters)."""
    shards = [p.to_local() for p in model.parameters() if isinstance(p, DTensor)]
    assert len(shards) == len(list(model.parameters())), "a model sharded by fully_shard"
    return shards


@dataclasses.dataclass
class _Position:
    """Where the loop is: the last step finished (0: none) and the training seconds so far. A healing
    group takes its peer's (torchft's state dict key ``loop``)."""

    step: int = 0
    elapsed: float = 0.0
    healed: bool = False  # load() ran: the position is a peer's

    def save(self) -> dict[str, Any]:
        return {"step": self.step, "elapsed": self.elapsed}

    def load(self, state: dict[str, Any]) -> None:
        self.step, self.elapsed, self.healed = int(state["step"]), float(state["elapsed"]), True


def _wait(ready: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``ready()`` until it is true; the seconds waited. ``ReplicaGroupError`` naming ``what`` after
    ``timeout_s``."""
    t0 = time.perf_counter()
    while not ready():
        if time.perf_counter() - t0 > timeout_s:
            raise ReplicaGroupError(f"{what} within {timeout_s:g} s")
        time.sleep(0.02)
    return time.perf_counter() - t0


def _await_rejoins(
    run_dir: Path, lighthouse: str, pending: list[tuple[int, int, int]], done: int, timeout_s: float
) -> float:
    """Before this group asks for a quorum after step ``done``: for the groups the schedule started again
    by then (``pending``'s ``(group, life, step)``, removed once handled), wait for their ready marks and
    until they have asked the lighthouse for the quorum themselves. torchft forms a quorum at once when
    the previous one's members have all asked ("fast quorum"), so a group that asks later joins one step
    (window) later; asking first, the groups that start again are in the quorum at a known step. A group
    whose start ended (the driver's :func:`ended_name` mark: it died at its start) is not waited for: the
    others go on without it. The seconds waited (emulation: not training time)."""
    due = [e for e in pending if e[2] <= done]
    if not due:
        return 0.0
    t0 = time.perf_counter()
    while True:
        coming = [e for e in due if not (run_dir / ended_name(e[0], e[1])).exists()]
        waiting = [e for e in coming if not (run_dir / ready_name(e[0], e[1])).exists()]
        if not waiting and (not coming or lighthouse_status(lighthouse).asking >= len(coming)):
            break
        if time.perf_counter() - t0 > timeout_s:
            g, _, s = (waiting or coming)[0]
            what = "start again after" if waiting else "ask for a quorum after"
            raise ReplicaGroupError(f"group {g} did not {what} --rejoin {g}@{s} within {timeout_s:g} s")
        time.sleep(0.02)
    for e in due:
        pending.remove(e)
    return time.perf_counter() - t0


class _Writer:
    """This process's part of the checkpoints, written by a background thread (one at a time, in order),
    so that the step waits only for the serialisation: :meth:`put` a step's parts (encoded bytes); in the
    quorum's first participant, once every participant's part of the step is there (bounded by
    ``timeout_s``), the checkpoint is completed. :meth:`wait` blocks until everything put is written;
    :attr:`done` lists what was written (the records of the group's log), :attr:`errors` what failed."""

    def __init__(self, run_dir: Path, world_size: int, meta: dict[str, Any], timeout_s: float) -> None:
        self.run_dir, self.world_size, self.meta, self.timeout_s = run_dir, world_size, meta, timeout_s
        self.jobs: queue.Queue[tuple[int, list[tuple[str, bytes, str]], int, dict[str, Any]] | None] = (
            queue.Queue()
        )
        self.done: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="lioncub-checkpoints", daemon=True)
        self.thread.start()

    def put(self, step: int, parts: list[tuple[str, bytes, str]], expected: int, ft: dict[str, Any]) -> None:
        """Write ``parts`` (name, bytes, SHA-256) of the checkpoint of ``step``; ``expected`` > 0: then
        complete it once ``expected`` ranks' parts are there, with ``ft`` in its ``meta.json``."""
        self.jobs.put((step, parts, expected, ft))

    def wait(self) -> None:
        """Until every part put so far is written (and its checkpoint completed, where this process does)."""
        self.jobs.join()

    def close(self) -> None:
        self.wait()
        self.jobs.put(None)
        self.thread.join(timeout=5.0)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._write(*job)
            except Exception as exc:  # any: a thread that died would leave wait() waiting forever
                self.errors.append(f"checkpoint of step {job[0]}: {type(exc).__name__}: {exc}")
            finally:
                self.jobs.task_done()
        self.jobs.task_done()

    def _write(
        self, step: int, parts: list[tuple[str, bytes, str]], expected: int, ft: dict[str, Any]
    ) -> None:
        t0 = time.perf_counter()
        for name, data, digest in parts:
            checkpoint.write_part(self.run_dir, step, name, data, digest)
        rec: dict[str, Any] = {"step": step, "write_s": time.perf_counter() - t0,
                               "bytes": sum(len(p[1]) for p in parts)}  # fmt: skip
        if expected:
            deadline = time.monotonic() + self.timeout_s
            while len(ranks := checkpoint.parts_written(self.run_dir, step)) < expected:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"only ranks {ranks} of the {expected} of the quorum wrote their part within "
                        f"{self.timeout_s:g} s (--collective-timeout); it stays incomplete"
                    )
                time.sleep(0.01)
            path = checkpoint.complete_parts(
                self.run_dir,
                step,
                self.world_size,
                ranks,
                {**self.meta, "fault_tolerant": {**ft, "ranks": ranks}},
            )
            rec.update(completed=str(path.relative_to(self.run_dir)), complete_s=time.perf_counter() - t0)
        self.done.append(rec)


class _Quiet(logging.Filter):
    """Drops torchft's warning at every quorum of a CPU job that it cannot reset NCCL's flight recorder."""

    def filter(self, rec: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in rec.getMessage()


def _group(
    config: TrainConfig,
    wl: Workload,
    model: torch.nn.Module,
    index: int,
    lighthouse: str,
    host: str,
    timeout_s: float,
    mesh: DeviceMesh | None = None,
) -> tuple[ReplicaGroup | DiLoCoGroup, loop.OptimizerSetup]:
    """This replica group and its optimizer: the variant's ``LionCub`` over a :class:`ReplicaGroup`, or
    for ``torchft-diloco`` lioncub's ``Lion`` inside torchft's DiLoCo (:class:`DiLoCoGroup`). In a group of
    several ranks (``--nnodes``) ``model`` is DDP over the group's ranks and this rank's ``LionCub`` votes
    its share of the parameters (``VoteMesh(group.comm, None, broadcast="caller")``: ``opt.shares``, whose
    broadcast the ``ReplicaGroup`` runs once the step stands); with
    ``--fsdp`` (``mesh``: the group's own ``(1, L)`` mesh) ``model`` is sharded over the group's ranks and
    ``LionCub`` votes on this rank's shards with the same shard rank of the other groups
    (``VoteMesh(group.comm, mesh)``)."""
    opt, cluster = config.optimizer, config.cluster
    size = cluster.nproc_per_node
    if opt.variant in PEER_VARIANTS:
        inner = Lion(wl.param_groups(model), betas=wl.betas)
        rule = opt.build().local_steps  # the outer rule diloco, each worker's momenta kept
        assert rule is not None  # torchft-diloco runs with --local-steps H (TrainConfig's check)
        peer = DiLoCoGroup(
            lighthouse,
            index,
            cluster.replica_groups,
            model,
            inner,
            rule.h,
            outer_lr=rule.lr,
            outer_momentum=rule.betas[0],
            timeout_s=timeout_s,
            host=host,
        )
        return peer, loop.OptimizerSetup(inner, model, None)
    group = ReplicaGroup(
        lighthouse,
        index,
        max_groups=cluster.replica_groups,
        momentum_on_heal=cluster.momentum_on_heal,
        timeout_s=timeout_s,  # --collective-timeout: every collective, heal, commit and quorum
        quorum_timeout_s=timeout_s,
        host=host,
        init_sync=False,  # every group builds the same model from the seed: the digests say so
        group_rank=dist.get_rank() if size > 1 else 0,
        group_world_size=size,
        store=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if size > 1 else "",
    )
    if mesh is not None:  # FSDP2 inside the group: each rank votes on its shards, nothing to share
        setup = loop.build_optimizer(config, wl, model, 1, process_group=VoteMesh(group.comm, mesh))
        assert isinstance(setup.opt, LionCub)
        group.attach(setup.opt)
        return group, setup
    shares = VoteMesh(group.comm, None, broadcast="caller")  # each rank its share, broadcast at the commit
    setup = loop.build_optimizer(config, wl, model, 1, process_group=shares if size > 1 else group.comm)
    assert isinstance(setup.opt, LionCub)
    group.attach(setup.opt)
    return group, setup


def _schedule(config: TrainConfig, index: int, life: int) -> tuple[set[int], list[tuple[int, int, int]]]:
    """The step after which this group holds for its ``--kill`` (this life's: the ``life``-th kill of the
    group; a group started again never holds at an earlier life's step), and the starts again it waits
    for as ``(group, life, step)``: not its own, nor its earlier lives'."""
    cluster = config.cluster
    faults = parse_faults(
        cluster.kill, cluster.rejoin, cluster.replica_groups, config.run.steps, config.optimizer.local_steps
    )
    own = [f.step for f in faults if f.kind == "kill" and f.group == index]
    kills = set(own[life : life + 1])
    lives: dict[int, int] = {}
    pending = []
    for f in faults:
        if f.kind == "rejoin":
            lives[f.group] = lives.get(f.group, 0) + 1
            if f.group != index or lives[f.group] > life:
                pending.append((f.group, lives[f.group], f.step))
    return kills, pending


class _GroupLoop:
    """The loop of one replica group (module docstring): its parts, :meth:`run` and one :meth:`step`."""

    def __init__(self, config: TrainConfig, run_dir: Path, index: int, life: int, lighthouse: str, host: str):
        run, cluster = config.run, config.cluster
        self.config, self.run_dir, self.index, self.life, self.lighthouse = (
            config,
            run_dir,
            index,
            life,
            lighthouse,
        )
        self.kills, self.pending = _schedule(config, index, life)
        timeout = env.seconds("LIONCUB_PG_TIMEOUT")
        self.timeout_s = timeout.total_seconds() if timeout is not None else PG_TIMEOUT_S
        self.size = cluster.nproc_per_node  # ranks in a group: with --nnodes, DDP among them
        if self.size > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self.rank = dist.get_rank() if self.size > 1 else 0  # in the group; rank 0 writes its files
        self.wl = make_workload(
            run.workload, run.size, rank=index * self.size + self.rank, world_size=cluster.nproc,
            seed=run.seed, data_mode=run.data_mode, device=torch.device("cpu"), **run.overrides,
        )  # fmt: skip
        self.model = self.wl.build_model()
        loop.seed_rank(run.seed, index * self.size + self.rank, life)  # dropout: each rank's and life's
        #: --fsdp: the group's own mesh (1, L), the model sharded over its ranks (no DDP); else None
        self.mesh = sharding.node_mesh(1, self.size, torch.device("cpu")) if cluster.fsdp else None
        model: torch.nn.Module = self.model
        if self.mesh is not None:
            sharding.shard_model(self.model, self.mesh)
        elif self.size > 1:
            model = DistributedDataParallel(self.model)
        #: --fsdp: the bytes a rank sends for FSDP2 inside its group per step (0: none)
        self.fsdp_intra = sharding.fsdp_intra_bytes(self.model, self.size) if self.mesh is not None else 0
        self.group, self.setup = _group(
            config, self.wl, model, index, lighthouse, host, self.timeout_s, self.mesh
        )
        self.opt = self.setup.opt
        self.position = _Position()
        self.group.register_state("loop", self.position.load, self.position.save)
        for g in self.opt.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.window: list[dict[str, Any]] = []  # this window's records, written when its commit is known
        self.clock = PhaseClock(torch.device("cpu"))
        self.out = -1
        self.heals: list[Heal] = []  # logged
        self.gradients: int | None = None  # bytes of the gradients after this process's first backward
        self.joined = life == 0  # started again: healed at a quorum with a live peer (until then False)
        self.stood = False  # the last step ended a commit boundary and was committed
        self.k = index * self.size + self.rank  # this process's rank in the job: its rank{k}.pt
        self.due = set(checkpoint_steps(config))
        self.writer: _Writer | None = None
        if self.due and isinstance(self.group, ReplicaGroup):
            meta = {"variant": config.optimizer.variant, "workload": run.workload, "size": run.size,
                    "seed": run.seed}  # fmt: skip
            self.writer = _Writer(run_dir, cluster.nproc, meta, self.timeout_s)
        self.launch = self.restore()  # last: the RNG states of a checkpoint

    def restore(self) -> Resumed | None:
        """The launch this start is one of (None: a start again, ``--rejoin``), as :func:`schedule_after`
        sees it from the newest checkpoint. Started by a launch over a checkpoint (a resume, a restart), the
        group loads its own part of it -- the parameters (``model.pt``; with ``--fsdp`` this rank's shards
        in its part), its optimizer state, RNG states,
        data and loop position, torchft's committed count -- and its rejoins to wait for are those after
        the checkpoint; a group without a part there (it was not in the quorum) starts afresh and heals
        from the others at the first quorum, where it is behind them."""
        cluster = self.config.cluster
        meta = checkpoint.latest(self.run_dir) if isinstance(self.group, ReplicaGroup) else None
        step = meta.step if meta is not None else 0
        faults = parse_faults(cluster.kill, cluster.rejoin, cluster.replica_groups, self.config.run.steps,
                              self.config.optimizer.local_steps)  # fmt: skip
        launch = schedule_after(faults, cluster.replica_groups, step)
        if self.index in launch.absent or self.life != launch.lives[self.index]:
            return None
        if meta is None or f"rank{self.k}.pt" not in meta.sha256:
            return launch
        assert isinstance(self.group, ReplicaGroup)
        self.pending[:] = [e for e in self.pending if e[2] > step]
        state = checkpoint.load_rank_state(meta, self.k, meta.world_size)
        assert isinstance(self.opt, LionCub)  # a ReplicaGroup's
        if self.mesh is not None:  # this rank's shards from its part (a resume keeps the run's mesh)
            with torch.no_grad():
                for t, value in zip(_local_shards(self.model), state["shards"], strict=True):
                    t.copy_(value)
            load_portable(self.opt, from_storable(state["optimizer"]))  # the quorum's N then
        else:
            self.model.load_state_dict(checkpoint.model_state(meta))
            self.opt.load_state_dict(state["optimizer"], allow_world_size_change=True)  # the quorum's N then
        self.wl.load_state_dict(state["data"])
        self.group.load_state_dict(state["group"]["replica_group"])
        self.position.step, self.position.elapsed = state["group"]["step"], state["group"]["elapsed"]
        self.joined = True
        checkpoint.restore_rng(state)
        return launch

    def save(self, step: int) -> None:
        """This process's part of the checkpoint of ``step`` (module docstring, point 5): serialised now,
        written by :attr:`writer`; the quorum's first participant also writes ``model.pt`` and completes it.
        The step's stall (wall and CPU seconds of the serialisation) goes into the group's log."""
        assert self.writer is not None and isinstance(self.group, ReplicaGroup)
        t0, cpu0 = time.perf_counter(), time.process_time()
        group = self.group
        if self.mesh is not None:  # this rank's shards: the optimizer's in the heal's form, the parameters'
            assert isinstance(self.opt, LionCub)
            optimizer = storable(portable_state(self.opt))
        else:
            optimizer = self.opt.state_dict()
        state = checkpoint.part_state(optimizer, self.wl.state_dict(), self.k)
        state["group"] = {"replica_group": group.state_dict(), "life": self.life, "index": self.index,
                          **self.position.save()}  # fmt: skip
        if self.mesh is not None:
            state["shards"] = [t.detach().clone() for t in _local_shards(self.model)]
        parts = [(f"rank{self.k}.pt", *checkpoint.encode(state))]
        whole: dict[str, Any] | None = None
        if self.mesh is not None and group.quorum_rank == 0:  # every rank of the first group: collective
            whole = sharding.full_model_state(self.model)
        first = group.quorum_rank == 0 and self.rank == 0
        if first:
            model = whole if whole is not None else self.model.state_dict()
            parts.append(("model.pt", *checkpoint.encode(model)))
        cluster = self.config.cluster  # the schedule: a resume's lives follow from its events up to here
        ft = {"participants": group.participants, "ranks_per_group": self.size, "kill": list(cluster.kill),
              "rejoin": list(cluster.rejoin)}  # fmt: skip
        self.writer.put(step, parts, group.participants * self.size if first else 0, ft)
        self.write({"kind": "checkpoint", "step": step, "group": self.index, "life": self.life,
                    "stall_s": time.perf_counter() - t0, "stall_cpu_s": time.process_time() - cpu0,
                    "bytes": sum(len(p[1]) for p in parts), "completes": first})  # fmt: skip
        self.drain()

    def drain(self, wait: bool = False) -> None:
        """The writer's news into the log (what it wrote, in how long) and its errors on stderr; ``wait``:
        first until everything put is written."""
        if self.writer is None:
            return
        if wait:
            self.writer.wait()
        while self.writer.done:
            self.write({"kind": "checkpoint_written", "group": self.index, **self.writer.done.pop(0)})
        while self.writer.errors:
            print(f"group {self.index}: {self.writer.errors.pop(0)}", file=sys.stderr, flush=True)

    def join(self) -> None:
        """Say this group is ready once the lighthouse lists it (a quorum then waits for it); started by
        the launch (not a rejoin), wait for every group it starts, so that the first quorum has them all."""
        listed = f"{self.group.lighthouse_id}: seen"
        what = f"the lighthouse did not list group {self.index}"
        _wait(lambda: listed in lighthouse_status(self.lighthouse).text, self.timeout_s, what)
        if self.rank == 0:
            write_atomically(self.run_dir / ready_name(self.index, self.life), f"{os.getpid()}\n")
        if self.launch is not None:
            lives, absent = self.launch.lives, self.launch.absent
            for g in (g for g in range(self.config.cluster.replica_groups) if g not in absent):
                mark = self.run_dir / ready_name(g, lives[g])
                _wait(mark.exists, self.timeout_s, f"group {g} did not start")

    def run(self) -> None:
        """Every step until the run's last (holding after a ``--kill`` step), then the end record."""
        self.join()
        if self.rank == 0:
            self.out = open_append(self.run_dir / log_name(self.index))
        run = self.config.run
        while self.position.step < (run.stop_at or run.steps):
            step = self.step()
            if self.stood and step in self.due and self.writer is not None:
                self.save(step)
            if step in self.kills:
                self.drain(wait=True)  # its part of a checkpoint of this step is whole before it dies
                if self.size > 1:  # and every rank's: the launcher's SIGKILL follows rank 0's hold record
                    dist.barrier()
                for r in self.window:
                    self.write({**r, "committed": None})  # the window dies with the group
                self.write({"kind": "hold", "step": step, "group": self.index})
                time.sleep(self.timeout_s)  # until the launcher's SIGKILL (--kill), bounded
                raise ReplicaGroupError(
                    f"held after its step {step} (--kill {self.index}@{step}) for {self.timeout_s:g} s "
                    "without the launcher's SIGKILL; it stops"
                )
        self.finish()

    def step(self) -> int:
        """One step (module docstring, point 2); the step it was."""
        run, group, position, opt = self.config.run, self.group, self.position, self.opt
        held = 0.0
        if group.boundary:
            held = _await_rejoins(self.run_dir, self.lighthouse, self.pending, position.step, self.timeout_s)
        t0 = self.clock()
        quorum = group.boundary and not isinstance(group, DiLoCoGroup)
        participants = group.begin()  # the quorum; a heal moves the position to the peer's
        t1 = self.clock()
        left_out = group.left_out if isinstance(group, ReplicaGroup) else None
        if left_out is not None:  # its heal failed: it sits this step out, and heals at the next quorum
            group.step()
            self.write({"kind": "left_out", "step": position.step + 1, "group": self.index,
                        "life": self.life, "why": left_out})  # fmt: skip
            return position.step
        if quorum:
            self.check_alone(participants)
            self.check_joined(participants)
        if position.healed:  # started again: the starts before it are the others' business
            self.pending[:] = [e for e in self.pending if e[2] > position.step]
        position.healed = False
        step = position.step + 1
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * lr_factor(step, run.steps, run.warmup, run.min_lr_ratio)
        loss = self.wl.loss(self.setup.model, self.wl.train_batch(step - 1))
        loss.backward()
        if self.gradients is None:  # once: every backward allocates the same gradients
            self.gradients = gradient_bytes(self.model)
        t2 = self.clock()
        ends = group.step_ends_boundary
        committed = group.step()
        self.stood = ends and committed
        self.model.zero_grad(set_to_none=True)  # every parameter's, the ones of other ranks' shares too
        t3 = self.clock()
        rec = loop.step_record(self.setup, step, t2 - t1, t3 - t2, None)
        rec["step_s"] += t1 - t0
        if ends and not committed:  # put back: its exchange (or commit) failed, nothing was applied, and
            # the optimizer's figures are not this step's: its phase was the wait on a peer that failed
            rec.update(comm_s=t3 - t2, exchange_s=t3 - t2, apply_s=0.0)
        if position.healed:  # torchft's DiLoCo heals at a window's end: this window was replaced
            self.pending[:] = [e for e in self.pending if e[2] > position.step]
            self.window = [{**r, "replaced": True} for r in self.window]
            step = rec["step"] = position.step + 1
        if isinstance(group, DiLoCoGroup) and ends:  # the sync ran in the inner step's hook
            self.check_joined(group.participants)
            n = group.participants
            ring = 2 * (n - 1) / n * 4 * sum(p.numel() for p in self.model.parameters())  # fp32 ring
            rec.update(comm_s=t3 - t2, exchange_s=t3 - t2, apply_s=0.0, collectives=1, bytes_sent=ring,
                       bytes_recv=ring)  # fmt: skip
        if self.size > 1:  # a node: its ranks vote their shares between the nodes, DDP runs inside it
            rec.update(self.node_bytes(rec["bytes_sent"], rec["bytes_recv"]))
        position.step, position.elapsed = step, position.elapsed + rec["step_s"]
        rec.update(time_s=position.elapsed, quorum_s=t1 - t0, held_s=held, participants=participants,
                   loss=float(loss.detach()), lr=opt.param_groups[0]["lr"], group=self.index)  # fmt: skip
        self.window.append(rec)
        for heal in self.new_heals():  # a group killed later has no end record: log it now
            # the loop's step it healed to (the schedule's steps), and the optimizer's (skipped steps aside)
            self.write({"kind": "heal", "group": self.index, "life": self.life, **dataclasses.asdict(heal),
                        "step": step - 1, "optimizer_step": heal.step})  # fmt: skip
        if ends:
            due = (run.eval_every and step % run.eval_every == 0) or step == run.steps
            if due and (self.rank == 0 or self.mesh is not None):  # on shards: every rank's forward gathers
                # before the step records: the launcher's --kill waits for those
                scores = self.wl.evaluate(self.model)
                if self.mesh is not None:
                    sharding.reshard(self.model)  # the root stays gathered after a forward
                self.write({"kind": "eval", "step": step, "time_s": position.elapsed, "group": self.index,
                            **scores})  # fmt: skip
            for r in self.window:  # the quorum's size, known at the window's end with torchft's DiLoCo
                done = committed and not r.pop("replaced", False)
                self.write({**r, "participants": group.participants, "committed": done})
            self.window.clear()
        elif step == run.steps:
            raise AssertionError("the run's last step ends a window (--steps is a multiple of H)")
        return step

    def check_alone(self, participants: int) -> None:
        """After a quorum: a group alone in it (not healed) after another group of the job has finished
        the run stops (``ReplicaGroupError``): it missed the quorums (stalled past ``--collective-timeout``,
        say) while the others trained on and finished, and training alone now would make a replica of its
        own -- its steps are not the job's and it writes no ``model.pt``. Alone while the others are only
        gone (killed) it trains on: the job's one live group."""
        groups = self.config.cluster.replica_groups
        if participants > 1 or self.position.healed or groups == 1:
            return
        done = [g for g in range(groups) if g != self.index and (self.run_dir / end_name(g)).exists()]
        if done:
            raise ReplicaGroupError(
                f"alone in its quorum after its step {self.position.step}, and group(s) "
                f"{', '.join(map(str, done))} finished the run without it (it missed their quorums: stalled "
                "past --collective-timeout?): it stops rather than train alone; its replica is not the job's"
            )

    def check_joined(self, participants: int) -> None:
        """After a quorum: a group started again (``--rejoin``) that its first quorum did not heal, alone in
        it, stops (``ReplicaGroupError``) rather than train alone from scratch: the others finished or died
        (the schedule's check refuses a rejoin after the last window start; this bounds what it cannot
        see, e.g. groups that finished early)."""
        if self.joined:
            return
        if self.position.healed or participants > 1:
            self.joined = True
            return
        raise ReplicaGroupError(
            f"started again (life {self.life}), its first quorum has no other group to heal it from (the "
            f"others finished or died): it stops rather than train alone from step {self.position.step}"
        )

    def node_bytes(self, sent: float, recv: float) -> dict[str, float]:
        """A step's bytes in a group of L ranks (a node): every rank votes its share with the other groups
        through the node's NIC; inside the node DDP allreduces the gradients (a ring: 2·(L−1)/L of their
        bytes per rank) and each rank broadcasts its share of the parameters to the others ((L−1)/L of the
        parameters' bytes per rank, the mean: whatever the tree, a broadcast reaches L − 1 ranks), both
        estimated from the parameters, sent and received alike. ``bytes_sent``/``bytes_recv``: a rank's,
        the mean of the node's ranks (their shares differ); ``nic_bytes``: the node's vote, all its ranks'
        shares; ``intra_bytes``: a rank's inside the node (:mod:`lioncub.train.nodebytes`). With ``--fsdp``
        as the plain sharded run records them (docs/shards.md): ``bytes_sent``/``bytes_recv`` the vote's
        only (the mean of the ranks'), ``intra_bytes`` FSDP2's
        (:func:`lioncub.train.sharding.fsdp_intra_bytes`)."""
        traffic = torch.tensor([sent, recv], dtype=torch.float64)
        dist.all_reduce(traffic)
        node_sent, node_recv = traffic.tolist()
        if self.mesh is not None:
            return {"bytes_sent": node_sent / self.size, "bytes_recv": node_recv / self.size,
                    "nic_bytes": node_sent, "intra_bytes": float(self.fsdp_intra)}  # fmt: skip
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        inside = 3 * (self.size - 1) / self.size * nbytes  # the ring's 2·(L−1)/L and the broadcasts' (L−1)/L
        return {
            "bytes_sent": node_sent / self.size + inside, "bytes_recv": node_recv / self.size + inside,
            "nic_bytes": node_sent, "intra_bytes": inside,
        }  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        """A record of this group's log (its rank 0 writes it)."""
        if self.rank == 0:
            append_record(self.out, record)

    def memory(self) -> dict[str, int]:
        """The bytes a rank of this group holds (:mod:`lioncub.train.memory`), the largest over the group's
        ranks (collective among them); torchft's DiLoCo: with its outer momenta and its backup."""
        optimizers: list[torch.optim.Optimizer] = [self.opt]
        extra = 0
        if isinstance(self.group, DiLoCoGroup):
            optimizers.append(self.group.outer)
            extra = sum(tensor_bytes(t) for t in self.group.backup())
        memory = rank_memory(self.model, optimizers, self.gradients or 0, extra_state=extra)
        return largest_over_ranks(memory, torch.device("cpu")) if self.size > 1 else memory

    def new_heals(self) -> list[Heal]:
        """This group's heals since the last call (kept in :attr:`heals`)."""
        new = self.group.heals[len(self.heals) :]
        self.heals += new
        return new

    def finish(self) -> None:
        """``groups/gG.end.json`` (with whether the ranks of the group hold the same parameters), and the
        model from the first participant of the last quorum."""
        group, model = self.group, self.model
        self.drain(wait=True)  # the last checkpoint complete before the group says it finished
        digest = params_digest(model)
        digests: list[str | None] = [digest]
        if self.size > 1:
            digests = [None] * self.size
            dist.all_gather_object(digests, digest)
        ranks_equal = len(set(digests)) == 1
        if self.mesh is not None:  # each rank its shards: the group's digest is its ranks' in shard order,
            # so equal digests of two groups are every shard equal to the same shard rank's
            digest = hashlib.sha256(",".join(map(str, digests)).encode()).hexdigest()
            ranks_equal = True  # the ranks hold different shards of one replica
        memory = self.memory()
        last = group.quorum_rank == 0 and self.position.step == self.config.run.steps  # not at --stop-at
        whole = sharding.full_model_state(model) if self.mesh is not None and last else None  # collective
        if self.rank != 0:
            return
        end = {
            "group": self.index, "life": self.life, "step": self.position.step,
            "digest": digest, "ranks_equal": ranks_equal,
            "params": sum(p.numel() for p in model.parameters()),
            "info": {k: v for k, v in self.wl.info().items() if isinstance(v, (int, float, str, bool))},
            "committed": group.committed, "skipped": group.skipped,
            "heals": [dataclasses.asdict(h) for h in self.heals], "memory": memory,
        }  # fmt: skip
        write_atomically(self.run_dir / end_name(self.index), json.dumps(end) + "\n")
        if last:
            buffer = io.BytesIO()
            torch.save(whole if whole is not None else model.state_dict(), buffer)
            write_atomically(self.run_dir / MODEL_FILE, buffer.getvalue())


def run_group(config: TrainConfig, run_dir: Path, index: int, life: int, lighthouse: str, host: str) -> int:
    """Train as replica group ``index`` (its ``life``-th start) of the fault-tolerant run in ``run_dir``;
    the exit status."""
    logging.getLogger("torchft.manager").addFilter(_Quiet())
    # a heal's tensors arrive in read-only buffers; they are copied into the replica at once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.set_num_threads(int(env.text("LIONCUB_THREADS")))
    group_loop = None
    try:
        with interrupt_as_one_line(
            lambda: f"at step {group_loop.position.step + 1 if group_loop else 1} (group {index})"
        ):
            group_loop = _GroupLoop(config, run_dir, index, life, lighthouse, host)
            group_loop.run()
    except ReplicaGroupError as exc:
        print(f"group {index}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if group_loop is not None:
            if group_loop.writer is not None:
                group_loop.writer.close()
            if group_loop.out >= 0:
                os.close(group_loop.out)
            group_loop.group.shutdown()
            if group_loop.size > 1:
                # The GIL released a moment before the group and DDP's reducer go: a gloo worker thread
                # resets the work it just ran (the last collective's) under the group's lock and needs the
                # GIL for its tensors, while the reducer's destructor takes that lock holding the GIL (a rank
                # of a two-rank group hung so at the end of a full run: py-spy, ~ProcessGroupGloo against
                # ~AsyncAllreduceWork)
                time.sleep(0.1)
                dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lioncub.train.replica_group RUN_DIR [CONFIG]``, started by the launcher of a
    fault-tolerant run (:mod:`lioncub.launch.groups`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not env.get("LIONCUB_GROUP") or not env.get("LIONCUB_LIGHTHOUSE"):
        print(
            "usage: python -m lioncub.train.replica_group RUN_DIR [CONFIG]  (started by lioncub train "
            "--fault-tolerant, which sets LIONCUB_GROUP, LIONCUB_GROUP_LIFE, LIONCUB_LIGHTHOUSE)",
            file=sys.stderr,
        )
        return 2
    run_dir, config = run_of(args)
    return run_group(
        config,
        run_dir,
        int(env.text("LIONCUB_GROUP")),
        int(env.text("LIONCUB_GROUP_LIFE")),
        env.text("LIONCUB_LIGHTHOUSE"),
        env.text("LIONCUB_GROUP_HOST"),
    )


if __name__ == "__main__":
    # the group's files are written and closed by now (atomically, or record by record: run_group's finally
    # closed its log): it ends without the interpreter's teardown (~0.3 s of a core per group forked from
    # the preloaded interpreter, a second of wall on a loaded machine, while the launcher waits)
    end_rank(main())
