"""A training rank: :func:`run_rank`, the one entry point of every process that trains.

Two command lines reach it. ``python -m lioncub.train.rank RUN_DIR [CONFIG]`` is what the driver
(:mod:`lioncub.train.driver`, behind ``lioncub train`` and ``lioncub compare``) starts on every rank of a
run directory it has prepared; ``lioncub train`` inside a job that ``torchrun`` started (``RANK`` and
``WORLD_SIZE`` set, or ``lioncub launch -- -m lioncub.cli train``) has no driver: its rank 0 takes the
run directory's writer lock and prepares it as the driver would, before any rank trains.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lioncub import env
from lioncub.launch.preload import end_rank
from lioncub.launch.supervisor import FORWARDED_SIGNALS
from lioncub.rundir import hold_ranks, is_marked
from lioncub.train import loop
from lioncub.train.config import TrainConfig
from lioncub.train.driver import check_lanes, check_run_options, format_summary

__all__ = [
    "PG_TIMEOUT_S",
    "format_final",
    "init_distributed",
    "interrupt_as_one_line",
    "main",
    "run_of",
    "run_rank",
    "train_in_job",
]

#: the timeout (s) of the group that a rank creates when ``$LIONCUB_PG_TIMEOUT`` is unset (a torchrun job not
#: started by ``lioncub train``, which always sets it): ``--collective-timeout``'s default
PG_TIMEOUT_S = 600.0


def run_rank(config: TrainConfig, run_dir: Path, *, driven: bool, resume: bool = False) -> int:
    """Train as this rank of the job its environment describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ...), resuming from the run's checkpoints if there are any (a restart); returns the exit status.

    ``driven``: the driver prepared ``run_dir`` (and holds its writer lock) and prints the summary; rank 0
    holds the directory's ranks lock while it lives (:func:`lioncub.rundir.hold_ranks`) and ends
    with the final validation line. Otherwise (``torchrun``, ``lioncub launch``) the world size is the
    job's, every rank checks the options (:func:`lioncub.train.driver.check_run_options`), rank 0 takes the
    writer lock and makes the directory ready as the driver does (a new run, or ``resume``:
    :func:`lioncub.train.prepare.prepare_run_dir`), every rank refuses alike with its ``ValueError``, and
    rank 0 ends with the summary line.

    SIGINT, SIGTERM or SIGHUP (what ``lioncub launch``/``train`` forward on Ctrl-C, or send to stop the
    ranks) end the process with one line, ``interrupted (SIGINT) at step 7``, and exit status 128 + the
    signal (:func:`interrupt_as_one_line`), not a traceback."""
    loop.PROGRESS["step"] = None
    try:
        if driven:
            summary = train_in_job(config, run_dir)
        else:
            config.cluster.nproc = int(os.environ["WORLD_SIZE"])
            check_run_options(config)  # every rank alike, before anything is written
            check_lanes(config)
            summary = train_in_job(config, run_dir, claim=lambda: _claim_run_dir(config, run_dir, resume))
    except KeyboardInterrupt:  # a SIGINT outside interrupt_as_one_line's handler: one line, no traceback
        print(f"interrupted (SIGINT) {loop.where()}", file=sys.stderr)
        return 128 + signal.SIGINT
    if int(os.environ.get("RANK", "0")) == 0:
        if not driven:
            print(format_summary(summary))
        elif summary["final"] is not None:
            print(format_final(summary["final"]))
    return 0


def _claim_run_dir(config: TrainConfig, run_dir: Path, resume: bool) -> Callable[[bool], None]:
    """Collective, in a job without a driver: rank 0 takes ``run_dir``'s writer lock and makes it ready
    (:func:`lioncub.train.prepare.prepare_run_dir`, recording this job so that its restarts go on with the
    run); every rank learns rank 0's verdict and raises its ``ValueError`` alike. Returns what rank 0 does
    when the run ends (``finish(ok)``: :func:`lioncub.train.prepare.finish_run`, then the lock is let go)."""
    from lioncub.train.prepare import finish_run, job_identity, prepare_run_dir

    device = loop.device_for(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the broadcast below runs on this rank's device under NCCL
    verdict, lock = [""], None
    if dist.get_rank() == 0:
        try:
            _, lock = prepare_run_dir(run_dir, config, resume=resume, job=job_identity())
        except (ValueError, TypeError, OSError) as exc:
            verdict[0] = str(exc) or repr(exc)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError(verdict[0])

    def finish(ok: bool) -> None:
        if lock is not None:
            try:
                finish_run(run_dir, ok)
            finally:
                lock.release()

    return finish


def train_in_job(
    config: TrainConfig, run_dir: Path, claim: Callable[[], Callable[[bool], None]] | None = None
) -> dict[str, Any]:
    """This process's whole part of a run: join the job (:func:`init_distributed`), ``claim`` the run
    directory (a job without a driver), :func:`lioncub.train.loop.train`, wait for every rank and leave the
    group, the signals handled by :func:`interrupt_as_one_line`. Returns the summary. Rank 0 of a driven
    run holds the directory's ranks lock meanwhile."""
    torch.set_num_threads(int(env.text("LIONCUB_THREADS")))
    loop.PROGRESS["step"] = None
    ranks = None
    if claim is None and os.environ.get("RANK", "0") == "0" and is_marked(run_dir):
        ranks = hold_ranks(run_dir)
    try:
        with interrupt_as_one_line(loop.where):
            init_distributed(config)
            try:
                finish = claim() if claim is not None else None
                ok = False
                try:
                    summary = loop.train(config, run_dir)
                    dist.barrier()
                    ok = True
                finally:
                    if finish is not None:
                        finish(ok)
            finally:
                dist.destroy_process_group()
    finally:
        if ranks is not None:
            ranks.release()
    return summary


def init_distributed(config: TrainConfig) -> None:
    """``init_process_group`` (NCCL on CUDA, else gloo) from the environment that ``lioncub launch`` or
    ``torchrun`` sets, with ``$LIONCUB_PG_TIMEOUT`` seconds (unset or empty: :data:`PG_TIMEOUT_S`) as every
    collective's timeout.
    On CUDA the rank's device is made current first and bound to the group (``device_id``: NCCL starts
    its communicator on that GPU, not on ``cuda:0``).

    Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) its keys outlive a restart (same port),
    and a restarted rank may read a peer's address from the previous attempt and fail with "Connection
    refused" (pytorch/pytorch#135712): the keys are put under a prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``), which every worker of a restarted job shares."""
    device = loop.device_for(config)
    backend, device_id = "gloo", None
    if device.type == "cuda":  # the rank's GPU is current before NCCL starts, and its communicator's
        torch.cuda.set_device(device)
        backend, device_id = "nccl", device
    timeout = env.seconds("LIONCUB_PG_TIMEOUT")
    if timeout is None:  # the group's timeout when no launcher set one: --collective-timeout's default
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"lioncub/attempt_{attempt}", agent)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
    )


@contextlib.contextmanager
def interrupt_as_one_line(where: Callable[[], str] = lambda: "") -> Iterator[None]:
    """In a rank: end the process with one line on stderr, ``interrupted (SIGINT) at step 7`` (``where()``
    gives the ``at step 7``), and exit status 128 + the signal when SIGINT, SIGTERM or SIGHUP arrives --
    what the launcher forwards on Ctrl-C and sends to stop the ranks -- instead of a ``KeyboardInterrupt``
    traceback (SIGINT) or a silent death (SIGTERM, SIGHUP).

    The signal is acted on at once even while the main thread waits inside a C++ call (a collective): a
    watcher thread reads it from :func:`signal.set_wakeup_fd`; the handler in the main thread does the
    same if it runs first. The process ends with ``os._exit``: files are already written atomically or
    record by record. Outside the main thread this does nothing; on exit everything is put back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    # re-entrant: a second signal while the main thread's handler is in stop() runs stop() again in that
    # thread (a plain Lock deadlocked there, with the watcher waiting too: a rank outliving its launcher)
    once = threading.RLock()
    wanted = {int(sig) for sig in FORWARDED_SIGNALS}

    def stop(signum: int) -> None:
        once.acquire()  # the first caller ends the process; another one waits here until it has
        try:
            detail = where()
        except Exception:  # the line must come out whatever state the rank is in
            detail = ""
        line = f"interrupted ({signal.Signals(signum).name}){' ' + detail if detail else ''}\n"
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(128 + signum)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # the write end was closed: the context is left
                return
            for signum in data:
                if signum in wanted:
                    stop(signum)

    previous = {sig: signal.signal(sig, lambda signum, frame: stop(signum)) for sig in FORWARDED_SIGNALS}
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="lioncub-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_fd)
        watcher.join(1.0)
        os.close(read_fd)


def format_final(final: dict[str, Any]) -> str:
    """``final validation at step 8: val_loss 2.1234, val_acc 0.4560`` from an ``eval`` record."""
    metrics = ", ".join(
        f"{k} {v:.4f}" for k, v in final.items() if k.startswith("val_") and isinstance(v, (int, float))
    )
    return f"final validation at step {final.get('step', '?')}: {metrics or 'no metrics'}"


def main(argv: list[str] | None = None) -> int:
    """``python -m lioncub.train.rank RUN_DIR [CONFIG]``: train ``CONFIG`` (default ``RUN_DIR/config.json``)
    in ``RUN_DIR``, prepared by the driver, as this rank."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print(
            "usage: python -m lioncub.train.rank RUN_DIR [CONFIG]  (inside a torch.distributed job)",
            file=sys.stderr,
        )
        return 2
    run_dir, config = run_of(args)
    return run_rank(config, run_dir, driven=True)


def run_of(args: list[str]) -> tuple[Path, TrainConfig]:
    """``RUN_DIR [CONFIG]`` of a process the driver starts: the run directory and the configuration
    (``CONFIG``, default ``RUN_DIR/config.json``)."""
    run_dir = Path(args[0])
    config_path = Path(args[1]) if len(args) == 2 else run_dir / "config.json"
    return run_dir, TrainConfig.from_json(json.loads(config_path.read_text()))


if __name__ == "__main__":
    end_rank(main())  # without the interpreter's teardown (lioncub.launch.preload.end_rank)
