"""Momentum synchronization: which momenta (io detection, patterns, groups), when (schedules), and what a
sync does on real gloo ranks (the mean of the pre-sync momenta, recomputed here from the gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lioncub.optim import LionCub
from lioncub.optim.sync import MomentumSync, find_io_parameters, select_parameters
from lioncub.train.workloads import make_workload

from processes import run_workers

BETAS = (0.9, 0.99)


@pytest.mark.parametrize(
    ("workload", "overrides"),
    [("gpt", {"tie_embeddings": False}), ("gpt", {"tie_embeddings": True}), ("cnn", {})],
)
def test_io_detection_matches_the_workloads(workload: str, overrides: dict) -> None:
    wl = make_workload(workload, "tiny", **overrides)
    model = wl.build_model()
    expected = set(wl.io_parameter_names(model))
    assert find_io_parameters(model) == [n for n, _ in model.named_parameters() if n in expected]


def test_io_detection_by_hand() -> None:
    gpt_like = nn.ModuleDict(
        {
            "wte": nn.Embedding(10, 4),
            "wpe": nn.Embedding(6, 4),
            "mlp": nn.Linear(4, 4),
            "head": nn.Linear(4, 10),
        }
    )
    assert find_io_parameters(gpt_like) == ["wte.weight", "wpe.weight", "head.weight", "head.bias"]
    cnn_like = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 3), nn.Linear(2, 3)
    )
    assert find_io_parameters(cnn_like) == ["0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"]


def test_select_by_pattern_and_group() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    named = list(model.named_parameters())
    groups = [{"name": "first", "params": list(model[0].parameters())}, {"name": "second", "params": []}]
    assert [n for n, _ in select_parameters(["*.bias"], named, groups, model)] == ["0.bias", "1.bias"]
    assert [n for n, _ in select_parameters(["first"], named, groups, model)] == ["0.weight", "0.bias"]
    assert select_parameters("none", named, groups, model) == []
    assert len(select_parameters("all", named, groups, model)) == 4
    with pytest.raises(ValueError, match=r"\['emb\.\*'\] match no parameter name and no param group"):
        select_parameters(["emb.*"], named, groups, model)
    with pytest.raises(ValueError, match="momentum_sync='io' needs model="):
        select_parameters("io", named, groups, None)
    with pytest.raises(ValueError, match="momentum_sync='some': allowed values are 'none', 'all', 'io'"):
        select_parameters("some", named, groups, model)


def test_schedules() -> None:
    every = MomentumSync(every=10)
    assert [t for t in range(1, 41) if every.due(t)] == [10, 20, 30, 40]
    until = MomentumSync(every=3, until=7)
    assert [t for t in range(1, 20) if until.due(t)] == [3, 6]
    # exponential, K = 1: increments 2^0, 2^1, 2^2, ... -> 1, 3, 7, 15, 31
    assert [t for t in range(1, 40) if MomentumSync(exp_k=1).due(t)] == [1, 3, 7, 15, 31]
    # K = 2: increments int(2^(j/2)) = 1, 1, 2, 2, 4, 5, 8, 11, 16 -> 1, 2, 4, 6, 10, 15, 23, 34, 50
    assert [t for t in range(1, 51) if MomentumSync(exp_k=2).due(t)] == [1, 2, 4, 6, 10, 15, 23, 34, 50]
    for bad in ({"every": 0}, {"until": -1}, {"exp_k": 0}):
        with pytest.raises(ValueError):
            MomentumSync(**bad)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"emb": nn.Embedding(7, 5), "mid": nn.Linear(5, 5), "head": nn.Linear(5, 7)})


def grads_of(rank: int, step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def io_synced_lioncub(model: nn.Module, variant: str) -> LionCub:
    return LionCub(
        model.parameters(),
        lr=0.01,
        betas=BETAS,
        variant=variant,
        momentum_sync=MomentumSync("io", every=2),
        model=model,
    )


def worker_sync(rank: int, world: int, variant: str) -> dict:
    model = make_model()
    opt = io_synced_lioncub(model, variant)
    out: dict = {"names": opt.sync_names, "stats": []}
    for step in (1, 2, 3, 4):
        if step == 3:  # a checkpoint between two syncs: the schedule goes on from the saved step
            state = opt.state_dict()
            opt = io_synced_lioncub(model, variant)
            opt.load_state_dict(state)
        for n, p in model.named_parameters():
            p.grad = grads_of(rank, step, model)[n]
        opt.step()
        out["stats"].append(opt.comm_stats()["last"])
        out[step] = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("variant", ["1bit", "8bit"])
def test_sync_averages_the_chosen_momenta_on_real_ranks(variant: str) -> None:
    world = 3
    out = run_workers(worker_sync, world, variant)
    model = make_model()
    io = ["emb.weight", "head.weight", "head.bias"]
    assert out[0]["names"] == io
    # the momenta every rank would hold without sync, recomputed from the gradients in the same fp32 ops
    own = {r: {n: torch.zeros_like(p) for n, p in model.named_parameters()} for r in range(world)}
    for step in (1, 2, 3, 4):
        for r in range(world):
            for n, g in grads_of(r, step, model).items():
                own[r][n].mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])
        for n, _ in model.named_parameters():
            if n in io and step % 2 == 0:  # synced: every rank holds the mean
                mean = torch.stack([own[r][n].double() for r in range(world)]).mean(0)
                for r in range(world):
                    torch.testing.assert_close(out[r][step][n].double(), mean, rtol=1e-6, atol=1e-7)
                    own[r][n] = out[r][step][n].clone()  # the next step starts from the synced value
            else:  # untouched
                for r in range(world):
                    assert torch.equal(out[r][step][n], own[r][n]), (step, n, r)
    io_numel = sum(p.numel() for n, p in model.named_parameters() if n in io)
    sync_bytes = 2 * (world - 1) / world * 4 * io_numel
    s1, s2 = out[0]["stats"][0], out[0]["stats"][1]
    assert s2["collectives"] == s1["collectives"] + 1
    assert s2["bytes_sent"] == pytest.approx(s1["bytes_sent"] + sync_bytes, abs=1)  # counted in whole bytes
    assert s1["sync_s"] == 0.0 and s2["sync_s"] > 0.0


def test_sync_is_refused_for_the_global_presets() -> None:
    out = run_workers(worker_refuse, 1)
    assert "keeps one global momentum already" in out[0]


def worker_refuse(rank: int, world: int) -> str:
    model = make_model()
    try:
        LionCub(model.parameters(), variant="32bit", momentum_sync="all", model=model)
    except ValueError as err:
        return str(err)
    return "no error"
