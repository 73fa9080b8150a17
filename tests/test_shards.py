"""The vote on shards (issue 46, item 1): :class:`LionCub` over FSDP2's parameters, each rank voting on its
local shards with the ranks that hold the same shard in the other replicas (:mod:`lioncub.optim.shards`).

The oracle: on 2 replicas × 2 shards, every rank also keeps the whole model and steps an unsharded
:class:`LionCub` over the same two voters (its ``"replicate"`` group) on the whole gradients — each replica's
mean gradient as FSDP2 reduce-scattered it, gathered (``full_tensor()``'s bits, in one all-gather:
:func:`_whole_grads`). The sharded parameters and momenta must equal the unsharded ones bit for bit, after
every step, for every preset, quantizers with per-tensor and per-chunk norms, local steps and momentum sync.
The model's first-dim sizes are uneven (shards of 4 and 3 rows, and an empty shard: ``Linear(5, 1)``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lioncub.optim import PRESETS, Checks, Lion, LionCub
from lioncub.optim.config import resolve_variant
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.shards import SHARD_DIMS, shard_piece
from lioncub.optim.sync import MomentumSync

from processes import run_workers

#: steps of a case: the first (zero momenta; the 1-bit tie rule's odd parity) and one on momenta (the even
#: parity), checked after each; a case whose events need more says so (``steps`` in :data:`EXTRA`)
STEPS = 2

#: (name, LionCub keyword options) of the cases beyond the presets; ``nan_at``: the step at which shard
#: rank 1 of replica 0 finds a NaN in its gradient (every rank skips that step, as the unsharded vote does);
#: ``steps``: 4 where a case's events need them (two windows of h=2, two syncs every 2, a NaN at step 2
#: then a window's end), 3 for a NaN at step 1 (a step after the skipped one), else :data:`STEPS`
EXTRA: list[tuple[str, dict[str, Any]]] = [
    ("8bit chunk_size=8", {"variant": resolve_variant("8bit", chunk_size=8)}),
    ("8bit linf", {"variant": resolve_variant("8bit", quantizer="linf")}),
    ("8bit l0", {"variant": resolve_variant("8bit", quantizer="l0")}),
    ("4bit-l1 lanes", {"variant": resolve_variant("8bit", bits=4)}),
    ("8bit qsgd", {"variant": resolve_variant("8bit", quantizer="qsgd")}),
    (
        "1bit local_steps h=2, reloaded",
        {"variant": "1bit", "local_steps": LocalSteps(h=2), "reload_at": 0, "steps": 4},
    ),
    ("8bit local_steps h=2", {"variant": "8bit", "local_steps": LocalSteps(h=2), "steps": 4}),
    (
        "32bit local_steps diloco",
        {"variant": "32bit", "local_steps": LocalSteps(h=2, outer="diloco"), "steps": 4},
    ),
    (
        "4bit momentum_sync all",
        {"variant": "4bit", "momentum_sync": MomentumSync("all", every=2), "steps": 4},
    ),
    ("8bit a bucket per tensor (empty ones)", {"variant": "8bit", "bucket_mb": 1e-6}),
    ("8bit buckets of 50 elements", {"variant": "8bit", "bucket_mb": 200 / 2**20}),  # cut by whole shards
    ("1bit a bucket per tensor (empty ones)", {"variant": "1bit", "bucket_mb": 1e-6}),
    ("dlion-mavo a bucket per tensor", {"variant": "dlion-mavo", "bucket_mb": 1e-6}),
    (
        "8bit NaN, replica check",
        {"variant": "8bit", "nan_at": 1, "checks": Checks(replica_check_every=1), "steps": 3},
    ),
    ("1bit local_steps NaN", {"variant": "1bit", "local_steps": LocalSteps(h=2), "nan_at": 2, "steps": 4}),
]


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial values on every rank, sharded or whole
    return nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))


def _loss(model: nn.Module, step: int, replica: int, shard: int) -> torch.Tensor:
    """A loss on data that differs per step, replica and shard rank."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica + shard)
    x, y = torch.randn(6, 13, generator=g), torch.randn(6, 1, generator=g)
    return nn.functional.mse_loss(model(x), y)


def _sharded(mesh: Any) -> nn.Sequential:
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


def _differences(name: str, step: int, sharded: LionCub, whole: LionCub) -> list[str]:
    """Where this rank's shards differ from the whole model's rows (parameters and momenta)."""
    assert sharded.shards is not None
    out = []
    params = [p for g in sharded.param_groups for p in g["params"]]
    wholes = [p for g in whole.param_groups for p in g["params"]]
    for i, (p, w) in enumerate(zip(params, wholes, strict=True)):
        assert isinstance(p, DTensor)
        piece = shard_piece(p.shape, sharded.shards.shards, sharded.shards.shard_rank)
        rows = slice(piece.start, piece.start + piece.counts[sharded.shards.shard_rank])
        if not torch.equal(p.to_local().reshape(-1), w.detach().reshape(-1)[rows]):
            out.append(f"{name} step {step}: parameter {i}")
        m, wm = sharded.state[p].get("exp_avg"), whole.state[w].get("exp_avg")
        if (m is None) != (wm is None) or (
            m is not None and not torch.equal(m.reshape(-1), wm.reshape(-1)[rows])
        ):
            out.append(f"{name} step {step}: momentum {i}")
    return out


def _share_differences(name: str, step: int, shared: LionCub, whole: LionCub) -> list[str]:
    """Where the model of DDP inside the shard dimension differs from the whole model (every parameter,
    after the shares' broadcast), and its momenta from the whole model's (this rank's share; none
    elsewhere)."""
    assert shared.shares is not None
    out = []
    params = [p for g in shared.param_groups for p in g["params"]]
    wholes = [p for g in whole.param_groups for p in g["params"]]
    for i, (p, w) in enumerate(zip(params, wholes, strict=True)):
        if not torch.equal(p, w):
            out.append(f"{name} step {step}: DDP inside, parameter {i}")
        m, wm = shared.state.get(p, {}).get("exp_avg"), whole.state[w].get("exp_avg")
        if not shared.shares.owns(p):
            wm = None  # another rank of the replica votes on it
        if (m is None) != (wm is None) or (m is not None and not torch.equal(m, wm)):
            out.append(f"{name} step {step}: DDP inside, momentum {i}")
    return out


def _whole_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each DTensor parameter's gradient, whole, as ``p.grad.full_tensor()`` gathers it (the same bits,
    shape and strides), for every parameter in one all-gather over the shard group: each rank's dim-0 chunk
    (``torch.chunk``'s, ⌈D/S⌉ rows) zero-padded to ⌈D/S⌉ rows. One collective instead of a DTensor
    redistribution per tensor (~15 % of the worker's CPU; this, ~3 %)."""
    shards = dist.get_world_size(group)
    pieces = []
    for p in params:
        assert isinstance(p.grad, DTensor)
        local = p.grad.to_local()
        padded = local.new_zeros((-(-p.shape[0] // shards), *p.shape[1:]))
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
    flat = torch.cat(pieces)
    gathered = flat.new_empty(shards * flat.numel())
    dist.all_gather_single(gathered, flat, group=group)
    out, pos = [], 0
    for p, piece in zip(params, pieces, strict=True):
        rows = gathered.view(shards, -1)[:, pos : pos + piece.numel()].reshape(-1, *p.shape[1:])
        out.append(rows[: p.shape[0]].clone(memory_format=torch.contiguous_format))  # the chunks in order
        pos += piece.numel()
    return out


def _restart(models: tuple[nn.Module, ...], initial: list[list[torch.Tensor]]) -> None:
    """The models back to their values when built (``initial``: each one's, the sharded model's local
    shards as FSDP2 cut them), without gradients."""
    with torch.no_grad():
        for model, values in zip(models, initial, strict=True):
            for p, value in zip(model.parameters(), values, strict=True):
                (p.to_local() if isinstance(p, DTensor) else p).copy_(value)
                p.grad = None


def worker_parity(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]], steps: int) -> list[str]:
    """The sharded vote (FSDP2) and DDP inside the shard dimension (plain parameters, each rank voting
    on its share of whole tensors) against the unsharded vote of the two replicas' mean gradients;
    ``steps`` steps per case, or the case's own ``"steps"``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    # the three models are built (and FSDP2 initialised) once, each case starting from their initial values
    models = model, whole, plain = _sharded(mesh), _model(), _model()
    initial = [
        [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in m.parameters()]
        for m in models
    ]
    bad: list[str] = []
    for name, options in cases:
        _restart(models, initial)
        kwargs = dict(lr=0.01, weight_decay=0.1, **options)
        nan_at, reload_at = kwargs.pop("nan_at", None), kwargs.pop("reload_at", None)
        case_steps = kwargs.pop("steps", steps)
        opt = LionCub(model.parameters(), process_group=mesh, **kwargs)
        ref = LionCub(whole.parameters(), process_group=mesh.get_group("replicate"), **kwargs)
        shared = LionCub(plain.parameters(), process_group=mesh, **kwargs)
        for step in range(case_steps):
            _loss(model, step, replica, shard).backward()
            if step == nan_at and (replica, shard) == (0, 1):
                next(model.parameters()).grad.to_local()[0, 0] = float("nan")  # type: ignore[union-attr]
            grads = _whole_grads(list(model.parameters()), mesh.get_group("shard"))
            for g, w, d in zip(grads, whole.parameters(), plain.parameters(), strict=True):
                w.grad = g  # the replica's mean gradient, whole
                d.grad = g.clone()  # as DDP inside the shard group would average it
            for o in (opt, ref, shared):
                o.step()
                o.zero_grad()
            if step == reload_at:  # a state dict of a window's middle, loaded back
                for o in (opt, ref, shared):
                    o.load_state_dict(copy.deepcopy(o.state_dict()))
            bad += _differences(name, step, opt, ref)
            if shared.config.quantizer != "qsgd":  # a share's tensors draw a stream of their own
                bad += _share_differences(name, step, shared, ref)
        if shared.shares is not None and not any(p in shared.state for p in plain.parameters()):
            bad.append(f"{name}: shard rank {shard} owns no tensor: the model does not test the shares")
        if not bad and not any(p.to_local().numel() == 0 for p in model.parameters()) and shard == 1:
            bad.append("no empty shard: the model does not test one")
        skipped = opt.comm_stats()["total"]["skipped_steps"]  # local steps: the NaN's replica only
        if shared.comm_stats()["total"]["skipped_steps"] != skipped:
            bad.append(f"{name}: {skipped} steps skipped on shards, DDP inside skipped otherwise")
        if ref.comm_stats()["total"]["skipped_steps"] != skipped or (
            replica == 0 and skipped != (nan_at is not None)
        ):
            bad.append(f"{name}: {skipped} steps skipped on shards, the unsharded vote skipped otherwise")
    return bad


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_the_vote_on_shards_is_the_unsharded_vote_bit_for_bit() -> None:
    """Every preset, :data:`STEPS` steps each on 2 replicas × 2 shards (one pool call)."""
    cases = [(name, {"variant": name}) for name in PRESETS]
    results = run_workers(worker_parity, 4, cases, STEPS, timeout=240)
    assert [r for r in results if r] == []


@pytest.mark.slow
def test_quantizers_local_steps_momentum_sync_and_nan_on_shards_are_the_unsharded_vote() -> None:
    """Quantizers with per-tensor and per-chunk norms, stochastic levels, local steps (two windows),
    momentum sync, a NaN on one shard rank (every rank skips), the replica check: :data:`STEPS` steps
    each, 3 for a step after a NaN, 4 for local steps, momentum sync and the NaN in a window
    (:data:`EXTRA`)."""
    results = run_workers(worker_parity, 4, EXTRA, STEPS, timeout=240)
    assert [r for r in results if r] == []


def test_the_shard_pieces_are_fsdp2s_dim0_chunks() -> None:
    assert shard_piece((7, 13), 2, 0).counts == (52, 39)
    assert shard_piece((7, 13), 2, 1).start == 52
    assert shard_piece((1, 5), 2, 1).counts == (5, 0)
    assert shard_piece((3,), 4, 3).counts == (1, 1, 1, 0)
    assert shard_piece((0, 4), 2, 0).counts == (0, 0)


def _message(make: Any) -> str:
    try:
        make()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _load_share(params: list[nn.Parameter], mesh: Any, *, whole: bool) -> None:
    """A state of DDP inside the shard dimension (a share's) into an optimizer of the whole model, or the
    other way round."""
    shares = LionCub(params, process_group=mesh)
    plain = LionCub(params, process_group=mesh.get_group("replicate"))
    (plain if whole else shares).load_state_dict((shares if whole else plain).state_dict())


def worker_refusals(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    nodes = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    t = torch.zeros(4, 6)

    def dt(placement: Any, on: Any = None) -> nn.Parameter:
        return nn.Parameter(distribute_tensor(t, on or mesh["shard"], [placement]))

    model = _sharded(mesh)
    params = list(model.parameters())
    plain = [nn.Parameter(torch.zeros(3))]

    def cast() -> None:
        cast_model = _sharded(mesh)
        opt = LionCub(cast_model.parameters(), process_group=mesh)
        cast_model.double()
        opt.step()

    return {
        "cast after": _message(cast),
        "no mesh": _message(lambda: LionCub(params)),
        "node mesh": _message(lambda: LionCub(params, process_group=nodes)),
        "replicate": _message(lambda: LionCub([dt(Replicate())], process_group=mesh)),
        "shard(1)": _message(lambda: LionCub([dt(Shard(1))], process_group=mesh)),
        "other mesh": _message(lambda: LionCub([dt(Shard(0), mesh["replicate"])], process_group=mesh)),
        "mixed": _message(lambda: LionCub(params + plain, process_group=mesh)),
        "shares over nodes": _message(
            lambda: LionCub(
                plain, process_group=mesh, variant=resolve_variant("1bit", topology="hierarchical")
            )
        ),
        "a share's state, whole": _message(lambda: _load_share(plain, mesh, whole=True)),
        "a whole state, shares": _message(lambda: _load_share(plain, mesh, whole=False)),
        "hierarchical": _message(
            lambda: LionCub(
                params, process_group=mesh, variant=resolve_variant("1bit", topology="hierarchical")
            )
        ),
        "diagnostics": _message(
            lambda: LionCub(params, process_group=mesh, variant="1bit", diagnostics_every=1)
        ),
        "overlap": _message(lambda: LionCub(params, process_group=mesh).overlap_with(None)),  # type: ignore[arg-type]
        "added plain group": _message(
            lambda: LionCub(params, process_group=mesh).add_param_group({"params": plain})
        ),
        "other dims": _message(
            lambda: LionCub(plain, process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
        ),
    }


def test_what_is_not_a_shard_of_the_mesh_is_refused_naming_what_is_supported() -> None:
    (messages, *_) = run_workers(worker_refusals, 4, timeout=120)
    supported = "DTensors placed (Shard(0),) on the 'shard' dimension"
    expected = {
        "cast after": ("RuntimeError", "became torch.float64 on cpu after LionCub was built", "build"),
        "no mesh": (
            "TypeError",
            "['params'][0] is a DTensor (6 of the 6 parameters are) and process_group=None does not say",
            supported,
        ),
        "node mesh": ("TypeError", "a DeviceMesh with dims ('node', 'local') does not say", supported),
        "replicate": ("TypeError", "placed (Replicate(),)", supported),
        "shard(1)": ("TypeError", "placed (Shard(dim=1),)", supported),
        "other mesh": ("ValueError", "on the mesh [0, 2]", supported),
        "mixed": (
            "TypeError",
            "LionCub: param_groups[0]['params'][6] is a plain Parameter of shape (3,) among DTensor",
            supported,
        ),
        "shares over nodes": (
            "ValueError",
            "topology='hierarchical' on a ('replicate', 'shard') mesh's shares",
            "",
        ),
        "a share's state, whole": ("ValueError", "holds the momenta of share ", "votes on the whole model"),
        "a whole state, shares": ("ValueError", "holds the momenta of the whole model", " votes on share "),
        "hierarchical": ("ValueError", "topology='hierarchical' on sharded parameters", ""),
        "diagnostics": ("ValueError", "diagnostics_every=1", ""),
        "overlap": ("ValueError", "overlap_with: the parameters are FSDP2's shards", ""),
        "added plain group": ("TypeError", "param_groups[1]['params'][0] is a plain Parameter", supported),
        "other dims": ("ValueError", "('replicate', 'shard') for FSDP2's parameters", "('a', 'b')"),
    }
    assert set(messages) == set(expected)
    for case, parts in expected.items():
        for part in parts:
            assert part in messages[case], (case, messages[case])


def worker_one_replica(rank: int, world: int, steps: int) -> list[str]:
    """One replica of 4 shards (a mesh (1, 4)): no vote, each rank's Lion step on its shards, which
    together are :class:`Lion`'s step on the whole model (``Linear(5, 1)``: three empty shards)."""
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=SHARD_DIMS)
    model, whole = _sharded(mesh), _model()
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, process_group=mesh)
    ref = Lion(whole.parameters(), lr=0.01, weight_decay=0.1)
    assert opt.single_process
    bad = []
    for step in range(steps):
        _loss(model, step, 0, rank).backward()
        for p, w in zip(model.parameters(), whole.parameters(), strict=True):
            w.grad = p.grad.full_tensor()  # type: ignore[union-attr]
        opt.step()
        ref.step()
        opt.zero_grad()
        for i, (p, w) in enumerate(zip(model.parameters(), whole.parameters(), strict=True)):
            if not torch.equal(p.full_tensor(), w.detach()):  # type: ignore[attr-defined]
                bad.append(f"step {step}: parameter {i}")
    return bad


def test_one_replica_of_shards_is_lion_on_the_whole_model() -> None:
    assert run_workers(worker_one_replica, 4, STEPS, timeout=120) == [[]] * 4


def worker_broadcast_init(rank: int, world: int) -> list[bool]:
    """Replicas initialised differently: LionCub's initial broadcast writes replica 0's shards into every
    replica's FSDP2 storage (the model's own ``to_local()`` and the next forward's gathered weights)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    replica = mesh["replicate"].get_local_rank()
    torch.manual_seed(replica)
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    LionCub(model.parameters(), process_group=mesh)
    group = mesh.get_group("replicate")
    same = []
    for p in model.parameters():
        local = p.to_local().contiguous()  # type: ignore[attr-defined]
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=group)
        same.append(torch.equal(both[0], both[1]))
    out = model(torch.ones(1, 13)).detach()
    outs = [torch.empty_like(out) for _ in range(2)]
    dist.all_gather(outs, out, group=group)
    return [*same, torch.equal(outs[0], outs[1])]


def test_the_initial_broadcast_writes_replica_0s_shards_into_fsdp2s_storage() -> None:
    for same in run_workers(worker_broadcast_init, 4, timeout=120):
        assert all(same), same


def worker_ddp_inside(rank: int, world: int) -> list[str]:
    """DDP inside the shard dimension as docs/shards.md says it: replicas initialised differently, each
    wrapped in DDP over its ``"shard"`` group (its allreduce kept), ``LionCub(process_group=mesh)``; the
    reference: one plain model per rank started from replica 0's values, its gradient the replica's
    mean (an all-reduce over the shard group, halved), the unsharded vote over ``"replicate"``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    torch.manual_seed(replica)
    ddp = nn.parallel.DistributedDataParallel(_model(), process_group=mesh.get_group("shard"))
    opt = LionCub(ddp.parameters(), lr=0.01, weight_decay=0.1, variant="1bit", process_group=mesh)
    whole = _model()  # seed 0: replica 0's values
    ref = LionCub(
        whole.parameters(),
        lr=0.01,
        weight_decay=0.1,
        variant="1bit",
        process_group=mesh.get_group("replicate"),
    )
    bad = []
    for step in range(3):
        _loss(ddp, step, replica, shard).backward()
        _loss(whole, step, replica, shard).backward()
        for w in whole.parameters():
            assert w.grad is not None
            dist.all_reduce(w.grad, group=mesh.get_group("shard"))
            w.grad /= 2
        for o in (opt, ref):
            o.step()
            o.zero_grad()
        bad += [
            f"step {step}: parameter {i}"
            for i, (p, w) in enumerate(zip(ddp.parameters(), whole.parameters(), strict=True))
            if not torch.equal(p, w)
        ]
    return bad


def test_ddp_inside_the_shard_dimension_is_the_unsharded_vote_of_the_replicas_means() -> None:
    assert run_workers(worker_ddp_inside, 4, timeout=120) == [[]] * 4


RECIPE = Path(__file__).resolve().parent.parent / "docs" / "shards.md"


def worker_recipe(rank: int, world: int, code: str) -> list[str]:
    """docs/shards.md's recipe as written (its ``train``), 3 steps: the two replicas' shards agree."""
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(code, str(RECIPE), "exec"), namespace)
    model = namespace["train"](replicas=2, steps=3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    replicate = mesh.get_group("replicate")
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local().contiguous()
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=replicate)
        if not torch.equal(both[0], both[1]) or not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def test_the_docs_recipe_runs_and_keeps_the_replicas_equal() -> None:
    code = re.search(r"```python\n(.*?)```", RECIPE.read_text(), re.S)
    assert code is not None, "docs/shards.md has no python recipe"
    assert run_workers(worker_recipe, 4, code.group(1), timeout=120) == [[]] * 4


def test_plain_parameters_have_no_view_of_shards() -> None:
    """One process, plain parameters: the optimizer's parts see its own param groups and state."""
    opt = LionCub([nn.Parameter(torch.zeros(3))], lr=0.1)
    assert opt.shards is None and opt.ctx.optimizer is opt
