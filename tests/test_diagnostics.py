"""Vote diagnostics: hand-computed rates on hand-made inputs, and on real ranks against the plain
recomputation of every worker's direction, the 1-bit vote and the momenta; off means no extra collective."""

from __future__ import annotations

import math

import pytest
import torch

from lioncub.optim import LionCub, diagnostics

from processes import run_workers

BETAS = (0.9, 0.99)


def test_agreement_tie_spread_and_shape_by_hand() -> None:
    u = torch.tensor([1, -1, 1, 0, -1], dtype=torch.int8)
    ref = torch.tensor([2.0, 3.0, -1.0, 5.0, 0.0])
    # signs: u (1, -1, 1, 0, -1), ref (1, 1, -1, 1, 0): equal at 0 only; opposite and nonzero at 1 and 2
    assert diagnostics.agreement(u, ref) == (0.2, 0.4)
    assert diagnostics.tie_rate(torch.tensor([0, 2, -2, 0])) == 0.5
    # two workers with momenta (1, 2) and (3, 2): mean (2, 2), mean of squares (5, 4), variance (1, 0)
    assert diagnostics.momentum_spread(torch.tensor([2.0, 2.0]), torch.tensor([5.0, 4.0])) == 1.0
    assert diagnostics.shape(torch.tensor([1.0, -1.0, 1.0, -1.0])) == (1.0, 1.0)
    ratio, kurt = diagnostics.shape(torch.tensor([0.0, 0.0, 0.0, 4.0]))  # mean|c| 1, max 4
    assert ratio == 4.0 and kurt == pytest.approx(((3**4 + 3 * 1) / 4) / (12 / 4) ** 2)
    assert all(math.isnan(v) for v in diagnostics.shape(torch.zeros(3)))
    gauss = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    assert diagnostics.shape(gauss)[1] == pytest.approx(3.0, abs=0.05)
    with pytest.raises(ValueError, match="differ"):
        diagnostics.agreement(torch.ones(2), torch.ones(3))


def grad(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(10 * rank + step))
    g.view(-1)[:2] = 0.0  # exact zeros: with m = 0 at step 1 they make c exactly 0 there
    return g


SHAPES = {"a": (37,), "b": (4, 5)}


def worker_diag(rank: int, world: int, every: int) -> dict:
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    model = torch.nn.ParameterDict(params)
    opt = LionCub(
        model.parameters(), lr=0.01, betas=BETAS, variant="1bit", diagnostics_every=every, model=model
    )
    for step in (1, 2):
        for n, p in params.items():
            p.grad = grad(rank, step, SHAPES[n])
        opt.step()
    return {
        "diag": opt.last_diagnostics,
        "raw_collectives": opt.comm.counter.collectives,
        "step_collectives": opt.comm_stats()["total"]["collectives"],
    }


def test_diagnostics_on_real_ranks_match_the_recomputation() -> None:
    world = 3
    out = run_workers(worker_diag, world, 2)
    step, diag = out[0]["diag"]
    shared = ("match", "flip", "tie", "momentum_max_std")  # the same on every rank (the shape is per rank)
    assert step == 2
    for o in out:
        assert all(o["diag"][1][n][k] == diag[n][k] for n in SHAPES for k in shared)
    beta1, beta2 = BETAS
    expected_overall = {"match": 0.0, "flip": 0.0, "tie": 0.0}
    for name, shape in SHAPES.items():
        m1 = [(1 - beta2) * grad(r, 1, shape) for r in range(world)]
        c2 = [beta1 * m1[r] + (1 - beta1) * grad(r, 2, shape) for r in range(world)]
        m2 = [beta2 * m1[r] + (1 - beta2) * grad(r, 2, shape) for r in range(world)]
        full = sum(c.double() for c in c2)
        plus = sum((c >= 0).int() for c in c2)  # the 1-bit vote: "+" for c >= 0, N odd: no ties
        u = torch.sign(2 * plus - world)
        match = float((torch.sign(u.double()) == torch.sign(full)).double().mean())
        flip = float(((torch.sign(u.double()) == -torch.sign(full)) & (full != 0)).double().mean())
        tie = float((sum(torch.sign(c) for c in c2) == 0).double().mean())
        stack = torch.stack([m.double() for m in m2])
        spread = math.sqrt(float(stack.var(dim=0, unbiased=False).max()))
        got = diag[name]
        assert got["match"] == pytest.approx(match) and got["flip"] == pytest.approx(flip)
        assert got["tie"] == pytest.approx(tie)
        assert got["momentum_max_std"] == pytest.approx(spread, rel=1e-4)
        assert got["max_over_mean"] == pytest.approx(diagnostics.shape(c2[0])[0], rel=1e-5)
        for key in expected_overall:
            expected_overall[key] += {"match": match, "flip": flip, "tie": tie}[key] * math.prod(shape)
    total = sum(math.prod(s) for s in SHAPES.values())
    for key, value in expected_overall.items():
        assert diag["overall"][key] == pytest.approx(value / total)
    assert 0.5 < diag["overall"]["match"] < 1.0  # 3 workers with independent gradients: mostly agree


def test_diagnostics_add_no_collective_when_off_and_are_not_charged_to_the_step_when_on() -> None:
    off, on = run_workers(worker_diag, 2, 0)[0], run_workers(worker_diag, 2, 2)[0]
    # layout check + initial broadcast + 2 steps × (non-finite check + all-to-all + all-gather);
    # diagnostics add 3 allreduces on step 2
    assert off["raw_collectives"] == 8 and off["diag"] is None
    assert on["raw_collectives"] == 8 + 3
    assert off["step_collectives"] == on["step_collectives"] == 6


def test_diagnostics_refused_for_the_global_presets() -> None:
    assert "does not vote" in run_workers(worker_refuse, 1)[0]


def worker_refuse(rank: int, world: int) -> str:
    try:
        LionCub([torch.nn.Parameter(torch.zeros(3))], variant="16bit", diagnostics_every=1)
    except ValueError as err:
        return str(err)
    return "no error"
