"""Issue 25: run directories that cannot be fooled -- one writer at a time, ownership from lioncub's own
record only (never a look-alike file), no torn state, every state lioncub leaves resumable or runnable again.

Every case puts files of the user's inside and outside the run directory, hashes every entry under the test's
directory before and after (files by SHA-256, links by target), and checks the exit code. Most cases use run
directories written by lioncub's own functions (a record, a config, checkpoints of a tiny model) and the
in-process CLI with launching stubbed; the ``slow`` ones train the tiny GPT for a few steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import background
import compare_runs
from cli_stub import cli_runner
from lioncub import cli
from lioncub.optim import Lion
from lioncub.rundir import (
    LOCK,
    MARKER,
    RANKS_LOCK,
    claim,
    open_append,
    read_record,
    record,
    remove_owned,
    write_atomically,
    write_owned,
)
from lioncub.train import checkpoint
from lioncub.train.config import TrainConfig
from lioncub.train.prepare import write_config
from lioncub.train.runlog import truncate_log
from ownership_runs import FINISHED, RUN, THESIS

from processes import python_cmd

QUICK = ["--steps", "3", "--eval-every", "0", "--no-progress"]


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable:
    """``lioncub ARGV`` in-process: (exit code, stderr); -1 if it reached the launcher."""
    return cli_runner(capsys, monkeypatch)


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: files by SHA-256, symbolic links by target, directories as ``dir``, FIFOs
    and sockets as ``not a file``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            elif not path.is_file():
                out[rel] = "not a file"  # a FIFO or a socket: never opened
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def user_files(root: Path) -> dict[str, str]:
    """A file of the user's outside the run directories (``root/outside/thesis.tex``); its hash."""
    (root / "outside").mkdir(exist_ok=True)
    (root / "outside" / "thesis.tex").write_bytes(THESIS)
    return tree(root / "outside")


def make_run(
    run_dir: Path, *, checkpoints: tuple[int, ...] = (2, 3), finished: bool = True, **fields: object
) -> TrainConfig:
    """A run directory as lioncub writes it, through its own functions: the record, config.json, a log of
    3 steps, checkpoints of a tiny model at ``checkpoints`` and (``finished``) summary.json."""
    config = TrainConfig.from_json({"steps": 3, "eval_every": 0, **fields})
    claim(run_dir)
    write_config(run_dir, "config.json", config)
    record(run_dir, files=["log.jsonl", "log.jsonl.part"])
    lines = [{"kind": "step", "step": s, "loss": 3.0, "time_s": 0.1 * s, "step_s": 0.1} for s in (1, 2, 3)]
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for step in checkpoints:
        save_tiny(run_dir, step, config.optimizer.variant)
    if finished:
        write_owned(run_dir, "summary.json", json.dumps({"steps_run": 3, "final": None}) + "\n")
    return config


def save_tiny(run_dir: Path, step: int, variant: str = "8bit") -> None:
    """A checkpoint of a one-rank run of a tiny linear model, as the training loop saves one."""
    model = torch.nn.Linear(3, 2)
    parts = {"model": model, "optimizer": Lion(model.parameters(), lr=0.1), "data_state": {}}
    meta = {"variant": variant, "workload": "gpt", "size": "tiny", "seed": 0}
    checkpoint.save(run_dir, step=step, rank=0, world_size=1, meta=meta, barrier=lambda: None, **parts)


# ----------------------------------------------------------------------------- ownership: the record


def test_a_look_alike_config_json_is_the_users(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 2: a config.json with lioncub's keys, in a directory without lioncub's marker, is the
    user's: neither ``--overwrite`` nor ``--resume`` touches it."""
    user_files(tmp_path)
    run = tmp_path / "B" / "8bit"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(
        json.dumps({"workload": "gpt", "size": "tiny", "variant": "8bit", "steps": 90})
    )
    (run / "log.jsonl").write_text('{"step": 90}\n')
    (run / "checkpoints" / "epoch90.pth").write_bytes(THESIS)
    before = tree(tmp_path)
    for extra in ([], ["--overwrite"]):
        rc, err = run_cli(["compare", "--variants", "8bit", *QUICK, "--out", str(tmp_path / "B"), *extra])
        assert rc == 2 and "did not write" in err and "pass --overwrite" not in err, err
        assert tree(tmp_path) == before, extra
    rc, err = run_cli(["train", "--out", str(run), "--resume", "--no-progress"])
    assert rc == 2 and "holds no lioncub run" in err and MARKER in err, err  # how to adopt an old run
    assert tree(tmp_path) == before


def test_a_stale_marker_adopts_nothing(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 3: ``rm -r RUN/*`` leaves the dotfiles; files put there later are the user's."""
    user_files(tmp_path)
    run = tmp_path / "run"
    make_run(run)
    for entry in run.iterdir():
        if not entry.name.startswith("."):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    rc, err = run_cli(["train", *QUICK, "--out", str(run)])  # nothing but the stale record: a new run
    assert rc == -1, err
    for entry in [e for e in run.iterdir() if not e.name.startswith(".")]:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "mymodel.pt").write_bytes(THESIS)
    (run / "summary.json").write_text('{"mine": 1}\n')
    (run / "log.jsonl").write_text('{"step": 1}\n')
    before = tree(tmp_path)
    for extra in ([], ["--resume"]):
        rc, err = run_cli(["train", *QUICK, "--out", str(run), *extra])
        assert rc == 2 and ("did not write" in err or "holds no lioncub run" in err), (extra, err)
        assert tree(tmp_path) == before, extra
    old = tmp_path / "old"  # a marker of today's lioncub (no list) without its config.json adopts nothing
    old.mkdir()
    (old / MARKER).write_text('{"kind": "run", "by": "lioncub"}\n')
    (old / "summary.json").write_bytes(THESIS)
    before = tree(tmp_path)
    rc, err = run_cli(["train", *QUICK, "--out", str(old)])
    assert rc == 2 and "did not write (summary.json)" in err, err
    assert tree(tmp_path) == before


def test_overwrite_deletes_only_what_lioncub_recorded(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 4: ``compare --overwrite`` refuses, naming it, a file the user put into ``checkpoints/``."""
    user_files(tmp_path)
    out = tmp_path / "cmp"
    claim(out, "compare")
    make_run(out / "8bit")
    (out / "8bit" / "checkpoints" / "exported_best.pt").write_bytes(THESIS)
    before = tree(tmp_path)
    rc, err = run_cli(["compare", "--variants", "8bit", *QUICK, "--overwrite", "--out", str(out)])
    assert rc == 2 and "checkpoints/exported_best.pt" in err, err
    assert tree(tmp_path) == before
    (out / "8bit" / "checkpoints" / "exported_best.pt").unlink()
    rc, err = run_cli(["compare", "--variants", "8bit", *QUICK, "--overwrite", "--out", str(out)])
    assert rc == -1, err  # lioncub's own run deleted, the new one prepared
    assert sorted(p.name for p in (out / "8bit").iterdir()) == [MARKER, LOCK, "config.json"]
    assert tree(tmp_path / "outside") == {"thesis.tex": hashlib.sha256(THESIS).hexdigest()}


def test_the_keep_cleanup_deletes_only_recorded_files(tmp_path: Path) -> None:
    """Findings 4, 5: the cleanup of old checkpoints deletes the files lioncub recorded in them, never a
    file the user put into one, nor a checkpoint directory lioncub did not make."""
    run = tmp_path / "run"
    make_run(run, checkpoints=(1,))
    (run / "checkpoints" / "step_00000001" / "notes.txt").write_bytes(THESIS)
    (run / "checkpoints" / "step_00000000").mkdir()
    (run / "checkpoints" / "step_00000000" / "weights.bin").write_bytes(THESIS)
    for step in (2, 3):
        save_tiny(run, step)
    assert sorted(os.listdir(run / "checkpoints" / "step_00000001")) == ["notes.txt"]
    assert (run / "checkpoints" / "step_00000000" / "weights.bin").read_bytes() == THESIS
    assert checkpoint.latest(run).step == 3 and (run / "checkpoints" / "step_00000002").is_dir()
    rec = read_record(run)
    assert "checkpoints/step_00000001/model.pt" not in rec.files and "checkpoints/step_00000003" in rec.dirs


def test_symlinks_are_never_followed(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 5: a ``summary.json`` linking to a file of the user's and a ``checkpoints/`` linking to a
    shared directory: refused, the targets untouched; lioncub's own writes replace a link, never follow it."""
    user_files(tmp_path)
    shared = tmp_path / "shared" / "step_00000001"
    shared.mkdir(parents=True)
    (shared / "weights.bin").write_bytes(THESIS)
    (tmp_path / "outside" / "mine.json").write_bytes(THESIS)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    make_run(a)
    (a / "summary.json").unlink()
    (a / "summary.json").symlink_to(tmp_path / "outside" / "mine.json")
    make_run(b)
    shutil.rmtree(b / "checkpoints")
    (b / "checkpoints").symlink_to(tmp_path / "shared")
    c.mkdir()
    (c / "checkpoints").symlink_to(tmp_path / "shared")
    before = tree(tmp_path)
    for argv in (
        ["--out", str(a), "--resume", "--steps", "5"],
        ["--out", str(b), "--resume", "--steps", "5"],
        ["--out", str(b)],
        ["--out", str(c)],
    ):
        rc, err = run_cli(["train", *QUICK[2:], *argv])
        assert rc == 2 and ("symbolic link" in err or "did not write" in err or "already holds" in err), err
        assert tree(tmp_path) == before, argv
    with pytest.raises(ValueError, match="symbolic link"):
        save_tiny(b, 4)  # a rank's checkpoint through the link: refused before anything is written
    assert tree(tmp_path) == before
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "outside" / "mine.json")
    write_atomically(link, "lioncub's\n")  # replaces the link
    assert not link.is_symlink() and (tmp_path / "outside" / "mine.json").read_bytes() == THESIS
    link.unlink()
    link.symlink_to(tmp_path / "outside" / "mine.json")
    with pytest.raises(OSError):
        open_append(link)


def test_remove_owned_never_deletes_a_changed_file(tmp_path: Path) -> None:
    """A recorded file whose content changed is the user's now (its SHA-256 is recorded)."""
    run = tmp_path / "run"
    make_run(run)
    (run / "summary.json").write_bytes(THESIS)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=r"summary\.json"):
        remove_owned(run)
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------- one writer at a time

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def held(path: Path, mode: str) -> Iterator[int]:
    """A process holding an ``exclusive`` or ``shared`` flock on ``path`` meanwhile; its pid."""
    proc = subprocess.Popen(
        python_cmd("-c", HOLD, str(path), mode), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def test_a_second_writer_is_refused_naming_the_process(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 6: the writer's lock held (by another ``lioncub train``), or rank 0 of an earlier run still
    alive (its launcher killed): refused, exit 2, naming the process; nothing touched."""
    user_files(tmp_path)
    run = tmp_path / "E"
    make_run(run)
    with held(run / LOCK, "exclusive") as pid:
        before = tree(tmp_path)
        for extra in (["--resume", "--steps", "5"], []):
            rc, err = run_cli(["train", *QUICK[2:], "--out", str(run), *extra])
            assert rc == 2 and f"is in use by process {pid}" in err, err
        assert tree(tmp_path) == before
    with held(run / RANKS_LOCK, "shared") as pid:
        before = tree(tmp_path)
        rc, err = run_cli(["train", *QUICK[2:], "--out", str(run), "--resume", "--steps", "5"])
        assert rc == 2 and "ranks of an earlier run still write there" in err and f"process {pid}" in err, err
        assert tree(tmp_path) == before


def test_the_driver_holds_the_lock_while_its_ranks_run(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lioncub.launch
    from lioncub.rundir import lock_writer

    seen = []

    def launch(*args: object, **kwargs: object) -> None:
        with pytest.raises(ValueError, match=f"in use by process {os.getpid()}") as err:
            lock_writer(tmp_path / "run")
        seen.append(str(err.value))
        raise RuntimeError("stop here")

    monkeypatch.setattr(lioncub.launch, "launch", launch)
    with pytest.raises(RuntimeError, match="stop here"):
        cli.main(["train", *QUICK, "--out", str(tmp_path / "run")])
    assert seen


# -------------------------------------------------------------------------------- states left behind


def test_a_missing_latest_resumes_from_the_newest_complete_checkpoint(
    run_cli: Callable, tmp_path: Path
) -> None:
    """Finding 9: without ``checkpoints/latest`` (or with one naming a broken checkpoint) a resume goes on
    from the newest complete checkpoint and says so; no advice to delete anything."""
    user_files(tmp_path)
    run = tmp_path / "run"
    make_run(run)
    (run / "checkpoints" / "latest").unlink()
    before = tree(tmp_path / "run" / "checkpoints")
    rc, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "5", "--no-progress"])
    assert rc == -1, err
    assert "latest is missing; resuming from step_00000003" in err and "delete" not in err, err
    assert tree(tmp_path / "run" / "checkpoints") == before
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    (run / "checkpoints" / "step_00000003" / "model.pt").unlink()  # latest names a broken one
    meta = checkpoint.latest(run)
    assert meta.step == 2 and "step_00000003" in meta.note and "newest complete" in meta.note


def test_a_run_stopped_before_its_first_checkpoint_runs_again(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 9: a run with a config and a log but no checkpoint (a launcher killed early): ``--resume``
    says to run the command again; the same command starts it afresh, unless files of the user's are there."""
    user_files(tmp_path)
    run = tmp_path / "run"
    make_run(run, checkpoints=(), finished=False)
    before = tree(tmp_path)
    rc, err = run_cli(["train", *QUICK, "--out", str(run), "--resume"])
    assert rc == 2 and "without --resume to start it again" in err and "delete" not in err, err
    assert tree(tmp_path) == before
    (run / "notes.txt").write_bytes(THESIS)
    rc, err = run_cli(["train", *QUICK, "--out", str(run)])
    assert rc == 2 and "did not write (notes.txt)" in err, err
    (run / "notes.txt").unlink()
    rc, err = run_cli(["train", *QUICK, "--out", str(run)])
    assert rc == -1 and "stopped before its first checkpoint" in err and "starting it afresh" in err, err
    assert not (run / "log.jsonl").exists() and (run / "config.json").exists()
    assert tree(tmp_path / "outside") == before_outside(before)


def before_outside(snapshot: dict[str, str]) -> dict[str, str]:
    return {k.removeprefix("outside/"): v for k, v in snapshot.items() if k.startswith("outside/")}


def test_a_torn_log_is_cut_back_to_its_last_whole_record(tmp_path: Path) -> None:
    """Finding 7: a log whose last line a crash or a full disk cut short is cut back, said so."""
    log = tmp_path / "log.jsonl"
    whole = "".join(json.dumps({"kind": "step", "step": s}) + "\n" for s in (1, 2, 3))
    log.write_text(whole + '{"kind": "step", "st')
    said: list[str] = []
    truncate_log(log, 2, said.append)
    assert log.read_text() == "".join(json.dumps({"kind": "step", "step": s}) + "\n" for s in (1, 2))
    assert len(said) == 1 and "line 4 is not a whole record" in said[0]
    log.write_text(whole[:-1])  # the last record whole but not its newline: cut too
    truncate_log(log, 3, said.append)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------------------------- paths and values


def test_out_paths_that_cannot_work_are_refused_before_writing(run_cli: Callable, tmp_path: Path) -> None:
    """Findings 9, 11: a path too long for the system, a name too long for the file system, a dangling
    link as ``--out``: exit 2 naming the problem, nothing created."""
    user_files(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = tree(tmp_path)
    deep = tmp_path.joinpath(*["d" * 200] * 20)
    assert 4000 < len(str(deep)) < 4096
    for out, fragment in (
        (deep, "choose a shorter --out"),
        (tmp_path / ("n" * 256), "at most 255 per name"),
        (tmp_path / "dangling", "symbolic link to"),
    ):
        rc, err = run_cli(["train", *QUICK, "--out", str(out)])
        assert rc == 2 and fragment in err and "Traceback" not in err, err
        assert tree(tmp_path) == before


def test_values_the_ranks_would_trip_over_are_refused(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Findings 10, 11: lanes too narrow for the ranks (before 32 or 128 ranks start), a seed beyond 64
    bits, one rank too big for the memory: exit 2 naming the option."""
    import lioncub.launch

    monkeypatch.setattr(lioncub.launch, "check_privileges", lambda: None)
    out = tmp_path / "x"
    for argv, fragments in (
        (["--variant", "4bit", "--nproc", "32", "--max-nproc", "32"], ["--variant 4bit with 32 ranks"]),
        (
            [
                "--variant",
                "4bit",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "16",
                "--link",
                "1gbit",
                "--max-nproc",
                "32",
            ],
            ["--variant 4bit with 32 ranks", "bits in [8]"],
        ),
        (["--variant", "8bit", "--nproc", "128", "--max-nproc", "128"], ["--variant 8bit with 128", "1bit"]),
        (
            ["--variant", "8bit-sign", "--nproc", "128", "--max-nproc", "128"],
            ["--variant 8bit-sign with 128"],
        ),
        (["--seed", "99999999999999999999"], ["--seed 99999999999999999999", "2**63 - 1"]),
        (
            ["--nproc", "1", "--set", "n_embd=65536", "--set", "n_layer=2000"],
            ["--nproc 1: a single rank needs"],
        ),
    ):
        rc, err = run_cli(["train", *QUICK, *argv, "--out", str(out)])
        assert rc == 2 and all(f in err for f in fragments), (argv, err)
        assert not out.exists()
    rc, err = run_cli(
        ["train", *QUICK, "--variant", "1bit", "--nproc", "128", "--max-nproc", "128", "--out", str(out)]
    )
    assert rc == -1, err


@pytest.mark.parametrize(
    ("edit", "old_marker"),
    [
        (lambda doc: [doc], "refused"),
        (lambda doc: {**doc, "cluster": {**doc["cluster"], "nnodes": 2}}, "refused"),
        (lambda doc: {**doc, "run": {**doc["run"], "overrides": {"batch_size": 3}}}, "adopted"),
        (lambda doc: "{not json", "refused"),
    ],
    ids=["json-list", "nnodes", "overrides", "not-json"],
)
def test_a_hand_edited_config_is_named_not_used(
    run_cli: Callable, tmp_path: Path, edit: Callable, old_marker: str
) -> None:
    """Findings 11, 12: an edited config.json is refused naming the file (not as options the user never
    typed), never used silently. Under today's marker (no SHA-256 recorded) one that does not parse as
    lioncub's is refused naming the file; one that parses is adopted as it is (docs/errors.md)."""
    fragment = "config.json was changed since lioncub wrote it"
    user_files(tmp_path)
    run = tmp_path / "run"
    make_run(run)
    doc = edit(json.loads((run / "config.json").read_text()))
    (run / "config.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    before = tree(tmp_path)
    for extra in (["--resume", "--steps", "5"], []):
        rc, err = run_cli(["train", "--no-progress", "--out", str(run), *extra])
        assert rc == 2 and fragment in err and "--nnodes 2:" not in err and "Traceback" not in err, err
        assert str(run / "config.json") in err
        assert tree(tmp_path) == before
    (run / MARKER).write_text('{"kind": "run", "by": "lioncub"}\n')  # today's marker: no digest to compare
    before = tree(tmp_path)
    rc, err = run_cli(["train", "--no-progress", "--out", str(run), "--resume", "--steps", "5"])
    if old_marker == "adopted":
        assert rc == -1, err
    else:
        assert rc == 2 and str(run / "config.json") in err and "Traceback" not in err, err
        assert tree(tmp_path) == before


def test_runs_of_todays_lioncub_still_resume(run_cli: Callable, tmp_path: Path) -> None:
    """A run directory with today's marker (no list) resumes: the files today's lioncub always writes are
    adopted by exact name, the user's are not (docs/errors.md)."""
    run = tmp_path / "run"
    make_run(run)
    (run / MARKER).write_text('{"kind": "run", "by": "lioncub"}\n')
    for name in (LOCK, RANKS_LOCK):
        with contextlib.suppress(FileNotFoundError):
            (run / name).unlink()
    (run / "notes.txt").write_bytes(THESIS)
    (run / "checkpoints" / "exported_best.pt").write_bytes(THESIS)
    rc, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "5", "--no-progress"])
    assert rc == -1, err
    assert "leaving alone what lioncub did not write there" in err and "notes.txt" in err, err
    rec = read_record(run)
    assert rec.version == 2 and {"config.json", "log.jsonl", "summary.json", "config.next.json"} <= set(
        rec.files
    )
    assert {"checkpoints/step_00000003/model.pt", "checkpoints/latest"} <= set(rec.files)
    assert "notes.txt" not in rec.files and "checkpoints/exported_best.pt" not in rec.files


# -------------------------------------------------------------------------------------------- report


def diag_record(step: int) -> dict:
    values = {
        "match": 0.6,
        "flip": 0.1,
        "tie": 0.2,
        "momentum_max_std": 0.01,
        "max_over_mean": 3.0,
        "kurtosis": 4.0,
    }
    return {"kind": "diag", "step": step, "overall": values, "layers": {"w": values}}


def diagnosed_run(run_dir: Path) -> None:
    """:func:`make_run` of ``--diagnostics-every 1``, with diagnostics of steps 1-3 in its log."""
    make_run(run_dir, diagnostics_every=1)
    with open(run_dir / "log.jsonl", "a") as f:
        f.write("".join(json.dumps(diag_record(s)) + "\n" for s in (1, 2, 3)))


@pytest.mark.slow
def test_report_writes_plots_only_where_lioncub_may(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 8: ``lioncub report RUN --out DIR`` into a directory of the user's is refused (nothing
    written); into a new one it marks and records its plots; into the run itself, recorded there too."""
    user_files(tmp_path)
    run = tmp_path / "run"
    diagnosed_run(run)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "diag_rates.png").write_bytes(THESIS)
    before = tree(tmp_path)
    rc, err = run_cli(["report", str(run), "--out", str(mine)])
    assert rc == 2 and "did not write" in err, err
    assert tree(tmp_path) == before
    plots = tmp_path / "plots"
    assert run_cli(["report", str(run), "--out", str(plots)])[0] == 0
    assert set(read_record(plots, "plots").files) >= {"diag_rates.png", "diag_update_shape.png"}
    (plots / "diag_rates.png").write_bytes(THESIS)  # the user's now
    before = tree(tmp_path)
    rc, err = run_cli(["report", str(run), "--out", str(plots)])
    assert rc == 2 and "diag_rates.png" in err and tree(tmp_path) == before, err
    assert run_cli(["report", str(run)])[0] == 0
    assert "diag_momentum_std.png" in read_record(run).files
    assert tree(tmp_path / "outside") == before_outside(before)


# ------------------------------------------------------------------------- files that would block


@contextlib.contextmanager
def unblocking(*fifos: Path, after_s: float = 3.0) -> Iterator[list[str]]:
    """Meanwhile, a watchdog that frees whoever waits in opening one of ``fifos`` (by opening its other
    end, then closing it) once ``after_s`` seconds have passed, so that code which opens a FIFO fails the
    test instead of hanging the suite; yields the FIFOs it had to open for someone."""
    freed: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        if stop.wait(after_s):
            return
        while not stop.is_set():
            for fifo in fifos:
                try:  # succeeds only while a reader has it open (or waits in opening it)
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    pass
                else:
                    os.close(fd)
                    freed.append(str(fifo))
                with contextlib.suppress(OSError):  # frees a writer waiting in opening it
                    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            stop.wait(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield freed
    finally:
        stop.set()
        thread.join()


def fifo_at(path: Path) -> Path:
    """A FIFO in place of ``path`` (whatever was there is removed)."""
    if os.path.lexists(path):
        path.unlink()
    os.mkfifo(path)
    return path


def refused_at_once(run_cli: Callable, argv: list[str], fifo: Path) -> str:
    """``lioncub ARGV`` with a FIFO at ``fifo``: exit 2 in under a second, the FIFO never opened, the error
    naming it; the error."""
    with unblocking(fifo) as freed:
        t0 = time.monotonic()
        rc, err = run_cli(argv)
        took = time.monotonic() - t0
    assert freed == [] and took < 1.0, (argv, took, err)  # freed: it waited in opening the FIFO
    assert rc == 2 and fifo.name in err, (argv, err)
    return err


def refused_with_a_fifo_at(run_cli: Callable, argv: list[str], path: Path, root: Path) -> None:
    """:func:`refused_at_once` with a FIFO in place of ``path``, nothing under ``root`` changed; then
    ``path`` as it was."""
    kept = path.read_bytes() if path.exists() else None
    fifo = fifo_at(path)
    before = tree(root)
    refused_at_once(run_cli, argv, fifo)
    assert tree(root) == before, argv
    fifo.unlink()
    if kept is not None:
        path.write_bytes(kept)


@pytest.mark.parametrize(
    "rel",
    [
        "checkpoints/latest",
        "checkpoints/step_00000003/meta.json",
        MARKER,
        LOCK,
        RANKS_LOCK,
        "config.json",
        "log.jsonl",
        "summary.json",
    ],
)
def test_a_fifo_in_a_run_is_refused_at_once(run_cli: Callable, tmp_path: Path, rel: str) -> None:
    """Issue 34: a FIFO at any file of a run that ``--resume`` (or a new run over a stopped one) reads is
    refused in under a second, naming it; nothing is written. The first three hung ``--resume`` forever;
    at a lock file the FIFO was taken for the lock."""
    user_files(tmp_path)
    run = tmp_path / "run"
    make_run(run)
    fifo = fifo_at(run / rel)
    before = tree(tmp_path)
    err = refused_at_once(run_cli, ["train", *QUICK[2:], "--out", str(run), "--resume", "--steps", "5"], fifo)
    assert rel in err, err
    if rel in (MARKER, LOCK, RANKS_LOCK):
        assert f"{fifo} is a FIFO (named pipe), not a regular file" in err, err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("rel", [MARKER, LOCK, RANKS_LOCK])
def test_a_fifo_in_a_new_out_is_refused_at_once(run_cli: Callable, tmp_path: Path, rel: str) -> None:
    """Issue 34: a directory holding only a FIFO named like lioncub's record or locks, given as a new
    ``--out``: refused in under a second, naming it (the record's FIFO hung ``lioncub train`` forever)."""
    out = tmp_path / "new"
    out.mkdir()
    fifo = fifo_at(out / rel)
    before = tree(tmp_path)
    for command in (["train", *QUICK], ["compare", "--variants", "8bit", *QUICK]):
        refused_at_once(run_cli, [*command, "--out", str(out)], fifo)
        assert tree(tmp_path) == before, command


def test_a_fifo_where_report_reads_is_refused_at_once(run_cli: Callable, tmp_path: Path) -> None:
    """Issue 34: ``lioncub report`` with a FIFO as the run's ``config.json`` (read for the plots' titles), as
    the record of the run or of ``--out``: refused in under a second, naming it. Each hung it forever."""
    run = tmp_path / "run"
    diagnosed_run(run)
    plots = tmp_path / "plots"
    plots.mkdir()
    for argv, path in (
        (["report", str(run), "--out", str(plots)], plots / MARKER),
        (["report", str(run)], run / MARKER),
        (["report", str(run)], run / "config.json"),
    ):
        refused_with_a_fifo_at(run_cli, argv, path, tmp_path)


def test_a_fifo_in_a_compare_directory_is_refused_at_once(run_cli: Callable, tmp_path: Path) -> None:
    """Issue 34: ``lioncub compare --report-only`` with a FIFO as ``OUT/summary.json`` (read for the order
    of the runs; it hung forever) or as a run's record: refused in under a second, naming it."""
    out = tmp_path / "cmp"
    write_log(out / "1bit", 20, 20, loss=2.0, compute_s=0.05, comm_s=0.03)
    claim(out, "compare")
    for argv, path in (
        (["compare", "--report-only", "--out", str(out)], out / "summary.json"),
        (["compare", "--report-only", "--variants", "1bit", "--out", str(out)], out / "1bit" / MARKER),
    ):
        refused_with_a_fifo_at(run_cli, argv, path, tmp_path)


def test_an_old_compare_marker_is_adopted(
    run_cli: Callable, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A compare directory with a marker of before the record: its report's files and its run directories
    are adopted by exact name (:mod:`lioncub.report.files` registers them), a file of the user's is not."""
    out = tmp_path / "cmp"
    write_log(out / "1bit", 20, 20, loss=2.0, compute_s=0.05, comm_s=0.03)
    (out / MARKER).write_text('{"kind": "compare", "by": "lioncub"}\n')
    (out / "summary.md").write_text("an old report\n")
    assert run_cli(["compare", "--report-only", "--out", str(out)])[0] == 0
    rec = read_record(out, "compare")
    assert rec.version == 2 and rec.dirs == {"1bit"} and "summary.md" in rec.files
    (out / "notes.txt").write_bytes(THESIS)
    rc, err = run_cli(["compare", "--report-only", "--out", str(out)])
    assert rc == 2 and "notes.txt" in err, err


# ----------------------------------------------------------------------------------------- compare


def write_log(run_dir: Path, steps: int, last: int, **step_fields: float) -> None:
    """A run of ``steps`` steps whose log ends at ``last``, with evals every 10 steps."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"variant": run_dir.name, "steps": steps, "seed": 0}))
    recs = [
        {"kind": "step", "step": s, "step_s": 0.1, "time_s": 0.1 * s, **step_fields}
        for s in range(1, last + 1)
    ]
    recs += [{"kind": "eval", "step": s, "val_loss": 3.0 - s / 30} for s in range(10, last + 1, 10)]
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    claim(run_dir)


def test_report_only_marks_a_partial_run(
    run_cli: Callable, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Finding 13: a compare stopped mid-variant: the partial run is marked as such and does not set the
    default target loss."""
    out = tmp_path / "cmp"
    write_log(out / "32bit", 60, 33)
    write_log(out / "1bit", 60, 60)
    claim(out, "compare")
    rc, _ = run_cli(["compare", "--out", str(out), "--report-only", "--variants", "32bit,1bit"])
    assert rc == 0
    table = (out / "summary.md").read_text()
    assert "| 32bit (partial: step 33 of 60) |" in table and "| 1bit |" in table
    assert "warning: 32bit is partial: its log ends at step 33 of 60" in table
    rule = json.loads((out / "summary.json").read_text())["target_rule"]
    assert rule.startswith("worst final val loss among the finished runs") and "= 1" in rule


@pytest.mark.slow
def test_node_runs_report_nic_and_in_node_bytes_apart(tmp_path: Path) -> None:
    """Finding 14: on emulated nodes the table shows a node's NIC bytes and a rank's in-node bytes apart;
    a flat collective's bytes are split as its pattern crosses the nodes."""
    from lioncub.report import runs as rp
    from lioncub.train.nodebytes import flat_shares, node_bytes

    assert flat_shares("32bit", 10**6, 2, 2) == (1.0, 1.0)  # a ring crosses each node boundary once
    nic, intra = flat_shares("1bit", 10**6, 2, 2)  # pairwise: L·(N−L)/(N−1) of a rank's bytes
    assert nic == pytest.approx(2 * 2 / 3) and intra == pytest.approx(1 / 3)
    assert node_bytes({"inter_node_bytes_sent": 10, "intra_node_bytes_sent": 40}, 50, (9, 9), 2) == {
        "nic_bytes": 20.0,
        "intra_bytes": 40.0,
    }
    # a layered vote's flat-group allreduces besides (momentum sync, averaged inner momenta): ring shares
    ring = flat_shares("32bit", 10**6, 2, 2)
    assert node_bytes({"inter_node_bytes_sent": 10, "intra_node_bytes_sent": 40}, 150, (9, 9), 2, ring) == {
        "nic_bytes": 20.0 + 100.0,
        "intra_bytes": 40.0 + 100.0,
    }
    write_log(tmp_path / "1bit", 10, 10, bytes_sent=8e6, nic_bytes=1e6, intra_bytes=7e6)
    write_log(tmp_path / "32bit", 10, 10, bytes_sent=4e6, nic_bytes=4e6, intra_bytes=4e6)
    report = rp.make_report([tmp_path / "1bit", tmp_path / "32bit"], tmp_path / "out", plots=False)
    header = report.table_markdown.splitlines()[0]
    assert (
        "NIC MB/step/node" in header and "in-node MB/step/rank" in header and "| MB/step/rank |" not in header
    )
    assert "| 1bit | 100.0 |" in report.table_markdown
    assert [r.nic_bytes_per_step for r in report.rows] == [1e6, 4e6]


def test_calibrate_names_the_intra_link_option(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 15: the intra-node level's fit without a slope names ``--intra-link``, not "the link"."""
    import torch.distributed as dist

    import lioncub.planning.measure as calibration

    def calibrate(*args: object, **kwargs: object) -> None:
        raise ValueError(
            "[node] the fp32 allreduce fit has no positive slope, so the link rate is unknown: use larger "
            "--sizes or more --repeats (or give the link's rate)"
        )

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    monkeypatch.setattr(calibration, "init_from_env", lambda timeout: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, err = run_cli(["calibrate", "--out", str(tmp_path / "c.json")])
    assert rc == 2 and "--intra-link RATE" in err and "give the link's rate" not in err, err


# ----------------------------------------------------------------------------- real runs (slow)

#: the launched runs (tests/ownership_runs.py), in ``WORKDIR/launched`` of tests/compare_runs.py's job (one
#: interpreter and one zygote for the launches of several modules), started in the background when
#: collection ends (tests/background.py)
BACKGROUND = {"compares": compare_runs.job}


def _workdir() -> Path:
    """Where tests/ownership_runs.py's launches ran."""
    return background.workdir("compares") / "launched"


def launched(name: str) -> dict:
    """Launch ``name`` of tests/ownership_runs.py: its exit code (``rc``) and its output (``output``)."""
    proc = background.result("compares", BACKGROUND["compares"])
    path = _workdir() / "launches.json"
    launches = json.loads(path.read_text()) if path.exists() else {}
    assert name in launches, f"exit {proc.returncode}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return launches[name]


@pytest.fixture(scope="module")
def finished() -> Path:
    """A 2-rank run of the tiny GPT that its ranks prepared (no driver): 3 steps, checkpoints at 2 and 3."""
    done = launched("finished")
    assert done["rc"] == 0, done["output"]
    return _workdir() / "finished"


def in_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of a one-rank job (what torchrun sets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "LIONCUB_LAUNCH_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
@pytest.mark.background("compares")
def test_the_rank_path_checks_before_it_writes(
    run_cli: Callable, finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 1: ``lioncub train`` as the ranks of a job (``lioncub launch -- -m lioncub.cli train``, or
    torchrun) refuses the same command again, another variant, a resume that changes the data: exit 2,
    nothing written; a plain ``--resume`` goes on, leaving the user's files in ``checkpoints/``.

    The launches ran in tests/ownership_runs.py, each on its own copy of the finished run; the refusals
    inside a job run here, in-process, on another."""
    pristine = tree(finished)
    root = _workdir()
    again = launched("again")
    assert again["rc"] == 2 and "already holds a run; pass --resume" in again["output"], again["output"]
    assert tree(root / "again") == {
        **{f"run/{k}" if k else "run": v for k, v in {"": "dir", **pristine}.items()},
        "outside": "dir",
        "outside/thesis.tex": hashlib.sha256(THESIS).hexdigest(),
    }
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    user_files(tmp_path)
    before = tree(tmp_path)
    threads = torch.get_num_threads()
    in_job(monkeypatch)
    try:
        for argv, fragment in (
            (["--variant", "1bit"], "already holds a run"),
            (["--resume", "--set", "batch_size=3", "--data-mode", "shard"], "--data-mode 'shard'"),
        ):
            rc, err = run_cli(["train", *FINISHED, *argv, "--out", str(run)])
            assert rc == 2 and fragment in err, (argv, err)
            assert tree(tmp_path) == before, argv
    finally:
        torch.set_num_threads(threads)
    resumed = launched("resumed")
    assert resumed["rc"] == 0, resumed["output"]
    run = root / "resumed" / "run"
    steps = [json.loads(x)["step"] for x in (run / "log.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(run / "checkpoints")) == [
        "exported_best.pt",
        "latest",
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert os.listdir(run / "checkpoints" / "step_00000002") == ["notes.txt"]
    assert (run / "checkpoints" / "exported_best.pt").read_bytes() == THESIS
    assert json.loads((run / "config.json").read_text())["run"]["steps"] == 5  # the resume's, now the run's
    assert tree(root / "resumed" / "outside") == {"thesis.tex": hashlib.sha256(THESIS).hexdigest()}


def _wait_for_a_step(log: Path, running: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and log.read_text().count("\n") >= 1):
        assert running() and time.monotonic() < deadline, "the run ended or took too long"
        time.sleep(0.2)


def _driver(rank: int, world: int, workdir: Path, argv: list[str]) -> None:
    """``background.Spawned``'s target: ``lioncub ARGV`` as this process (a fork of the fork server, torch
    imported: the driver need not import it again), its output discarded."""
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
    raise SystemExit(cli.main(argv))


@pytest.mark.slow
def test_a_killed_launcher_leaves_a_run_that_runs_again(run_cli: Callable, tmp_path: Path) -> None:
    """Findings 6, 9: while ``lioncub train`` runs, a second writer is refused naming it; SIGKILLed before
    its first checkpoint, it leaves a run that ``--resume`` says to run again and the same command restarts
    (once its ranks, sent SIGTERM by the kernel, have stopped)."""
    user_files(tmp_path)
    run = tmp_path / "K"
    argv = ["train", *RUN, "--steps", "400", "--checkpoint-every", "0", "--out", str(run)]
    driver = background.Spawned(_driver, 1, args=(argv,), timeout=120)  # the launcher: `lioncub ARGV`
    driver.start()
    proc = driver.procs[0]
    try:
        _wait_for_a_step(run / "log.jsonl", proc.is_alive)
        rc, err = run_cli(["train", *RUN, "--out", str(run), "--resume"])
        assert rc == 2 and f"in use by process {proc.pid}" in err, err
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        driver.cleanup()
    deadline = time.monotonic() + 30
    while True:
        rc, err = run_cli(
            ["train", *RUN, "--steps", "400", "--checkpoint-every", "0", "--out", str(run), "--resume"]
        )
        if "still write there" not in err or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rc == 2 and "without --resume to start it again" in err and "delete" not in err, err
    rc, err = run_cli([*argv[:-2], "--out", str(run)])
    assert rc == -1 and "starting it afresh" in err, err


@pytest.mark.slow
def test_rank_zero_of_a_job_holds_the_lock(run_cli: Callable, tmp_path: Path) -> None:
    """Finding 6: a run that ``lioncub launch -- -m lioncub.cli train`` started (no driver) is held by its
    rank 0: another writer is refused naming that process. The launcher (``lioncub launch`` by
    ``cli.main``) is a fork of the fork server, as in the test above; its rank a fresh interpreter, whose
    command line the refusal names."""
    run = tmp_path / "J"
    argv = ["launch", "--nproc", "1", "--", "-m", "lioncub.cli", "train", *RUN, "--steps", "400",
            "--checkpoint-every", "0", "--out", str(run)]  # fmt: skip
    driver = background.Spawned(_driver, 1, args=(argv,), timeout=120)  # the launcher: `lioncub ARGV`
    driver.start()
    proc = driver.procs[0]
    try:
        _wait_for_a_step(run / "log.jsonl", proc.is_alive)
        rc, err = run_cli(["train", *RUN, "--out", str(run), "--resume"])
        assert rc == 2 and "is in use by process" in err and "lioncub.cli train" in err, err
        assert f"process {proc.pid} " not in err  # not the launcher: its rank 0
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGTERM)  # the launcher stops its rank
        proc.join(20)
    finally:
        driver.cleanup()


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted at ``where`` (skips, saying why, where this process cannot mount one)."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk is emulated with a small tmpfs, and mounting one needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"mounting a small tmpfs was refused here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
@pytest.mark.background("compares")
def test_a_full_disk_mid_resume_leaves_a_run_that_resumes(
    finished: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Finding 7: a resume that fills the disk fails and may leave the log ending mid-record; with space
    freed, the next resume cuts the log back (saying so) and goes on; a new run is still refused."""
    with small_disk(tmp_path / "disk") as disk:
        run = disk / "run"
        shutil.copytree(finished, run, symlinks=True)
        stat = os.statvfs(disk)
        log_pages = -(-(run / "log.jsonl").stat().st_size // 4096)
        spare = (
            2 * log_pages + 8
        ) * 4096  # the log's rewrite, the record, config.next.json: then the appends
        (disk / "filler").write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - spare))
        resume = ["train", "--out", str(run), "--resume", "--checkpoint-every", "0", "--no-progress"]
        assert cli.main([*resume, "--steps", "400"]) != 0  # the disk fills while the log grows
        capfd.readouterr()
        torn = not (run / "log.jsonl").read_bytes().endswith(b"\n")  # unless the disk filled between records
        (disk / "filler").unlink()
        assert cli.main([*resume, "--steps", "6"]) == 0
        printed = "".join(capfd.readouterr())
        assert ("is not a whole record" in printed) == torn, printed[-3000:]
        records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4, 5, 6]
        assert cli.main(["train", *RUN, "--out", str(run)]) == 2
        assert "already holds a run" in capfd.readouterr().err


def test_compare_report_is_written_through_the_record(tmp_path: Path) -> None:
    """The compare report's files are lioncub's by record; one the user changed is not written over."""
    from lioncub.report import runs as rp

    out = tmp_path / "cmp"
    write_log(out / "1bit", 10, 10)
    claim(out, "compare")
    rp.make_report([out / "1bit"], out, write=lambda name, data: write_owned(out, name, data))
    assert {"summary.md", "summary.json", "bytes_per_step.png"} <= set(read_record(out, "compare").files)
    (out / "summary.md").write_bytes(THESIS)
    with pytest.raises(ValueError, match=r"summary\.md"):
        rp.make_report([out / "1bit"], out, write=lambda name, data: write_owned(out, name, data))
    assert (out / "summary.md").read_bytes() == THESIS
