"""Vote algorithms: refusals of overflowing configurations, exhaustive lane sums, DDP helper, replicas."""

from __future__ import annotations

import itertools

import pytest
import torch

from lioncub.collectives import LaneVote, QuantizedVote, ServerVote, SignSumVote, auto_lane_bits
from lioncub.ops import packing
from lioncub.optim import PRESETS, Checks, VoteConfig, resolve_variant
from sim_comm import fake_comm

from processes import run_workers


@pytest.mark.parametrize("n, bits", [(16, 4), (4, 2), (256, 8)])
def test_lane_vote_refuses_overflowing_worker_counts(n: int, bits: int) -> None:
    with pytest.raises(ValueError, match=f"at most {(1 << bits) - 1} workers"):
        LaneVote(fake_comm(n), bits)


def test_auto_widens_lanes() -> None:
    assert [LaneVote(fake_comm(n), "auto").bits for n in (2, 3, 4, 15, 16, 255)] == [2, 2, 4, 4, 8, 8]
    assert auto_lane_bits(3) == 2
    with pytest.raises(ValueError, match="at most 255 workers"):
        LaneVote(fake_comm(256), "auto")


def test_quantized_budgets_and_refusals() -> None:
    assert QuantizedVote(fake_comm(8), "l1", 8).levels == 15
    assert QuantizedVote(fake_comm(3), "l1", 4).levels == 2  # offset lanes: 3 x (2*2) <= 15
    with pytest.raises(ValueError, match="at most 7 workers"):
        QuantizedVote(fake_comm(8), "l1", 4)
    q = QuantizedVote(fake_comm(8), "l1", "auto")
    assert q.bits == 8 and q.levels == 15
    assert QuantizedVote(fake_comm(2), "l1", "auto").bits == 4  # 2-bit lanes leave no level for 2 workers
    with pytest.raises(ValueError, match="n_workers=128"):
        SignSumVote(fake_comm(128))
    with pytest.raises(ValueError, match="quantizer='l7'"):
        QuantizedVote(fake_comm(2), "l7")


@pytest.mark.parametrize("bits", [2, 4])
def test_allowed_lane_votes_never_overflow_exhaustively(bits: int) -> None:
    """Every combination of votes of N ≤ 2^p − 1 workers: the uint8 byte sum decodes to the true count."""
    for n in range(1, (1 << bits)):
        patterns = torch.tensor(list(itertools.product([0, 1], repeat=n)), dtype=torch.uint8).T  # [n, 2^n]
        wire = sum(packing.pack_lanes(v, bits).to(torch.int64) for v in patterns) % 256
        counts = packing.unpack_lanes(wire.to(torch.uint8), bits, patterns.shape[1]).to(torch.int64)
        assert torch.equal(counts, patterns.to(torch.int64).sum(0))


@pytest.mark.parametrize("n, bits", [(1, 4), (3, 4), pytest.param(7, 4, marks=pytest.mark.slow), (1, 2)])
def test_allowed_offset_levels_never_overflow_extremes(n: int, bits: int) -> None:
    """Every combination of the extreme levels (−s, 0, s) of N workers: the uint8 byte sum of their offset
    lanes decodes to the true sum (a worker's lanes, a function of its level, encoded once per level)."""
    s = QuantizedVote(fake_comm(n), "l1", bits).levels
    encoded = {
        q: packing.pack_lanes(packing.offset_encode(torch.tensor([q] * 5, dtype=torch.int8), s), bits)
        for q in (-s, 0, s)
    }
    for levels in itertools.product([-s, 0, s], repeat=n):
        wire = (sum(encoded[q].to(torch.int64) for q in levels) % 256).to(torch.uint8)
        total = packing.offset_decode(packing.unpack_lanes(wire, bits, 5), n, s)
        assert total.tolist() == [sum(levels)] * 5


def test_wire_byte_formulas() -> None:
    d = 1000
    assert ServerVote(fake_comm(4, 0)).wire_bytes(d) == (3 * 250, 3 * 125)
    assert ServerVote(fake_comm(4, 2)).wire_bytes(d) == (125, 250)
    assert LaneVote(fake_comm(4), 4).wire_bytes(d) == (750.0, 750.0)


def test_variant_knobs() -> None:
    assert resolve_variant("8bit").quantizer == "l1"
    assert resolve_variant("8bit", quantizer="l0").quantizer == "l0"
    assert resolve_variant("1bit", transport="quantized").quantizer == "l1"
    with pytest.raises(ValueError, match="variant='9bit'"):
        resolve_variant("9bit")
    with pytest.raises(ValueError, match="aggregation='average' is not available with transport='1bit'"):
        resolve_variant("1bit", aggregation="average")
    with pytest.raises(ValueError, match="bits=3"):
        resolve_variant("4bit", bits=3)
    assert set(PRESETS) == {"32bit", "16bit", "1bit", "4bit", "8bit", "8bit-sign", "dlion-mavo", "dlion-avg"}
    assert isinstance(PRESETS["8bit"], VoteConfig)


def worker_ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.optim import LionCub
    from lioncub.optim.ddp import skip_gradient_allreduce

    torch.manual_seed(rank)  # different init per rank: DDP must broadcast rank 0's
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)))
    skip_gradient_allreduce(model)
    opt = LionCub(model.parameters(), lr=0.01, variant="1bit", checks=Checks(broadcast_init=False))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + rank))
    model(x).square().mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    expected = torch.autograd.grad(model.module(x).square().mean(), list(model.module.parameters()))
    opt.step()
    opt.check_replicas()
    return {
        "local_equal": all(torch.equal(a, b) for a, b in zip(local, expected, strict=True)),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_ddp_without_gradient_allreduce() -> None:
    results = run_workers(worker_ddp, 2)
    assert all(r["local_equal"] for r in results)  # grads stayed local
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # DDP's init broadcast + the vote keep replicas identical


def worker_divergence(rank: int, world: int) -> str:
    from lioncub.optim import LionCub, ReplicaDivergenceError

    p = torch.nn.Parameter(torch.zeros(10))
    opt = LionCub([p], lr=0.1, variant="8bit", checks=Checks(replica_check_every=2))
    p.grad = torch.ones(10)
    opt.step()  # step 1: no check
    if rank == 1:
        with torch.no_grad():
            p[3] += 1e-7  # silent corruption on one rank
    p.grad = torch.ones(10)
    try:
        opt.step()  # step 2: checked
    except ReplicaDivergenceError as err:
        return str(err)
    return "no error"


def test_replica_check_catches_divergence() -> None:
    for msg in run_workers(worker_divergence, 2):
        assert "ranks [1] disagree with rank 0" in msg and "step 2" in msg
