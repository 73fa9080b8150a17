"""A training rank: :func:`run_rank`, the one entry point of every process that trains.

Two command lines reach it. ``python -m lioncub.train.rank RUN_DIR [CONFIG]`` is what the driver
(:mod:`lioncub.train.driver`, behind ``lioncub train`` and ``lioncub compare``) starts on every rank of a
run directory it has prepared; ``lioncub train`` inside a job that ``torchrun`` started (``RANK`` and
``WORLD_SIZE`` set) has no driver, and its ranks prepare the run directory themselves.
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

from lioncub.launch.supervisor import FORWARDED_SIGNALS
from lioncub.train import loop
from lioncub.train.config import TrainConfig
from lioncub.train.driver import format_summary, write_config
from lioncub.train.rundir import claim, foreign_entries

__all__ = ["format_final", "init_distributed", "interrupt_as_one_line", "main", "run_rank", "train_in_job"]


def run_rank(config: TrainConfig, run_dir: Path, *, driven: bool) -> int:
    """Train as this rank of the job its environment describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ...), resuming from the run's checkpoints if there are any (a restart); returns the exit status.

    ``driven``: the driver prepared ``run_dir`` and prints the summary; rank 0 ends with the final
    validation line. Otherwise (under torchrun) the world size is the job's, every rank refuses (with a
    ``ValueError``) a directory holding files lioncub did not write, rank 0 writes ``config.json`` and ends
    with the summary line.

    SIGINT, SIGTERM or SIGHUP (what ``lioncub launch``/``train`` forward on Ctrl-C, or send to stop the
    ranks) end the process with one line, ``interrupted (SIGINT) at step 7``, and exit status 128 + the
    signal (:func:`interrupt_as_one_line`), not a traceback."""
    if not driven:
        config.cluster.nproc = int(os.environ["WORLD_SIZE"])
        _claim_run_dir(config, run_dir)
    loop.PROGRESS["step"] = None
    try:
        summary = train_in_job(config, run_dir)
    except KeyboardInterrupt:  # a SIGINT outside interrupt_as_one_line's handler: one line, no traceback
        print(f"interrupted (SIGINT) {loop.where()}", file=sys.stderr)
        return 128 + signal.SIGINT
    if int(os.environ.get("RANK", "0")) == 0:
        if not driven:
            print(format_summary(summary))
        elif summary["final"] is not None:
            print(format_final(summary["final"]))
    return 0


def _claim_run_dir(config: TrainConfig, run_dir: Path) -> None:
    """A run directory without a driver: every rank decides alike whether it may write there (what rank 0
    writes is lioncub's); rank 0 claims it and writes ``config.json``."""
    foreign = foreign_entries(run_dir)
    if foreign:
        raise ValueError(
            f"--out {run_dir} holds files lioncub did not write ({', '.join(foreign[:5])}); give a new or "
            "empty directory"
        )
    if int(os.environ["RANK"]) == 0:
        claim(run_dir)
        write_config(run_dir / "config.json", config)


def train_in_job(config: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """This process's whole part of a run: join the job (:func:`init_distributed`),
    :func:`lioncub.train.loop.train`, wait for every rank and leave the group, the signals handled by
    :func:`interrupt_as_one_line`. Returns the summary."""
    torch.set_num_threads(int(os.environ.get("LIONCUB_THREADS", "1")))
    loop.PROGRESS["step"] = None
    with interrupt_as_one_line(loop.where):
        init_distributed(config)
        try:
            summary = loop.train(config, run_dir)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return summary


def init_distributed(config: TrainConfig) -> None:
    """``init_process_group`` (NCCL on CUDA, else gloo) from the environment that ``lioncub launch`` or
    ``torchrun`` sets, with ``$LIONCUB_PG_TIMEOUT`` seconds (default 600) as every collective's timeout.

    Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) its keys outlive a restart (same port),
    and a restarted rank may read a peer's address from the previous attempt and fail with "Connection
    refused" (pytorch/pytorch#135712): the keys are put under a prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``), which every worker of a restarted job shares."""
    backend = "nccl" if loop.device_for(config).type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("LIONCUB_PG_TIMEOUT", "600")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"lioncub/attempt_{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


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
    once = threading.Lock()
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
    run_dir = Path(args[0])
    config_path = Path(args[1]) if len(args) == 2 else run_dir / "config.json"
    config = TrainConfig.from_json(json.loads(config_path.read_text()))
    return run_rank(config, run_dir, driven=True)


if __name__ == "__main__":
    sys.exit(main())
