"""LionCub on real gloo ranks against the plain single-process simulation of N workers
(``tests/oracles.py``): every preset on 1-5 ranks, gloo's native exchange, one rank = Lion, the tie rules,
and a resume that keeps the tie phase and the momenta."""

from __future__ import annotations

import math
import os

import pytest
import torch

from lioncub.optim import Lion, LionCub
from lioncub.optim.step_check import STEP_CHECK_WORDS
from oracles import (
    ALL_PRESETS,
    SHAPES,
    initial_params,
    local_grad,
    param_groups,
    simulate,
    worker_run_presets,
)

from processes import run_workers

#: steps of the oracle's problem run on the ranks (not all of :data:`oracles.STEPS`): every event of it
#: happens by step 4 — step 1's exact zero directions (momenta 0), step 2's missing gradient, the tie rule's
#: and the zero split's two step parities twice each, momenta from step 2 on, a new lr every step
STEPS = 4


def expected_bytes(preset: str, n: int, buckets: list[int], rank: int) -> float:
    """Bytes sent per rank per step, from the wire formats (independent of the accounting code)."""
    total = 0.0
    ring = 2 * (n - 1) / n
    for d in buckets:
        if preset == "32bit":
            total += ring * 8 * math.ceil(d / n) * n  # float64 here; padded to a multiple of N
        elif preset == "1bit":
            padded = math.ceil(d / (8 * n)) * 8 * n
            total += 2 * (n - 1) / n * padded / 8
        elif preset == "4bit":
            total += ring * math.ceil(d / 2)
        elif preset in ("8bit", "8bit-sign", "dlion-avg"):
            total += ring * d
        elif preset == "16bit":
            total += ring * 2 * math.ceil(d / n) * n
        elif preset == "dlion-mavo":
            total += (n - 1) * math.ceil(d / 4) if rank == 0 else math.ceil(d / 8)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_preset_matches_simulation_on_every_rank(world: int) -> None:
    results = run_workers(
        worker_run_presets, world, ALL_PRESETS, 0.0008, "auto", "flat", 1, False, STEPS, timeout=240
    )
    for preset in ALL_PRESETS:
        want = simulate(preset, world, steps=STEPS)
        for rank in range(world):
            got = results[rank][preset]["params"]
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), f"{preset}: rank {rank} parameter {i} differs from simulation"
            # identical on every rank, bitwise
            for i, p in enumerate(got):
                assert torch.equal(p, results[0][preset]["params"][i])
        if world > 1:
            stats = results[0][preset]["stats"]["last"]
            buckets = results[0][preset]["buckets"]
            for rank in range(world):
                sent = results[rank][preset]["stats"]["last"]["bytes_sent"]
                check = (world - 1) * 4 * STEP_CHECK_WORDS  # the step check all-gathers these int32 per rank
                want = expected_bytes(preset, world, buckets, rank) + check
                assert sent == pytest.approx(want, abs=len(buckets))
            assert stats["collectives"] >= len(buckets)


@pytest.mark.parametrize("world", [3, 4])
def test_native_exchange_matches_simulation(world: int) -> None:
    """gloo's own all_to_all / all_gather (exchange="native") give the same result as the p2p exchange."""
    presets = ["1bit", "dlion-mavo", "4bit"]
    results = run_workers(
        worker_run_presets, world, presets, 0.0008, "native", "flat", 1, False, STEPS, timeout=240
    )
    for preset in presets:
        want = simulate(preset, world, steps=STEPS)
        for rank in range(world):
            for i, (g, w) in enumerate(zip(results[rank][preset]["params"], want, strict=True)):
                assert torch.equal(g, w), f"{preset}: rank {rank} parameter {i} differs from simulation"


def worker_equals_lion(rank: int, world: int, dtype: torch.dtype) -> dict:
    out = {}
    for preset in ALL_PRESETS:
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        oa = LionCub(a, lr=0.01, weight_decay=0.1, variant=preset)
        ob = Lion(b, lr=0.01, weight_decay=0.1)
        for step in range(4):
            for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
                g = local_grad(0, step + 1, i, pa.detach().double()).to(dtype)
                pa.grad, pb.grad = g, g.clone()
            oa.step()
            ob.step()
        out[preset] = [bool(torch.equal(pa, pb)) for pa, pb in zip(a, b, strict=True)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_world_size_one_equals_lion(dtype: torch.dtype) -> None:
    (res,) = run_workers(worker_equals_lion, 1, dtype)
    for preset, same in res.items():
        if preset == "8bit":
            continue  # L1 levels that round to 0 give no update (checked in the simulation test)
        assert all(same), f"{preset} with one worker differs from Lion: {same}"


def worker_ties(rank: int, world: int) -> dict:
    from lioncub.collectives import Comm, LaneVote, OneBitVote, SignSumVote

    comm = Comm()
    d = 1001
    # half of the ranks vote +, half vote -: every element is a tie
    local = torch.full((d,), 1.0 if rank < world // 2 else -1.0)
    one = OneBitVote(comm)
    res = {"1bit": [one.start(local, step=s).wait() for s in (1, 2, 3)]}
    res["4bit"] = LaneVote(comm, 4).start(local, step=1).wait()
    res["int8"] = SignSumVote(comm).start(local, step=1).wait()
    # independent random signs: tie rate of the sign majority vote
    g = torch.Generator().manual_seed(rank)
    rnd = torch.randn(200_000, generator=g)
    res["tie_rate"] = float((SignSumVote(comm).start(rnd, step=1).wait() == 0).double().mean())
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_tie_rules(world: int) -> None:
    results = run_workers(worker_ties, world)
    for res in results:
        a, b, c = res["1bit"]
        assert bool((a == 1).all()) and bool((b == -1).all()) and bool((c == 1).all())  # alternate
        assert bool((res["4bit"] == 0).all()) and bool((res["int8"] == 0).all())  # p-bit: ties stay 0
        expected = math.comb(world, world // 2) / 2**world
        sigma = math.sqrt(expected * (1 - expected) / 200_000)
        assert abs(res["tie_rate"] - expected) < 5 * sigma
    assert results[0]["tie_rate"] == results[-1]["tie_rate"]


def worker_state_round_trip(rank: int, world: int, tmp: str) -> list[torch.Tensor]:
    """Run 3 steps, checkpoint, 3 more; a second optimizer resumed from the checkpoint must match."""
    params = [torch.nn.Parameter(p) for p in initial_params(rank)]
    opt = LionCub(params, lr=0.01, variant="1bit")
    for step in range(1, 7):
        if step == 4:
            torch.save(
                {"p": [p.detach().clone() for p in params], "o": opt.state_dict()},
                os.path.join(tmp, f"ck{rank}.pt"),
            )
        for i, p in enumerate(params):
            p.grad = local_grad(rank, step, i, p.detach())
        opt.step()
    ck = torch.load(os.path.join(tmp, f"ck{rank}.pt"), weights_only=True)
    params2 = [torch.nn.Parameter(p) for p in ck["p"]]
    opt2 = LionCub(params2, lr=0.01, variant="1bit")
    opt2.load_state_dict(ck["o"])
    assert opt2.global_step == 3
    for step in range(4, 7):
        for i, p in enumerate(params2):
            p.grad = local_grad(rank, step, i, p.detach())
        opt2.step()
    return [bool(torch.equal(a, b)) for a, b in zip(params, params2, strict=True)]


def test_resume_keeps_tie_phase_and_momenta(tmp_path) -> None:
    for res in run_workers(worker_state_round_trip, 2, str(tmp_path)):
        assert all(res)


def worker_bucket_subsets(rank: int, world: int, variant: str) -> dict:
    """Three steps of ``variant`` over small buckets, once by ``step()`` and once as two rounds per step
    over halves of the buckets (``VoteRound.run(buckets=...)``, what a shard or a fragment runs)."""
    from lioncub.optim.engine import StepTimes

    out: dict = {}
    for split in (False, True):
        params = [torch.nn.Parameter(t) for t in initial_params(rank)]
        opt = LionCub(param_groups(params), lr=0.01, variant=variant, bucket_mb=0.0005)
        buckets = opt.layout.buckets
        halves = [buckets[::2], buckets[1::2]]
        for step in (1, 2, 3):
            for i, p in enumerate(params):
                p.grad = local_grad(rank, step, i, p.detach())
            if not split:
                opt.step()
                continue
            for half in halves:
                before, times = opt.accounting.snapshot(), StepTimes()
                result = opt.round.run(step, times, buckets=half)
                assert result is not None
                opt.round.finish(before, times, skipped=False)
        out[split] = ([p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params])
        out["buckets"] = len(buckets)
    return out


@pytest.mark.parametrize("variant", ["1bit", "4bit", "dlion-avg"])
def test_a_round_over_a_subset_of_buckets(variant: str) -> None:
    """Rounds over disjoint subsets of the buckets, together, are bit for bit the round over all of them."""
    for res in run_workers(worker_bucket_subsets, 3, variant):
        assert res["buckets"] >= 3
        for whole, parts in zip(res[False], res[True], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
