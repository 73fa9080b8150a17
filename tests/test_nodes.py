"""Tests of ``lioncub launch --nnodes M --nproc-per-node L``: emulated nodes (one network namespace and one
shaped NIC per node, its ranks on the namespace's loopback), each started by a multi-node torchrun with a c10d
rendezvous; and the wire bytes LionCub counts against the node's interface counters.

The network tests need root (network namespaces, tc) and are skipped with a stated reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import subprocess

import pytest

import background
import node_runs
from emulated_network import assert_nothing_left, tcp_payload
from lioncub.cli import launch as launch_cli
from lioncub.cli import train as train_cli
from lioncub.cli.options import config_from_args
from lioncub.launch import (
    EmulatedNetwork,
    LaunchConfig,
    LinkSpec,
    node_env,
    torchrun_command,
)
from lioncub.launch.supervisor import TorchrunReport

from processes import PY


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lioncub launch")
    launch_cli.add_arguments(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ unit tests


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nnodes": 2, "link_rate_bps": 1e9}, r"--nnodes 2: needs --nproc-per-node L"),
        ({"nproc_per_node": 2, "link_rate_bps": 1e9}, r"--nproc-per-node 2: applies only with --nnodes M"),
        ({"nnodes": 2, "nproc_per_node": 2}, r"--nnodes 2: .*needs --link RATE"),
        ({"nnodes": 2, "nproc_per_node": 2, "nproc": 3, "link_rate_bps": 1e9}, r"--nproc 3 with --nnodes"),
        ({"nnodes": 0, "nproc_per_node": 2, "link_rate_bps": 1e9}, r"--nnodes must be .* within 1\.\.150"),
        ({"nnodes": 2, "nproc_per_node": 0, "link_rate_bps": 1e9}, r"--nproc-per-node must be .* >= 1"),
        ({"intra_link_rate_bps": 1e9, "nproc": 2}, r"--intra-link: .*applies only with --nnodes"),
        ({"nnodes": 2, "nproc_per_node": 2, "link_rate_bps": 1e9, "intra_link_rate_bps": -1.0}, "--intra"),
    ],
)  # fmt: skip
def test_node_options_are_validated_naming_the_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchConfig(["x.py"], **kwargs)


def test_node_config_sets_the_world_size() -> None:
    config = LaunchConfig(["x.py"], nnodes=3, nproc_per_node=2, link_rate_bps=1e8)
    assert config.nproc == 6
    assert LaunchConfig(["x.py"], nproc=6, nnodes=3, nproc_per_node=2, link_rate_bps=1e8).nproc == 6


def test_torchrun_command_and_node_env() -> None:
    argv = torchrun_command(
        [PY, "train.py", "--x"], nnodes=2, nproc_per_node=4, endpoint="10.1.2.100:29500", run_id="lcb00abc",
        node=1, local_addr="10.1.2.101", restarts=2, log_dir="/tmp/l/n1", shutdown_s=5,
    )  # fmt: skip
    text = " ".join(argv)
    assert argv[:3] == [PY, "-m", "torch.distributed.run"]
    for part in (
        "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.1.2.100:29500",
        "--rdzv-id lcb00abc --rdzv-conf is_host=0 --local-addr 10.1.2.101 --max-restarts 2",
        "--tee 3 --log-dir /tmp/l/n1",
    ):
        assert part in text
    assert argv[-4:] == ["--no-python", PY, "train.py", "--x"]  # the command runs once per rank, as given
    base = {
        "PATH": "/bin",
        "RANK": "7",
        "MASTER_PORT": "1",
        "LIONCUB_RESTART_COUNT": "3",
        "OMP_NUM_THREADS": "2",
    }
    env = node_env(1, 2, ifname="lcb00abcv1", launch_id="lcb00abc", link_bps=1e9, base=base, extra={"A": "b"})
    assert not {"RANK", "MASTER_PORT", "LIONCUB_RESTART_COUNT"} & set(env)  # torchrun sets the ranks' own
    expected = {
        "GLOO_SOCKET_IFNAME": "lcb00abcv1", "LIONCUB_NODE": "1", "LIONCUB_NNODES": "2",
        "LIONCUB_LINK_BPS": "1000000000", "OMP_NUM_THREADS": "2", "A": "b", "PATH": "/bin",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[r${rank}] ",
    }  # fmt: skip
    assert {k: env[k] for k in expected} == expected
    assert "LIONCUB_INTRA_LINK_BPS" not in env


TORCHRUN_FAILURE = """\
Failures:
[1]:
  time      : 2026-12-04_14:39:05
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 28025)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_14:39:05
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : 3 (pid: 28026)
  error_file: <N/A>
============================================================
"""


def test_torchrun_root_cause_is_read_from_its_report() -> None:
    report = TorchrunReport()
    for line in TORCHRUN_FAILURE.splitlines(keepends=True):
        report.feed(line)
    assert (report.rank, report.local_rank, report.exitcode) == (3, 1, 3)  # not the SIGTERMed rank 2


def test_node_network_names_fit_linux_limits_and_sort_as_torchrun_sorts() -> None:
    net = EmulatedNetwork(150, LinkSpec(1e9), launch_id="lcbfffff", nodes=True, intra_link=LinkSpec(1e10))
    names = [net.bridge] + [n for r in net.hosts for n in (r.ifname, r.bridge_port)]
    assert max(map(len, names)) <= 15  # IFNAMSIZ - 1
    addresses = [r.address for r in net.hosts]
    assert addresses[0].endswith(".100") and addresses[-1].endswith(".249")
    assert sorted(addresses) == addresses  # torchrun's rendezvous orders nodes by address, as text
    assert [r.netns for r in net.hosts[:2]] == ["lcbfffff-n0", "lcbfffff-n1"]
    with pytest.raises(ValueError, match=r"--nnodes: .*1\.\.150"):
        EmulatedNetwork(151, LinkSpec(1e9), nodes=True)
    with pytest.raises(ValueError, match="--intra-link"):
        EmulatedNetwork(2, LinkSpec(1e9), intra_link=LinkSpec(1e10))


def test_cli_refuses_nproc_with_nnodes_and_dry_runs_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--nnodes", "2", "--nproc", "4", "--nproc-per-node", "2", "--link", "1gbit", "--", "x.py"]
    assert launch_cli.run(_cli(args)) == 2
    assert "--nproc 4 with --nnodes 2: give either --nproc N" in capsys.readouterr().err
    assert launch_cli.run(_cli(["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit",
                                "--intra-link", "fast", "--", "x.py"])) == 2  # fmt: skip
    assert "--intra-link: cannot read 'fast'" in capsys.readouterr().err
    args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "3",
        "--link",
        "1gbit",
        "--intra-link",
        "10gbit",
        "--dry-run",
    ]
    assert launch_cli.run(_cli([*args, "--", "-m", "m"])) == 0
    out = capsys.readouterr().out
    assert "2 nodes × 3 ranks" in out and "tbf rate 10gbit on each node's lo" in out
    node1 = (
        r"node 1: .*GLOO_SOCKET_IFNAME=lcb[0-9a-f]{5}v1 .*LIONCUB_NODE=1 .*ip netns exec lcb[0-9a-f]{5}-n1 "
        r"\S+ -m torch\.distributed\.run --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d "
        r"--rdzv-endpoint (10\.\d+\.\d+)\.100:29500 .*--local-addr \1\.101 .*--no-python \S+ -m m"
    )
    assert re.search(node1, out), out


def _train_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lioncub train")
    train_cli.add_arguments(parser)
    return parser.parse_args(["--out", "unused", *argv])


def test_train_options_become_nodes_of_the_run() -> None:
    from lioncub.train.driver import RANK_MODULE, format_summary, make_launch_config

    config = config_from_args(
        _train_args(["--nnodes", "2", "--nproc-per-node", "3", "--link", "1gbit", "--intra-link", "10gbit"])
    )
    cluster = config.cluster
    assert (cluster.nnodes, cluster.nproc, cluster.nproc_per_node, cluster.intra_link) == (2, 6, 3, "10gbit")
    launch_config = make_launch_config(config, ["-m", RANK_MODULE], 60.0)
    assert (launch_config.nnodes, launch_config.nproc_per_node, launch_config.nproc) == (2, 3, 6)
    assert (launch_config.link_rate_bps, launch_config.intra_link_rate_bps) == (1e9, 1e10)
    flat = config_from_args(_train_args(["--nproc", "4"]), base=config)  # --nproc N: one node per rank again
    assert (flat.cluster.nnodes, flat.cluster.intra_link, flat.cluster.nproc) == (None, None, 4)
    assert flat.to_json()["cluster"]["nnodes"] is None
    summary = {"config": config.to_json(), "world_size": 6, "steps_run": 1}
    assert "on 2 nodes × 3 ranks, 1gbit NICs, 10gbit inside a node:" in format_summary(summary)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--link", "1gbit"], "--nnodes 2: needs --nproc-per-node L"),
        (["--nproc-per-node", "2"], "--nproc-per-node 2: applies only with --nnodes M"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--nproc", "4"], "--nproc 4 with --nnodes 2"),
        (["--nnodes", "2", "--nproc-per-node", "2"], "--nnodes 2: emulates nodes .* needs --link RATE"),
        (["--nproc", "2", "--intra-link", "1gbit"], "--intra-link 1gbit: applies only with --nnodes"),
    ],
)
def test_train_node_options_are_checked(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_train_args(argv))


# ------------------------------------------------------------------------------- emulated network


@pytest.mark.root
def test_node_network_shapes_each_nic_and_the_loopback_inside() -> None:
    net = EmulatedNetwork(2, LinkSpec(1e8), nodes=True, intra_link=LinkSpec(2e9)).up()
    try:
        for host in net.hosts:
            nic = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", host.ifname],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            port = subprocess.run(["tc", "-n", net.bridge_netns, "qdisc", "show", "dev", host.bridge_port],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
            lo = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", "lo"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert "tbf" in nic and "rate 100Mbit" in nic and "rate 100Mbit" in port  # both directions
            assert "tbf" in lo and "rate 2Gbit" in lo
        assert len(net.loopback_counters()) == len(net.counters()) == 2
    finally:
        net.close()
    assert_nothing_left(net.launch_id)


def payload(counts: list[int]) -> tuple[int, int]:
    """(tx, rx) TCP payload of NODE_STEPS' counter deltas: the frames' bytes less their headers."""
    tx, rx, tx_frames, rx_frames, _ = counts
    return tcp_payload(tx, tx_frames), tcp_payload(rx, rx_frames)


def less_idle(record: dict, name: str) -> tuple[float, float]:
    """Interface ``name``'s (tx, rx) payload over the steps less the idle window's rate times their time."""
    busy, idle = payload(record["delta"][name]), payload(record["idle"][name])
    scale = record["window_s"] / record["idle_s"]
    return busy[0] - scale * idle[0], busy[1] - scale * idle[1]


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("node_runs")
def test_two_nodes_of_two_ranks_wire_bytes_match_the_node_nic() -> None:
    """2 nodes × 2 ranks, flat 1-bit LionCub: torchrun's environment lays the ranks out node by node, and the
    bytes LionCub counts go through the node's NIC (to the 2 remote ranks) and its loopback (to the local
    one) as the interface counters measure them, within 1 %, less what TCP sent twice (``ss``'s per-socket
    ``bytes_retrans``) and less the control traffic the interfaces carry when idle (torchrun's agents poll
    their store at 10 Hz; measured in an idle window). Without those two a loaded CI-like run read +3 % on
    the loopback."""
    proc = background.result("node_runs", BACKGROUND["node_runs"])
    path = background.workdir("node_runs") / "wire.json"
    assert path.exists(), proc.stdout + proc.stderr
    done = json.loads(path.read_text())
    assert done["ok"], done["out"] + done["err"]
    m, ell, launch_id = node_runs.M, node_runs.L, done["launch_id"]
    n = m * ell
    records = [
        json.loads(line.split("RESULT ", 1)[1]) for line in done["out"].splitlines() if "RESULT " in line
    ]
    assert len(records) == n, done["out"]
    by_rank = {int(r["env"]["RANK"]): r for r in records}
    for rank, r in by_rank.items():  # torchrun's node rank is the emulated node: rank = node·L + local
        node, local = divmod(rank, ell)
        expected = {"RANK": rank, "GROUP_RANK": node, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": ell,
                    "LIONCUB_NODE": node, "LIONCUB_NNODES": m}  # fmt: skip
        assert r["env"] == {k: str(v) for k, v in expected.items()}
        assert r["nic"] == f"{launch_id}v{node}"
    d_pad = -(-node_runs.D // (8 * n)) * 8 * n
    assert by_rank[0]["sent"] == pytest.approx(
        4 * 2 * (n - 1) / n * d_pad / 8, rel=1e-3
    )  # flat 1-bit's bytes
    assert done["node_tx_bytes"] is not None and len(done["node_tx_bytes"]) == m
    for node in range(m):
        sent = sum(by_rank[node * ell + k]["sent"] for k in range(ell))  # what the node's ranks counted
        r0 = by_rank[node * ell]
        nic = f"{launch_id}v{node}"

        remote = sent * (n - ell) / (n - 1)  # each rank sends as much to every other rank: 2 of 3 are remote
        local = sent * (ell - 1) / (n - 1)
        (nic_tx, nic_rx), (lo_tx, _) = less_idle(r0, nic), less_idle(r0, "lo")
        assert r0["sockets"] >= n  # gloo's n − 1 pairs and the store's: `ss` was read
        again_nic, again_lo = r0["delta"][nic][4], r0["delta"]["lo"][4]  # sent again: on the wire twice
        idle_nic, idle_lo = payload(r0["idle"][nic]), payload(r0["idle"]["lo"])
        print(f"node {node}: LionCub {sent} B in {r0['window_s']:.2f} s; NIC payload tx {nic_tx:.0f} B "
              f"(expected {remote:.0f}, {again_nic} B of it retransmitted), loopback {lo_tx:.0f} B "
              f"(expected {local:.0f}, {again_lo} retransmitted); idle in {r0['idle_s']:.2f} s: "
              f"NIC {idle_nic} B, lo {idle_lo} B")  # fmt: skip
        assert nic_tx - again_nic == pytest.approx(remote, rel=0.01)
        again_in = sum(by_rank[o * ell]["delta"][f"{launch_id}v{o}"][4] for o in range(m) if o != node)
        assert nic_rx - again_in == pytest.approx(remote, rel=0.01)  # the NIC is symmetric here
        assert lo_tx - again_lo == pytest.approx(local, rel=0.01)
        assert done["node_tx_bytes"][node] >= r0["delta"][nic][0]  # the launcher's: the whole run
    assert_nothing_left(launch_id)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("node_runs")
@pytest.mark.parametrize("preload", node_runs.PRELOADS, ids=["fresh", "forked"])
def test_a_failed_rank_on_a_node_is_named_and_every_node_stops(preload: tuple[str, ...]) -> None:
    """Fresh interpreters, or torchrun's agents and ranks forked from a zygote (:mod:`lioncub.launch.workers`:
    the ranks' exit statuses reach torchrun through their shims; the other ranks are stopped through them).
    Both launches run last in the background job ``node_runs`` (mostly waiting: torchruns' start, the
    stop)."""
    proc = background.result("node_runs", BACKGROUND["node_runs"])
    path = node_runs.failed_rank_path(background.workdir("node_runs") / "failed_rank", preload)
    assert path.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    result, err = pickle.loads(path.read_bytes())
    assert (result.returncode, result.failed_rank, result.failed_node) == (3, 3, 1), err
    assert result.message == "rank 3 (node 1, local rank 1) exited with code 3"
    assert "[lioncub] rank 3 (node 1, local rank 1) exited with code 3; stopping node 0" in err
    assert result.rank_returncodes[3] == 3 and result.wall_s < 40  # rank 0..2 sleep 60 s: they were stopped
    if preload:  # torchrun ran the shims, and no process fell back to a fresh interpreter
        assert "worker_shim.py FAILED" in err and "fresh interpreter" not in err
    assert_nothing_left(result.launch_id)


#: the launches on emulated nodes (tests/node_runs.py: the wire bytes' launch, ``lioncub train`` on two nodes,
#: the failed rank's two launches; shared with tests/test_fsdp_cli.py), one after another in one interpreter,
#: started in the background when collection ends (tests/background.py); nothing to run without root
BACKGROUND = {"node_runs": node_runs.job}


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("node_runs")
def test_lioncub_train_on_two_nodes() -> None:
    proc = background.result("node_runs", BACKGROUND["node_runs"])
    path = background.workdir("node_runs") / "two_nodes.json"
    assert path.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    done = json.loads(path.read_text())
    out = background.workdir("node_runs") / "two_nodes"
    assert done["returncode"] == 0, done["out"] + done["err"]
    # 8bit at 2×2: a NIC carries 1.5·d bytes of the flat int8 ring, d of the hierarchical 8-bit lanes
    assert "topology='auto' chose 'hierarchical' for 8bit" in done["out"]
    assert "gpt/tiny 8bit@auto on 2 nodes × 2 ranks, 1gbit NICs: 2 steps" in done["out"]
    saved = json.loads((out / "config.json").read_text())
    cluster, topology = saved["cluster"], saved["optimizer"]["topology"]
    assert (cluster["nnodes"], cluster["nproc"], topology) == (2, 4, "auto")
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4
