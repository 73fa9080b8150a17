"""One replica group of a fault-tolerant run (``lioncub train --fault-tolerant``): the training loop of a
process that votes with the other groups through :class:`lioncub.integrations.torchft.ReplicaGroup`.

:func:`lioncub.launch.groups.launch_groups` starts it as ``python -m lioncub.train.replica_group RUN_DIR
[CONFIG]`` with ``LIONCUB_GROUP`` (its index G), ``LIONCUB_GROUP_LIFE`` (0, or k at its k-th rejoin),
``LIONCUB_LIGHTHOUSE`` and ``LIONCUB_GROUP_HOST``. Read it top to bottom in :func:`run_group`:

1. The workload (data shard G of ``--nproc``), the model (every group builds the same one from the seed)
   and the variant's ``LionCub`` over the group's :class:`~lioncub.collectives.GroupComm`
   (:func:`lioncub.train.loop.build_optimizer`), attached to the ``ReplicaGroup``. The loop's position
   (the last step finished and the training seconds so far) is state a healing group takes from its peer.
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

:mod:`lioncub.train.fault_tolerant` launches the groups and merges their logs into the run's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lioncub import env
from lioncub.integrations.torchft import DiLoCoGroup, ReplicaGroup, ReplicaGroupError
from lioncub.launch.groups import Fault, parse_faults
from lioncub.names import PEER_VARIANTS
from lioncub.optim import Lion, LionCub, LocalSteps
from lioncub.optim.engine import PhaseClock
from lioncub.rundir import open_append, write_atomically
from lioncub.train import loop
from lioncub.train.config import TrainConfig, lr_factor
from lioncub.train.rank import PG_TIMEOUT_S, interrupt_as_one_line
from lioncub.train.runlog import append_record
from lioncub.train.workloads import Workload, make_workload

__all__ = [
    "MODEL_FILE",
    "end_name",
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


def end_name(group: int) -> str:
    """What group ``group`` writes when it finished the run."""
    return f"groups/g{group}.end.json"


def ready_name(group: int, life: int) -> str:
    """The mark group ``group`` leaves when it started (``life`` 0) or started again and is about to join
    the next quorum."""
    return f"groups/g{group}.ready{life}"


def group_files(groups: int, faults: list[Fault]) -> list[str]:
    """Every file the groups of a run write (the driver records them before the launch)."""
    files = [name for g in range(groups) for name in (log_name(g), end_name(g), end_name(g) + ".part")]
    files += [MODEL_FILE, MODEL_FILE + ".part"]
    marks = [ready_name(g, 0) for g in range(groups)]
    lives = {g: 0 for g in range(groups)}
    for f in faults:
        if f.kind == "rejoin":
            lives[f.group] += 1
            marks.append(ready_name(f.group, lives[f.group]))
    return files + [name for mark in marks for name in (mark, mark + ".part")]


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests, bitwise equal replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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


def _await_heartbeat(lighthouse: str, replica_id: str, timeout_s: float) -> None:
    """Wait until the lighthouse lists ``replica_id`` among the live groups (its ``/status`` page): from
    then on a quorum waits for this group (its join timeout) rather than forming without it, so the
    schedule's starts fall at known steps. ``ReplicaGroupError`` after ``timeout_s``."""
    import urllib.request

    t0 = time.perf_counter()
    while True:
        try:
            with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as page:
                if f"{replica_id}: seen" in page.read().decode(errors="replace"):
                    return
        except OSError:
            pass
        if time.perf_counter() - t0 > timeout_s:
            raise ReplicaGroupError(
                f"the lighthouse {lighthouse} did not list {replica_id} within {timeout_s:g} s"
            )
        time.sleep(0.05)


def _await_rejoins(run_dir: Path, rejoins: list[tuple[int, int, int]], done: int, timeout_s: float) -> float:
    """Wait until every group the schedule started (again) by step ``done`` (``(group, life, step)``) has
    left its ready mark; the seconds waited. ``ReplicaGroupError`` after ``timeout_s``."""
    due = [
        (g, life, s) for g, life, s in rejoins if s <= done and not (run_dir / ready_name(g, life)).exists()
    ]
    if not due:
        return 0.0
    t0 = time.perf_counter()
    for g, life, s in due:
        while not (run_dir / ready_name(g, life)).exists():
            if time.perf_counter() - t0 > timeout_s:
                raise ReplicaGroupError(
                    f"group {g} did not start within {timeout_s:g} s"
                    + (f" of --rejoin {g}@{s}" if life else "")
                    + f" (no {ready_name(g, life)})"
                )
            time.sleep(0.02)
    return time.perf_counter() - t0


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
) -> tuple[ReplicaGroup | DiLoCoGroup, loop.OptimizerSetup]:
    """This replica group and its optimizer: the variant's ``LionCub`` over a :class:`ReplicaGroup`, or
    for ``torchft-diloco`` lioncub's ``Lion`` inside torchft's DiLoCo (:class:`DiLoCoGroup`)."""
    opt, cluster = config.optimizer, config.cluster
    if opt.variant in PEER_VARIANTS:
        inner = Lion(wl.param_groups(model), betas=wl.betas)
        rule = LocalSteps(opt.local_steps, "diloco", opt.outer_lr, opt.outer_betas, inner_momentum="keep")
        peer = DiLoCoGroup(
            lighthouse,
            index,
            cluster.nproc,
            model,
            inner,
            opt.local_steps,
            outer_lr=rule.lr,
            outer_momentum=rule.betas[0],
            timeout_s=timeout_s,
            host=host,
        )
        return peer, loop.OptimizerSetup(inner, model, None)
    group = ReplicaGroup(
        lighthouse,
        index,
        max_groups=cluster.nproc,
        momentum_on_heal=cluster.momentum_on_heal,
        timeout_s=timeout_s,  # --collective-timeout: every collective, heal, commit and quorum
        quorum_timeout_s=timeout_s,
        host=host,
        init_sync=False,  # every group builds the same model from the seed: the digests say so
    )
    setup = loop.build_optimizer(config, wl, model, 1, process_group=group.comm)
    assert isinstance(setup.opt, LionCub)
    group.attach(setup.opt)
    return group, setup


def run_group(config: TrainConfig, run_dir: Path, index: int, life: int, lighthouse: str, host: str) -> int:
    """Train as replica group ``index`` (its ``life``-th start) of the fault-tolerant run in ``run_dir``;
    the exit status."""
    logging.getLogger("torchft.manager").addFilter(_Quiet())
    # a heal's tensors arrive in read-only buffers; they are copied into the replica at once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    run, cluster = config.run, config.cluster
    torch.set_num_threads(int(env.text("LIONCUB_THREADS")))
    faults = parse_faults(cluster.kill, cluster.rejoin, cluster.nproc, run.steps)
    kills = {f.step for f in faults if f.kind == "kill" and f.group == index}
    lives: dict[int, int] = {}
    rejoins = []
    for f in faults:
        if f.kind == "rejoin":
            lives[f.group] = lives.get(f.group, 0) + 1
            rejoins.append((f.group, lives[f.group], f.step))
    wl = make_workload(
        run.workload,
        run.size,
        rank=index,
        world_size=cluster.nproc,
        seed=run.seed,
        data_mode=run.data_mode,
        device=torch.device("cpu"),
        **run.overrides,
    )
    model = wl.build_model()
    loop.seed_rank(run.seed, index, life)  # dropout: each group's own stream, and each life's
    timeout = env.seconds("LIONCUB_PG_TIMEOUT")
    timeout_s = timeout.total_seconds() if timeout is not None else PG_TIMEOUT_S
    group, setup = _group(config, wl, model, index, lighthouse, host, timeout_s)
    opt = setup.opt
    position = _Position()
    group.register_state("loop", position.load, position.save)
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    _await_heartbeat(lighthouse, group.lighthouse_id, timeout_s)  # a quorum waits for this group now
    write_atomically(run_dir / ready_name(index, life), f"{os.getpid()}\n")
    if life == 0:  # the job's first quorum has every group (reruns of a schedule give the same bits)
        _await_rejoins(run_dir, [(g, 0, 0) for g in range(cluster.nproc)], 0, timeout_s)
    out = open_append(run_dir / log_name(index))
    window: list[dict[str, Any]] = []  # this window's records, written when its commit is known
    clock = PhaseClock(torch.device("cpu"))
    try:
        with interrupt_as_one_line(lambda: f"at step {position.step + 1} (group {index})"):
            while position.step < run.steps:
                held = _await_rejoins(run_dir, rejoins, position.step, timeout_s) if group.boundary else 0.0
                t0 = clock()
                participants = group.begin()  # the quorum; a heal moves the position to the peer's
                t1 = clock()
                position.healed = False
                step = position.step + 1
                for g in opt.param_groups:
                    g["lr"] = g["initial_lr"] * lr_factor(step, run.steps, run.warmup, run.min_lr_ratio)
                loss = wl.loss(model, wl.train_batch(step - 1))
                loss.backward()
                t2 = clock()
                ends = group.step_ends_boundary
                committed = group.step()
                opt.zero_grad(set_to_none=True)
                t3 = clock()
                rec = loop.step_record(setup, step, t2 - t1, t3 - t2, None)
                rec["step_s"] += t1 - t0
                if position.healed:  # torchft's DiLoCo heals at a window's end: this window was replaced
                    window = [{**r, "replaced": True} for r in window]
                    step = rec["step"] = position.step + 1
                if isinstance(group, DiLoCoGroup) and ends:  # the sync ran in the inner step's hook
                    n = group.participants
                    ring = 2 * (n - 1) / n * 4 * sum(p.numel() for p in model.parameters())  # fp32 ring
                    rec.update(comm_s=t3 - t2, exchange_s=t3 - t2, apply_s=0.0, collectives=1,
                               bytes_sent=ring, bytes_recv=ring)  # fmt: skip
                position.step, position.elapsed = step, position.elapsed + rec["step_s"]
                rec.update(
                    time_s=position.elapsed,
                    quorum_s=t1 - t0,
                    held_s=held,
                    participants=participants,
                    loss=float(loss.detach()),
                    lr=opt.param_groups[0]["lr"],
                    group=index,
                )
                window.append(rec)
                if ends:
                    if (run.eval_every and step % run.eval_every == 0) or step == run.steps:
                        # before the step records: the launcher's --kill waits for those
                        append_record(out, {"kind": "eval", "step": step, "time_s": position.elapsed,
                                            "group": index, **wl.evaluate(model)})  # fmt: skip
                    for r in window:  # the quorum's size, known at the window's end with torchft's DiLoCo
                        done = committed and not r.pop("replaced", False)
                        append_record(out, {**r, "participants": group.participants, "committed": done})
                    window.clear()
                elif step == run.steps:
                    raise AssertionError("the run's last step ends a window (--steps is a multiple of H)")
                if step in kills:
                    for r in window:
                        append_record(out, {**r, "committed": None})  # the window dies with the group
                    append_record(out, {"kind": "hold", "step": step, "group": index})
                    while True:  # until the launcher's SIGKILL (--kill)
                        time.sleep(60)
            end = {
                "group": index,
                "life": life,
                "step": position.step,
                "digest": params_digest(model),
                "params": sum(p.numel() for p in model.parameters()),
                "info": {k: v for k, v in wl.info().items() if isinstance(v, (int, float, str, bool))},
                "committed": group.committed,
                "skipped": group.skipped,
                "heals": [dataclasses.asdict(h) for h in group.heals],
            }
            write_atomically(run_dir / end_name(index), json.dumps(end) + "\n")
            if group.quorum_rank == 0:  # the model, once: the first participant of the last quorum
                buffer = io.BytesIO()
                torch.save(model.state_dict(), buffer)
                write_atomically(run_dir / MODEL_FILE, buffer.getvalue())
    except ReplicaGroupError as exc:
        print(f"group {index}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        os.close(out)
        group.shutdown()
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
    run_dir = Path(args[0])
    config_path = Path(args[1]) if len(args) == 2 else run_dir / "config.json"
    config = TrainConfig.from_json(json.loads(config_path.read_text()))
    return run_group(
        config,
        run_dir,
        int(env.text("LIONCUB_GROUP")),
        int(env.text("LIONCUB_GROUP_LIFE")),
        env.text("LIONCUB_LIGHTHOUSE"),
        env.text("LIONCUB_GROUP_HOST"),
    )


if __name__ == "__main__":
    sys.exit(main())
