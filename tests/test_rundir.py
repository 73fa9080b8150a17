"""lioncub never loses a user's file (docs/errors.md, "Run directories"): it writes only into new, empty or
lioncub-marked directories, deletes only what it wrote, refuses every bad ``--out`` before writing, and a
refused or failed resume leaves the run as it was. Every case puts user files in the way and checks that
they survive byte for byte."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import background
import compare_runs
from lioncub.rundir import (
    MARKER,
    SpecialFileError,
    check_out_path,
    claim,
    foreign_entries,
    is_marked,
    open_append,
    open_run_file,
    read_run_file,
    record,
    remove_owned,
)

THESIS = b"irreplaceable\n"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -------------------------------------------------------------------------------------------- unit


def test_out_paths_that_can_never_be_a_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_bytes(THESIS)
    for bad, why in (
        ("", "empty path"),
        ("  ", "empty path"),
        ("/", "file system root"),
        (".", "working directory itself"),
        (str(tmp_path), "working directory itself"),
        ("file", "exists and is not a directory"),
        ("file/run", "is a file, not a directory"),
    ):
        with pytest.raises(ValueError, match=why):
            check_out_path(bad)
    assert check_out_path("new/run") == Path("new/run")
    assert (tmp_path / "file").read_bytes() == THESIS


def test_out_path_in_a_read_only_place(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], capture_output=True
    ).returncode:
        pytest.skip("root writes to any directory, and mounting a read-only tmpfs was refused here")
    try:
        with pytest.raises(ValueError, match="not writable"):
            check_out_path(ro / "run")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)


def test_only_marked_directories_are_lioncubs(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "log.jsonl").write_text('{"step": 7}\n')  # a name lioncub uses, in a directory it did not make
    (user / "summary.json").write_text('{"mine": 1}\n')
    assert not is_marked(user) and foreign_entries(user) == ["log.jsonl", "summary.json"]
    ours = tmp_path / "ours"
    claim(ours)
    record(ours, files=["config.json", "log.jsonl", "summary.json", "diag_rates.png"], dirs=["checkpoints"])
    for name in ("config.json", "log.jsonl", "summary.json", "diag_rates.png"):
        (ours / name).write_text("{}")
    (ours / "checkpoints").mkdir()
    assert is_marked(ours) and foreign_entries(ours) == []
    (ours / "notes.txt").write_bytes(THESIS)
    assert foreign_entries(ours) == ["notes.txt"]
    legacy = tmp_path / "legacy"  # a config.json alike without lioncub's marker is the user's (issue 25)
    legacy.mkdir()
    (legacy / "config.json").write_text(
        json.dumps({"workload": "gpt", "size": "tiny", "variant": "1bit", "steps": 3})
    )
    assert not is_marked(legacy) and foreign_entries(legacy) == ["config.json"]


def test_remove_owned_deletes_only_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    claim(out, "compare")
    record(out, files=["summary.md"])
    (out / "summary.md").write_text("# report\n")
    run = out / "1bit"
    claim(run)
    record(run, files=["log.jsonl"], dirs=["checkpoints"])
    (run / "log.jsonl").write_text("{}\n")
    (run / "checkpoints").mkdir()
    (run / "thesis.tex").write_bytes(THESIS)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"1bit/thesis\.tex"):
        remove_owned(out, "compare", subruns=True)
    assert snapshot(tmp_path) == before  # nothing deleted
    (run / "thesis.tex").unlink()
    remove_owned(out, "compare", subruns=True)
    assert not out.exists()
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_bytes(THESIS)
    with pytest.raises(ValueError, match=r"config\.json"):
        remove_owned(user)
    assert (user / "config.json").read_bytes() == THESIS


def test_an_old_marker_of_a_kind_nobody_registered_adopts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A marker without a list adopts what the kind's owner registered (:mod:`lioncub.report.files` for a
    compare directory); in a process where no package registered the kind, nothing: all is the user's."""
    import lioncub.report.files  # noqa: F401  (registers the compare directory's old files)
    from lioncub.rundir import legacy, read_record

    out = tmp_path / "cmp"
    out.mkdir()
    (out / MARKER).write_text('{"kind": "compare", "by": "lioncub"}\n')
    (out / "summary.md").write_bytes(THESIS)
    assert read_record(out).files == {"summary.md": []}
    monkeypatch.setattr(legacy, "_REGISTERED", {})
    rec = read_record(out)
    assert rec is not None and rec.version == 1 and rec.files == {} and rec.dirs == set()
    assert foreign_entries(out, "compare") == ["summary.md"]


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """``TimeoutError`` in this thread if the block takes more than ``seconds`` (a blocked ``open`` too)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_run_files_that_are_no_files_are_refused_without_opening(tmp_path: Path) -> None:
    """Issue 34: :func:`open_run_file` (how lioncub opens every run file) refuses a FIFO, a socket and a
    device, naming the path, without waiting on the FIFO (no writer ever comes here); a symbolic link fails
    as it always did (``ELOOP``) unless followed, a regular file opens, a missing one is created on asking."""
    fifo = tmp_path / "latest"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "meta.json"))
    t0 = time.monotonic()
    with within(5):  # an open that waits on the FIFO fails the test instead of hanging it
        for path, what in (
            (fifo, "a FIFO (named pipe)"),
            (tmp_path / "meta.json", "a socket"),
            (Path(os.devnull), "a character device"),
        ):
            for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND | os.O_CREAT):
                with pytest.raises(SpecialFileError, match=f"^{path} is {re.escape(what)}, not a regular"):
                    open_run_file(path, flags)
            with pytest.raises(SpecialFileError, match=str(path)):
                read_run_file(path, follow_symlinks=True)
        with pytest.raises(SpecialFileError, match=str(fifo)):
            open_append(fifo)
    assert time.monotonic() - t0 < 1.0
    sock.close()
    (tmp_path / "config.json").write_bytes(THESIS)
    (tmp_path / "link").symlink_to(tmp_path / "config.json")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        open_run_file(tmp_path / "link")
    assert read_run_file(tmp_path / "link", follow_symlinks=True) == THESIS
    assert read_run_file(tmp_path / "config.json") == THESIS
    (tmp_path / "to_fifo").symlink_to(fifo)  # followed only where asked, and then refused as the FIFO
    with pytest.raises(SpecialFileError, match="to_fifo is a FIFO"):
        read_run_file(tmp_path / "to_fifo", follow_symlinks=True)
    with pytest.raises(FileNotFoundError):
        open_run_file(tmp_path / "missing")
    os.close(open_run_file(tmp_path / "new", os.O_WRONLY | os.O_CREAT))
    assert (tmp_path / "new").is_file()


# --------------------------------------------------------------------------------------------- CLI


def test_compare_never_deletes_or_overwrites_user_files(run_cli: Callable, tmp_path: Path) -> None:
    out = tmp_path / "mydata"
    (out / "1bit").mkdir(parents=True)
    (out / "1bit" / "thesis.tex").write_bytes(THESIS)
    (out / "summary.json").write_text('{"mine": 1}\n')
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"], ["--report-only"]):
        rc, err = run_cli(
            ["compare", "--variants", "1bit", "--nproc", "2", "--steps", "3", "--out", str(out), *extra]
        )
        assert rc == 2 and "did not write" in err, err
        assert snapshot(tmp_path) == before, extra


def test_train_refuses_a_directory_with_user_files(run_cli: Callable, tmp_path: Path) -> None:
    out = tmp_path / "x"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 7}\n')
    (out / "summary.json").write_text("not json")
    before = snapshot(tmp_path)
    rc, err = run_cli(["train", "--steps", "2", "--out", str(out)])
    assert rc == 2 and "holds files lioncub did not write (log.jsonl, summary.json)" in err, err
    assert snapshot(tmp_path) == before
    rc, err = run_cli(["train", "--steps", "2", "--out", str(tmp_path / "y"), "--convert-momenta", "average"])
    assert rc == 2 and "--convert-momenta average: applies only with --resume" in err, err
    assert not (tmp_path / "y").exists()


#: the module's two launches (tests/ownership_runs.py's ``RUNDIR_RUNS``, in ``WORKDIR/launched/rundir`` of
#: tests/compare_runs.py's job: one interpreter and one preloaded interpreter for the launches of several
#: modules): ``part``, a 1-rank run stopped at step 2 of 4; ``x``, a 2-rank run whose rank 1 SIGKILLs itself
#: after the backward of step 2 (tests/kill_rank.py); started in the background when collection ends
#: (tests/background.py)
BACKGROUND = {"compares": compare_runs.job}


def _run(name: str) -> tuple[int, str, Path]:
    """Run ``name`` of ``ownership_runs.RUNDIR_RUNS`` (the background job): its exit status, stderr and
    directory."""
    proc = background.result("compares", BACKGROUND["compares"])
    path = background.workdir("compares") / "launched" / "rundir" / "runs.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads(path.read_text())[name]
    return done["returncode"], done["stderr"], path.parent / name


@pytest.fixture(scope="module")
def stopped_run() -> Path:
    """A real 1-rank run of the tiny GPT stopped at step 2 of 4 (a checkpoint to resume from)."""
    code, err, path = _run("part")
    assert code == 0, err
    return path


@pytest.mark.slow
@pytest.mark.background("compares")
def test_a_refused_resume_leaves_the_run_as_it_was(run_cli: Callable, stopped_run: Path) -> None:
    before = snapshot(stopped_run)
    for argv, fragment in (
        (["--set", "batch_size=8"], "--set batch_size=8: the run in"),
        (["--set", "dropout=0.1"], "has dropout at its default"),
        (["--seed", "3"], "this run is --workload gpt --size tiny --seed 3"),
        (["--data-mode", "shard"], "--data-mode 'shard'"),
        (["--variant", "1bit"], "written by --variant 8bit; this run is --variant 1bit"),
        (["--quantizer", "l0"], "--quantizer 'l0': the run in"),
    ):
        rc, err = run_cli(["train", "--out", str(stopped_run), "--resume", "--steps", "6", *argv])
        assert rc == 2 and fragment in err, (argv, err)
        assert snapshot(stopped_run) == before, argv
    rc, err = run_cli(["train", "--out", str(stopped_run), "--resume", "--steps", "6"])
    assert rc == -1, err  # checks passed: it reached the (stubbed) launcher
    assert (stopped_run / "config.next.json").exists()  # the new config waits for the run to succeed
    assert (stopped_run / "config.json").read_bytes() == before["config.json"]
    (stopped_run / "config.next.json").unlink()


@pytest.mark.slow
@pytest.mark.background("compares")
def test_report_only_reports_the_runs_in_out(run_cli: Callable, stopped_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    out.mkdir()
    shutil.copytree(stopped_run, out / "8bit")
    rc, err = run_cli(["compare", "--out", str(out), "--report-only"])
    assert rc == 0, err
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["8bit"]  # not the default list (32bit, 16bit, …)
    assert (out / MARKER).exists()


# ----------------------------------------------------------------------------- checked before launch


def test_nproc_is_bounded_by_memory_unless_allowed(run_cli: Callable, tmp_path: Path) -> None:
    out = tmp_path / "x"
    rc, err = run_cli(["train", "--nproc", "100000", "--steps", "2", "--out", str(out)])
    assert rc == 2 and "--nproc 100000: this machine's available memory holds about" in err, err
    assert "--max-nproc" in err and not out.exists()
    rc, err = run_cli(["train", "--nproc", "100", "--max-nproc", "50", "--steps", "2", "--out", str(out)])
    assert rc == 2 and "above --max-nproc 50" in err, err
    rc, err = run_cli(["train", "--nproc", "100", "--max-nproc", "100", "--steps", "2", "--out", str(out)])
    assert rc == -1, err  # allowed on purpose: it reached the (stubbed) launcher


def test_link_without_privileges_is_refused_before_writing(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lioncub.launch
    from lioncub.launch import PrivilegeError

    def lacking() -> None:
        raise PrivilegeError(
            "--link needs network namespaces, but this process lacks: capability CAP_NET_ADMIN"
        )

    monkeypatch.setattr(lioncub.launch, "check_privileges", lacking)
    out = tmp_path / "x"
    rc, err = run_cli(["train", "--nproc", "2", "--link", "1gbit", "--steps", "2", "--out", str(out)])
    assert rc == 2 and "--link 1gbit: --link needs network namespaces" in err and "CAP_NET_ADMIN" in err, err
    assert not out.exists()


def test_workload_data_is_checked_before_writing(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    out = tmp_path / "x"
    rc, err = run_cli(["train", "--steps", "2", "--set", "block_size=100000", "--out", str(out)])
    assert rc == 2 and "block_size=100000: the val split" in err and "below" in err, err
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tiktoken" else find_spec(name, *a)
    )
    rc, err = run_cli(["train", "--steps", "2", "--set", "tokenizer=gpt2", "--out", str(out)])
    assert rc == 2, err
    assert "tiktoken" in err or "gpt2" in err, err  # without the BPE files, those are named first
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.background("compares")
def test_a_failed_new_run_leaves_nothing_in_the_way() -> None:
    code, err, out = _run("x")
    assert code != 0 and "rank 1 was killed by SIGKILL" in err, err  # the launcher names the rank
    assert out.is_dir() and list(out.iterdir()) == []  # no config.json blocking a rerun


def test_progress_rate_comes_from_the_log(tmp_path: Path) -> None:
    import io

    from lioncub.train.progress import Progress

    log = tmp_path / "log.jsonl"
    log.write_text("")
    stream = io.StringIO()
    bar = Progress(log, "1bit", 0, 20, stream)
    bar.start()
    with open(log, "a") as f:  # 20 steps of 50 ms of training each, written at once
        for step in range(1, 21):
            f.write(json.dumps({"kind": "step", "step": step, "time_s": 0.05 * step, "loss": 3.0}) + "\n")
    deadline = time.monotonic() + 10
    while "step 19/20" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    bar.done.set()
    bar.join(5)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[train] 1bit step 1/20") and "ETA -" in lines[0]  # one step: no rate yet
    assert all("20.00 steps/s" in line for line in lines[1:]), lines  # the log's time, not the reader's
    late = io.StringIO()  # a log read only after the run ended prints nothing (the summary comes last)
    after = Progress(log, "1bit", 0, 20, late)
    after.done.set()
    after.run()
    assert late.getvalue() == ""


def test_the_memory_bound_counts_a_ranks_share_with_fsdp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT of 77 M parameters (8 × 896) on 2 nodes × 4 ranks with 16 GiB available: each rank holding the
    whole model (24 B per parameter, ~2.4 GiB) does not fit 8 ranks in 80 % of it, and is refused; with
    ``--fsdp`` a rank holds a quarter of those bytes beside the model it builds before sharding (~1.4 GiB)
    and 8 fit. (Measured, BENCHMARKS.md: the sharded run used 5.3 GiB in all.)"""
    from lioncub.train import driver
    from lioncub.train.config import TrainConfig

    monkeypatch.setattr(driver, "available_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr("lioncub.launch.check_privileges", lambda: None)  # --link needs root: not the point
    shape = {"n_layer": 8, "n_embd": 896, "n_head": 8, "block_size": 32, "batch_size": 2, "eval_windows": 4}
    values = {"workload": "gpt", "size": "tiny", "overrides": shape, "variant": "1bit", "nnodes": 2,
              "nproc": 8, "link": "1gbit", "steps": 2}  # fmt: skip
    with pytest.raises(ValueError, match=r"--nproc 8: this machine's available memory holds about 5 ranks"):
        driver.check_before_launch(TrainConfig.from_values(values), None)
    driver.check_before_launch(TrainConfig.from_values({**values, "fsdp": True}), None)
