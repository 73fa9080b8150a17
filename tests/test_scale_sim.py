"""The vote rules of benchmarks/scale_sim.py (N workers simulated in one process) against the N-worker
oracle the optimizer is tested with (``tests/oracles.py``: ``sim_vote``, flat 1-bit with the tie rule, 8bit
L1, dlion-avg, and ``node_majority_oracle``). scale_sim's rules are the oracle's: what this checks is its
rule names, its flattened directions split by parameter tensor (``vote``), its budgets and refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from oracles import node_majority_oracle, sim_vote

_spec = importlib.util.spec_from_file_location(
    "scale_sim", Path(__file__).resolve().parents[1] / "benchmarks" / "scale_sim.py"
)
assert _spec is not None and _spec.loader is not None
scale_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale_sim)

SEGMENTS = [37, 143, 5, 64]


def directions(n: int, seed: int) -> torch.Tensor:
    """[n, D] float32 directions with exact zeros and many exact ties of the 1-bit vote."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, sum(SEGMENTS), generator=g) * torch.rand(1, sum(SEGMENTS), generator=g).exp()
    c[:, :10] = 0.0  # exact zeros vote "+"
    c[: n // 2, 10:40] = c[: n // 2, 10:40].abs()  # half +, half −: ties at even n
    c[n // 2 :, 10:40] = -c[n // 2 :, 10:40].abs()
    return c


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("step", [1, 2])
def test_flat_rules_are_the_optimizer_oracle(n: int, step: int) -> None:
    c = directions(n, seed=10 * n + step)
    rows = list(c)
    assert torch.equal(scale_sim.majority_1bit(c, step).double(), sim_vote("1bit", rows, step, n))
    # the average in float32, as AverageVote divides in the dtype of the directions (the oracle: float64)
    assert torch.equal(scale_sim.average_of_signs(c), sim_vote("dlion-avg", rows, step, n).float())
    for rule, preset in (("1bit", "1bit"), ("avg", "dlion-avg")):  # the flattened path, split by tensor
        assert torch.equal(scale_sim.vote(rule, c, step, SEGMENTS).double(), sim_vote(preset, rows, step, n))
    # 8bit: one normaliser per parameter tensor (segment), levels ⌊127/N⌋
    want = torch.cat(
        [
            sim_vote("8bit", [r[o : o + k] for r in rows], step, n)
            for o, k in zip(offsets(), SEGMENTS, strict=True)
        ]
    )
    assert torch.equal(scale_sim.vote("8bit", c, step, SEGMENTS).double(), want)


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 3), (2, 4), (4, 1)])
@pytest.mark.parametrize("step", [1, 2])
def test_node_majority_is_the_topology_oracle(nodes: int, per_node: int, step: int) -> None:
    n = nodes * per_node
    c = directions(n, seed=nodes * 7 + per_node + step)
    want = node_majority_oracle(nodes)("1bit", list(c), step, n)
    got = scale_sim.vote(f"nm{per_node}", c, step, SEGMENTS)
    assert torch.equal(got.double(), want)
    if per_node == 1:  # one rank per node: the flat majority
        assert torch.equal(got, scale_sim.majority_1bit(c, step))


def test_budgets_and_refusals() -> None:
    assert scale_sim.rule_levels("8bit", 64) == 1 and scale_sim.rule_levels("int16-l1", 128) == 255
    assert scale_sim.check_rule("8bit", 128) is not None  # ⌊127/128⌋ = 0: refused, as lioncub does
    assert scale_sim.check_rule("nm8", 12) is not None and scale_sim.check_rule("nm4", 12) is None


def offsets() -> list[int]:
    return [sum(SEGMENTS[:i]) for i in range(len(SEGMENTS))]
