"""The α–β–γ cost model (``lioncub.planning.costmodel``), ``lioncub cost`` and ``lioncub calibrate``.

Hand-computed cases write their arithmetic out; properties run under hypothesis; the model's bytes are
checked against the vote classes' own ``wire_bytes``; calibrate runs on 2 loopback gloo ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lioncub import cli
from lioncub.collectives import (
    AverageVote,
    DenseMean,
    LaneVote,
    OneBitVote,
    QuantizedVote,
    ServerVote,
    SignSumVote,
)
from lioncub.optim.config import PRESETS, VoteConfig
from lioncub.optim.factory import make_vote
from lioncub.planning import costmodel as cm
from lioncub.planning.measure import fit_alpha_beta
from lioncub.report import cost as cost_report
from profiles import examples
from sim_comm import fake_comm

PRESET_NAMES = list(PRESETS)
NO_COMPUTE = cm.Compute()


def net(latency_s: float = 0.0, bandwidth_Bps: float = 1e8, efficiency: float = 1.0) -> cm.Network:
    return cm.Network(latency_s, bandwidth_Bps, efficiency)


# ------------------------------------------------------------------------------------ hand-computed


def test_fp32_ring_allreduce_by_hand() -> None:
    # d = 1e6, N = 4, α = 100 us, 1e8 B/s: latency 2·3·1e-4 = 6e-4 s; bytes 2·3/4·4e6 = 6e6;
    # bandwidth 6e6 / 1e8 = 0.06 s; total 0.0606 s
    p = cm.predict("32bit", 1_000_000, 4, net(1e-4, 1e8))
    assert p.allowed and p.latency_s == pytest.approx(6e-4)
    assert p.bytes_sent == pytest.approx(6e6) and p.bytes_recv == pytest.approx(6e6)
    assert p.bandwidth_s == pytest.approx(0.06)
    assert p.compute_s == 0 and p.total_s == pytest.approx(0.0606)


def test_bf16_with_link_efficiency_by_hand() -> None:
    # d = 1e6, N = 2, 1e8 B/s at 50 % payload: bytes 2·1/2·2e6 = 2e6; 2e6 / (1e8·0.5) = 0.04 s;
    # latency 2·1·1e-3 = 2e-3 s
    p = cm.predict("16bit", 1_000_000, 2, net(1e-3, 1e8, 0.5))
    assert p.bytes_sent == pytest.approx(2e6)
    assert p.bandwidth_s == pytest.approx(0.04)
    assert p.latency_s == pytest.approx(2e-3)


def test_one_bit_all_to_all_and_all_gather_by_hand() -> None:
    # d = 1000, N = 3: padded to ⌈1000/24⌉·24 = 42·24 = 1008 bits; each phase (N−1)/N·1008/8 = 84 B;
    # both phases 168 B; α: (N−1) per phase = 4 α = 4e-5 s; bandwidth 168 / 1e6 = 1.68e-4 s
    p = cm.predict("1bit", 1000, 3, net(1e-5, 1e6))
    assert p.bytes_sent == pytest.approx(168) and p.bytes_recv == pytest.approx(168)
    assert p.latency_s == pytest.approx(4e-5)
    assert p.bandwidth_s == pytest.approx(1.68e-4)
    assert [c.op for c in p.collectives] == ["all_to_all", "all_gather"]


def test_four_bit_lanes_by_hand() -> None:
    # d = 1001, N = 5: ⌈1001/2⌉ = 501 B of nibbles; ring 2·4/5·501 = 801.6 B; 2·4 = 8 α
    p = cm.predict("4bit", 1001, 5, net(1e-6, 1e6))
    assert p.bytes_sent == pytest.approx(801.6)
    assert p.latency_s == pytest.approx(8e-6)
    assert p.bandwidth_s == pytest.approx(801.6e-6)


def test_parameter_server_by_hand() -> None:
    # d = 1000, N = 4: 1-bit up ⌈1000/8⌉ = 125 B, 2-bit lanes down ⌈1000/4⌉ = 250 B.
    # Root ingress 3·125 = 375 B, then egress 3·250 = 750 B: 1125 B / 1e3 B/s = 1.125 s;
    # α: 3 messages in + 3 out = 6 α = 6 ms
    p = cm.predict("dlion-mavo", 1000, 4, net(1e-3, 1e3))
    assert p.bandwidth_s == pytest.approx(1.125)
    assert p.latency_s == pytest.approx(6e-3)
    assert (p.bytes_sent, p.bytes_recv) == (750, 375)  # the root, the busiest rank
    assert cm.wire_bytes("dlion-mavo", 1000, 4, rank=2) == (125, 250)


def test_quantized_eight_bit_compute_by_hand() -> None:
    # d = 1e6, N = 8: bytes 2·7/8·1e6 = 1.75e6. Compute: quantize 1e6·1e-9 = 1e-3, sign of the sum
    # 1e6·1e-10 = 1e-4, reduction γ·(N−1)/N·d = 1e-11·0.875e6 = 8.75e-6 → 1.10875e-3 s
    compute = cm.Compute(quantize_s_per_elem=1e-9, elementwise_s_per_elem=1e-10, reduce_s_per_byte=1e-11)
    p = cm.predict("8bit", 1_000_000, 8, net(0.0, 1e9), compute)
    assert p.bytes_sent == pytest.approx(1.75e6)
    assert p.compute_s == pytest.approx(1.10875e-3)
    assert p.bandwidth_s == pytest.approx(1.75e-3)


def test_amortised_momentum_sync_by_hand() -> None:
    # 8bit-sign, d = 1e6, N = 2, sync of 1e5 fp32 parameters every 10 steps:
    # vote 2·1/2·1e6 = 1e6 B; sync 2·1/2·4e5 / 10 = 4e4 B → 1.04e6 B; α: 2·1 + 2·1/10 = 2.2 α
    p = cm.predict("8bit-sign", 1_000_000, 2, net(1e-3, 1e6), sync_every=10, sync_params=100_000)
    assert p.bytes_sent == pytest.approx(1.04e6)
    assert p.latency_s == pytest.approx(2.2e-3)
    assert p.sync_s == pytest.approx(0.2e-3 + 0.04)
    assert p.total_s == pytest.approx(2.2e-3 + 1.04)


def test_buckets_pay_latency_and_padding_each() -> None:
    # 1bit, d = 250 in buckets of 100 (100, 100, 50), N = 2: each bucket pads to a multiple of 16 bits:
    # 112 + 112 + 64 = 288 bits; bytes 2·1/2·288/8 = 36; α: 3 buckets · 2 phases · 1 = 6
    p = cm.predict("1bit", 250, 2, net(1.0, 1e6), bucket_numel=100)
    assert p.bytes_sent == pytest.approx(36)
    assert p.latency_s == pytest.approx(6.0)


def test_local_steps_divide_the_vote_by_h_by_hand() -> None:
    # 1bit, d = 1e6, N = 4, one vote every 16 steps: a vote is 2·3/4·1e6/8 = 187500 B and 2·3 = 6 α
    # (all-to-all + all-gather, N−1 messages each); per inner step 187500/16 = 11718.75 B, 6/16 α
    p = cm.predict("1bit", 1_000_000, 4, net(1e-3, 1e6), local_steps=16)
    assert p.bytes_sent == pytest.approx(187_500 / 16)
    assert p.latency_s == pytest.approx(6e-3 / 16)
    assert p.bandwidth_s == pytest.approx(0.1875 / 16)
    fp16 = cm.predict("16bit", 1_000_000, 4, net(1e-3, 1e6))
    assert p.bytes_sent <= fp16.bytes_sent / 100  # the floor: 1bit/h16 moves <= 1/100 of 16bit


@pytest.mark.parametrize("name", ["1bit", "8bit", "32bit", "dlion-mavo"])
@pytest.mark.parametrize("h", [1, 4, 64])
def test_local_steps_scale_every_part_of_the_vote(name: str, h: int) -> None:
    compute = cm.DEFAULT_CPU_COMPUTE
    every, once = (cm.predict(name, 123_457, 6, net(1e-4, 1e7), compute, local_steps=k) for k in (h, None))
    for field in ("latency_s", "bandwidth_s", "compute_s", "bytes_sent", "bytes_recv"):
        assert getattr(every, field) == pytest.approx(getattr(once, field) / h), field
    cluster = cm.Cluster(2, 3, net(1e-4, 1e7), net(1e-6, 1e9))
    pair = [cm.predict_cluster(name, 123_457, cluster, "flat", compute, local_steps=k) for k in (h, None)]
    assert pair[0].total_s == pytest.approx(pair[1].total_s / h)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_local_steps_must_be_a_whole_number(bad: object) -> None:
    with pytest.raises(ValueError, match="local_steps"):
        cm.predict("1bit", 1000, 2, net(), local_steps=bad)  # type: ignore[arg-type]


def test_single_worker_sends_nothing() -> None:
    for name in PRESET_NAMES:
        p = cm.predict(name, 1000, 1, net(1.0, 1.0), cm.DEFAULT_CPU_COMPUTE)
        assert p.allowed and p.communication_s == 0 and p.bytes_sent == 0


# ----------------------------------------------------------------------------------- properties

VARIANTS = st.sampled_from(PRESET_NAMES)
DIMS = st.integers(1, 10**10)
WORKERS = st.integers(1, 300)
RATES = st.floats(1e3, 1e12)
LATENCIES = st.floats(0, 1e-1)


@settings(max_examples=examples(150), deadline=None)
@given(VARIANTS, DIMS, WORKERS, RATES, RATES, LATENCIES)
def test_more_bandwidth_never_costs_more(name: str, d: int, n: int, r1: float, r2: float, lat: float) -> None:
    lo, hi = sorted((r1, r2))
    slow = cm.predict(name, d, n, net(lat, lo), cm.DEFAULT_CPU_COMPUTE)
    fast = cm.predict(name, d, n, net(lat, hi), cm.DEFAULT_CPU_COMPUTE)
    if slow.allowed:
        assert fast.total_s <= slow.total_s * (1 + 1e-12)


@settings(max_examples=examples(150), deadline=None)
@given(VARIANTS, DIMS, WORKERS, RATES, LATENCIES, LATENCIES)
def test_more_latency_never_costs_less(name: str, d: int, n: int, rate: float, a1: float, a2: float) -> None:
    lo, hi = sorted((a1, a2))
    quick = cm.predict(name, d, n, net(lo, rate), bucket_numel=1 << 20)
    slow = cm.predict(name, d, n, net(hi, rate), bucket_numel=1 << 20)
    if quick.allowed:
        assert slow.total_s >= quick.total_s * (1 - 1e-12)


@settings(max_examples=examples(200), deadline=None)
@given(DIMS, st.integers(2, 300))
def test_one_bit_moves_a_32nd_of_fp32_up_to_padding(d: int, n: int) -> None:
    one, fp32 = cm.wire_bytes("1bit", d, n)[0], cm.wire_bytes("32bit", d, n)[0]
    # padding adds < 8N bits per phase, i.e. at most (N−1)/N·N = N−1 bytes per phase
    assert fp32 / 32 <= one * (1 + 1e-12)
    assert one - fp32 / 32 <= 2 * (n - 1) + 1e-6 * one


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(1, 10**9), st.integers(2, 200), RATES, LATENCIES)
def test_parameter_server_cost_is_linear_in_n(d: int, n: int, rate: float, lat: float) -> None:
    def total(k: int) -> float:
        return cm.predict("dlion-mavo", d, k, net(lat, rate), cm.DEFAULT_CPU_COMPUTE).total_s

    # T(N) = T(2) + (N − 2)·(T(3) − T(2)) exactly in the model (root ingress/egress and count ∝ N − 1)
    step = total(3) - total(2)
    assert step > 0
    assert total(n) == pytest.approx(total(2) + (n - 2) * step, rel=1e-9)


@pytest.mark.parametrize(
    ("variant", "limit"),
    [
        ("4bit", 15),
        ("8bit", 127),
        ("8bit-sign", 127),
        ("dlion-avg", 127),
        (VoteConfig("lanes", "majority", None, 2), 3),
        (VoteConfig("lanes", "majority", None, "auto"), 255),
        (VoteConfig("quantized", "majority", "l1", 4), 7),
        (VoteConfig("quantized", "majority", "l1", "auto"), 127),
        (VoteConfig("server", "average", None, None), 254),
    ],
)
def test_lane_limits(variant: str | VoteConfig, limit: int) -> None:
    assert cm.allowed(variant, limit) == (True, "")
    ok, why = cm.allowed(variant, limit + 1)
    assert not ok and str(limit) in why
    p = cm.predict(variant, 1000, limit + 1, net())
    assert not p.allowed and math.isnan(p.total_s) and p.reason == why
    with pytest.raises(ValueError):
        cm.wire_bytes(variant, 1000, limit + 1)


@pytest.mark.parametrize("name", ["32bit", "16bit", "1bit", "dlion-mavo"])
def test_variants_without_lanes_are_always_allowed(name: str) -> None:
    assert all(cm.allowed(name, n)[0] for n in (1, 2, 127, 128, 255, 256, 4096))


# ------------------------------------------------------- model bytes = the vote classes' own counts


CUSTOM = [
    VoteConfig("lanes", "majority", None, "auto"),
    VoteConfig("lanes", "majority", None, 2),
    VoteConfig("quantized", "majority", "l1", 4),
    VoteConfig("quantized", "majority", "l1", 2),
    VoteConfig("quantized", "majority", "l1", "auto"),
    VoteConfig("server", "average", None, None),
    VoteConfig("dense", "mean", None, None, torch.float16),
]


@pytest.mark.parametrize("config", [*PRESETS.values(), *CUSTOM], ids=[*PRESETS, *(str(i) for i in range(7))])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 15, 16, 64, 127, 128, 255])
def test_model_bytes_equal_the_vote_classes_wire_bytes(config: VoteConfig, n: int) -> None:
    allowed = cm.allowed(config, n)[0]
    ranks = (0, n - 1) if config.transport == "server" else (0,)
    for rank in ranks:
        try:
            vote = make_vote(fake_comm(n, rank), config)  # type: ignore[arg-type]
        except ValueError:
            assert not allowed, f"the model allows N={n} but the vote class refuses it"
            return
        assert allowed, f"the vote class accepts N={n} but the model refuses it"
        if n == 1:
            continue  # nothing is exchanged (the classes' formulas are for N ≥ 2)
        for d in (1, 7, 8, 1000, 12_345, 1 << 20):
            assert cm.wire_bytes(config, d, n, rank) == pytest.approx(vote.wire_bytes(d), rel=1e-12), d


def test_vote_classes_cover_every_transport() -> None:
    kinds = set()
    for config in [*PRESETS.values(), *CUSTOM]:
        try:
            kinds.add(type(make_vote(fake_comm(2), config)))  # type: ignore[arg-type]
        except ValueError:
            assert not cm.allowed(config, 2)[0]
    assert kinds == {DenseMean, OneBitVote, LaneVote, SignSumVote, AverageVote, QuantizedVote, ServerVote}


def test_variants_are_named_by_what_they_put_on_the_wire() -> None:
    for name, config in PRESETS.items():
        assert cm.resolve_config(name) == (name, config)
        assert cm.resolve_config(config)[0] == name
        assert (
            cm.resolve_config(dataclasses.replace(config, seed=7))[0] == name
        )  # the seed is not on the wire
    assert cm.resolve_config(VoteConfig("lanes", "majority", None, None))[0] == "4bit"  # the default width
    assert cm.resolve_config(VoteConfig("dense", "mean", None, None, torch.float16))[0] == "16bit"
    assert cm.resolve_config(VoteConfig("lanes", "majority", None, 2))[0] == "lanes-majority-2bit"
    assert cm.resolve_config(VoteConfig("dense", "mean", None, None, "float64"))[0] == "dense-mean-64bit"
    with pytest.raises(ValueError, match="bits=3"):
        cm.resolve_config(VoteConfig("lanes", "majority", None, 3))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_model_bytes_are_the_configs_wire_bytes(name: str) -> None:
    config = PRESETS[name]
    for n in (2, 3, 8, 15, 100):
        if not config.capacity(n)[0]:
            assert not cm.allowed(name, n)[0]
            continue
        root = config.server_root
        ranks = (root, root + 1, n - 1) if config.transport == "server" else (0, n - 1)
        for d in (1, 7, 1000, 12_345, 1 << 20):
            for rank in ranks:
                assert cm.wire_bytes(name, d, n, rank) == config.wire_bytes(d, n, rank), (d, n, rank)
            p = cm.predict(name, d, n, net())  # the busiest rank: the server's root
            assert (p.bytes_sent, p.bytes_recv) == config.wire_bytes(d, n, root), (d, n)


# ------------------------------------------------------------------------ winner and crossovers


def test_crossover_is_where_the_costs_meet() -> None:
    d, n = 774_000_000, 8
    network = cm.Network(50e-6, 1.0, cm.TCP_EFFICIENCY)
    rate = cm.crossover_bandwidth("1bit", "8bit-sign", d, n, network, cm.DEFAULT_CPU_COMPUTE)
    assert rate is not None
    at = network.with_bandwidth(rate)
    a = cm.predict("1bit", d, n, at, cm.DEFAULT_CPU_COMPUTE)
    b = cm.predict("8bit-sign", d, n, at, cm.DEFAULT_CPU_COMPUTE)
    assert a.total_s == pytest.approx(b.total_s, rel=1e-9)
    # 1-bit sends less, computes more: it wins below the crossing and loses above
    assert (
        cm.winner(d, n, at.with_bandwidth(rate / 2), cm.DEFAULT_CPU_COMPUTE, ["1bit", "8bit-sign"]).variant
        == "1bit"
    )
    assert (
        cm.winner(d, n, at.with_bandwidth(rate * 2), cm.DEFAULT_CPU_COMPUTE, ["1bit", "8bit-sign"]).variant
        == "8bit-sign"
    )


def test_crossover_none_when_one_always_wins() -> None:
    # same α terms, no compute: the variant with fewer bytes is faster at every rate
    assert cm.crossover_bandwidth("32bit", "16bit", 10**6, 4, 1e-4) is None
    assert cm.crossover_bandwidth("8bit-sign", "dlion-avg", 10**6, 4, 1e-4, cm.DEFAULT_CPU_COMPUTE) is None
    with pytest.raises(ValueError, match="not allowed"):
        cm.crossover_bandwidth("4bit", "1bit", 10**6, 16, 1e-4)


def test_winner_skips_variants_that_are_not_allowed_and_regimes_agree() -> None:
    network = cm.Network.from_rate(1e9, 50e-6)
    rows = cm.table(10**8, 16, network, cm.DEFAULT_CPU_COMPUTE)
    best = cm.winner(10**8, 16, network, cm.DEFAULT_CPU_COMPUTE)
    assert best.total_s == min(p.total_s for p in rows if p.allowed)
    assert not next(p for p in rows if p.variant == "4bit").allowed
    spans = cm.regimes(10**8, 16, network, cm.DEFAULT_CPU_COMPUTE)
    assert spans[0][0] == pytest.approx(10e6 / 8) and spans[-1][1] == pytest.approx(400e9 / 8)
    for (_, hi, v), (lo, _, w) in itertools.pairwise(spans):
        assert hi == lo and v != w
    for lo, hi, v in spans:
        mid = math.sqrt(lo * hi)
        assert cm.winner(10**8, 16, network.with_bandwidth(mid), cm.DEFAULT_CPU_COMPUTE).variant == v
    at = next(v for lo, hi, v in spans if lo <= network.bandwidth_Bps <= hi)
    assert at == best.variant


# ------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("774M", 774_000_000),
        ("25M", 25_000_000),
        ("1.5B", 1_500_000_000),
        ("125000000", 125_000_000),
        ("2.5k", 2500),
        ("7g", 7_000_000_000),
        (" 3 M ", 3_000_000),
        ("1e6", 1_000_000),
    ],
)
def test_parse_count(text: str, count: int) -> None:
    assert cm.parse_count(text) == count


@pytest.mark.parametrize("text", ["7X", "", "M", "-1M", "0", "1.2.3M", "0.1"])
def test_parse_count_rejects_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--params: "):
        cm.parse_count(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50us", 5e-5), ("50µs", 5e-5), ("1ms", 1e-3), ("0.2s", 0.2), ("100ns", 1e-7), ("0", 0.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert cm.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "fast", "1 hour", "-1ms", "1mS"])
def test_parse_duration_rejects_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--latency: "):
        cm.parse_duration(text)


def test_parse_bandwidth_uses_the_launchers_rates() -> None:
    assert cm.parse_bandwidth("1gbit") == 125e6
    assert cm.parse_bandwidth("100mbit") == 12.5e6
    with pytest.raises(ValueError, match=r"^--bandwidth: "):
        cm.parse_bandwidth("fast")
    with pytest.raises(ValueError, match=r"^--bandwidth: .*ambiguous"):
        cm.parse_bandwidth("1gbps")


# ------------------------------------------------------------------------------------ lioncub cost


def test_cost_command_prints_table_winner_and_crossovers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cost", "--params", "774M", "--workers", "8", "--bandwidth", "1gbit", "--latency", "50us"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for name in PRESET_NAMES:
        assert name in out
    assert "d = 774M parameters, N = 8 workers, 1 Gbit/s links" in out
    assert "winner: 1bit" in out
    assert "1.00x" in out  # 32bit against itself
    assert "fastest by link rate:" in out and "crossovers with the winner:" in out
    assert "1bit vs 8bit-sign: equal at" in out


def test_local_steps_with_averaged_inner_momenta_by_hand() -> None:
    # 1bit, d = 1e6, N = 4, H = 16, the inner momenta averaged (fp32 ring) at each outer step:
    # (187500 + 2·3/4·4e6) / 16 = (187500 + 6e6) / 16 B per inner step
    p = cm.predict("1bit", 1_000_000, 4, net(0.0, 1e6), local_steps=16, sync_every=16)
    assert p.bytes_sent == pytest.approx((187_500 + 6e6) / 16)


def test_cost_command_with_local_steps(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cost", "--params", "124M", "--workers", "4", "--variants", "1bit,16bit"]
    argv += ["--bandwidth", "100mbit"]
    assert cli.main([*argv, "--local-steps", "16"]) == 0
    out = capsys.readouterr().out
    assert "one vote every 16 local steps (per inner step)" in out
    assert cli.main([*argv, "--local-steps", "16", "--inner-momentum", "average"]) == 0
    assert "momentum sync every 16 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*argv, "--local-steps", "0"])
    assert "argument --local-steps:" in capsys.readouterr().err
    assert cli.main([*argv, "--local-steps", "16", "--sync-every", "10"]) == 2
    assert "--sync-every 10 with --local-steps 16" in capsys.readouterr().err
    assert cli.main([*argv, "--inner-momentum", "average"]) == 2
    assert "--inner-momentum average: applies only with --local-steps H" in capsys.readouterr().err


def test_cost_command_chooses_the_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from lioncub.planning.schedule import choose_schedule

    argv = ["cost", "--params", "825472", "--workers", "4", "--variants", "1bit", "--compute", "none"]
    for rate in ("2mbit", "100mbit"):
        assert cli.main([*argv, "--bandwidth", rate, "--step-compute", "186ms"]) == 0
        out = capsys.readouterr().out
        net = cm.Network.from_rate(cm.parse_bandwidth(rate) * 8, 50e-6)
        vote = cm.predict("1bit", 825472, 4, net).total_s
        expected = choose_schedule(0.186, vote)
        assert f"schedule for 1bit: {expected.reason}" in " ".join(out.split()), out
    assert expected.local_steps == 4  # 100 Mbit/s (m/c 0.08): f(4) = 1, so any vote's time is worth saving
    nodes = ["cost", "--params", "825472", "--nnodes", "2", "--nproc-per-node", "2", "--variants", "1bit"]
    assert cli.main([*nodes, "--bandwidth", "4mbit", "--step-compute", "186ms"]) == 0
    assert "schedule for 1bit flat: a vote every" in capsys.readouterr().out  # the fastest exact topology
    assert cli.main([*argv, "--step-compute", "186ms", "--local-steps", "4"]) == 2
    assert "--step-compute chooses H itself" in capsys.readouterr().err


def test_cost_command_reports_variants_that_are_not_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cost", "--params", "10M", "--workers", "16", "--variants", "4bit,1bit,8bit"]) == 0
    out = capsys.readouterr().out
    assert "not allowed" in out and "4bit is not allowed for N = 16" in out
    assert "winner: " in out


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--params", "7X", "--workers", "8"], "--params"),
        (["--params", "7M", "--workers", "0"], "--workers"),
        (["--params", "7M", "--workers", "8", "--bandwidth", "fast"], "--bandwidth"),
        (["--params", "7M", "--workers", "8", "--latency", "5"], "--latency"),
        (["--params", "7M", "--workers", "8", "--variants", "9bit"], "--variants"),
        (["--params", "7M", "--workers", "8", "--efficiency", "2"], "--efficiency"),
    ],
)
def test_cost_command_bad_input_names_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["cost", *argv])
    assert exc.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cost_plot_has_both_panels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The panels of the figure that ``lioncub cost --plot`` saved (kept, not built a second time)."""
    from matplotlib.figure import Figure

    from lioncub.cli import cost as cost_cli

    drawn: list[Figure] = []

    def keep(*args: Any, **kwargs: Any) -> Figure:
        drawn.append(cost_report.figure(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(cost_cli, "figure", keep)
    out = tmp_path / "cost.png"
    assert cli.main(["cost", "--params", "25M", "--workers", "4", "--plot", str(out)]) == 0
    assert f"saved {out}" in capsys.readouterr().out
    assert png_size(out) == (1440, 576)  # 12 x 4.8 inches at 120 dpi
    (fig,) = drawn
    panels = fig.get_axes()
    assert len(panels) == 2
    assert [ax.get_xscale() for ax in panels] == ["log", "log"]
    for ax in panels:
        assert [
            line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")
        ] == PRESET_NAMES
    bw_lines = {line.get_label(): line for line in panels[0].get_lines()}
    xs = bw_lines["32bit"].get_xdata()
    assert xs[0] == pytest.approx(10e6) and xs[-1] == pytest.approx(400e9)
    n_line = {line.get_label(): line for line in panels[1].get_lines()}["4bit"]
    ns, ts = n_line.get_xdata(), n_line.get_ydata()
    assert ns[0] == 2 and ns[-1] == 128
    assert all(math.isfinite(t) == (k <= 15) for k, t in zip(ns, ts, strict=True))  # lane limit


def synthetic_calibration(path: Path) -> cm.Calibration:
    network = cm.Network(
        20e-6, 125e6, 0.95, {"all_to_all": cm.OpCost(30e-6, 0.6), "allreduce_f32": cm.OpCost(20e-6, 0.95)}
    )
    calib = cm.Calibration(network, dataclasses.replace(NO_COMPUTE, pack_s_per_elem=1e-9), 4, 1e9)
    calib.save(path)
    return calib


def test_calibration_round_trip_and_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "calib.json"
    calib = synthetic_calibration(path)
    loaded = cm.load_calibration(path)
    assert loaded.network == calib.network and loaded.compute == calib.compute
    assert loaded.world_size == 4 and loaded.link_bps == 1e9
    # the all-to-all's own efficiency: 1-bit phase 1 at 0.6·125e6 B/s, phase 2 at the default 0.95
    p = cm.predict("1bit", 8000, 4, loaded.network)
    each = 3 / 4 * 8000 / 8
    assert p.bandwidth_s == pytest.approx(each / (0.6 * 125e6) + each / (0.95 * 125e6))
    assert p.latency_s == pytest.approx(3 * 30e-6 + 3 * 20e-6)
    assert cli.main(["cost", "--params", "25M", "--workers", "4", "--calibration", str(path)]) == 0
    assert f"constants: calibration {path} (N = 4)" in capsys.readouterr().out


def test_calibration_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    with pytest.raises(ValueError, match="cannot read calibration"):
        cm.load_calibration(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cm.load_calibration(path)
    synthetic_calibration(path)
    doc = json.loads(path.read_text())
    for change, message in [
        ({"version": 2}, "version 2"),
        ({"network": {"latency_s": 1e-5}}, "bandwidth_Bps"),
        ({"compute": {"pack_s_per_elem": -1}}, "pack_s_per_elem"),
        ({"world_size": 0}, "world_size"),
    ]:
        path.write_text(json.dumps({**doc, **change}))
        with pytest.raises(ValueError, match=message) as exc:
            cm.load_calibration(path)
        assert str(path) in str(exc.value)


# ------------------------------------------------------------------------------------ calibration


def test_fit_alpha_beta() -> None:
    pts = [(x, 1e-3 + 2e-9 * x) for x in (1e4, 1e5, 1e6, 1e7)]
    fit = fit_alpha_beta(pts)
    assert fit.intercept_s == pytest.approx(1e-3) and fit.seconds_per_byte == pytest.approx(2e-9)
    assert fit.rel_rms_residual == pytest.approx(0, abs=1e-9) and fit.ok
    # a negative intercept is refitted through the origin
    fit = fit_alpha_beta([(1e6, 0.9e-3), (2e6, 2.1e-3)])
    assert fit.intercept_s == 0 and fit.seconds_per_byte > 0
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_alpha_beta([(1e6, 1e-3), (1e6, 2e-3)])


def test_calibrate_needs_a_job(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["calibrate", "--out", "x.json"]) == 2
    assert "lioncub launch --nproc" in capsys.readouterr().err
