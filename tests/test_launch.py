"""Tests of ``lioncub launch``: parsing, rank environment, process supervision and the emulated network.

The network tests need root (network namespaces, tc) and are skipped with a stated reason otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import background
import compare_runs
import ownership_runs
from emulated_network import assert_nothing_left, tcp_payload
from lioncub.cli import launch as launch_cli
from lioncub.launch import (
    EmulatedNetwork,
    LaunchConfig,
    LinkSpec,
    PrivilegeError,
    build_command,
    check_privileges,
    cleanup,
    launch,
    netns,
    parse_rate,
    parse_size,
    rank_env,
)
from lioncub.optim.step_check import STEP_CHECK_WORDS

from processes import PY, context


def _run(config: LaunchConfig):  # type: ignore[no-untyped-def]
    out, err = io.StringIO(), io.StringIO()
    result = launch(config, out=out, err=err)
    return result, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------------------ unit tests


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100mbit", 1e8),
        ("1gbit", 1e9),
        ("2.5gbit", 2.5e9),
        ("10kbit", 1e4),
        ("1GBit", 1e9),
        ("800bit", 800.0),
        ("500Mbps", 5e8),
        ("1Gbps", 1e9),
        ("64Kbps", 64e3),
        (" 100 mbit ", 1e8),
    ],
)
def test_parse_rate_accepts_tc_units_and_bits_per_second(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text", ["", "100", "0mbit", "0.0gbit", "-1gbit", "fast", "1.2.3gbit", "10 furlongs", "infgbit", "1e9bit"]
)
def test_parse_rate_rejects_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--link.*(mbit|positive)"):
        parse_rate(text)


def test_parse_rate_refuses_tc_bytes_per_second_spelling() -> None:
    with pytest.raises(ValueError, match=r"ambiguous.*bytes per second.*mbit or Mbps"):
        parse_rate("100mbps")
    with pytest.raises(ValueError, match="ambiguous"):
        parse_rate("1GBps")


def test_parse_size() -> None:
    assert parse_size("256kb") == 262144
    assert parse_size("1mb") == 1 << 20
    assert parse_size("65536") == 65536
    assert parse_size("1500b") == 1500
    for bad in ("", "0kb", "12 parsecs", "-5kb"):
        with pytest.raises(ValueError, match="--burst"):
            parse_size(bad)


def test_link_spec_validation_and_default_burst() -> None:
    assert LinkSpec(1e8).burst == 25_000  # 2 ms at 100 Mbit/s
    assert LinkSpec(1e9).burst == 250_000
    assert LinkSpec(1e7).burst == 16 * 1024  # the floor
    assert LinkSpec(4e9).burst == 1_000_000  # 2 ms at 4 Gbit/s
    assert LinkSpec(1e8, mtu=9000, burst_bytes=9014).burst == 9014
    with pytest.raises(ValueError, match=r"--burst.*smaller than one frame"):
        LinkSpec(1e8, mtu=9000, burst_bytes=8192)
    with pytest.raises(ValueError, match="--mtu"):
        LinkSpec(1e8, mtu=40)


def test_build_command() -> None:
    assert build_command(["-m", "pkg.mod", "--x", "1"]) == [PY, "-m", "pkg.mod", "--x", "1"]
    assert build_command(["train.py", "--steps", "3"]) == [PY, "train.py", "--steps", "3"]
    assert build_command(["--", "dir/run.py"]) == [PY, "dir/run.py"]
    assert build_command(["python3", "train.py"]) == ["python3", "train.py"]
    assert build_command(["sh", "-c", "true"]) == ["sh", "-c", "true"]
    with pytest.raises(ValueError, match="no command"):
        build_command(["--"])


def test_rank_env_loopback() -> None:
    base = {"PATH": "/bin", "LIONCUB_LINK_BPS": "123", "RANK": "9"}
    env = rank_env(
        2, 4, master_addr="127.0.0.1", master_port=1234, ifname="lo", launch_id="lcb00abc", base=base
    )
    assert env["PATH"] == "/bin"
    expected = {
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "GLOO_SOCKET_IFNAME": "lo",
        "LIONCUB_LAUNCH_ID": "lcb00abc", "LIONCUB_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    assert {k: env[k] for k in expected} == expected
    assert "LIONCUB_LINK_BPS" not in env  # an outer launch's link must not leak into an unshaped one


def test_rank_env_link_restart_and_overrides() -> None:
    env = rank_env(
        1, 2, master_addr="10.100.1.10", master_port=29500, ifname="lcb00abcv1", launch_id="lcb00abc",
        link_bps=1e8, restart_count=2, max_restarts=3, base={"OMP_NUM_THREADS": "2"},
        extra={"MASTER_PORT": "777", "FOO": "bar"},
    )  # fmt: skip
    assert env["GLOO_SOCKET_IFNAME"] == "lcb00abcv1"
    assert env["MASTER_ADDR"] == "10.100.1.10"
    assert env["LIONCUB_LINK_BPS"] == "100000000"
    assert env["LIONCUB_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["OMP_NUM_THREADS"] == "2"  # the user's setting wins
    assert env["MASTER_PORT"] == "777" and env["FOO"] == "bar"


def test_launch_config_validation() -> None:
    with pytest.raises(ValueError, match="--nproc"):
        LaunchConfig(["x.py"], nproc=0)
    with pytest.raises(ValueError, match="no command"):
        LaunchConfig([], nproc=2)
    with pytest.raises(ValueError, match="--timeout"):
        LaunchConfig(["x.py"], timeout_s=0)
    with pytest.raises(ValueError, match="--burst"):
        LaunchConfig(["x.py"], link_rate_bps=1e8, burst_bytes=100)


def test_network_names_fit_linux_limits() -> None:
    ids = {netns.new_launch_id() for _ in range(50)}
    assert all(re.fullmatch(r"lcb[0-9a-f]{5}", i) for i in ids) and len(ids) > 40
    net = EmulatedNetwork(240, LinkSpec(1e9), launch_id="lcbfffff")  # constructing creates nothing
    names = [net.bridge] + [n for r in net.ranks for n in (r.ifname, r.bridge_port)]
    assert max(map(len, names)) <= 15  # IFNAMSIZ - 1
    assert net.master_addr == net.ranks[0].address
    assert net.ranks[239].address.endswith(".249")
    assert netns.subnet_for("lcb00001") != netns.subnet_for("lcb00101")


def test_missing_privileges_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "effective_capabilities", lambda: 1 << netns.CAP_NET_ADMIN)
    with pytest.raises(PrivilegeError, match=r"lacks: capability CAP_SYS_ADMIN; .*Without --link"):
        check_privileges()
    monkeypatch.setattr(netns, "effective_capabilities", lambda: 0)
    monkeypatch.setattr(netns, "_tool", lambda name: None if name == "tc" else "/sbin/ip")
    with pytest.raises(PrivilegeError, match=r"CAP_NET_ADMIN, capability CAP_SYS_ADMIN, the `tc` tool"):
        check_privileges()


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lioncub launch")
    launch_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_options_of_several_commands_are_declared_once(capsys: pytest.CaptureFixture[str]) -> None:
    """``--nproc-per-node`` (launch, cost, calibrate, train, compare) and ``--timeout`` (launch, train,
    compare) are one description each (``cli.options.LaunchOptions``): one help, one minimum, one default,
    ``LaunchConfig``'s too."""
    import importlib

    required = {"cost": ["--params", "1M"], "calibrate": ["--out", "x.json"], "train": ["--out", "x"]}
    required["compare"] = ["--out", "x"]
    required["launch"] = []
    for command, argv in required.items():
        parser = argparse.ArgumentParser(prog=f"lioncub {command}")
        importlib.import_module(f"lioncub.cli.{command}").add_arguments(parser)
        assert "--nproc-per-node L" in parser.format_help()
        assert parser.parse_args([*argv, "--nproc-per-node", "1"]).nproc_per_node == 1
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--nproc-per-node", "0"])
        assert "must be a whole number >= 1, got 0" in capsys.readouterr().err
        if command in ("launch", "train", "compare"):
            assert parser.get_default("timeout") == LaunchConfig(["x.py"]).timeout_s == 7200
            helps = re.sub(r"\s+", " ", parser.format_help())
            assert "--nproc N ranks, each its own node under --link" in helps
            assert "--intra-link RATE with --nnodes: shape each node's loopback, which its" in helps


def test_cli_dry_run_and_bad_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_cli.run(_cli(["--nproc", "2", "--link", "1gbit", "--dry-run", "--", "-m", "m", "-x"])) == 0
    out = capsys.readouterr().out
    assert "tbf rate 1gbit" in out
    rank1 = r"rank 1: .*GLOO_SOCKET_IFNAME=lcb[0-9a-f]{5}v1 .*ip netns exec lcb[0-9a-f]{5}-r1 \S+ -m m -x"
    assert re.search(rank1, out)
    assert launch_cli.run(_cli(["--link", "fast", "--", "x.py"])) == 2
    assert "--link: cannot read 'fast'" in capsys.readouterr().err
    assert (
        launch_cli.run(_cli(["--nproc", "2", "--collective-timeout", "30", "--dry-run", "--", "x.py"])) == 0
    )
    assert re.search(r"rank 1: .*LIONCUB_PG_TIMEOUT=30 ", capsys.readouterr().out)
    assert launch_cli.run(_cli(["--collective-timeout", "0", "--", "x.py"])) == 2
    assert "--collective-timeout 0.0 must be a finite number of seconds > 0" in capsys.readouterr().err


def test_cli_is_registered() -> None:
    from lioncub.cli import COMMANDS

    assert COMMANDS["launch"][0] == "lioncub.cli.launch"


# ------------------------------------------------------------------------------- loopback launches


def _launched(name: str) -> tuple:
    """(result, stdout, stderr) of launch ``name`` of ``ownership_runs.forked_launches`` (the background job
    ``compares``; its programs, :data:`ownership_runs.ALLREDUCE_AND_LISTENERS`, ``TIMED_ALLREDUCE`` and
    ``ONE_BIT_STEPS``, are there: no module imports a test module)."""
    proc = background.result("compares", BACKGROUND["compares"])
    done = background.workdir("compares") / "launched" / "forked"
    error = done / f"{name}.error"
    assert not error.exists(), error.read_text()
    assert (done / f"{name}.pickle").exists(), f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return pickle.loads((done / f"{name}.pickle").read_bytes())


#: tests/background.py's job that runs ``ownership_runs.forked_launches`` (after the launches of other modules
#: whose zygote forks their ranks too): tests/compare_runs.py's
BACKGROUND = {"compares": compare_runs.job}


@pytest.fixture(scope="module")
def loopback_three_ranks() -> tuple:
    """One launch of 3 ranks on loopback (in the background job ``compares``) serves the two tests
    below: (result, stdout, stderr)."""
    assert ownership_runs.ALLREDUCE_AND_LISTENERS != ownership_runs.ALLREDUCE
    return _launched("loopback")


@pytest.mark.slow
@pytest.mark.background("compares")
def test_the_rendezvous_store_listens_on_loopback_only(loopback_three_ranks: tuple) -> None:
    result, out, err = loopback_three_ranks
    assert result.ok, err
    listening = re.search(r"\[r0\] listen \[(.*)\]", out).group(1)
    # 127.0.0.1 in /proc/net/tcp's little-endian hex; torch's own store would be 00000000 (every interface)
    assert re.fullmatch(r"'0100007F:[0-9A-F]{4}'", listening), out


@pytest.mark.slow
@pytest.mark.background("compares")
def test_loopback_allreduce_three_ranks(loopback_three_ranks: tuple) -> None:
    result, out, err = loopback_three_ranks
    assert result.ok, err
    assert result.rank_returncodes == [0, 0, 0] and result.failed_rank is None and result.traffic is None
    for k in range(3):
        assert f"[r{k}] sum=6 ifname=lo world=3\n" in out and f"[r{k}] threads=1\n" in out
        assert f"[r{k}] no newline at the end\n" in out


def test_rank_failure_stops_the_others_quickly() -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)"
    t0 = time.monotonic()
    result, _, err = _run(LaunchConfig([PY, "-c", code], nproc=3, timeout_s=120, grace_s=5))
    assert time.monotonic() - t0 < 15
    assert (result.returncode, result.failed_rank) == (3, 1)
    assert result.message == "rank 1 exited with code 3"
    assert result.rank_returncodes == [-signal.SIGTERM, 3, -signal.SIGTERM]
    assert "rank 1 exited with code 3; stopping ranks 0, 2" in err


def test_rank_killed_by_signal_is_named() -> None:
    code = "import os, time\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), 9)\ntime.sleep(60)"
    result, _, _ = _run(LaunchConfig([PY, "-c", code], nproc=2, timeout_s=60, grace_s=5))
    assert (result.returncode, result.failed_rank) == (128 + signal.SIGKILL, 0)
    assert result.message == "rank 0 was killed by SIGKILL"


@pytest.mark.slow
def test_timeout_kills_everything_and_reports_running_ranks() -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(0)\ntime.sleep(30)"
    result, _, _ = _run(LaunchConfig([PY, "-c", code], nproc=3, timeout_s=1.5, grace_s=1))
    assert result.timed_out and result.returncode == 124
    assert result.wall_s < 8
    assert result.message == "timed out; ranks still running: 0, 2"
    assert result.rank_returncodes == [-signal.SIGTERM, 0, -signal.SIGTERM]


@pytest.mark.slow
def test_grace_period_then_sigkill() -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(30)"
    result, _, err = _run(LaunchConfig([PY, "-c", code], nproc=2, timeout_s=1.0, grace_s=0.5))
    assert result.timed_out and result.rank_returncodes == [-signal.SIGKILL, -signal.SIGKILL]
    assert "sending SIGKILL" in err


def test_restarts_rerun_all_ranks() -> None:
    # rank 0 fails until the second restart; rank 1 waits to be stopped, so the failed rank is always 0
    code = (
        "import os, sys, time\nrc = 0 if os.environ['LIONCUB_RESTART_COUNT'] == '2' else 5\n"
        "if rc and os.environ['RANK'] == '1':\n    time.sleep(30)\nsys.exit(rc)"
    )
    result, _, err = _run(LaunchConfig([PY, "-c", code], nproc=2, restarts=3, timeout_s=60))
    assert result.ok and result.restarts == 2
    assert "restarting all ranks (2/3)" in err
    result, _, _ = _run(LaunchConfig([PY, "-c", code], nproc=2, restarts=1, timeout_s=60))
    assert (result.returncode, result.restarts, result.failed_rank) == (5, 1, 0)


def test_unstartable_command_is_reported() -> None:
    result, _, err = _run(LaunchConfig(["/nonexistent/prog"], nproc=2, timeout_s=10))
    assert (result.returncode, result.failed_rank) == (127, 0)
    assert "could not start" in err


def _sigint_launcher(rank: str, out: str) -> None:
    """The launcher that :func:`test_sigint_is_forwarded_to_the_ranks` interrupts: a fork of the fork server
    of ``processes.context`` (torch, which the launcher's rendezvous store imports, already imported: a fresh
    interpreter spent ~1.5 s of CPU importing it), its output (and its ranks') in ``out``, its exit status
    the launch's. A long grace: a rank slow to answer under load is still waited for, not SIGKILLed."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(launch(LaunchConfig([rank], nproc=2, timeout_s=60, grace_s=30)).returncode)


@pytest.mark.slow
def test_sigint_is_forwarded_to_the_ranks(tmp_path: Path) -> None:
    rank, out = tmp_path / "rank.py", tmp_path / "launcher.out"
    rank.write_text(
        textwrap.dedent("""
        import signal, sys, time
        def stop(signum, frame):
            print(f"got {signum}", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGINT, stop)
        print("ready", flush=True)
        time.sleep(60)
    """)
    )
    proc = context().Process(target=_sigint_launcher, args=(str(rank), str(out)), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not {"[r0] ready", "[r1] ready"} <= set(out.read_text().splitlines() if out.exists() else ()):
            assert proc.is_alive() and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGINT)
        proc.join(30)
    finally:
        proc.kill()
    printed = out.read_text()
    assert proc.exitcode == 130, printed
    for r in (0, 1):
        assert f"[r{r}] got {int(signal.SIGINT)}" in printed, printed


# ------------------------------------------------------------------------------- emulated network


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("compares")
@pytest.mark.parametrize("nproc", [2, 4])
def test_allreduce_over_100mbit_links_matches_bandwidth(nproc: int) -> None:
    """Launched in the background job ``compares`` (its time is the shaped links')."""
    rate = ownership_runs.LINK_RATE
    result, out, err = _launched(f"links_{nproc}")
    assert result.ok, out + err
    measured_ms = float(re.search(r"\[r0\] ALLREDUCE_MS=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    wire_bytes = 2 * (nproc - 1) / nproc * 4e6  # ring allreduce, per rank and direction
    predicted_ms = wire_bytes / (0.956 * rate / 8) * 1e3  # TCP payload is 95.6 % of the line at MTU 1500
    print(f"n={nproc}: allreduce 4 MB at 100mbit: {measured_ms:.1f} ms, predicted {predicted_ms:.1f} ms")
    # Never faster than the shaped link (the shaping is in force); slower only by CPU contention of
    # 2N processes on 2 cores (CI has measured +19 % for the median at N = 4), not by 2x (a wrong rate,
    # or both directions sharing one queue).
    assert 0.9 * predicted_ms <= measured_ms <= 1.35 * predicted_ms
    # bytes on the wire: 4 allreduces of 4 MB, plus small barriers and rendezvous traffic
    assert result.traffic is not None and len(result.traffic) == nproc
    for t in result.traffic:  # TCP payload: the frames' bytes less their headers
        tx_payload = tcp_payload(t.tx_bytes, t.tx_packets)
        rx_payload = tcp_payload(t.rx_bytes, t.rx_packets)
        assert 4 * wire_bytes <= tx_payload <= 1.01 * 4 * wire_bytes + 300e3, t
        assert 4 * wire_bytes <= rx_payload <= 1.01 * 4 * wire_bytes + 300e3, t
    assert "hostname of the client socket" not in err  # /etc/netns/<ns>/hosts silences the c10d warning
    assert_nothing_left(result.launch_id)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("compares")
def test_interface_counters_agree_with_the_optimizers_accounting() -> None:
    """Launched in the background job ``compares``: 3 ranks behind 1 Gbit/s links."""
    nproc, d = 3, 4_000_003
    result, out, err = _launched("one_bit")
    assert result.ok, out + err
    d_pad = -(-d // (8 * nproc)) * 8 * nproc
    expected = 4 * 2 * (nproc - 1) / nproc * d_pad / 8  # 4 steps of all-to-all + all-gather of packed bits
    expected += 4 * (nproc - 1) * 4 * STEP_CHECK_WORDS  # and of the step check, all-gathered per step
    assert result.traffic is not None
    for t in result.traffic:
        m = re.search(rf"\[r{t.rank}\] ACCOUNTED sent=(\d+) recv=(\d+)", out)
        assert m is not None, out
        sent, recv = int(m.group(1)), int(m.group(2))
        assert sent == recv == pytest.approx(expected, abs=8 * nproc)  # the 1-bit wire bytes above
        # the interface's TCP payload: L2 bytes minus the headers of every frame (data and ACKs alike)
        tx_payload = tcp_payload(t.tx_bytes, t.tx_packets)
        rx_payload = tcp_payload(t.rx_bytes, t.rx_packets)
        print(f"rank {t.rank}: accounted {sent} B, interface payload tx {tx_payload} rx {rx_payload} B")
        assert tx_payload == pytest.approx(sent, rel=0.05)  # rendezvous, gloo headers: well under 5 %
        assert rx_payload == pytest.approx(recv, rel=0.05)
        assert tx_payload >= sent and rx_payload >= recv
    assert_nothing_left(result.launch_id)


@pytest.mark.root
def test_rank_failure_under_link_tears_down_the_network() -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)"
    result, _, err = _run(LaunchConfig([PY, "-c", code], nproc=3, link_rate_bps=1e8, timeout_s=60))
    assert (result.returncode, result.failed_rank) == (3, 1), err
    assert result.wall_s < 15
    assert result.rank_returncodes == [-signal.SIGTERM, 3, -signal.SIGTERM]
    assert_nothing_left(result.launch_id)


@pytest.mark.root
def test_cleanup_removes_leftovers_of_dead_launchers_only() -> None:
    import atexit

    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = EmulatedNetwork(2, LinkSpec(1e8)).up()
    live = EmulatedNetwork(1, None).up()
    orphan = f"{netns.new_launch_id()}-r0"  # a lioncub-looking namespace without a state file
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    straggler = None
    try:
        # simulate a launcher killed with -9: no teardown, its pid gone, a process left in a namespace
        atexit.unregister(leftover.close)
        state = json.loads(leftover.state_path.read_text())
        leftover.state_path.write_text(json.dumps({**state, "pid": dead.pid}))
        straggler = subprocess.Popen([*leftover.exec_prefix(1), "sleep", "60"])
        time.sleep(0.2)
        report = cleanup()
        assert leftover.launch_id in report.launches
        assert set(leftover.namespaces) <= set(report.namespaces)
        assert live.launch_id in report.live
        assert orphan in report.orphans and orphan in netns.list_netns()  # only `--cleanup --all` removes it
        assert straggler.wait(timeout=5) == -signal.SIGKILL
        assert_nothing_left(leftover.launch_id)
        assert set(live.namespaces) <= set(netns.list_netns())
    finally:
        if straggler is not None and straggler.poll() is None:
            straggler.kill()
        live.close()
        leftover.close()
        subprocess.run(["ip", "netns", "del", orphan], check=False)
    assert_nothing_left(live.launch_id)
