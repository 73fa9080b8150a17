"""Votes laid over nodes (``VoteConfig.topology``, :mod:`lioncub.collectives.hierarchical`) on real gloo
ranks in an ``(M, L)`` device mesh, against the plain N-worker simulation (``tests/oracles.py``):

* ``hierarchical`` is bitwise the flat vote for every voting preset, at 2×2, 2×3 and 3×2;
* ``node-majority`` (1bit) is its own estimator: each node's majority with the tie rule, then the
  majority of the nodes with the tie rule — checked against that oracle, and shown to differ from flat.
"""

from __future__ import annotations

import pytest
import torch

from lioncub.optim import resolve_variant
from lioncub.optim.step_check import STEP_CHECK_WORDS
from oracles import node_majority_oracle, simulate, worker_run_presets

from processes import run_workers

#: the voting presets a hierarchical vote serves (the dense presets and the parameter server do not)
VOTES = ["1bit", "4bit", "8bit", "8bit-sign", "dlion-avg"]
#: steps of the oracle's problem (not all of :data:`oracles.STEPS`): every event of it happens by step 4
#: (step 1's exact zero directions, step 2's missing gradient, both tie parities twice, momenta)
STEPS = 4


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (2, 3), (3, 2)])
def test_hierarchical_is_bitwise_the_flat_vote(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    results = run_workers(
        worker_run_presets, world, VOTES, 0.0008, "auto", "hierarchical", nodes, False, STEPS, timeout=240
    )
    for preset in VOTES:
        want = simulate(preset, world, steps=STEPS)
        for rank in range(world):
            assert results[rank][preset]["vote"] == "HierarchicalVote"
            for i, (g, w) in enumerate(zip(results[rank][preset]["params"], want, strict=True)):
                assert torch.equal(g, w), f"{preset} {nodes}x{per_node}: rank {rank} parameter {i} differs"


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2)])
def test_node_majority_is_the_majority_of_node_majorities(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    results = run_workers(
        worker_run_presets, world, ["1bit"], 0.0008, "auto", "node-majority", nodes, False, STEPS, timeout=240
    )
    want = simulate("1bit", world, node_majority_oracle(nodes), steps=STEPS)
    for rank in range(world):
        assert results[rank]["1bit"]["vote"] == "NodeMajorityVote"
        for i, (g, w) in enumerate(zip(results[rank]["1bit"]["params"], want, strict=True)):
            assert torch.equal(g, w), f"node-majority {nodes}x{per_node}: rank {rank} parameter {i} differs"
    flat = simulate("1bit", world, steps=STEPS)
    assert any(not torch.equal(a, b) for a, b in zip(want, flat, strict=True))  # a different estimator


@pytest.mark.parametrize(
    ("variant", "topology", "fragment"),
    [
        ("32bit", "hierarchical", "topology='hierarchical' applies to the votes, not to transport='dense'"),
        ("dlion-mavo", "hierarchical", "not to transport='server'"),
        ("8bit", "node-majority", "topology='node-majority' applies to the 1-bit vote"),
        ("1bit", "ring", "topology='ring': allowed values are ['flat', 'hierarchical', 'node-majority']"),
    ],
)
def test_topologies_that_do_not_apply_are_refused(variant: str, topology: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_variant(variant, topology=topology)
    assert fragment in str(err.value)


def worker_level_bytes(rank: int, world: int, topology: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lioncub.optim import LionCub

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    p = torch.nn.Parameter(torch.zeros(1001))
    opt = LionCub([p], lr=0.1, variant=resolve_variant("1bit", topology=topology), process_group=mesh)
    p.grad = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    opt.step()
    return opt.comm_stats()["last"]


@pytest.mark.parametrize("topology", ["hierarchical", "node-majority"])
def test_bytes_per_level_match_the_wire_formats(topology: str) -> None:
    """2×2, 1bit, d = 1001 in one bucket: the bytes each rank counts per level, from the wire formats."""
    stats = run_workers(worker_level_bytes, 4, topology, timeout=60)
    d, k = 1001, 501  # k: this rank's slice, ⌈d / L⌉
    intra = d + k  # int8 node counts: ring allreduce 2·(L−1)/L·d, then all-gather of (L−1)·k int8
    # hierarchical: node counts ≤ 2, summed over 2 nodes ≤ 4: 4-bit lanes, ring 2·(M−1)/M·k/2 bytes;
    # node-majority: the 1-bit vote among M = 2 nodes, k padded to 8·M bits, 2·(M−1)/M of it
    inter = (k + 1) // 2 if topology == "hierarchical" else (-(-k // 16) * 16) / 8
    for s in stats:
        assert s["intra_node_bytes_sent"] == intra and s["inter_node_bytes_sent"] == inter
        assert (
            s["bytes_sent"] == intra + inter + 3 * 4 * STEP_CHECK_WORDS
        )  # and the step check on the flat group


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--variant", "32bit", "--topology", "hierarchical"],
            "--topology hierarchical: --variant 32bit is DDP",
        ),
        (
            ["--variant", "8bit", "--topology", "node-majority"],
            "--topology node-majority applies to the 1-bit vote (variant '1bit')",
        ),
        (
            ["--variant", "dlion-mavo", "--topology", "hierarchical"],
            "--topology hierarchical applies to the votes, not to transport='server'",
        ),
        (["--variant", "1bit", "--topology", "hierarchical", "--overlap"], "--overlap votes flat"),
    ],
)
def test_train_refuses_a_topology_that_does_not_apply(argv: list[str], fragment: str) -> None:
    import argparse

    from lioncub.cli.options import add_run_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_run_arguments(parser, "train")
    with pytest.raises(ValueError) as err:
        config_from_args(parser.parse_args(argv))
    assert fragment in str(err.value)


def _group(world: int) -> object:
    """A stand-in for rank 0's view of a group of ``world`` ranks (only its size and rank are read)."""
    from lioncub.collectives import Comm

    comm = Comm.single()
    comm.world_size = world
    return comm


@pytest.mark.parametrize(
    ("preset", "topology"), [*[(p, "hierarchical") for p in VOTES], ("1bit", "node-majority")]
)
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (2, 3), (3, 2), (4, 8)])
def test_the_cost_model_charges_the_bytes_the_vote_sends(
    topology: str, preset: str, nodes: int, per_node: int
) -> None:
    """The two-level cost model (lioncub.planning.costmodel.topology_phases) and the votes of
    lioncub.collectives.hierarchical agree on every rank's bytes per level."""
    from lioncub.optim.factory import make_vote
    from lioncub.planning import costmodel

    d = 100_003
    wide = {"bits": "auto"} if preset == "4bit" else {}  # 4-bit lanes hold at most 15 workers
    config = resolve_variant(preset, topology=topology, **wide)
    vote = make_vote(_group(nodes * per_node), config, (_group(per_node), _group(nodes)))
    phases, _ = costmodel.topology_phases(config, d, nodes, per_node, topology)
    charged = {
        level: sum(p.sent * p.count for p in phases if p.level == level) for level in ("intra", "inter")
    }
    intra, inter = vote.level_bytes(d)
    assert charged["intra"] == pytest.approx(intra) and charged["inter"] == pytest.approx(inter)


@pytest.mark.parametrize(
    ("variant", "want"), [("1bit", "flat"), ("8bit", "hierarchical"), ("4bit", "hierarchical")]
)
def test_auto_picks_the_exact_topology_with_fewer_bytes_per_nic(variant: str, want: str) -> None:
    """2 nodes × 2 ranks behind 100 Mbit/s NICs, bytes through a NIC per step of d parameters:
    1bit flat d/4 (the pairwise exchange) vs hierarchical d/2 (node counts ≤ 4 in 4-bit lanes);
    8bit flat 1.5·d (the int8 ring) vs hierarchical d (8-bit lanes); 4bit flat 0.75·d (4-bit lanes in a
    ring) vs hierarchical d/2 (4-bit lanes, ring over 2 nodes)."""
    from lioncub.planning import costmodel
    from lioncub.planning.auto import choose_topology

    inter = costmodel.Network.from_rate(100e6, 50e-6)
    cluster = costmodel.Cluster(2, 2, inter, costmodel.Network.from_rate(400e9, 5e-6))
    d = 10_000_000
    choice, reason = choose_topology(variant, d, cluster)
    flat, hier = (costmodel.predict_cluster(variant, d, cluster, t) for t in ("flat", "hierarchical"))
    assert choice == ("flat" if flat.total_s <= hier.total_s else "hierarchical") == want, reason
    assert f"topology='auto' chose {want!r} for {variant}" in reason
