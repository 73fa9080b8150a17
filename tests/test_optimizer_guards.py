"""LionCub's guards where it used to be silent or unclear, on gloo ranks: ranks that would apply different
steps (a per-rank GradScaler, a per-rank lr), parameters it cannot vote on (tensor subclasses, sparse,
meta, complex, duplicates), exact zeros that no longer drift, state dicts named by their update rule and
stored once per rank, and the errors of a node layout that does not divide the world."""

from __future__ import annotations

import io
import os
import warnings

import pytest
import torch

from lioncub import LionCub, resolve_variant
from lioncub.ops import native
from lioncub.optim import Lion
from lioncub.optim.step_check import HyperparameterMismatchError

from processes import run_workers

# ------------------------------------------------------------------ ranks that would apply different steps


def worker_diverging(rank: int, world: int, how: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = LionCub(model.parameters(), lr=0.05, variant="1bit")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(1, 5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        if how == "lr" and step == 2 and rank == 1:
            opt.param_groups[0]["lr"] = 0.04  # a scheduler stepped on this rank only
        if how == "scaler":
            if step == 2 and rank == 1:
                loss = loss * float("inf")  # this rank's scaler backs off, the other's does not
            scaler.scale(loss).backward()
            try:
                scaler.step(opt)
            except HyperparameterMismatchError as err:
                return str(err)
            scaler.update()
        else:
            loss.backward()
            try:
                opt.step()
            except HyperparameterMismatchError as err:
                return str(err)
        opt.zero_grad(set_to_none=True)
    return "no error"


@pytest.mark.parametrize("how", ["scaler", "lr"])
def test_ranks_that_would_apply_different_steps_raise_on_every_rank(how: str) -> None:
    """A plain torch GradScaler backs off on the overflowing rank only, and a per-rank lr change: the next
    step's check names the ranks and their values on every rank, before anything is applied."""
    for rank, msg in enumerate(run_workers(worker_diverging, 2, how, timeout=60)):
        assert msg.startswith(f"rank {rank}: at optimizer step "), msg
        if how == "scaler":
            assert "rank 0: grad scale 1024.0" in msg and "rank 1: grad scale 512.0" in msg, msg
            assert "lioncub.optim.amp.GradScaler" in msg
        else:
            assert "rank(s) [1]" in msg and "lr=0.05" in msg and "lr=0.04" in msg, msg


# ------------------------------------------------------------------ what LionCub cannot vote on


def worker_dtensor(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh))
    try:
        LionCub([torch.nn.Parameter(torch.zeros(3)), sharded], lr=0.1, variant="1bit")
    except TypeError as err:
        return str(err)
    return "accepted"


def test_a_dtensor_parameter_is_refused_on_every_rank() -> None:
    """FSDP2 / tensor parallelism hand DTensors: without the mesh that says who holds which shard
    (tests/test_shards.py) refused at construction (no broadcast of a sharded tensor, no kernel reading a
    DTensor's pointer), naming the parameter and what is supported."""
    for msg in run_workers(worker_dtensor, 2, timeout=60):
        assert msg.startswith("LionCub: param_groups[0]['params'][1] is a DTensor"), msg
        assert "FSDP2's parameters: DTensors placed (Shard(0),)" in msg and "('replicate', 'shard')" in msg


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.nn.Parameter(torch.zeros(4, device="meta")), "on the meta device"),
        (lambda: torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)), "complex"),
        (lambda: torch.nn.Parameter(torch.eye(3).to_sparse()), "sparse"),
    ],
    ids=["meta", "complex", "sparse"],
)
def test_parameters_it_cannot_vote_on_are_refused_when_given(make, what: str) -> None:
    """At construction and at add_param_group (also frozen ones: they may be unfrozen later)."""
    with pytest.raises(TypeError, match=what):
        LionCub([torch.nn.Parameter(torch.zeros(2)), make()], lr=0.1)
    opt = LionCub([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    frozen = make()
    frozen.requires_grad_(False)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\] is"):
        opt.add_param_group({"params": [frozen]})
    assert len(opt.param_groups) == 1


class _Wrapped(torch.Tensor):
    """A tensor subclass (its data may live elsewhere than its pointer says)."""


def test_a_kernel_refuses_what_it_cannot_read() -> None:
    """Every fused kernel entry checks its tensors: a subclass, a non-contiguous or short tensor raises."""
    if not native.available():
        pytest.skip(f"no fused CPU kernels: {native.reason()}")
    m, g = torch.zeros(16), torch.zeros(16)
    sub = torch.Tensor._make_subclass(_Wrapped, torch.zeros(16))
    with pytest.raises(ValueError, match="_Wrapped; the fused CPU kernels take plain torch tensors"):
        native.direction(sub, g, 0.9, out=torch.zeros(16))
    with pytest.raises(ValueError, match="contiguous"):
        native.direction(m, torch.zeros(16, 2)[:, 0], 0.9, out=torch.zeros(16))
    with pytest.raises(ValueError, match="the kernel reads 16"):
        native.apply_int8(m, torch.zeros(8, dtype=torch.int8), lr=0.1, weight_decay=0.0)


def test_a_parameter_listed_twice_is_refused_by_lion_and_lioncub() -> None:
    """torch.optim only warns; the fused step would update it twice and lose its momentum. Refused before
    torch.optim's warning (which says it will be an error "in future"), in a later group too."""
    w, v = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    for cls in (Lion, LionCub):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning on the way to the refusal
            with pytest.raises(
                ValueError, match=r"param_groups\[0\]\['params'\]\[1\] is the parameter already at"
            ):
                cls([w, w], lr=0.1)
            opt = cls([w], lr=0.1)
            with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[2\] is the parameter"):
                opt.add_param_group({"params": (v, torch.nn.Parameter(torch.zeros(1)), v)})
            assert len(opt.param_groups) == 1


# ------------------------------------------------------------------ exact zeros


#: steps of the unused-rows runs: even, two of each parity (the split rule's +1 and −1 for odd N)
UNUSED_STEPS = 4


def worker_unused_rows(rank: int, world: int, variant: str) -> dict[str, torch.Tensor]:
    """Each zero rule's run (``"split"``, ``"plus"``): how far rows 4..7 moved in :data:`UNUSED_STEPS`."""
    out = {}
    for zero_vote in ("split", "plus"):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 4)  # rows 4..7 never used: their gradient is exactly zero on every rank
        opt = LionCub(emb.parameters(), lr=0.01, variant=resolve_variant(variant, zero_vote=zero_vote))
        start = emb.weight.detach().clone()
        for step in range(UNUSED_STEPS):
            ids = torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(100 * rank + step))
            emb(ids).square().sum().backward()
            opt.step()
            opt.zero_grad()
        out[zero_vote] = (emb.weight.detach() - start)[4:]
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", ["1bit", "4bit", "dlion-mavo"])
def test_rows_no_batch_used_do_not_drift(world: int, variant: str) -> None:
    """Rows whose c is exactly 0 on every rank: under the papers' rule (zeros vote "+") they walk by −lr per
    step; with ``zero_vote="split"`` (the default) they end where they started after an even number of
    steps (a tie for even N; +1 and −1 on alternate steps for odd N). Both rules in one pool call."""
    moved = run_workers(worker_unused_rows, world, variant, timeout=60)[0]
    assert float(moved["split"].abs().max()) < 1e-6, moved["split"]
    plus = moved["plus"]
    assert torch.allclose(plus, torch.full_like(plus, -0.01 * UNUSED_STEPS), atol=1e-6), plus


def test_the_zero_rule_is_an_option_of_the_one_bit_votes_only() -> None:
    with pytest.raises(ValueError, match="zero_vote='plus' applies to the one-bit votes"):
        resolve_variant("8bit", zero_vote="plus")
    with pytest.raises(ValueError, match=r"zero_vote='half': allowed values are \['split', 'plus'\]"):
        resolve_variant("1bit", zero_vote="half")


# ------------------------------------------------------------------ state dicts


def worker_sizes(rank: int, world: int) -> tuple[int, int]:
    p = torch.nn.Parameter(torch.zeros(1 << 16))
    opt = LionCub([p], lr=0.1, variant="1bit")
    p.grad = torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))
    opt.step()
    own = io.BytesIO()
    torch.save(opt.state_dict(), own)
    opt.consolidate_state_dict(to=0)
    whole = io.BytesIO()
    torch.save(opt.state_dict(), whole)
    return len(own.getvalue()), len(whole.getvalue())


def test_a_consolidated_state_holds_each_rank_once() -> None:
    """N ranks' momenta, not N + 1 (rank 0's used to be both the top level and ``ranks[0]``)."""
    own, whole = run_workers(worker_sizes, 3, timeout=60)[0]
    assert 2.95 * own < whole < 3.05 * own, (own, whole)


def worker_topologies(rank: int, world: int) -> dict[str, str]:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one node of every rank

    def make(variant: str, topology: str, zero_vote: str | None = None) -> LionCub:
        p = torch.nn.Parameter(torch.ones(6))
        opt = LionCub([p], lr=0.1, variant=resolve_variant(variant, topology=topology, zero_vote=zero_vote))
        p.grad = torch.arange(6.0) - rank
        opt.step()
        return opt

    out = {"name": make("1bit", "hierarchical").variant}
    for saved, loaded in (
        (("1bit", "flat"), ("1bit", "hierarchical")),
        (("1bit", "hierarchical"), ("1bit", "flat")),
        (("4bit", "hierarchical"), ("8bit", "hierarchical")),
        (("1bit", "flat"), ("1bit", "node-majority")),
    ):
        state = make(*saved).state_dict()
        try:
            make(*loaded).load_state_dict(state)
            out["@".join(saved) + " -> " + "@".join(loaded)] = "loaded"
        except ValueError as err:
            out["@".join(saved) + " -> " + "@".join(loaded)] = str(err)
    # version-1 states (before "rule"): the preset's name, one-bit votes with the papers' zero rule; a
    # vote over nodes was "custom"
    for saved_name, variant, topology, zeros in (
        ("1bit", "1bit", "flat", None),
        ("1bit", "1bit", "flat", "plus"),
        ("8bit", "8bit", "flat", None),
        ("custom", "1bit", "hierarchical", "plus"),
        ("custom", "1bit", "flat", "plus"),
    ):
        state = make("1bit", "flat").state_dict()
        meta = state["lioncub"]
        del meta["rule"]
        meta.update(version=1, variant=saved_name)
        try:
            make(variant, topology, zeros).load_state_dict(state)
            out[f"v1 {saved_name} -> {variant}@{topology}/{zeros}"] = "loaded"
        except ValueError as err:
            out[f"v1 {saved_name} -> {variant}@{topology}/{zeros}"] = str(err)
    return out


def test_states_are_named_by_preset_and_topology_and_load_where_the_update_is_the_same() -> None:
    res = run_workers(worker_topologies, 2, timeout=60)[0]
    assert res["name"] == "1bit@hierarchical"
    assert res["1bit@flat -> 1bit@hierarchical"] == "loaded"  # bitwise the same update
    assert res["1bit@hierarchical -> 1bit@flat"] == "loaded"
    refused = res["4bit@hierarchical -> 8bit@hierarchical"]
    assert "variant='4bit@hierarchical', this optimizer is variant='8bit@hierarchical'" in refused, refused
    assert "their updates differ" in res["1bit@flat -> 1bit@node-majority"]
    assert (
        "resume it with variant=resolve_variant('1bit', zero_vote='plus')" in res["v1 1bit -> 1bit@flat/None"]
    )
    assert res["v1 1bit -> 1bit@flat/plus"] == "loaded"
    assert res["v1 8bit -> 8bit@flat/None"] == "loaded"  # not a one-bit vote: its rule is unchanged
    assert res["v1 custom -> 1bit@hierarchical/plus"] == "loaded"
    assert "their updates differ" in res["v1 custom -> 1bit@flat/plus"]


# ------------------------------------------------------------------ node layouts


def worker_uneven_nodes(rank: int, world: int, env: dict[str, str]) -> str:
    for key, value in env.items():
        if value.startswith("per-rank:"):
            value = value.split(":")[1].split(",")[rank]
        os.environ[key] = value
    try:
        LionCub(
            [torch.nn.Parameter(torch.zeros(4))],
            lr=0.1,
            variant=resolve_variant("1bit", topology="hierarchical"),
        )
    except ValueError as err:
        return str(err)
    return "built"


@pytest.mark.parametrize(
    ("world", "env", "said"),
    [
        (3, {"LOCAL_WORLD_SIZE": "per-rank:2,2,1"}, "rank 2: $LOCAL_WORLD_SIZE='1'"),
        (2, {"LIONCUB_NNODES": "3"}, "rank 1: $LIONCUB_NNODES='3'"),
    ],
    ids=["torchrun-uneven-nodes", "more-nodes-than-ranks"],
)
def test_a_node_layout_that_does_not_divide_the_world_fails_alike_on_every_rank(world, env, said) -> None:
    """Every rank raises the same error naming each rank's setting (none is left waiting for a mesh)."""
    msgs = run_workers(worker_uneven_nodes, world, env, timeout=60)
    assert len(set(msgs)) == 1, msgs
    assert "the ranks do not agree on one node size" in msgs[0] and said in msgs[0], msgs[0]
