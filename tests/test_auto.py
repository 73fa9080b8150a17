"""``variant="auto"`` (:func:`lioncub.planning.auto.auto_variant`): the cost model picks the preset, rank 0
decides, every rank follows.

The oracles are closed-form regimes of the α–β model where the winner is known without the model: with
no compute and no latency the fewest bytes win (1-bit); a calibration whose all-to-all runs at 1 % of the
link makes the 1-bit exchange the slowest, so the next fewest bytes win (4-bit lanes, or an int8 sum once
N is past the 4-bit lane limit of 15 workers).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from lioncub.optim import LionCub
from lioncub.optim.config import PRESETS
from lioncub.planning import costmodel as cm
from lioncub.planning.auto import AUTO_ENV, auto_variant, choose_variant

from processes import run_workers

NO_COMPUTE = cm.Compute()
INT8_PRESETS = {"8bit", "8bit-sign", "dlion-avg"}  # d bytes of int8 per rank each, without compute


def calibration(path: Path, *, all_to_all_efficiency: float, world_size: int = 4) -> Path:
    network = cm.Network(0.0, 125e6, 0.95, {"all_to_all": cm.OpCost(0.0, all_to_all_efficiency)})
    cm.Calibration(network, NO_COMPUTE, world_size, 1e9).save(path)
    return path


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("rate_bps", [1e7, 1e9, 1e11])
def test_fewest_bytes_win_without_compute_or_latency(n: int, rate_bps: float) -> None:
    # a bare Network gets the default CPU compute costs; a Calibration carries its own (here: none)
    cal = cm.Calibration(cm.Network.from_rate(rate_bps, 0.0), NO_COMPUTE, n)
    choice = choose_variant(10**6 + 7, n, cal)
    assert choice.variant == "1bit"
    assert len(choice.predictions) == len(PRESETS)
    assert "chose '1bit'" in choice.reason and f"on {n} workers over" in choice.reason


@pytest.mark.parametrize(("n", "expected"), [(4, {"4bit"}), (15, {"4bit"}), (16, INT8_PRESETS)])
def test_a_slow_all_to_all_moves_the_choice(tmp_path: Path, n: int, expected: set[str]) -> None:
    path = calibration(tmp_path / "cal.json", all_to_all_efficiency=0.01, world_size=n)
    choice = choose_variant(4 * 10**6, n, str(path))
    assert choice.variant in expected
    if n == 16:
        assert "4bit: 4-bit lanes cannot hold the vote count of 16 workers" in choice.reason


def test_fast_link_with_cpu_costs_prefers_no_codec() -> None:
    # at 1 Tbit/s the wire time of 100 MB is below a millisecond and the CPU codec of the voting presets
    # costs more than it saves
    assert choose_variant(25 * 10**6, 4, "1000gbit").variant == "32bit"
    assert choose_variant(25 * 10**6, 4, "100mbit").variant == "1bit"


def test_candidates_restrict_and_are_checked() -> None:
    cal = cm.Calibration(cm.Network.from_rate(1e9, 0.0), NO_COMPUTE, 16)
    assert choose_variant(10**6, 16, cal, candidates=["4bit", "16bit"]).variant == "16bit"
    with pytest.raises(ValueError, match=r"none of \['4bit'\] is allowed for N=16"):
        choose_variant(10**6, 16, cal, candidates=["4bit"])
    for bad in (["2bit"], [], "1bit"):
        with pytest.raises(ValueError, match=r"candidates=.*non-empty list of presets"):
            choose_variant(10**6, 4, cal, candidates=bad)


def test_network_from_env_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTO_ENV, raising=False)
    with pytest.raises(ValueError, match=f"network=.*{AUTO_ENV}"):
        choose_variant(10**6, 4)
    monkeypatch.setenv(AUTO_ENV, str(calibration(tmp_path / "cal.json", all_to_all_efficiency=0.01)))
    choice = choose_variant(10**6, 4)
    assert choice.variant == "4bit" and "calibration cal.json" in choice.reason
    with pytest.raises(ValueError, match="network"):
        choose_variant(10**6, 4, "fast")
    with pytest.raises(TypeError, match="network=3"):
        choose_variant(10**6, 4, 3)  # type: ignore[arg-type]


def test_the_optimizer_points_to_auto_variant() -> None:
    # the choice is made before the optimizer exists; LionCub itself takes a preset or a VoteConfig
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"variant='auto' is lioncub\.planning\.auto\.auto_variant"):
        LionCub([p], variant="auto")


# -- on real ranks -------------------------------------------------------------------------------------


def worker_auto(
    rank: int, world: int, networks: list[str | None], compute: list[float | None] | None = None
) -> dict:
    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(1000))]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lioncub").addHandler(handler)
    logging.getLogger("lioncub").setLevel(logging.INFO)
    try:
        compute_s = None if compute is None else compute[rank]
        choice = auto_variant(params, network=networks[rank], latency_s=0.0, compute_s=compute_s)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    opt = LionCub(params, lr=0.01, variant=choice.variant, local_steps=choice.local_steps)
    for step in range(16):  # a whole window where H = 16: every rank's parameters agree at its end
        params[0].grad = torch.randn(1000, generator=torch.Generator().manual_seed(10 * rank + step))
        opt.step()
    return {
        "variant": opt.variant,
        "reason": choice.reason,
        "params": params[0].detach().clone(),
        "logged": records,
        "state_variant": opt.state_dict()["lioncub"]["variant"],
        "local_steps": choice.local_steps,
    }


@pytest.mark.slow
def test_rank0_decides_and_every_rank_follows() -> None:
    # rank 0 predicts for a 10 Mbit/s link (1-bit wins); the others were told 1 Tbit/s (32-bit would win)
    out = run_workers(worker_auto, 3, ["10mbit", "1000gbit", "1000gbit"])
    assert [o["variant"] for o in out] == ["1bit"] * 3
    assert all(o["state_variant"] == "1bit" for o in out)
    assert all(torch.equal(o["params"], out[0]["params"]) for o in out)
    assert len(out[0]["logged"]) == 1 and "chose '1bit'" in out[0]["logged"][0]
    assert out[1]["logged"] == [] and out[1]["reason"] == "variant='auto': rank 0 chose '1bit'"


@pytest.mark.slow
def test_rank0_chooses_h_and_every_rank_follows() -> None:
    # 1000 parameters at 10 kbit/s: one 1-bit vote takes ~0.16 s; against 1 ms of compute (rank 0's)
    # a vote every 16 steps wins with the default factors; the others (10 s of compute) would pick H = 4
    out = run_workers(worker_auto, 3, ["10kbit"] * 3, [1e-3, 10.0, 10.0])
    assert [o["local_steps"] for o in out] == [16] * 3 and [o["variant"] for o in out] == ["1bit"] * 3
    assert all(torch.equal(o["params"], out[0]["params"]) for o in out)
    assert "a vote every 16 steps (one vote" in out[0]["reason"]
    assert out[1]["reason"] == "variant='auto': rank 0 chose '1bit', a vote every 16 steps"


@pytest.mark.slow
def test_rank0_error_reaches_every_rank_without_a_hang() -> None:
    out = run_workers(worker_auto, 3, ["no such rate", "1gbit", "1gbit"], timeout=60)
    assert out[0]["error"].startswith("ValueError") and "network" in out[0]["error"]
    assert out[1]["error"] == "RuntimeError: rank 1: variant='auto' failed on rank 0 (see rank 0's error)"
    assert out[2]["error"].startswith("RuntimeError: rank 2")


def test_world_size_one_needs_no_codec() -> None:
    out = run_workers(worker_auto, 1, ["10mbit"])  # one worker: nothing travels, a codec only costs
    assert out[0]["variant"] == "32bit" and "on 1 worker over" in out[0]["reason"]


def test_reason_lists_the_runner_up(tmp_path: Path) -> None:
    cal = dataclasses.replace(
        cm.load_calibration(calibration(tmp_path / "c.json", all_to_all_efficiency=0.95)), compute=NO_COMPUTE
    )
    choice = choose_variant(8 * 10**6, 4, cal)
    runner_up = sorted((p for p in choice.predictions if p.allowed), key=lambda p: p.total_s)[1]
    assert f"(next: {runner_up.variant} " in choice.reason
