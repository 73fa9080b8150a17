"""The two-level cost model (:func:`lioncub.planning.costmodel.predict_cluster`): M nodes × L ranks, α/β of
the node's NIC and of a rank's link inside its node, and ``lioncub cost --nnodes M --nproc-per-node L``.

Bytes are checked in float64 against closed forms worked out by hand (the back-of-envelope NIC bytes:
flat 1-bit ``2·L·(M−1)/M · d/8`` per node, hierarchical ``2·(M−1)/M · d·b/8``, node-majority
``2·(M−1)/M · d/8``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import background
from emulated_network import netns_usable
from lioncub import cli, transports
from lioncub.cli import cost as cost_cli
from lioncub.optim.config import PRESETS, VoteConfig
from lioncub.planning import costmodel as cm

from processes import run_workers

NIC = cm.Network(20e-6, 1.25e9, 1.0)  # 10 Gbit/s, α = 20 us
INTRA = cm.Network(2e-6, 50e9, 1.0)  # 400 Gbit/s, α = 2 us


def _cluster(m: int, ell: int) -> cm.Cluster:
    return cm.Cluster(m, ell, NIC, INTRA)


def _p(
    variant: str, topology: str, m: int, ell: int, d: int = 1_000_000, **kw: object
) -> cm.ClusterPrediction:
    return cm.predict_cluster(variant, d, _cluster(m, ell), topology, **kw)  # type: ignore[arg-type]


def test_flat_one_bit_on_two_nodes_of_four_by_hand() -> None:
    # N = 8, d = 1e6 = 15625·64: no padding; each rank's packed vector is 125000 B, a slice 15625 B
    p = _p("1bit", "flat", 2, 4)
    assert p.nic_sent == p.nic_recv == 2 * 4 * 4 * 15625  # 2 phases × 4 ranks × 4 remote peers × slice
    assert p.intra_sent == 2 * 3 * 15625  # 2 phases × 3 local peers
    assert p.bytes_sent == 2 * 7 * 15625
    latency = 2 * 7 * 20e-6  # two pairwise phases of N−1 messages, at the NIC's α
    bandwidth = 2 * max(4 * 4 * 15625 / 1.25e9, 3 * 15625 / 50e9)
    assert p.latency_s == pytest.approx(latency, rel=1e-12)
    assert p.bandwidth_s == pytest.approx(bandwidth, rel=1e-12)
    assert p.compute_s == 0.0


def test_flat_ring_crosses_each_node_boundary_once() -> None:
    p = _p("32bit", "flat", 2, 4)
    each = 2 * 7 / 8 * 4e6  # ring allreduce of 4 MB over 8 ranks
    assert p.nic_sent == p.intra_sent == p.bytes_sent == pytest.approx(each, rel=1e-15)
    assert p.latency_s == pytest.approx(14 * 20e-6, rel=1e-12)
    assert p.bandwidth_s == pytest.approx(each / 1.25e9, rel=1e-12)


def test_hierarchical_one_bit_by_hand() -> None:
    p = _p("1bit", "hierarchical", 2, 4)
    assert cm.hierarchical_lane_bits("1bit", 2, 4) == 4  # counts up to N = 8 need 4-bit lanes
    k = 250_000  # this local rank's slice
    assert p.nic_sent == 4 * (2 * 1 / 2 * k * 4 / 8)  # L ranks' inter-node ring allreduce of 4-bit lanes
    assert p.intra_sent == 2 * 3 / 4 * 1e6 + 3 * k  # int8 intra-node allreduce + int8 all-gather
    assert p.bytes_sent == p.intra_sent + 2 * 1 / 2 * k * 4 / 8
    assert p.latency_s == pytest.approx(2 * 3 * 2e-6 + 2 * 1 * 20e-6 + 3 * 2e-6, rel=1e-12)


def test_node_majority_by_hand() -> None:
    p = _p("1bit", "node-majority", 2, 4)
    k_bytes = 250_000 / 8  # 250000 votes = 15625·16, no padding
    assert p.nic_sent == 4 * 2 * (1 / 2) * k_bytes  # L ranks × (all-to-all + all-gather) among 2 nodes
    assert p.intra_sent == 2 * 3 / 4 * 1e6 + 3 * 250_000


def test_hierarchical_sign_sum_and_quantized_lanes_by_hand() -> None:
    # 8bit-sign at 2×2: signs offset to {0,1,2}, a node sum ≤ 4, two nodes ≤ 8 → 4-bit lanes
    p = _p("8bit-sign", "hierarchical", 2, 2)
    assert cm.hierarchical_lane_bits("8bit-sign", 2, 2) == 4
    assert p.nic_sent == 2 * (2 * 1 / 2 * 500_000 * 4 / 8)
    assert p.intra_sent == 2 * 1 / 2 * 1e6 + 1 * 500_000
    # 8bit (L1 levels, 127 // N per worker) at 2×4: 15 levels, offset node sums ≤ 4·30 = 120, two ≤ 240
    assert cm.hierarchical_lane_bits("8bit", 2, 4) == 8
    assert _p("8bit", "hierarchical", 2, 4).nic_sent == 4 * (2 * 1 / 2 * 250_000)
    # 1-bit counts of 16 × 16 ranks do not fit 8-bit lanes: int32 between the nodes
    assert cm.hierarchical_lane_bits("1bit", 16, 16) is None
    d = 16 * 1000
    assert _p("1bit", "hierarchical", 16, 16, d=d).nic_sent == pytest.approx(16 * 2 * 15 / 16 * 4 * 1000)


def test_server_root_takes_the_remote_ranks_through_its_nic() -> None:
    p = _p("dlion-mavo", "flat", 2, 2, d=8000)
    up, down = 1000, 2000  # 1-bit votes up, 2-bit lanes back
    gather, scatter = p.phases
    assert (gather.nic_recv, gather.nic_sent, gather.intra_recv) == (2 * up, 2 * up, up)
    assert (scatter.nic_sent, scatter.nic_recv, scatter.intra_sent) == (2 * down, 2 * down, down)
    assert (p.bytes_sent, p.bytes_recv) == (3 * down, 3 * up)  # the root's, as predict() counts it


@pytest.mark.parametrize(("m", "ell"), [(2, 2), (2, 4), (4, 4), (3, 2), (2, 8), (8, 8)])
def test_nic_bytes_per_node_of_each_one_bit_topology(m: int, ell: int) -> None:
    """NIC bytes per node: flat ``2·L·(M−1)/M · d/8``, hierarchical ``2·(M−1)/M · d·b/8`` (b-bit lanes),
    node-majority ``2·(M−1)/M · d/8``."""
    d = 8 * m * ell * ell * 1000  # no padding anywhere
    flat = _p("1bit", "flat", m, ell, d=d).nic_sent
    hier = _p("1bit", "hierarchical", m, ell, d=d).nic_sent
    node = _p("1bit", "node-majority", m, ell, d=d).nic_sent
    b = cm.hierarchical_lane_bits("1bit", m, ell)
    assert b is not None and (1 << b) - 1 >= m * ell
    assert flat == pytest.approx(2 * ell * (m - 1) / m * d / 8, rel=1e-12)
    assert hier == pytest.approx(2 * (m - 1) / m * d * b / 8, rel=1e-12)
    assert node == pytest.approx(2 * (m - 1) / m * d / 8, rel=1e-12)
    assert hier / flat == pytest.approx(b / ell)  # hierarchical helps only when b < L
    assert node * ell == pytest.approx(flat)  # node-majority: L× fewer bytes than flat


@pytest.mark.parametrize("variant", list(PRESETS))
def test_one_rank_per_node_is_the_flat_model(variant: str) -> None:
    options = {"sync_every": 10, "sync_params": 10_000, "bucket_numel": 300_001}
    flat = cm.predict(variant, 1_000_003, 6, NIC, cm.DEFAULT_CPU_COMPUTE, **options)
    mine = cm.predict_cluster(variant, 1_000_003, _cluster(6, 1), "flat", cm.DEFAULT_CPU_COMPUTE, **options)
    assert mine.allowed == flat.allowed
    for attr in ("latency_s", "bandwidth_s", "compute_s", "sync_s", "bytes_sent", "bytes_recv"):
        assert getattr(mine, attr) == pytest.approx(getattr(flat, attr), rel=1e-12), attr
    assert mine.intra_sent == 0.0


@pytest.mark.parametrize("variant", list(PRESETS))
def test_one_node_sends_nothing_through_its_nic(variant: str) -> None:
    for topology in cm.TOPOLOGIES:
        p = _p(variant, topology, 1, 4)
        if p.allowed:
            assert p.nic_sent == p.nic_recv == 0.0, topology
            assert p.intra_sent > 0


@pytest.mark.parametrize(("m", "ell"), [(1, 4), (2, 1), (2, 2), (2, 4), (3, 3), (16, 16), (2, 200)])
def test_level_bytes_are_the_transports(m: int, ell: int) -> None:
    def by_level(phases: list[cm.Phase]) -> tuple[float, float]:
        return tuple(sum(p.sent for p in phases if p.level == level) for level in ("intra", "inter"))

    configs = [*PRESETS.values(), VoteConfig("lanes", "majority", None, "auto")]
    configs.append(VoteConfig("quantized", "majority", "l1", 2))
    for config in configs:
        t, bits = config.transport, config.bits
        facts = transports.FACTS[t]
        for d in (1, 7, 1000, 1_000_003):
            if cm.topology_allowed(config, "hierarchical", m * ell)[0]:
                phases, _ = cm.topology_phases(config, d, m, ell, "hierarchical")
                assert by_level(phases) == facts.hierarchical_level_bytes(bits, d, m, ell), (t, d)
            if cm.topology_allowed(config, "node-majority", m * ell)[0]:
                phases, _ = cm.topology_phases(config, d, m, ell, "node-majority")
                assert by_level(phases) == transports.node_majority_level_bytes(d, m, ell), d


def test_topologies_that_do_not_apply_say_why() -> None:
    p = _p("32bit", "hierarchical", 2, 2)
    assert not p.allowed and "no hierarchical form" in p.reason and math.isnan(p.total_s)
    assert "1-bit vote among node majorities" in _p("4bit", "node-majority", 2, 2).reason
    assert "4-bit lanes cannot hold" in _p("4bit", "hierarchical", 4, 4).reason  # the flat vote must exist
    with pytest.raises(ValueError, match="topology='ring'"):
        cm.topology_allowed("1bit", "ring", 4)
    rows = cm.cluster_table(1000, _cluster(2, 2), variants=["1bit", "32bit"])
    assert [(r.variant, r.topology) for r in rows][:3] == [("1bit", t) for t in cm.TOPOLOGIES]


# --------------------------------------------------------------------------------------------- CLI


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lioncub cost")
    cost_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cost_ranks_every_preset_and_topology(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "774M", "--nnodes", "2", "--nproc-per-node", "4", "--bandwidth", "10gbit",
            "--intra-bandwidth", "400gbit", "--compute", "none"]  # fmt: skip
    assert cost_cli.run(_args(argv)) == 0
    out = capsys.readouterr().out
    assert "2 nodes × 4 ranks" in out
    assert "1bit" in out and "node-majority" in out and "hierarchical" in out
    assert "not allowed" in out and "no hierarchical form" in out
    assert "fastest exact:" in out and "fastest overall:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2: needs --nproc-per-node L"),
        (["--nproc-per-node", "2"], "--nproc-per-node: applies only with --nnodes"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--workers", "4"], "give either --workers N"),
        (["--workers", "4", "--intra-bandwidth", "1gbit"], "--intra-bandwidth: applies only with --nnodes"),
        ([], "give either --workers N"),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--plot", "x.png"],
            "--plot: applies only with --workers",
        ),
        (["--nnodes", "2", "--nproc-per-node", "2", "--topologies", "flat,ring"], "allowed values"),
    ],
)
def test_cost_node_options_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cost_cli.run(_args(["--params", "1M", *argv]))
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------ two-level calibration (both levels measured)


def _two_level(nnodes: int = 2, world: int = 4) -> cm.Calibration:
    return cm.Calibration(NIC, cm.Compute(), world, 1e10, {}, INTRA, nnodes, None)


@pytest.mark.parametrize(("m", "ell"), [(2, 2), (2, 4), (4, 2), (3, 3)])
def test_nic_share_is_the_models_split_of_each_flat_collective(m: int, ell: int) -> None:
    seen = set()
    for variant in ("32bit", "16bit", "1bit", "8bit-sign", "dlion-mavo"):
        phases, _ = cm.topology_phases(variant, 1_000_003, m, ell, "flat")
        for p in phases:
            seen.add(p.op)
            assert max(p.nic_sent, p.nic_recv) == pytest.approx(
                cm.nic_share(p.op, m, ell) * max(p.sent, p.recv), rel=1e-12
            ), (variant, p.op)
    assert seen == {"allreduce_f32", "allreduce_bf16", "all_to_all", "all_gather", "allreduce_i8",
                    "gather_root", "scatter_root"}  # fmt: skip
    assert cm.nic_share("all_to_all", 1, 4) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        cm.nic_share("broadcast", m, ell)


def test_the_flat_level_prices_only_the_flat_schemes() -> None:
    slow_flat = cm.Network(20e-6, 0.625e9, 1.0)  # the same NIC at half the rate under the flat collectives
    base, with_flat = _cluster(2, 4), cm.Cluster(2, 4, NIC, INTRA, slow_flat)
    flat = [cm.predict_cluster("32bit", 10**6, c, "flat") for c in (base, with_flat)]
    assert flat[1].bandwidth_s == pytest.approx(2 * flat[0].bandwidth_s)
    hier = [cm.predict_cluster("8bit", 10**6, c, "hierarchical") for c in (base, with_flat)]
    assert hier[1].total_s == hier[0].total_s


def test_a_two_level_calibration_round_trips_and_lays_out_the_cluster(tmp_path: Path) -> None:
    flat_nic = cm.Network(30e-6, 1.25e9, 0.8)
    calib = dataclasses.replace(_two_level(), flat=flat_nic)
    assert calib.nproc_per_node == 2
    cluster = calib.cluster()
    assert (cluster.nnodes, cluster.nproc_per_node, cluster.inter, cluster.intra) == (2, 2, NIC, INTRA)
    assert cluster.flat == flat_nic
    assert calib.cluster(4, 8).n_workers == 32  # the measured levels, another layout
    path = tmp_path / "nodes.json"
    calib.save(path)
    back = cm.load_calibration(path)
    assert (back.nnodes, back.world_size, back.network, back.intra, back.flat) == (2, 4, NIC, INTRA, flat_nic)
    want = cm.predict_cluster("1bit", 10**6, cluster, "hierarchical")
    assert cm.predict_cluster("1bit", 10**6, back.cluster(), "hierarchical").total_s == want.total_s


@pytest.mark.parametrize(
    ("nnodes", "world", "fragment"),
    [(1, 4, "nnodes=1"), (3, 4, "dividing world_size=4"), (4, 4, "at least 2 ranks")],
)
def test_a_two_level_calibration_needs_nodes_of_several_ranks(nnodes: int, world: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        _two_level(nnodes, world)
    with pytest.raises(ValueError, match="intra and nnodes go together"):
        cm.Calibration(NIC, cm.Compute(), 4, None, {}, INTRA, None)


def test_a_one_level_calibration_has_no_cluster_and_a_bad_node_count_in_json_is_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="calibrate --nnodes M --nproc-per-node L"):
        cm.Calibration(NIC, cm.Compute(), 4).cluster()
    doc = _two_level().to_json()
    doc["nnodes"] = 3
    with pytest.raises(ValueError, match="'nnodes'"):
        cm.calibration_from_json(doc, "x.json")
    doc["nnodes"] = 2
    del doc["intra_network"]
    with pytest.raises(ValueError, match="intra_network"):
        cm.calibration_from_json(doc, "x.json")


def test_cost_predicts_with_both_measured_levels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nodes.json"
    slow_inside = cm.Network(1e-3, 1e8, 1.0)  # the calibration says: 800 Mbit/s inside a node, α 1 ms
    cm.Calibration(NIC, cm.Compute(), 4, 1e10, {}, slow_inside, 2, None).save(path)
    argv = ["--params", "8M", "--nnodes", "2", "--nproc-per-node", "2", "--calibration", str(path)]
    assert cost_cli.run(_args(argv)) == 0
    out = capsys.readouterr().out
    assert "2 nodes × 2 ranks, both levels" in out and "800 Mbit/s" in out and "α = 1 ms" in out
    assert cost_cli.run(_args([*argv, "--intra-bandwidth", "400gbit"])) == 0
    assert "400 Gbit/s" in capsys.readouterr().out
    assert cost_cli.run(_args(["--params", "8M", "--workers", "4", "--calibration", str(path)])) == 2
    assert "predict with --nnodes M --nproc-per-node L" in capsys.readouterr().err


#: the payloads (bytes) of the two-level calibration on loopback: its test checks the bytes each point
#: moves, never its time (both rates are told), so 64 and 256 KiB (they were 1 and 4 MiB)
TWO_LEVEL_SIZES = (1 << 16, 1 << 18)


def worker_two_level_calibration(rank: int, world: int) -> dict:
    """2 nodes × 2 ranks on loopback, both levels' rates told (on a loaded CPU a loopback fit's slope can
    come out <= 0, so no level here depends on one; the unknown-rate path runs in the emulated test)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lioncub.planning.measure import calibrate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    calib = calibrate(
        TWO_LEVEL_SIZES, 2, 1, ops=["allreduce_f32", "all_gather"], compute_numel=0, link_bps=1e9,
        nodes=mesh, intra_link_bps=8e9,
    )  # fmt: skip
    return calib.to_json()


@pytest.mark.slow
def test_calibrate_measures_the_nic_and_the_node_separately() -> None:
    docs = run_workers(worker_two_level_calibration, 4, timeout=120)
    assert all(d["per_op"] == docs[0]["per_op"] for d in docs)  # every rank gets the same result
    assert all(d["intra_per_op"] == docs[0]["intra_per_op"] for d in docs)
    doc = docs[0]
    assert doc["nnodes"] == 2 and doc["world_size"] == 4 and doc["link_bps"] == 1e9
    assert doc["network"]["bandwidth_Bps"] == 1e9 / 8  # the NIC's rate as told
    assert doc["intra_link_bps"] == 8e9 and doc["intra_network"]["bandwidth_Bps"] == 1e9
    for size, (nic, _), (node, _) in zip(
        TWO_LEVEL_SIZES,
        doc["per_op"]["allreduce_f32"]["points"],
        doc["intra_per_op"]["allreduce_f32"]["points"],
        strict=True,
    ):
        # ring over M = 2 nodes: 2·(M−1)/M·size per rank, the node's L = 2 rings share its NIC; inside: over L
        assert nic == 2 * size and node == size
    for size, (nic, _), (node, _) in zip(
        TWO_LEVEL_SIZES,
        doc["per_op"]["all_gather"]["points"],
        doc["intra_per_op"]["all_gather"]["points"],
        strict=True,
    ):
        assert nic == 2 * (size // 2) and node == size // 2  # (n−1)·size/n per rank, n = 2 at each level
    for size, (flat, _) in zip(TWO_LEVEL_SIZES, doc["flat_per_op"]["allreduce_f32"]["points"], strict=True):
        assert flat == 1.5 * size  # the 4-rank ring: 2·(N−1)/N·size through each NIC, once
    for size, (flat, _) in zip(TWO_LEVEL_SIZES, doc["flat_per_op"]["all_gather"]["points"], strict=True):
        assert flat == pytest.approx(4 * (size // 4))  # L·(N−L) = 4 slices of size/N through a NIC
    calib = cm.calibration_from_json(doc)
    assert calib.cluster().n_workers == 4 and calib.intra is not None and calib.intra.bandwidth_Bps == 1e9
    assert calib.flat is not None and calib.cluster().flat == calib.flat


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--nnodes", "2"], ["--nnodes 2", "--nproc-per-node L"]),
        (["--nnodes", "1", "--nproc-per-node", "2"], ["--nnodes", ">= 2"]),
        (["--nnodes", "2", "--nproc-per-node", "2"], ["--nnodes 2", "--link RATE"]),
        (["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--nproc", "4"], ["give either"]),
        (["--nproc", "4", "--nproc-per-node", "2"], ["--nproc-per-node", "only with --nnodes"]),
        (["--nproc", "4", "--intra-link", "1gbit"], ["--intra-link", "only with --nnodes"]),
        (["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--flat"], ["--flat", "--nproc N"]),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--intra-link", "x"],
            ["--intra-link"],
        ),
    ],
)
def test_calibrate_node_options_are_checked(
    argv: list[str], fragments: list[str], tmp_path: Path, run_cli: Callable[[list[str]], tuple[int, str]]
) -> None:
    rc, err = run_cli(["calibrate", "--out", str(tmp_path / "c.json"), *argv])
    assert rc == 2, (rc, err)
    assert all(f in err for f in fragments), err


def test_calibrate_on_nodes_reaches_the_launcher_and_refuses_layout_options_inside_a_job(
    tmp_path: Path, run_cli: Callable[[list[str]], tuple[int, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_cli
    argv = ["calibrate", "--out", str(tmp_path / "c.json"), "--nnodes", "2", "--nproc-per-node", "2"]
    assert run([*argv, "--link", "1gbit"])[0] == -1  # valid: it would launch 2 emulated nodes
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc, err = run(argv)
    assert rc == 2 and "--nnodes, --nproc-per-node: start a job from outside one" in err


#: ``lioncub calibrate`` on 2 loopback ranks (``--out`` follows)
CALIBRATE_LOOPBACK = ["calibrate", "--nproc", "2", "--sizes", "1mb,4mb,16mb", "--repeats", "3",
                      "--ops", "allreduce_f32,allreduce_u8,all_to_all,gather_root",
                      "--compute-numel", "256K"]  # fmt: skip
#: ``lioncub calibrate`` on 2 emulated nodes of 2 ranks (``--out`` follows); the node's loopback shaped (4
#: Gbit/s): unshaped, it moved 2-8 MB in a few ms, and with the suite's background jobs on the same cores its
#: fit had no slope (three times in full runs, with 2 and with 5 repeats); shaped, the time grows with the
#: payload by milliseconds
CALIBRATE_NODES = ["calibrate", "--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--intra-link",
                   "4gbit", "--ops", "allreduce_f32", "--sizes", "2mb,4mb,8mb", "--repeats", "3",
                   "--compute-numel", "0"]  # fmt: skip


def _calibrate(argv: list[str], out: Path) -> None:
    """``lioncub ARGV --out out/calib.json`` (``lioncub.cli.main`` in this process); its stdout, stderr and
    exit status in ``out/stdout``, ``stderr``, ``rc``."""
    out.mkdir()
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        rc = cli.main([*argv, "--out", str(out / "calib.json")])
        sys.stdout.flush()
        sys.stderr.flush()
    (out / "rc").write_text(str(rc))


def _calibrations(rank: int, world: int, workdir: Path) -> None:
    """The background job ``calibrations`` (one forked process): :data:`CALIBRATE_LOOPBACK` into
    ``workdir/loopback``, then, where network namespaces can be built, :data:`CALIBRATE_NODES` into
    ``workdir/nodes``. One zygote forks the ranks of both (and the nodes' torchrun agents): the second run
    does not import torch again."""
    _calibrate(CALIBRATE_LOOPBACK, workdir / "loopback")
    if netns_usable():
        _calibrate(CALIBRATE_NODES, workdir / "nodes")


#: tests/background.py's jobs of this module
BACKGROUND = {"calibrations": lambda: background.Spawned(_calibrations, 1, timeout=240)}


def _calibrated(name: str) -> tuple[int, str, str, Path]:
    """Run ``name`` of the background job ``calibrations``: (exit status, stdout, stderr, its calib.json)."""
    codes = background.result("calibrations", BACKGROUND["calibrations"])
    out = background.workdir("calibrations") / name
    assert (out / "rc").exists(), f"the job's process exited with {codes}"
    printed, errors = (out / "stdout").read_text(), (out / "stderr").read_text()
    return int((out / "rc").read_text()), printed, errors, out / "calib.json"


@pytest.mark.slow
@pytest.mark.background("calibrations")
def test_calibrate_on_two_loopback_ranks() -> None:
    """``lioncub calibrate --nproc 2`` (the background job ``calibrations``; its ranks forked from the job's
    zygote: torch imported once)."""
    rc, out, err, path = _calibrated("loopback")
    printed = out + err
    assert rc == 0 and "wrote" in printed, printed
    assert "as a fresh interpreter" not in printed  # every rank was forked
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["world_size"] == 2 and doc["link_bps"] is None
    assert set(doc["per_op"]) == {"allreduce_f32", "allreduce_u8", "all_to_all", "gather_root"}
    for op, fit in doc["per_op"].items():
        assert len(fit["points"]) == 3 and [b for b, _ in fit["points"]] == sorted(
            b for b, _ in fit["points"]
        )
        # a fit is usable exactly when the time grew with the payload (else the network's values stand in)
        assert fit["ok"] == (fit["seconds_per_byte"] > 0), op
        assert ("efficiency" in fit) == fit["ok"], op
        # the stored line and residual are those of its points (float64, the residual's formula); how well
        # loopback on a shared CPU fits a line depends on the load, so no bound on the residual itself
        x, t = (np.array([p[i] for p in fit["points"]], dtype=np.float64) for i in (0, 1))
        line = fit["intercept_s"] + fit["seconds_per_byte"] * x
        assert fit["rel_rms_residual"] == pytest.approx(np.sqrt(np.mean(((t - line) / t) ** 2)), rel=1e-9)
    # another op's slope may come out <= 0 under load; the ring allreduce is the steadiest, the reference
    assert doc["per_op"]["allreduce_f32"]["ok"]
    assert doc["network"]["bandwidth_Bps"] > 0 and doc["network"]["efficiency"] == pytest.approx(1.0)
    assert all(v > 0 for k, v in doc["compute"].items() if k != "reduce_s_per_byte")
    calib = cm.load_calibration(path)
    p = cm.predict("1bit", 10**6, 2, calib.network, calib.compute)
    assert p.allowed and math.isfinite(p.total_s) and p.total_s > 0


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.background("calibrations")
def test_calibrate_two_emulated_nodes_measures_the_nic_rate() -> None:
    """`lioncub calibrate --nnodes 2 --nproc-per-node 2 --link 1gbit` (the background job ``calibrations``:
    it mostly waits on the shaped links): the NIC's fitted payload rate is the shaped rate (both ranks of a
    node share it), the node's loopback (shaped at 4 Gbit/s) is faster."""
    rc, printed, errors, path = _calibrated("nodes")
    assert rc == 0, printed + errors
    assert "NIC:" in printed and "inside a node:" in printed, printed
    calib = cm.load_calibration(path)
    assert calib.nnodes == 2 and calib.world_size == 4 and calib.link_bps == 1e9
    assert 0.8 < calib.network.rate("allreduce_f32") * 8 / 1e9 < 1.15
    # the shaped loopback is CPU-bound on 2 loaded cores: 1.9 Gbit/s of its 4 was measured in a full run
    assert calib.intra is not None and calib.intra.rate("allreduce_f32") > 1.25 * calib.network.rate(
        "allreduce_f32"
    ), (calib.intra.rate("allreduce_f32") * 8 / 1e9, printed)


# ------------------------------------------------------------------- topology="auto" in the library


def test_auto_topology_follows_the_two_level_model(tmp_path: Path) -> None:
    from lioncub.optim import resolve_variant
    from lioncub.planning.auto import auto_topology, choose_topology

    params = [torch.nn.Parameter(torch.zeros(2_000_000))]
    slow_nic, fast_inside = cm.Network.from_rate(1e8, 50e-6), cm.Network.from_rate(4e11, 5e-6)
    for variant in ("1bit", "8bit"):
        want, _ = choose_topology(variant, 2_000_000, cm.Cluster(2, 4, slow_nic, fast_inside), cm.Compute(),
                                  bucket_numel=25 * 2**20 // 4)  # fmt: skip
        path = tmp_path / f"{variant}.json"
        cm.Calibration(slow_nic, cm.Compute(), 8, 1e8, {}, fast_inside, 2).save(path)
        got, why = auto_topology(params, variant, network=str(path), nnodes=2, nproc_per_node=4)
        assert got == want and f"calibration {variant}.json" in why, why
        assert auto_topology(params, variant, network=str(path), nnodes=4, nproc_per_node=1)[0] == "flat"
    # 8bit: the int8 ring puts 1.5·d through each NIC, the hierarchical lanes d → hierarchical at 100 Mbit/s
    assert auto_topology(params, "8bit", network="100mbit", nnodes=2, nproc_per_node=2)[0] == "hierarchical"
    assert auto_topology(params, "1bit", network="100mbit", nnodes=2, nproc_per_node=2)[0] == "flat"
    assert auto_topology(params, "32bit", network="100mbit", nnodes=2, nproc_per_node=2)[0] == "flat"
    with pytest.raises(ValueError, match="auto_topology"):
        resolve_variant("1bit", topology="auto")


def test_auto_topology_reads_the_layout_from_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from lioncub.planning.auto import auto_topology

    params = [torch.nn.Parameter(torch.zeros(1_000_000))]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 nodes of 2
    monkeypatch.delenv("LIONCUB_NNODES", raising=False)
    assert auto_topology(params, "8bit", network="100mbit")[0] == "hierarchical"
    monkeypatch.setenv("LIONCUB_NNODES", "4")  # lioncub launch --nproc 4 --link: a node per rank
    choice, why = auto_topology(params, "8bit", network="100mbit")
    assert choice == "flat" and "4 node(s) of 1 rank(s)" in why


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"nnodes": 2}, "give both"),
        ({"nnodes": 0, "nproc_per_node": 2}, "nnodes=0"),
        ({"nnodes": 2, "nproc_per_node": 2, "network": "/nonexistent/x.json"}, "lioncub calibrate"),
        ({"nnodes": 2, "nproc_per_node": 2, "network": "1gbit", "bucket_mb": 0}, "bucket_mb"),
        ({"nnodes": 2, "nproc_per_node": 2, "network": "1gbit", "intra": "fast"}, "intra"),
    ],
)
def test_auto_topology_refuses_bad_input(kwargs: dict, fragment: str) -> None:
    from lioncub.planning.auto import auto_topology

    with pytest.raises(ValueError, match=fragment):
        auto_topology([torch.nn.Parameter(torch.zeros(10))], "1bit", **kwargs)
