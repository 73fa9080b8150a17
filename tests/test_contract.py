"""LionCub keeps the ``torch.optim`` contract that training frameworks rely on (2–3 gloo ranks, against the
N-worker oracle of ``tests/oracles.py`` and ``lioncub.Lion``):

* a parameter whose gradient is ``None`` on every rank is not touched; frozen (``requires_grad_(False)``)
  mid-run, added with ``add_param_group``, unfrozen later, and partly-missing gradients (zero votes);
* the ranks agree on the step number (a rank at another step is named), hyperparameters are numbers;
* one process is exactly ``lioncub.Lion``; a GradScaler overflow on one rank skips the step on every rank;
* every rank's state survives a save from rank 0 (``consolidate_state_dict``); another rank's state is
  refused; gradients already averaged by DDP are warned about once;
* with the overlap hook, ``.grad`` changed after backward (clipping, a NaN written in) raises on every rank.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lioncub.optim import Lion, LionCub
from lioncub.optim.step_check import GradientChangedError, StepMismatchError
from oracles import ALL_PRESETS, BETAS, DENSE, local_grad, simulate_steps

from processes import run_workers

SHAPES = [(7, 5), (11,), (3, 4), (6,), (5,), (4, 2)]
LR, WD = 0.01, 0.1
HEAD_LR = 0.003
STEPS = 4  # step 3 changes the layout; step 4 is the first on the momenta of what it added/unfroze
BUCKET_MB = 1e-4  # about one parameter per bucket
#: p0 always trained; p1 frozen from step 3; p2 never used (grad None everywhere); p3 without a gradient
#: on rank 1 at step 2 (a zero vote); p4 added by add_param_group at step 3; p5 frozen at construction
#: and unfrozen at step 3


def _initial(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return [torch.randn(s, generator=g, dtype=torch.float64) + rank for s in SHAPES]


def _has_grad(rank: int, step: int, i: int) -> bool:
    if i == 1:
        return step < 3
    if i == 2:
        return False
    if i == 3:
        return not (step == 2 and rank == 1)
    if i in (4, 5):
        return step >= 3
    return True


def _grad(rank: int, step: int, i: int, p: torch.Tensor, dense_n: int) -> torch.Tensor:
    g = local_grad(rank, step, i, p, dense_n)
    return g if g is not None else torch.zeros_like(p)


def worker_contract(rank: int, world: int, presets: list[str]) -> dict:
    out = {}
    for preset in presets:
        params = [torch.nn.Parameter(p) for p in _initial(rank)]
        params[5].requires_grad_(False)
        opt = LionCub(
            [params[i] for i in (0, 1, 2, 3, 5)],
            lr=LR,
            betas=BETAS,
            weight_decay=WD,
            variant=preset,
            bucket_mb=1e-4,
        )
        dense_n = world if preset in DENSE else 0
        for step in range(1, STEPS + 1):
            if step == 3:
                params[1].requires_grad_(False)
                params[5].requires_grad_(True)
                opt.add_param_group({"params": [params[4]], "lr": HEAD_LR})
            for i, p in enumerate(params):
                # the head added at step 3 is rank-dependent until the step copies rank 0's values to every
                # rank; its first gradient is the one of rank 0's values (as from a seeded init)
                at = _initial(0)[4] if (i, step) == (4, 3) else p.detach()
                p.grad = _grad(rank, step, i, at, dense_n) if _has_grad(rank, step, i) else None
            opt.step()
        out[preset] = {
            "params": [p.detach().clone() for p in params],
            "momenta": [opt.state[p]["exp_avg"].clone() if p in opt.state else None for p in params],
        }
    return out


def simulate_contract(preset: str, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The same schedule on the N-worker oracle (``oracles.simulate_steps``): a parameter touched only on
    steps where some worker has its gradient (the others vote with zero), rank 0's initial values; the
    parameters and rank 0's momenta (None: never trained)."""
    dense_n = n if preset in DENSE else 0

    def grads(rank: int, step: int, theta: list[torch.Tensor]) -> list[torch.Tensor | None]:
        return [
            _grad(rank, step, i, p, dense_n) if _has_grad(rank, step, i) else None
            for i, p in enumerate(theta)
        ]

    def hyper(step: int, i: int) -> tuple[float, float]:
        return (HEAD_LR if i == 4 else LR), WD

    run = simulate_steps(preset, n, _initial(0), STEPS, grads, hyper)
    return run.theta, run.momentum(preset)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_unused_added_and_unfrozen_parameters_match_the_simulation(world: int) -> None:
    results = run_workers(worker_contract, world, ALL_PRESETS, timeout=240)
    start = _initial(0)
    for preset in ALL_PRESETS:
        want, want_m = simulate_contract(preset, world)
        for rank in range(world):
            got = results[rank][preset]
            for i, (g, w) in enumerate(zip(got["params"], want, strict=True)):
                assert torch.equal(g, w), f"{preset}: rank {rank} parameter {i} differs from the simulation"
            if rank == 0:  # the momenta of rank 0 (the dense presets: the one global momentum)
                for i, (g, w) in enumerate(zip(got["momenta"], want_m, strict=True)):
                    if w is None:  # never trained: no momentum, or zeros
                        assert g is None or not g.any(), (preset, i)
                    else:
                        assert torch.equal(g, w), (preset, i)
        # the never-used parameter did not move (no decay, no vote of "+" on ties)
        assert torch.equal(results[0][preset]["params"][2], start[2]), preset


def worker_step_mismatch(rank: int, world: int) -> str:
    p = torch.nn.Parameter(torch.ones(8))
    opt = LionCub([p], lr=0.1, variant="1bit")
    saved = None
    for step in range(1, 4):
        p.grad = torch.full_like(p, float(rank + 1))
        try:
            opt.step()
        except StepMismatchError as err:
            return str(err)
        if step == 1:
            saved = opt.state_dict()
        if step == 2 and rank == 1:
            opt.load_state_dict(saved)  # this rank went back one step (an older checkpoint)
    return "no error"


def test_ranks_at_different_steps_are_named_with_both_step_numbers() -> None:
    errors = run_workers(worker_step_mismatch, 2, timeout=60)
    assert "rank 0: this rank is at optimizer step 3, rank(s) [1] at step(s) [2]" in errors[0]
    assert "rank 1: this rank is at optimizer step 2, rank(s) [0] at step(s) [3]" in errors[1]


def worker_layout_mismatch(rank: int, world: int) -> str:
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    opt = LionCub([a, b], lr=0.1, variant="8bit")
    if rank == 1:
        b.requires_grad_(False)
    a.grad, b.grad = torch.ones(4), torch.ones(3)
    try:
        opt.step()
    except StepMismatchError as err:
        return str(err)
    return "no error"


def test_ranks_that_freeze_different_parameters_are_named() -> None:
    errors = run_workers(worker_layout_mismatch, 2, timeout=60)
    assert "rank(s) [1] optimize a different list of parameters at step 1" in errors[0]
    assert "rank(s) [0] optimize a different list of parameters" in errors[1]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lr": "1e-3"}, "Invalid lr: '1e-3'"),
        ({"weight_decay": "0"}, "Invalid weight_decay"),
        ({"betas": ("0.9", 0.99)}, "Invalid betas[0]"),
    ],
)
def test_hyperparameters_must_be_numbers(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        LionCub([torch.nn.Parameter(torch.ones(2))], **kwargs)
    assert fragment in str(err.value)
    with pytest.raises(ValueError) as err:
        Lion([torch.nn.Parameter(torch.ones(2))], **kwargs)
    assert fragment in str(err.value)


def test_a_string_lr_set_later_is_refused_before_the_step() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = LionCub([p], lr=0.1)
    opt.param_groups[0]["lr"] = "1e-3"
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="Invalid lr: '1e-3'"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2))


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_one_process_is_exactly_lion(preset: str) -> None:
    """No process group: every preset is lioncub.Lion, bit for bit (params and momenta)."""
    g = torch.Generator().manual_seed(5)
    shapes = [(9, 4), (4,), (3,)]
    a = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    cub = LionCub(a, lr=0.01, weight_decay=0.1, variant=preset)
    lion = Lion(b, lr=0.01, weight_decay=0.1)
    assert cub.single_process
    for step in range(4):
        for x, y in zip(a, b, strict=True):
            grad = torch.randn(x.shape, generator=g)
            grad.view(-1)[:2] = 0.0  # exact zeros: Lion's sign(0) = 0 update
            x.grad, y.grad = (grad.clone(), grad.clone()) if step != 2 else (None, None)
        cub.step()
        lion.step()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
        assert torch.equal(cub.state[x]["exp_avg"], lion.state[y]["exp_avg"])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", [0, 37])  # in the vectorised body, in the scalar tail
def test_one_process_skips_a_non_finite_step(bad: float, where: int) -> None:
    """No process group: a NaN/Inf gradient anywhere skips the step (nothing applied, the momentum kept)
    and the next finite step is Lion's again."""
    p = torch.nn.Parameter(torch.randn(38, generator=torch.Generator().manual_seed(1)))
    q = torch.nn.Parameter(p.detach().clone())
    cub, lion = LionCub([p], lr=0.01, variant="1bit"), Lion([q], lr=0.01)
    p.grad, q.grad = torch.ones(38), torch.ones(38)
    cub.step(), lion.step()
    before = p.detach().clone(), cub.state[p]["exp_avg"].clone()
    p.grad = torch.ones(38)
    p.grad[where] = bad
    cub.step()
    assert torch.equal(p.detach(), before[0]) and torch.equal(cub.state[p]["exp_avg"], before[1])
    assert cub.comm_stats()["total"]["skipped_steps"] == 1
    p.grad, q.grad = -torch.ones(38), -torch.ones(38)
    cub.step(), lion.step()
    assert torch.equal(p, q) and torch.equal(cub.state[p]["exp_avg"], lion.state[q]["exp_avg"])


def worker_grad_scaler(rank: int, world: int, agreeing: bool) -> dict:
    from lioncub.optim.amp import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = LionCub(model.parameters(), lr=0.05, variant="1bit")
    scaler = (GradScaler if agreeing else torch.amp.GradScaler)("cpu", init_scale=2.0**10)
    skipped = []
    for step in range(1, 5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        if step == 2 and rank == 1:
            loss = loss * float("inf")  # only this rank's gradients overflow
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    return {
        "skipped": skipped,
        "params": [p.detach().clone() for p in model.parameters()],
        "total_skipped": opt.comm_stats()["total"]["skipped_steps"],
        "scale": scaler.get_scale(),
    }


def test_a_grad_scaler_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    """lioncub.optim.amp.GradScaler: the step is skipped on every rank and both scalers back off (torch's
    own scaler backs off on the overflowing rank only, and the next step's check then raises on every rank:
    tests/test_optimizer_guards.py)."""
    results = run_workers(worker_grad_scaler, 2, True, timeout=60)
    for res in results:
        assert res["skipped"] == [False, True, False, False]
        assert res["total_skipped"] == 1
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert [res["scale"] for res in results] == [512.0, 512.0]


def worker_consolidate(rank: int, world: int) -> dict:
    p = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    opt = LionCub([p], lr=0.1, variant="8bit")
    for step in range(1, 3):
        p.grad = torch.arange(5, dtype=torch.float64) * (rank + 1) - step
        opt.step()
    own = opt.state[p]["exp_avg"].clone()
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict()  # what a framework saves on rank 0
    plain = LionCub(
        [torch.nn.Parameter(torch.ones(5, dtype=torch.float64))], lr=0.1, variant="8bit"
    ).state_dict()
    # every rank loads the file rank 0 wrote
    objs = [saved if rank == 0 else None]
    torch.distributed.broadcast_object_list(objs, src=0)
    q = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    fresh = LionCub([q], lr=0.1, variant="8bit")
    fresh.load_state_dict(objs[0])
    out = {
        "own": own,
        "loaded": fresh.state[q]["exp_avg"].clone(),
        "step": fresh.global_step,
        "has_ranks": "ranks" in saved["lioncub"],
        "sent_per_step": opt.comm_stats()["last"]["bytes_sent"],
    }
    for step in range(3, 5):  # the resumed run's steps: its totals count them alone, not the restored 2
        q.grad = torch.arange(5, dtype=torch.float64) * (rank + 1) - step
        fresh.step()
    out["resumed_total"] = fresh.comm_stats()["total"]
    other = [plain if rank == 0 else None]
    torch.distributed.broadcast_object_list(other, src=0)
    try:
        LionCub(
            [torch.nn.Parameter(torch.ones(5, dtype=torch.float64))], lr=0.1, variant="8bit"
        ).load_state_dict(other[0])
        out["other_rank"] = "loaded"
    except ValueError as err:
        out["other_rank"] = str(err)
    return out


def test_every_rank_state_survives_a_save_from_rank_zero() -> None:
    """Each rank's momenta through rank 0's consolidated file; the resumed optimizer's ``comm_stats``
    totals count its own steps (bytes / steps stays a per-step rate, which the frameworks' logs use)."""
    results = run_workers(worker_consolidate, 2, timeout=60)
    assert results[0]["has_ranks"] and not results[1]["has_ranks"]
    assert not torch.equal(results[0]["own"], results[1]["own"])  # the momenta are per rank
    for res in results:
        assert torch.equal(res["loaded"], res["own"]) and res["step"] == 2
        total = res["resumed_total"]  # bytes per step after a resume: 2 steps' bytes over 2 steps
        assert total["steps"] == 2 and total["bytes_sent"] == 2 * res["sent_per_step"] > 0
    assert results[0]["other_rank"] == "loaded"
    assert "rank 1: this optimizer state was saved by rank 0" in results[1]["other_rank"]
    assert "consolidate_state_dict(to=0)" in results[1]["other_rank"]


def worker_averaged(rank: int, world: int, skip: bool) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.optim.ddp import skip_gradient_allreduce

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(5, 2))
    if skip:
        skip_gradient_allreduce(model)
    opt = LionCub(model.parameters(), lr=0.01, variant="1bit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank * 10 + step))
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "already averaged" in str(w.message)]


def test_gradients_averaged_by_ddp_are_warned_about_once() -> None:
    warned = run_workers(worker_averaged, 2, False, timeout=60)
    assert len(warned[0]) == 1 and "skip_gradient_allreduce" in warned[0][0] and warned[1] == []
    assert run_workers(worker_averaged, 2, True, timeout=60) == [[], []]


def worker_overlap_hazards(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for hazard in ("clip", "nan", "scaler", "bf16"):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)))
        opt = LionCub(model.parameters(), lr=0.01, variant="8bit")
        opt.overlap_with(model)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        try:
            if hazard == "bf16":
                for _ in range(2):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(x).float().square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                out[hazard] = [p.detach().clone() for p in model.parameters()]
                continue
            if hazard == "scaler":
                scaler = torch.amp.GradScaler("cpu")
                scaler.scale(model(x).square().mean()).backward()
                scaler.step(opt)
            else:
                model(x).square().mean().backward()
                if hazard == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                elif rank == 1:
                    next(model.parameters()).grad[0, 0] = float("nan")
                opt.step()
            out[hazard] = "no error"
        except (GradientChangedError, RuntimeError) as err:
            out[hazard] = f"{type(err).__name__}: {err}"
        opt.overlap_hook.close()
    return out


def test_overlap_refuses_gradients_changed_after_backward() -> None:
    results = run_workers(worker_overlap_hazards, 2, timeout=90)
    for res in results:
        assert res["clip"].startswith("GradientChangedError") and "on rank(s) [0, 1]" in res["clip"]
        assert "skip_gradient_allreduce" in res["clip"]
        # a NaN written into rank 1's .grad after backward: named on both ranks, nothing applied
        assert res["nan"].startswith("GradientChangedError") and "on rank(s) [1]" in res["nan"], res["nan"]
        assert "GradScaler (fp16) with overlap_with()" in res["scaler"]
    for a, b in zip(results[0]["bf16"], results[1]["bf16"], strict=True):
        assert torch.equal(a, b) and torch.isfinite(a).all()
