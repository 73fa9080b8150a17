"""Tests of :mod:`lioncub.launch.preload`: a rank forked from a preloaded interpreter (a zygote) behaves as
the fresh interpreter ``python -m MODULE`` would, under the launcher's supervision.

The oracle is the same launch with ``preload=()``: fresh interpreters started by ``subprocess.Popen``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import background
import compare_runs
import ownership_runs
from emulated_network import assert_nothing_left
from lioncub import cli
from lioncub.launch import LaunchConfig, launch, preload
from lioncub.launch.preload import MODULES, PreloadError, Zygote, shared_env
from lioncub.launch.workers import WorkerRelay
from lioncub.train.config import TrainConfig
from lioncub.train.driver import RANK_MODULE, make_launch_config

from processes import PY, context

#: a cheap zygote for the tests of process semantics (torch's import is what a real one saves)
LIGHT = ("json",)

PROBE = textwrap.dedent("""
    import json, os, signal, socket, sys, time
    rank = os.environ["RANK"]
    print(json.dumps({
        "ifaces": sorted(n for _, n in socket.if_nameindex()), "sys": sorted(os.listdir("/sys/class/net")),
        "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "spec": __spec__.name, "path0": sys.path[0],
        "session": os.getsid(0) == os.getpid() == os.getpgid(0), "stdin": sys.stdin.read(),
        "probe": os.environ.get("PROBE"), "rank": rank, "world": os.environ["WORLD_SIZE"],
        "buffered": os.environ.get("PYTHONUNBUFFERED"), "hosts": open("/etc/hosts").read(),
    }), flush=True)
    print(f"stderr of {rank}", file=sys.stderr, flush=True)
    with open(f"pid{rank}", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    mode = sys.argv[1]
    if mode == "atexit":
        import atexit
        atexit.register(lambda: print(f"atexit of {rank}", flush=True))
    elif mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print(f"SIGTERM in {rank}", flush=True), sys.exit(9)))
    if rank == "1":
        while mode in ("exit", "raise", "kill") and not os.path.exists("pid0"):
            time.sleep(0.01)  # rank 0 has printed before rank 1 ends the launch (else a race under load)
        if mode == "exit":
            sys.exit(3)
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("exit", "raise", "kill", "term", "sleep"):
        time.sleep(60)
""")


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "probe_rank.py").write_text(PROBE)
    return tmp_path


def _launch(
    probe_dir: Path, mode: str, preload: tuple[str, ...], timeout_s: float = 60, link: float | None = None,
    launch_id: str | None = None, env: dict[str, str] | None = None,
):  # fmt: skip  # type: ignore[no-untyped-def]
    out, err = io.StringIO(), io.StringIO()
    for stale in probe_dir.glob("pid*"):  # the files of an earlier launch in this directory
        stale.unlink()
    config = LaunchConfig(
        ["-m", "probe_rank", mode], nproc=2, timeout_s=timeout_s, grace_s=5, cwd=str(probe_dir),
        env={"PROBE": "yes", **(env or {})}, preload=preload, link_rate_bps=link,
    )  # fmt: skip
    result = launch(config, out=out, err=err, launch_id=launch_id)
    lines = out.getvalue().splitlines()
    probes = [json.loads(line.split("] ", 1)[1]) for line in lines if line.split("] ", 1)[1][:1] == "{"]
    probes.sort(key=lambda p: p["rank"])
    others = sorted(line for line in lines if "{" not in line)
    return result, probes, others, err.getvalue()


@pytest.fixture(scope="module")
def modes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One probe directory for every mode of :func:`test_a_forked_rank_is_the_fresh_interpreter`: their
    forked launches have one zygote's key (environment, directory, modules), so one zygote forks them all
    instead of one started per mode."""
    path = tmp_path_factory.mktemp("modes")
    (path / "probe_rank.py").write_text(PROBE)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "atexit", "exit", "raise", "kill"])
def test_a_forked_rank_is_the_fresh_interpreter(modes_dir: Path, mode: str) -> None:
    probe_dir = modes_dir
    fresh = _launch(probe_dir, mode, ())
    forked = _launch(probe_dir, mode, LIGHT)
    (r0, p0, o0, e0), (r1, p1, o1, e1) = fresh, forked
    for probe in p0 + p1:  # the host's interfaces come and go as other tests build networks: not compared
        del probe["ifaces"], probe["sys"]
    assert p1 == p0 and len(p0) == 2, (p0, p1)
    assert o1 == o0  # stdout lines other than the probe's: atexit's
    assert p0[0]["session"] and p0[0]["stdin"] == "" and p0[0]["name"] == "__main__"
    assert p0[0]["argv"] == [str(probe_dir / "probe_rank.py"), mode] and p0[0]["probe"] == "yes"
    for attr in ("returncode", "failed_rank", "message", "rank_returncodes"):
        assert getattr(r1, attr) == getattr(r0, attr), attr
    assert ("[r0] stderr of 0" in e1) and ("[r1] stderr of 1" in e1)
    if mode == "raise":
        assert "RuntimeError: boom" in e0 and "RuntimeError: boom" in e1
    expected = {"ok": 0, "atexit": 0, "exit": 3, "raise": 1, "kill": 128 + signal.SIGKILL}[mode]
    assert r1.returncode == expected
    if mode == "atexit":
        assert o1 == ["[r0] atexit of 0", "[r1] atexit of 1"]


@pytest.mark.root
@pytest.mark.slow
def test_a_forked_rank_behind_a_link_is_in_its_network_namespace(probe_dir: Path) -> None:
    # the same launch id: the same names and addresses, one launch after the other
    runs = (_launch(probe_dir, "ok", p, link=1e8, launch_id="lcb0ff1c") for p in ((), LIGHT))
    (r0, p0, _, e0), (r1, p1, _, e1) = runs
    assert r0.ok and r1.ok, e0 + e1
    assert p1 == p0 and len(p0) == 2
    for probe in p0:  # its own namespace: lo and its veth, in /sys too (a mount namespace of its own)
        assert probe["ifaces"] == probe["sys"] and len(probe["ifaces"]) == 2 and "lo" in probe["ifaces"]
        assert probe["hosts"].startswith("127.0.0.1 localhost\n")  # the namespace's own /etc/hosts
    assert p0[0]["ifaces"] != p0[1]["ifaces"]
    veths = {name for probe in p0 for name in probe["ifaces"] if name != "lo"}
    host = set(os.listdir("/sys/class/net"))  # the launcher's own /sys: its devices, none of theirs
    assert veths.isdisjoint(host) and "lo" in host and all(host != set(probe["sys"]) for probe in p0)
    assert_nothing_left("lcb0ff1c")


@pytest.mark.slow
def test_stop_timeout_and_the_reused_zygote(probe_dir: Path) -> None:
    # the launcher's SIGTERM on a timeout reaches the forked rank's own handler, as it does a fresh one's
    result, _, others, _ = _launch(probe_dir, "term", LIGHT, timeout_s=1.5)
    assert result.timed_out and result.rank_returncodes == [9, 9]
    assert others == ["[r0] SIGTERM in 0", "[r1] SIGTERM in 1"]
    zygote_pid = {int((probe_dir / f"pid{k}").read_text().split()[1]) for k in range(2)}
    _launch(probe_dir, "ok", LIGHT)  # a second launch of the same environment forks from the same zygote
    assert {int((probe_dir / f"pid{k}").read_text().split()[1]) for k in range(2)} == zygote_pid
    out = io.StringIO()
    config = LaunchConfig(
        ["-m", "probe_rank", "ok"], nproc=2, timeout_s=60, cwd=str(probe_dir), preload=LIGHT,
        env={"PROBE": "yes", "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert launch(config, out=out, err=io.StringIO()).ok  # torch reads OMP_NUM_THREADS: a new zygote
    assert {int((probe_dir / f"pid{k}").read_text().split()[1]) for k in range(2)}.isdisjoint(zygote_pid)


def _launcher(probe_dir: str) -> None:
    """The launcher that :func:`test_a_killed_launcher_takes_its_forked_ranks_with_it` kills: a fork of the
    fork server of ``processes.context`` (torch, which the launcher's rendezvous store imports, already
    imported: a fresh interpreter spent a second importing it), its output in ``probe_dir/launcher.out``."""
    out = os.open(os.path.join(probe_dir, "launcher.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    config = LaunchConfig(["-m", "probe_rank", "sleep"], nproc=2, timeout_s=60, cwd=probe_dir, preload=LIGHT)
    sys.exit(launch(config).returncode)


@pytest.mark.slow
def test_a_killed_launcher_takes_its_forked_ranks_with_it(probe_dir: Path) -> None:
    proc = context().Process(target=_launcher, args=(str(probe_dir),), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not all((probe_dir / f"pid{k}").exists() for k in range(2)):
            assert time.monotonic() < deadline and proc.is_alive(), (probe_dir / "launcher.out").read_text()
            time.sleep(0.05)
        time.sleep(0.2)
        pids = [int((probe_dir / f"pid{k}").read_text().split()[0]) for k in range(2)]
        proc.kill()
        proc.join(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a forked rank outlived its killed launcher"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return False


def test_a_dead_zygote_fails_its_ranks_and_is_replaced(probe_dir: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "PROBE": "no"}
    zygote = Zygote(PY, LIGHT, shared_env([env]), str(probe_dir))
    zygote.start()
    rank = zygote.fork([PY, "-m", "probe_rank", "sleep"], env, str(probe_dir))
    try:
        assert rank.poll() is None
        line = rank.stdout.readline()
        assert json.loads(line)["probe"] == "no"
        os.kill(zygote.proc.pid, signal.SIGKILL)
        assert rank.wait(10) == -signal.SIGKILL  # reported, and the rank's group killed
        assert rank.reason == "the preload zygote died (killed by SIGKILL)"
        deadline = time.monotonic() + 10
        while _alive(rank.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank.pid)
        with pytest.raises(PreloadError, match="has exited"):
            zygote.fork([PY, "-m", "probe_rank", "ok"], env, str(probe_dir))
    finally:
        zygote.close()
        rank.stdout.close()
        rank.stderr.close()
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as first:
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as again:  # the dead one is replaced
        assert again.alive() and again.proc.pid != first.proc.pid


def test_a_zygote_that_cannot_import_is_named_and_the_launch_falls_back(probe_dir: Path) -> None:
    no_such = ("lioncub_no_such_module",)
    with (
        pytest.raises(PreloadError, match=r"ModuleNotFoundError.*lioncub_no_such_module"),
        preload.lease(dict(os.environ), str(probe_dir), no_such),
    ):
        pass
    result, probes, _, err = _launch(probe_dir, "ok", no_such)
    assert result.ok and len(probes) == 2
    assert "starting every rank as a fresh interpreter: the preloaded interpreter did not start" in err


def test_shared_env_leaves_out_what_differs_and_what_is_read_at_run_time() -> None:
    launch_set = {"MASTER_PORT": "5", "LIONCUB_LAUNCH_ID": "q", "PYTEST_CURRENT_TEST": "t"}
    envs = [{"A": "1", "B": "x", "RANK": "0", **launch_set}, {"A": "1", "B": "y", "RANK": "1", **launch_set}]
    assert shared_env(envs) == {"A": "1"}


def test_a_launch_across_nodes_and_a_plain_launch_share_the_zygotes_environment() -> None:
    """What the agents of a launch across nodes get (torchrun's line prefix, the node's NIC, the emulated
    network) is read at run time: a process that launches both keeps one zygote, which imports torch once."""
    from lioncub.launch.environment import node_env, rank_env

    base = {"PATH": "/usr/bin", "A": "1"}
    plain = [rank_env(r, 2, master_addr="127.0.0.1", master_port=5, ifname="lo", launch_id="p", base=base)
             for r in range(2)]  # fmt: skip
    nodes = [node_env(n, 2, ifname=f"lcb{n}", launch_id="q", link_bps=1e8, base=base) for n in range(2)]
    assert "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" in nodes[0]
    assert shared_env(nodes) == shared_env(plain) == {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_preload_is_refused_where_a_rank_cannot_be_forked() -> None:
    with pytest.raises(ValueError, match=r"--preload forks ranks of `-m MODULE \.\.\.` or `-c CODE`"):
        LaunchConfig(["train.py"], nproc=2, preload=MODULES)
    LaunchConfig(["-m", "x"], nnodes=2, nproc_per_node=2, preload=MODULES, link_rate_bps=1e8)  # torchrun's
    LaunchConfig(["-m", "x"], nproc=2, preload=MODULES, link_rate_bps=1e8)  # a link: forked, then setns
    LaunchConfig(["-c", "pass"], nproc=2, preload=MODULES)
    with pytest.raises(ValueError, match="--preload must be a tuple of module names"):
        LaunchConfig(["-m", "x"], nproc=2, preload="torch")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "link", "nnodes", "preload_env", "forked"),
    [("cpu", "loopback", None, None, True), ("cpu", "100mbit", None, None, True),
     ("cpu", "100mbit", 2, None, True), ("cpu", "loopback", None, "0", False),
     ("cuda", "loopback", None, None, False)],
)  # fmt: skip
def test_lioncub_train_forks_its_ranks_on_the_cpu_under_nproc(
    monkeypatch: pytest.MonkeyPatch, device: str, link: str, nnodes: int | None, preload_env: str | None,
    forked: bool,
) -> None:  # fmt: skip
    if preload_env is None:
        monkeypatch.delenv("LIONCUB_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LIONCUB_PRELOAD", preload_env)
    config = TrainConfig()
    config.run.device, config.cluster.link, config.cluster.nproc = device, link, 4
    config.cluster.nnodes = nnodes
    launch_config = make_launch_config(config, [PY, "-m", RANK_MODULE, "run"], 60.0)
    assert bool(launch_config.preload) == forked
    if forked:
        assert set(MODULES) <= set(launch_config.preload)


def test_lioncub_launch_preload(
    probe_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(probe_dir)
    assert cli.main(["launch", "--nproc", "2", "--preload", "json, csv", "--", "-m", "probe_rank", "ok"]) == 0
    out = capfd.readouterr().out
    assert out.count('"name": "__main__"') == 2
    parents = {int((probe_dir / f"pid{k}").read_text().split()[1]) for k in range(2)}
    assert len(parents) == 1 and parents != {os.getpid()}  # both forked by one zygote, not by the launcher
    assert cli.main(["launch", "--nproc", "2", "--preload", "torch", "--", "probe_rank.py", "ok"]) == 2
    assert "--preload forks ranks of `-m MODULE ...` or `-c CODE`" in capfd.readouterr().err


@pytest.mark.slow
def test_every_wait_on_the_zygote_is_bounded(probe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (probe_dir / "slow_import.py").write_text("import time\ntime.sleep(30)\n")
    # the bounds are waited out in full (an import that sleeps, a stopped zygote): short ones, 0.2 s
    monkeypatch.setattr(preload, "START_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    slow = pytest.raises(PreloadError, match=r"importing slow_import took more than 0\.2 s")
    with slow, preload.lease(dict(os.environ), str(probe_dir), ("slow_import",)):
        pass
    assert time.monotonic() - t0 < 10
    # the zygote below must start (a fresh interpreter importing json: over 0.5 s on a loaded 2-core machine,
    # seen in the suite); only its fork is bounded tightly
    monkeypatch.setattr(preload, "START_TIMEOUT_S", 60.0)
    monkeypatch.setattr(preload, "FORK_TIMEOUT_S", 0.2)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote:
        os.kill(zygote.proc.pid, signal.SIGSTOP)  # a zygote that does not answer
        with pytest.raises(PreloadError, match=r"did not fork the rank in 0\.2 s"):
            zygote.fork([PY, "-m", "probe_rank", "ok"], env, str(probe_dir))
        assert not zygote.alive()
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as again:
        assert again is not zygote and again.alive()  # replaced


# -- what a fresh interpreter has and a fork must not share: random state, threads, the zygote's life ----

#: tests/background.py's job that runs ``ownership_runs.draw_runs`` (after the launches of other modules whose
#: zygote forks these ranks too): tests/compare_runs.py's
BACKGROUND = {"compares": compare_runs.job}


def _draws(i: int) -> list[dict]:
    """What each rank of run ``i`` of ``ownership_runs.DRAW_RUNS`` drew, forked (the background job
    ``compares``)."""
    proc = background.result("compares", BACKGROUND["compares"])
    workdir = background.workdir("compares") / "launched" / "draws"
    error = workdir.with_name("draws.error")
    assert not error.exists(), error.read_text()
    assert (workdir / f"rc{i}").exists(), f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    rc, launcher = (int(v) for v in (workdir / f"rc{i}").read_text().split())
    out, err = (workdir / f"out{i}").read_text(), (workdir / f"err{i}").read_text()
    assert rc == 0, out + err
    assert "fresh interpreter" not in err, err  # numpy's BLAS threads stop at a fork: no reason to refuse
    draws = sorted((json.loads(line.split("] ", 1)[1]) for line in out.splitlines()), key=lambda d: d["rank"])
    assert len(draws) == 2 and draws[0]["ppid"] == draws[1]["ppid"] != launcher  # forked
    return draws


@pytest.mark.slow
@pytest.mark.background("compares")
def test_an_unseeded_script_draws_other_numbers_on_every_rank_and_run() -> None:
    import numpy
    import torch

    planned = ownership_runs.DRAW_RUNS
    assert planned[2] == ("seeded",) and planned[0] == planned[1] == ()
    runs = [_draws(0), _draws(1)]  # the second from the same zygote
    for source in ("torch", "numpy", "random"):
        drawn = [str(rank[source]) for run in runs for rank in run]
        assert len(set(drawn)) == 4, (source, drawn)  # as fresh interpreters: seeded from OS entropy
    torch_1 = torch.randint(0, 2**62, (4,), generator=torch.Generator().manual_seed(1)).tolist()
    import random

    seeded = {"torch": torch_1, "numpy": numpy.random.RandomState(1).rand(2).tolist()}
    seeded["random"] = random.Random(1).random()
    for rank in _draws(2):  # a script that seeds gets its seed
        assert {k: rank[k] for k in seeded} == seeded


def _zygote_processes() -> list[int]:
    """This process's children that run a module of ``lioncub.launch`` (zygotes), zombies left out."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        ours = int(stat[1]) == os.getpid() and stat[0] != "Z"
        if ours and argv[1:2] == [b"-m"] and argv[2].startswith(b"lioncub.launch."):
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_a_sweep_of_launches_with_other_environments_keeps_at_most_one_zygote(probe_dir: Path) -> None:
    for k in range(4):
        result, probes, _, err = _launch(probe_dir, "ok", LIGHT, env={"SWEEP": str(k)})
        assert result.ok and "fresh interpreter" not in err and len(probes) == 2, err
        assert len(_zygote_processes()) <= 1, k


def test_a_replaced_zygote_lives_while_a_launch_holds_it(probe_dir: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as held:
        with preload.lease(shared_env([{**env, "OTHER": "1"}]), str(probe_dir), LIGHT) as other:
            assert other is not held and held.alive()  # its launch still runs ranks of it
        assert other.alive()  # released, but the current one: kept for the next launch of its key
        assert held.retired and held.alive()
    assert not held.alive() and held.proc.returncode is not None  # closed once released, and reaped
    assert other.alive() and len(_zygote_processes()) == 1


def _rank_pids(probe_dir: Path, n: int = 2) -> list[tuple[int, int]] | None:
    """(pid, parent pid) of every rank of the probe, once all have written them."""
    try:
        pids = [(probe_dir / f"pid{k}").read_text().split() for k in range(n)]
    except FileNotFoundError:
        return None
    return [(int(p[0]), int(p[1])) for p in pids] if all(len(p) == 2 for p in pids) else None


@pytest.mark.slow
def test_a_launch_whose_zygote_dies_says_so(probe_dir: Path) -> None:
    def kill_the_zygote() -> None:
        deadline = time.monotonic() + 30
        while (pids := _rank_pids(probe_dir)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids is not None and pids[0][1] == pids[1][1] != os.getpid()
        os.kill(pids[0][1], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_zygote)
    killer.start()
    result, _, _, err = _launch(probe_dir, "sleep", LIGHT, env={"ZYGOTE": "killed"})
    killer.join()
    assert result.returncode == 128 + signal.SIGKILL
    assert result.message.startswith("the preload zygote died (killed by SIGKILL)"), result.message
    assert "was killed by SIGKILL" not in err and "[lioncub] the preload zygote died (killed by" in err


def test_preload_works_under_pythonwarnings_error(probe_dir: Path) -> None:
    result, probes, _, err = _launch(probe_dir, "ok", LIGHT, env={"PYTHONWARNINGS": "error"})
    assert result.ok and len(probes) == 2 and "fresh interpreter" not in err, err
    pids = _rank_pids(probe_dir)
    assert pids is not None and pids[0][1] == pids[1][1] != os.getpid()  # forked by one zygote


def test_a_zygote_with_a_native_thread_does_not_fork(probe_dir: Path) -> None:
    # faulthandler's watchdog is a C thread that Python's threading module does not know of
    (probe_dir / "native_thread.py").write_text("import faulthandler\nfaulthandler.dump_traceback_later(600)")
    result, probes, _, err = _launch(probe_dir, "ok", ("native_thread",))
    assert result.ok and len(probes) == 2
    assert "starting every rank as a fresh interpreter: " in err and "1 native thread" in err, err
    pids = _rank_pids(probe_dir)
    assert pids is not None and pids[0][1] == pids[1][1] == os.getpid()  # fresh interpreters


def test_the_network_namespace_is_a_field_of_the_request(probe_dir: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "PROBE": "no"}
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote:
        argv = [PY, "-m", "probe_rank", "ok"]
        rank = zygote.fork(argv, env, str(probe_dir), netns="lioncub-no-such-netns")
        assert rank.wait(10) == 1
        assert "cannot enter network namespace lioncub-no-such-netns" in rank.stderr.read().decode()
        rank.stdout.close(), rank.stderr.close()
        with pytest.raises(PreloadError, match=r"or `-c CODE`, got \['ip', 'netns'"):
            zygote.fork(["ip", "netns", "exec", "lioncub-no-such-netns", *argv], env, str(probe_dir))


def test_no_fork_where_a_gpu_may_be_used(
    probe_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    nvidiactl = probe_dir / "nvidiactl"  # a machine with a GPU
    nvidiactl.write_text("")
    monkeypatch.setattr(preload, "GPU_DEVICE_FILES", (str(nvidiactl),))
    monkeypatch.chdir(probe_dir)
    assert cli.main(["launch", "--nproc", "2", "--preload", "json", "--", "-m", "probe_rank", "ok"]) == 0
    err = capfd.readouterr().err
    assert f"starting every rank as a fresh interpreter: this machine has {nvidiactl}" in err
    pids = _rank_pids(probe_dir)
    assert pids is not None and pids[0][1] == pids[1][1] == os.getpid()
    for device, forked in (("auto", False), ("cuda", False), ("cpu", True)):  # lioncub train's ranks
        monkeypatch.delenv("LIONCUB_PRELOAD", raising=False)
        config = TrainConfig()
        config.run.device, config.cluster.nproc = device, 2
        launch_config = make_launch_config(config, [PY, "-m", RANK_MODULE, "run"], 60.0)
        assert bool(launch_config.preload) == forked, device
    assert launch_config.preload_device == "cpu"
    for k in range(2):
        (probe_dir / f"pid{k}").unlink()
    config = LaunchConfig(["-m", "probe_rank", "ok"], nproc=2, cwd=str(probe_dir), preload=LIGHT,
                          preload_device="cpu")  # fmt: skip
    assert launch(config, out=io.StringIO(), err=io.StringIO()).ok  # ranks on the CPU: forked
    pids = _rank_pids(probe_dir)
    assert pids is not None and pids[0][1] == pids[1][1] != os.getpid()


#: ``python -c`` code that says what a fresh interpreter's ``-c`` gives it
C_PROBE = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "spec": __spec__,
                      "names": sorted(n for n in globals() if not n.startswith("__")), "pid": os.getpid()}))
    sys.exit(int(sys.argv[1]))
""")


def test_a_c_rank_is_the_fresh_interpreter(probe_dir: Path) -> None:
    """``python -c CODE ARGS`` forked: the same argv, ``__main__``, ``sys.path[0]`` and globals as fresh (none
    of the zygote's names), and its exit status."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    argv = [PY, "-c", C_PROBE, "4", "x"]
    fresh = subprocess.run(argv, capture_output=True, text=True, cwd=probe_dir, env=env)
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote:
        rank = zygote.fork([PY, "-c", C_PROBE, "4", "x"], env, str(probe_dir))
        assert rank.wait(20) == fresh.returncode == 4
        assert rank.stdout is not None and rank.stderr is not None
        forked, err = json.loads(rank.stdout.read()), rank.stderr.read().decode()
        rank.stdout.close(), rank.stderr.close()
    expected = json.loads(fresh.stdout)
    assert forked.pop("pid") == rank.pid and expected.pop("pid") != rank.pid
    assert forked == expected and err == fresh.stderr == "", (forked, expected)
    assert expected["argv"] == ["-c", "4", "x"] and expected["names"] == ["json", "os", "sys"]


def test_concurrent_forks_each_get_their_own_rank(probe_dir: Path) -> None:
    """Forks asked for from several threads at once (the relay of torchrun's shims does) each get the pid of
    the rank they asked for: the zygote's replies carry no request id, so one request at a time."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    n = 8
    start, got = threading.Barrier(n), [None] * n

    def fork(k: int) -> None:
        start.wait()
        code = f"import os; print({k}, os.getpid())"
        rank = zygote.fork([PY, "-c", code], {**env, "RANK": str(k)}, str(probe_dir))
        assert rank.wait(20) == 0 and rank.stdout is not None and rank.stderr is not None
        got[k] = (rank.pid, rank.stdout.read().decode().split())
        rank.stdout.close(), rank.stderr.close()

    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote:
        threads = [threading.Thread(target=fork, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert got == [(pid, [str(k), str(pid)]) for k, (pid, _) in enumerate(got)], got


def _shim(relay: WorkerRelay, code: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    """A rank's shim as torchrun's agent starts it (its own session), running ``python -c code args``."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.Popen(relay.command(0, [PY, "-c", code, *args]), env=env, text=True,
                            start_new_session=True, **popen)  # fmt: skip


def test_a_shim_stands_in_for_its_forked_rank(probe_dir: Path) -> None:
    """:mod:`lioncub.launch.workers`: the rank a shim asks for is a fork of the zygote writing to the shim's
    stdout and stderr, with the shim's environment and directory; the shim exits as the rank did (code, or
    the same signal, SIGKILL included), passes SIGTERM on, and a shim killed by SIGKILL takes its rank with
    it."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    code = textwrap.dedent("""
        import os, sys, time
        open(f"part{sys.argv[1]}", "w").write(f"{os.getpid()} {os.getppid()}")
        os.rename(f"part{sys.argv[1]}", f"rank{sys.argv[1]}")  # whole when the test sees it
        print("out", os.environ["RANK"], os.getcwd()); print("err", sys.argv[1:], file=sys.stderr)
        if sys.argv[2] == "sleep":
            time.sleep(60)
        sys.exit(int(sys.argv[2]))
    """)
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote, \
            WorkerRelay(zygote, str(probe_dir), [None]) as relay:  # fmt: skip
        shim = _shim(relay, code, "a", "5", cwd=probe_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = shim.communicate(timeout=30)
        assert shim.returncode == 5 and out == f"out 0 {probe_dir}\n" and err == "err ['a', '5']\n", err
        pid, parent = map(int, (probe_dir / "ranka").read_text().split())
        assert pid != shim.pid and parent == zygote.proc.pid  # forked by the zygote, not the shim

        # SIGTERM to the shim reaches the rank, which dies of it, and so does the shim; SIGKILL to the shim
        # cannot be passed on (the relay kills the rank); a rank SIGKILLed from outside (the OOM killer) is
        # a shim dying of SIGKILL, a signal whose handler cannot be set to its default
        for target, sig in (("shim", signal.SIGTERM), ("shim", signal.SIGKILL), ("rank", signal.SIGKILL)):
            name = f"b{target}{int(sig)}"
            shim = _shim(relay, code, name, "sleep", cwd=probe_dir, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 20
            while not (probe_dir / f"rank{name}").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            pid = int((probe_dir / f"rank{name}").read_text().split()[0])
            os.kill(shim.pid if target == "shim" else pid, sig)
            assert shim.wait(20) == -sig, shim.stderr and shim.stderr.read()
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not _alive(pid), f"rank {pid} outlived its shim ({sig.name})"


def test_a_shim_whose_rank_cannot_be_forked_runs_it_fresh(probe_dir: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    with preload.lease(shared_env([env]), str(probe_dir), LIGHT) as zygote, \
            WorkerRelay(zygote, str(probe_dir), [None]) as relay:  # fmt: skip
        zygote.closed = True  # as after its death: no fork
        shim = _shim(relay, "import os, sys; print(os.getpid()); sys.exit(6)", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)  # fmt: skip
        out, err = shim.communicate(timeout=30)
    assert shim.returncode == 6 and out.split() == [str(shim.pid)]  # the shim became the rank (exec)
    assert "this rank starts as a fresh interpreter: the preloaded interpreter has exited" in err


#: a script's end: a non-daemon thread that finishes after the main thread, an atexit handler, output left in
#: stdout's and stderr's buffers, and an object still alive whose finalizer writes (each event a line of
#: ``order``); it ends with ``sys.exit(7)``, or with ``preload.end_rank(7)`` as lioncub's own processes do
END_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from lioncub.launch.preload import end_rank

    def note(line, open=open):
        with open("order", "a") as f:
            f.write(line + "\\n")

    class Alive:
        def __del__(self, note=note):
            note("teardown")

    alive = Alive()
    threading.Thread(target=lambda: (time.sleep(0.2), note("thread"))).start()
    atexit.register(note, "atexit")
    sys.stdout.write("out, unflushed")
    sys.stderr.write("err, unflushed")
    if sys.argv[1] == "end_rank":
        end_rank(7)
    sys.exit(7)
""")


def test_end_rank_ends_as_python_does_but_for_the_teardown(tmp_path: Path) -> None:
    """``preload.end_rank(7)`` ends a process as Python's own exit does (the oracle: the same script ending
    with ``sys.exit(7)``): the non-daemon thread joined, then the atexit handlers, stdout and stderr
    flushed, exit status 7; only the teardown is left out: an object alive at the end is not finalized."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the streams buffer their writes
    ends = {}
    for how in ("sys.exit", "end_rank"):
        (cwd := tmp_path / how).mkdir()
        argv = [PY, "-c", END_SCRIPT, how]
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
        ends[how] = (proc.returncode, proc.stdout, proc.stderr, (cwd / "order").read_text().split())
    assert ends["sys.exit"] == (7, "out, unflushed", "err, unflushed", ["thread", "atexit", "teardown"])
    assert ends["end_rank"] == (7, "out, unflushed", "err, unflushed", ["thread", "atexit"])
