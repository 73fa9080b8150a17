"""Local steps (``LionCub(local_steps=LocalSteps(...))``) on gloo ranks against the N-worker oracle
(``oracles.simulate_local``), bit for bit: H inner Lion steps per rank, then the outer step of each rule
(vote through every voting preset, hierarchical at 2×2, dsm, diloco), H = 1 included; every rank's
parameters and states after a resume in the middle of a window; a non-finite inner step on one rank; one
process is Lion."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub import Lion, LionCub, LocalSteps, resolve_variant
from oracles import BETAS, initial_params, local_grad, lr_factor, param_groups, simulate_local

from processes import run_workers

VOTES = ["1bit", "4bit", "8bit", "8bit-sign", "dlion-avg", "dlion-mavo"]
STEPS = 7  # windows of H = 3 end at steps 3 and 6; step 7 is inside the third


def worker_local(
    rank: int,
    world: int,
    variant: str,
    outer: str,
    h: int,
    outer_lr: float,
    topology: str,
    stop: int,
    inner_momentum: str = "reset",
) -> dict:
    """``STEPS`` steps of local steps on this rank (a resume after ``stop`` steps when ``stop``)."""
    group = None
    if topology != "flat":
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("node", "local"))

    def build() -> tuple[list[torch.nn.Parameter], LionCub, torch.optim.lr_scheduler.LambdaLR]:
        params = [torch.nn.Parameter(p) for p in initial_params(rank)]
        opt = LionCub(
            param_groups(params),
            betas=BETAS,
            variant=resolve_variant(variant, topology=topology),
            process_group=group,
            local_steps=LocalSteps(h=h, outer=outer, outer_lr=outer_lr, inner_momentum=inner_momentum),
        )
        return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    params, opt, sched = build()
    for step in range(1, STEPS + 1):
        if step == stop + 1 and stop:  # a resume in the middle of a window: new objects, saved states
            states = (opt.state_dict(), sched.state_dict())
            # the model as a framework saves it, once for all ranks: rank 0's replica, loaded on every rank
            # before the optimizer; the optimizer's state puts back this rank's own
            model_file = [p.detach().clone() for p in params]
            dist.broadcast_object_list(holder := [model_file], src=0, group=None)
            params, opt, sched = build()
            with torch.no_grad():
                for p, saved in zip(params, holder[0], strict=True):
                    p.copy_(saved)
            opt.load_state_dict(states[0])
            sched.load_state_dict(states[1])
        for i, p in enumerate(params):
            p.grad = local_grad(rank, step, i, p.detach())
        opt.step()
        sched.step()
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    return {"params": [p.detach().clone() for p in params], "state": state, "stats": opt.comm_stats()}


CASES = [
    *[(v, "vote", 3, 2) for v in VOTES],
    *[(v, "vote", 3, 3) for v in ("1bit", "4bit", "8bit")],
    ("1bit", "vote", 1, 2),  # H = 1: a vote on each rank's own Lion step, not the per-step vote
    ("32bit", "dsm", 3, 3),
    ("16bit", "dsm", 2, 2),
    ("32bit", "diloco", 3, 3),
    ("16bit", "diloco", 3, 2),
]


@pytest.mark.parametrize(
    ("variant", "outer", "h", "world"), CASES, ids=[f"{v}-{o}-h{h}-n{n}" for v, o, h, n in CASES]
)
def test_local_steps_match_the_simulation_on_every_rank(variant: str, outer: str, h: int, world: int) -> None:
    outer_lr = 0.7 if outer == "diloco" else 0.5
    results = run_workers(worker_local, world, variant, outer, h, outer_lr, "flat", 0, timeout=120)
    want = simulate_local(variant, outer, world, h, outer_lr, STEPS)
    for rank, res in enumerate(results):
        for i, (got, exp) in enumerate(zip(res["params"], want[rank], strict=True)):
            assert torch.equal(got, exp), f"rank {rank} parameter {i} differs from the simulation"
    outer_steps = STEPS // h
    assert results[0]["stats"]["total"]["steps"] == STEPS
    assert results[0]["stats"]["total"]["collectives"] > 0 and outer_steps >= 2


MOMENTUM_CASES = [("vote", "keep"), ("vote", "average"), ("dsm", "keep")]


@pytest.mark.parametrize(("outer", "inner_momentum"), MOMENTUM_CASES)
def test_every_inner_momentum_rule_matches_the_simulation(outer: str, inner_momentum: str) -> None:
    """The default ``reset`` is in the cases above; ``keep`` and ``average`` (an fp32 allreduce of the
    inner momenta after each outer step) here, at 2 ranks with H = 2."""
    variant = "1bit" if outer == "vote" else "32bit"
    results = run_workers(worker_local, 2, variant, outer, 2, 0.5, "flat", 0, inner_momentum, timeout=120)
    want = simulate_local(variant, outer, 2, 2, 0.5, STEPS, inner_momentum)
    other = simulate_local(variant, outer, 2, 2, 0.5, STEPS, "reset")
    assert any(not torch.equal(a, b) for a, b in zip(want[0], other[0], strict=True))  # the rules differ
    for rank, res in enumerate(results):
        for i, (got, exp) in enumerate(zip(res["params"], want[rank], strict=True)):
            assert torch.equal(got, exp), f"rank {rank} parameter {i} differs from the simulation"


def test_hierarchical_local_votes_match_the_flat_simulation_at_2x2() -> None:
    results = run_workers(worker_local, 4, "1bit", "vote", 3, 0.5, "hierarchical", 0, timeout=120)
    want = simulate_local("1bit", "vote", 4, 3, 0.5, STEPS)
    for rank, res in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(res["params"], want[rank], strict=True)), rank


@pytest.mark.parametrize(("variant", "outer"), [("1bit", "vote"), ("8bit", "vote"), ("32bit", "diloco")])
def test_a_resume_in_the_middle_of_a_window_is_bitwise(variant: str, outer: str) -> None:
    """Saved after step 4 (one step into the second window of H = 3) and resumed from rank 0's model (one
    model file) and each rank's optimizer state: every rank's parameters, inner and outer momenta and
    anchor equal the uninterrupted run's."""
    args = (variant, outer, 3, 0.5, "flat")
    whole = run_workers(worker_local, 2, *args, 0, timeout=120)
    resumed = run_workers(worker_local, 2, *args, 4, timeout=120)
    for rank in range(2):
        for a, b in zip(whole[rank]["params"], resumed[rank]["params"], strict=True):
            assert torch.equal(a, b), rank
        for sa, sb in zip(whole[rank]["state"], resumed[rank]["state"], strict=True):
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), rank


def worker_nan_inner(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = LionCub(model.parameters(), lr=0.01, variant="1bit", local_steps=LocalSteps(h=2))
    for step in range(1, 5):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        if step == 1 and rank == 1:
            loss = loss * float("nan")  # this rank's first inner step is skipped, on this rank only
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": opt.comm_stats()}


def test_a_non_finite_inner_step_is_skipped_on_its_rank_and_the_replicas_agree_after_the_window() -> None:
    res = run_workers(worker_nan_inner, 2, timeout=60)
    assert res[1]["stats"]["total"]["skipped_steps"] == 1 and res[0]["stats"]["total"]["skipped_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"], strict=True))


def test_one_process_with_local_steps_is_lion() -> None:
    ps = [torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(3))) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    cub = LionCub(ps, lr=0.01, variant="1bit", local_steps=LocalSteps(h=2))
    lion = Lion(qs, lr=0.01)
    for step in range(5):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn(7, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        cub.step()
        lion.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))


def test_local_steps_refuse_what_has_no_meaning_between_outer_steps() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="outer='diloco' averages the pseudo-gradients in fp32 or bf16"):
        LionCub([p], lr=0.1, variant="1bit", local_steps=LocalSteps(h=4, outer="diloco"))
    with pytest.raises(ValueError, match="inner_momentum='average'"):
        LionCub([p], lr=0.1, variant="1bit", momentum_sync="all", local_steps=LocalSteps(h=4))
    with pytest.raises(ValueError, match=r"LocalSteps: h=0 must be an int >= 1"):
        LocalSteps(h=0)
    with pytest.raises(ValueError, match=r"outer='sgd': allowed values are \['vote', 'dsm', 'diloco'\]"):
        LocalSteps(h=2, outer="sgd")


def test_local_steps_given_as_an_int_or_a_dict() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    assert LionCub([p], lr=0.1, local_steps=8).local_steps == LocalSteps(h=8)
    config = {"h": 4, "outer": "vote", "outer_lr": 0.5, "inner_momentum": "reset"}
    assert LionCub([p], lr=0.1, local_steps=config).local_steps == LocalSteps(**config)
    with pytest.raises(ValueError, match=r"unknown keys \['H'\]; the keys are \['h', 'outer'"):
        LionCub([p], lr=0.1, local_steps={"H": 4})
    for bad in (True, 2.5, "16"):
        with pytest.raises(TypeError, match=r"must be a lioncub\.LocalSteps"):
            LionCub([p], lr=0.1, local_steps=bad)  # type: ignore[arg-type]


def test_a_state_of_other_local_steps_settings_and_overlap_are_refused() -> None:
    """Other settings are refused in a window's middle, naming each setting that differs and where it can
    change; at a step that starts a window under both H they are taken (the momenta carry over)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    opt = LionCub([p], lr=0.1, local_steps=4)
    opt.step()
    sd = opt.state_dict()

    def load(other: LocalSteps | None, state: dict) -> LionCub:
        fresh = LionCub([torch.nn.Parameter(torch.ones(3))], lr=0.1, local_steps=other)
        fresh.load_state_dict(state)
        return fresh

    with pytest.raises(ValueError, match=r"saved with local steps .* this optimizer has local_steps=None"):
        load(None, sd)
    with pytest.raises(ValueError, match=r"at step 1 with other local-steps settings: h=4 \(now 8\)\. They "
                       r"can change only where a window starts under both h=4 and h=8"):  # fmt: skip
        load(LocalSteps(h=8), sd)
    with pytest.raises(ValueError, match=r"inner_momentum='reset' \(now 'keep'\)"):
        load(LocalSteps(h=4, inner_momentum="keep"), sd)
    for _ in range(7):  # step 8: a window starts under h = 4 and h = 8
        opt.step()
    changed = r"saved at step 8 with other .*h=4 \(now 8\), inner_momentum='reset' \(now 'keep'\); the "
    with pytest.warns(UserWarning, match=changed + "windows from step 9 run the new ones") as seen:
        moved = load(LocalSteps(h=8, inner_momentum="keep"), opt.state_dict())
    assert seen[0].filename == __file__  # points at the caller's load_state_dict
    assert moved.global_step == 8 and torch.equal(moved.state[moved.param_groups[0]["params"][0]]["exp_avg"],
                                                  opt.state[p]["exp_avg"])  # fmt: skip
    with pytest.raises(ValueError, match="no vote in the backward"):
        opt.overlap_with(torch.nn.Linear(2, 2))


def worker_stats(rank: int, world: int) -> list[dict]:
    p = torch.nn.Parameter(torch.ones(1000))
    opt = LionCub([p], lr=0.01, variant="1bit", local_steps=LocalSteps(h=2))
    seen = []
    for step in range(1, 5):
        p.grad = torch.full((1000,), float("nan") if (step, rank) == (2, 1) else 1.0 + rank)
        opt.step()
        seen.append({k: opt.comm_stats()[k] for k in ("last", "total")})
    return seen


def test_comm_stats_book_the_inner_and_the_outer_step_together() -> None:
    """H = 2, 2 ranks, 1000 parameters: an inner step sends nothing and books its arithmetic; the step
    that ends a window books the inner step and the outer vote together in ``"last"`` (and a NaN inner
    step on rank 1 at step 2 shows there on rank 1 alone), and the totals count every byte once."""
    for rank, seen in enumerate(run_workers(worker_stats, 2, timeout=60)):
        inner, outer = seen[0]["last"], seen[1]["last"]
        assert inner["bytes_sent"] == 0 and inner["collectives"] == 0 and inner["apply_s"] > 0
        assert outer["bytes_sent"] > 1000 / 8 / 2  # the 1-bit vote of 1000 elements, and the step check
        assert outer["apply_s"] > 0 and outer["skipped_steps"] == (1 if rank == 1 else 0)
        assert seen[3]["last"]["bytes_sent"] == outer["bytes_sent"]
        assert seen[3]["total"]["bytes_sent"] == 2 * outer["bytes_sent"]
        assert seen[3]["total"]["skipped_steps"] == (1 if rank == 1 else 0)


def worker_edge_cases(rank: int, world: int) -> dict:
    """The cases of test_local_steps_edge_cases on this rank (H = 2 or 3, fresh optimizers)."""
    out: dict = {}
    g = torch.Generator().manual_seed(100 + rank)
    # maximize: the same steps as minimizing the negated gradients, for every outer rule
    for variant, outer in (("1bit", "vote"), ("32bit", "dsm"), ("32bit", "diloco")):
        runs = []
        for maximize in (False, True):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(11))
            opt = LionCub(
                [p], lr=0.05, variant=variant, maximize=maximize, local_steps={"h": 2, "outer": outer}
            )
            for step in range(4):
                grad = torch.randn(11, generator=torch.Generator().manual_seed(10 * step + rank))
                p.grad = -grad if maximize else grad
                opt.step()
            runs.append(p.detach().clone())
        out[f"maximize-{outer}"] = runs
    # a parameter frozen in the middle of a window, one no rank ever gives a gradient, one added mid-window
    torch.manual_seed(1)
    a, b, unused = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
    late = torch.nn.Parameter(torch.full((4,), float(rank)))  # rank-dependent: rank 0's is broadcast
    start, b0 = unused.detach().clone(), b.detach().clone()
    opt = LionCub([a, b, unused], lr=0.05, variant="1bit", local_steps=3)
    seen = []
    for step in range(1, 10):
        a.grad = torch.randn(5, generator=g)
        b.grad = torch.randn(5, generator=g) if b.requires_grad else None
        if step > 2:
            late.grad = torch.randn(4, generator=g)
        opt.step()
        if step == 2:
            b.requires_grad_(False)  # mid-window: takes effect at the next window (step 4)
            opt.add_param_group({"params": [late]})  # likewise; rank 0's values then
        if step % 3 == 0:
            seen.append([q.detach().clone() for q in (a, b, unused, late)])
    out["windows"], out["unused_moved"] = seen, not torch.equal(unused.detach(), start)
    out["b_moved"] = not torch.equal(seen[0][1], b0)
    return out


def test_local_steps_edge_cases() -> None:
    """2 ranks. ``maximize=True`` is minimizing −g (the outer step too, also DiLoCo's); at every window's
    end the replicas agree — with a parameter frozen mid-window (its inner steps up to then are voted on,
    then it rests) and one added mid-window (it joins at the next window with rank 0's values); a
    parameter that no rank ever gives a gradient is not touched (a 1-bit vote on exact zeros would move it
    by the tie rule)."""
    results = run_workers(worker_edge_cases, 2, timeout=120)
    for outer in ("vote", "dsm", "diloco"):
        for r in results:
            plain, maximized = r[f"maximize-{outer}"]
            assert torch.equal(plain, maximized), outer
    r0, r1 = results
    for window, (w0, w1) in enumerate(zip(r0["windows"], r1["windows"], strict=True)):
        for name, x, y in zip(("a", "b", "unused", "late"), w0, w1, strict=True):
            if (window, name) != (0, "late"):  # added at step 2: the optimizer's from the next window on
                assert torch.equal(x, y), (window, name)
    frozen = [w[1] for w in r0["windows"]]
    assert r0["b_moved"]  # its inner steps of the first window were voted on at step 3 ...
    assert torch.equal(frozen[0], frozen[1]) and torch.equal(frozen[1], frozen[2])  # ... then it rests
    late = [w[3] for w in r0["windows"]]
    assert torch.equal(late[0], torch.zeros(4)) and not torch.equal(
        late[1], late[0]
    )  # rank 0's, then trained
    assert not r0["unused_moved"] and not r1["unused_moved"]


def worker_first_step_and_scales(rank: int, world: int) -> dict:
    import warnings

    p = torch.nn.Parameter(torch.ones(6))
    opt = LionCub([p], lr=0.1, variant="1bit", local_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 5):
            # identical gradients at the first step (DDP left averaging), then each rank's own, scaled by a
            # per-rank GradScaler whose scale differs from step 2 on (an inner overflow on one rank only)
            scale = torch.tensor(2.0 ** (3 + (rank if step > 1 else 0)))
            grad = (
                torch.full((6,), 0.5)
                if step == 1
                else torch.randn(6, generator=torch.Generator().manual_seed(rank))
            )
            p.grad = grad * scale
            opt.grad_scale, opt.found_inf = scale, torch.tensor(0.0)
            opt.step()
    return {"warned": [str(w.message) for w in caught], "p": p.detach().clone()}


def test_identical_first_gradients_warn_and_per_rank_scales_are_the_inner_steps_own() -> None:
    """Gradients identical on every rank at the first step (DDP's allreduce left on) are warned about by
    rank 0; per-rank GradScaler scales (one rank backed off after an inner overflow) are each rank's own:
    the outer step applies Δ, not a scaled gradient, and does not compare them."""
    r0, r1 = run_workers(worker_first_step_and_scales, 2, timeout=60)
    assert any("every inner step then allreduces the gradients through DDP" in w for w in r0["warned"]), r0
    assert not any("identical on every rank" in w for w in r1["warned"])
    assert torch.equal(r0["p"], r1["p"])


# -- a resume in the middle of a window after the layout changed in it (frozen, unfrozen, added, removed)

LAYOUT_H, LAYOUT_STEPS, LAYOUT_STOP = 5, 10, 3  # saved after step 3 of the first window


def _layout_params(rank: int, case: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(50 + rank)  # rank-dependent: the optimizer broadcasts rank 0's
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((6, 4), (7,), (3, 5), (9,))]
    if case == "unfreeze":
        params[1].requires_grad_(False)
    return params


def _layout_optimizer(params: list[torch.nn.Parameter], case: str, step: int) -> LionCub:
    """The optimizer as the user's code builds it at ``step`` (after ``step`` steps): what changed by then."""
    late = case in ("add_first", "add_mid")
    opt = LionCub(params[:3] if late else params, lr=0.01, weight_decay=0.1, variant="1bit",
                  local_steps=LocalSteps(h=LAYOUT_H))  # fmt: skip
    if case == "add_first" or (case == "add_mid" and step >= 2):
        opt.add_param_group({"params": [params[3]], "lr": 0.02, "weight_decay": 0.05})
    return opt


def _change_layout(params: list[torch.nn.Parameter], opt: LionCub, case: str, step: int) -> None:
    """What the user's code does after ``step`` steps."""
    if step == 2 and case == "freeze":
        params[1].requires_grad_(False)
    if step == 2 and case == "unfreeze":
        params[1].requires_grad_(True)
    if step == 2 and case == "add_mid":
        opt.add_param_group({"params": [params[3]], "lr": 0.02, "weight_decay": 0.05})


def _load_model(params: list[torch.nn.Parameter], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def worker_layout(rank: int, world: int, case: str, stop: int, model_first: bool = True) -> dict:
    """``LAYOUT_STEPS`` steps with the layout changed by ``case`` after step 2; a resume after ``stop``
    steps (0: none) from rank 0's model file and each rank's optimizer state, loaded in either order."""
    params = _layout_params(rank, case)
    opt = _layout_optimizer(params, case, 0)
    for step in range(1, LAYOUT_STEPS + 1):
        if step == stop + 1 and stop:
            state = opt.state_dict()
            holder = [[p.detach().clone() for p in params]]
            dist.broadcast_object_list(holder, src=0)  # one model file: rank 0's replica
            params = _layout_params(rank, case)
            for p in params[1:2]:  # the user's code as it is now
                p.requires_grad_(case == "unfreeze" or (case != "freeze" and p.requires_grad))
            opt = _layout_optimizer(params, case, stop)

            if model_first:
                _load_model(params, holder[0])
                opt.load_state_dict(state)
            else:  # a hand-written loop that loads the optimizer before the model
                opt.load_state_dict(state)
                _load_model(params, holder[0])
        for i, p in enumerate(params):
            gen = torch.Generator().manual_seed(7919 * step + 31 * rank + i)
            p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
        opt.step()
        _change_layout(params, opt, case, step)
    state = [{k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else {} for p in params]
    return {"params": [p.detach().clone() for p in params], "state": state}


LAYOUT_CASES = [("freeze", 2, True), ("unfreeze", 2, True), ("add_first", 3, True), ("add_mid", 2, True),
                ("freeze", 2, False)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("case", "world", "model_first"), LAYOUT_CASES)
def test_a_resume_after_the_layout_changed_in_the_window_is_bitwise(
    case: str, world: int, model_first: bool
) -> None:
    """Saved in the middle of a window in which a parameter was frozen, unfrozen or added (or before the
    first step: a head added with add_param_group), and resumed by code that builds the optimizer as it is
    now: the window keeps its own layout, so every rank's parameters and states equal the uninterrupted
    run's, and the ranks agree — also when the optimizer state is loaded before the model file."""
    whole = run_workers(worker_layout, world, case, 0, timeout=120)
    resumed = run_workers(worker_layout, world, case, LAYOUT_STOP, model_first, timeout=120)
    for rank in range(world):
        for a, b in zip(whole[rank]["params"], resumed[rank]["params"], strict=True):
            assert torch.equal(a, b), (case, rank)
        for i, (sa, sb) in enumerate(zip(whole[rank]["state"], resumed[rank]["state"], strict=True)):
            assert sa.keys() == sb.keys(), (case, rank, i, sorted(sa), sorted(sb))
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (case, rank, i)
    for rank in range(1, world):  # a window boundary (step 10): the replicas agree
        assert all(torch.equal(a, b) for a, b in zip(whole[0]["params"], whole[rank]["params"], strict=True))


# -- the order of loading, with gradients that depend on the parameters (a loss on data) ----------------

ORDER_H, ORDER_STEPS, ORDER_STOP = 4, 12, 6  # saved after step 6: in the middle of the second window


def _order_model(rank: int) -> torch.nn.Sequential:
    gen = torch.Generator().manual_seed(70 + rank)  # rank-dependent: the optimizer broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _order_loss(model: torch.nn.Sequential, rank: int, step: int, functional: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 5, generator=gen), torch.randn(16, 3, generator=gen)
    if functional:  # the parameters used outside an nn.Module call
        first, last = model[0], model[2]
        out = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, first.weight, first.bias)),
                                         last.weight, last.bias)  # fmt: skip
    else:
        out = model(x)
    return torch.nn.functional.mse_loss(out, y)


def worker_load_order(rank: int, world: int, order: str, functional: bool) -> dict:
    """``ORDER_STEPS`` steps of a real loss with local steps (H = ``ORDER_H``); a resume after
    ``ORDER_STOP`` steps unless ``order`` is ``"none"``: rank 0's model file and this rank's optimizer
    state, the model first (``"model_first"``), the optimizer first (``"opt_first"``), or the optimizer
    first and ``restore_replicas()`` after the model (``"restore"``). A refused step returns its message."""
    model = _order_model(rank)
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, variant="1bit", local_steps=ORDER_H)
    differs = False  # this rank's replica is not the model file at the save
    for step in range(1, ORDER_STEPS + 1):
        if step == ORDER_STOP + 1 and order != "none":
            state = opt.state_dict()
            holder = [{k: v.clone() for k, v in model.state_dict().items()}]
            dist.broadcast_object_list(holder, src=0)  # one model file: rank 0's replica
            differs = any(not torch.equal(v, holder[0][k]) for k, v in model.state_dict().items())
            model = _order_model(rank)
            opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, variant="1bit", local_steps=ORDER_H)
            if order == "model_first":
                model.load_state_dict(holder[0])
                opt.load_state_dict(state)
            else:
                opt.load_state_dict(state)
                model.load_state_dict(holder[0])
                if order == "restore":
                    opt.restore_replicas()
        _order_loss(model, rank, step, functional).backward()
        try:
            opt.step()
        except RuntimeError as err:
            return {"refused": str(err)}
        opt.zero_grad()
    params = list(model.parameters())
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    return {"params": [p.detach().clone() for p in params], "differs": differs, "state": state}


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_a_state_loaded_before_the_model_resumes_bitwise_or_is_refused(functional: bool) -> None:
    """Saved in a window's middle (2 ranks, H = 4, step 6) and resumed from rank 0's model file and each
    rank's optimizer state, with gradients of a loss on data (a wrong parameter after the load changes every
    later step): the model first, the optimizer first (the first module call puts the replicas back), or the
    optimizer first and restore_replicas() after the model give the uninterrupted run's bits on every
    rank. Where the loss uses the parameters outside a module call, the optimizer-first order without
    restore_replicas() is refused at the next step, naming the parameter and the fix."""
    whole = run_workers(worker_load_order, 2, "none", functional, timeout=120)
    orders = ["model_first", "restore"] + ([] if functional else ["opt_first"])
    for order in orders:
        resumed = run_workers(worker_load_order, 2, order, functional, timeout=120)
        for rank in range(2):
            assert "refused" not in resumed[rank], (order, resumed[rank])
            for a, b in zip(whole[rank]["params"], resumed[rank]["params"], strict=True):
                assert torch.equal(a, b), (order, rank)
            for sa, sb in zip(whole[rank]["state"], resumed[rank]["state"], strict=True):
                assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), (order, rank)
        assert resumed[1]["differs"] and not resumed[0]["differs"]  # rank 1 resumes from another's file
    if functional:
        refused = run_workers(worker_load_order, 2, "opt_first", True, timeout=120)
        for rank in range(2):  # every rank that loaded the model so (rank 0's replica is the file: alike)
            message = refused[rank].get("refused", "")
            assert message.startswith(f"rank {rank}: LionCub: param_groups[0][0], param_groups[0][1], "
                                      "param_groups[0][2] and 1 more was overwritten after load_state_dict"
                                      ), message  # fmt: skip
            assert "Load the model before the optimizer state, or call opt.restore_replicas()" in message


def worker_refused_layouts(rank: int, world: int) -> list[str]:
    """The messages of loads that cannot continue a window: a parameter removed, another shape, a state of
    one process in a window's middle, a state of an earlier version in a window's middle."""
    params = _layout_params(rank, "freeze")
    opt = _layout_optimizer(params, "freeze", 0)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.full(p.shape, 0.1 * (i + 1 + rank))
        opt.step()
    state = opt.state_dict()
    messages = []

    def refused(build) -> None:  # type: ignore[no-untyped-def]
        try:
            build()
        except ValueError as err:
            messages.append(str(err))
        else:
            messages.append("accepted")

    fresh = _layout_params(rank, "freeze")
    refused(lambda: LionCub(fresh[:3], lr=0.01, variant="1bit", local_steps=LAYOUT_H).load_state_dict(state))
    other = [*fresh[:3], torch.nn.Parameter(torch.zeros(10))]
    refused(lambda: LionCub(other, lr=0.01, variant="1bit", local_steps=LAYOUT_H).load_state_dict(state))
    old = {**state, "lioncub": {k: v for k, v in state["lioncub"].items() if k != "window"} | {"version": 2}}
    refused(lambda: LionCub(fresh, lr=0.01, variant="1bit", local_steps=LAYOUT_H).load_state_dict(old))
    alone = LionCub([torch.nn.Parameter(p.detach().clone()) for p in fresh], lr=0.01, variant="1bit",
                    local_steps=LAYOUT_H, process_group=dist.new_group([rank]))  # fmt: skip
    for p in alone.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    for _ in range(3):
        alone.step()
    one = alone.state_dict()
    refused(
        lambda: LionCub(fresh, lr=0.01, variant="1bit", local_steps=LAYOUT_H).load_state_dict(
            one, allow_world_size_change=True
        )
    )
    return messages


@pytest.mark.slow
def test_a_window_that_cannot_continue_is_refused_naming_the_parameter() -> None:
    removed, reshaped, version2, one_process = run_workers(worker_refused_layouts, 2, timeout=120)[0]
    assert "param groups of [4] parameters, this optimizer [3]; the window in progress has " in removed
    assert "['param_groups[0][3]']" in removed and "freeze one with requires_grad_(False)" in removed
    assert "covers param_groups[0][3] (param_groups[0][3], shape (9,))" in reshaped
    assert "has shape (10,)" in reshaped and "a multiple of 5" in reshaped
    assert "at step 3, in the middle of a window of h=5" in version2 and "state version 2" in version2
    assert "saved by one process" in one_process


# -- weight decay outside the vote: a coordinate no rank moves decays as weight decay alone ------------

UNTOUCHED_RULES = [(v, "vote") for v in VOTES] + [("32bit", "dsm"), ("32bit", "diloco")]


#: steps of the untouched-rows runs: 10 windows of H = 16 (the issue measured 20; an even number of windows
#: brings the 1-bit vote's alternating ties back; with the inner steps decaying, the rows end ~100 % off
#: under the sign rules and 1.6 % under DiLoCo in these 10)
UNTOUCHED_STEPS = 160


def worker_untouched_rows(rank: int, world: int, variant: str, outer: str) -> dict:
    """:data:`UNTOUCHED_STEPS` steps of H = 16 on an embedding whose rows 6..11 no batch uses (exactly zero
    gradients on every rank; init std 0.02, lr 3e-4, weight decay 0.1, as the issue's measurement)."""
    emb = torch.nn.Parameter(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)) * 0.02)
    start = emb.detach().clone()
    opt = LionCub(
        [emb], lr=3e-4, weight_decay=0.1, variant=variant, local_steps=LocalSteps(h=16, outer=outer)
    )
    for step in range(UNTOUCHED_STEPS):
        grad = torch.zeros(12, 8)
        grad[:6] = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        emb.grad = grad
        opt.step()
    return {"start": start, "end": emb.detach().clone()}


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "outer"), UNTOUCHED_RULES)
def test_a_coordinate_no_rank_moves_decays_as_weight_decay_alone(variant: str, outer: str) -> None:
    """Under every rule an untouched row ends where weight decay alone takes it: within rounding for the
    votes that hold a zero (``docs/local-steps.md``, "Coordinates no rank moves"), within 5 % for the 1-bit
    vote, whose ties alternate ±ηᵒ (back after every second window: 10 windows here). Before decay left
    the vote the row's norm fell by 85 % under 1bit/h16 in 20 windows."""
    res = run_workers(worker_untouched_rows, 2, variant, outer, timeout=120)
    start, end = res[0]["start"][6:].double(), res[0]["end"][6:].double()
    alone = start * (1 - 3e-4 * 0.1) ** UNTOUCHED_STEPS
    err = float((end - alone).norm() / alone.norm())
    assert err < (0.05 if variant == "1bit" else 1e-5), (variant, outer, err)
    assert torch.equal(res[0]["end"], res[1]["end"])  # the replicas agree


# -- what a framework sees in a window's middle: the shared parameters, a model-only resume ------------


def worker_shared_parameters(rank: int, world: int) -> dict:
    """H = 4, 2 ranks. Run A: 8 steps, θ shown (``show_shared_parameters``) and a state saved after step 6.
    Run B: the same 8 steps untouched. Run C: a model-only resume at step 6 from θ (``continue_at``)."""

    def build(seed: int = 0) -> tuple[list[torch.nn.Parameter], LionCub]:
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seed + i)))
                  for i, s in enumerate(((5, 3), (4,)))]  # fmt: skip
        return params, LionCub(params, lr=0.01, weight_decay=0.1, variant="1bit", local_steps=LocalSteps(h=4))

    def grads(params: list[torch.nn.Parameter], step: int) -> None:
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(97 * step + 13 * rank + i))

    out: dict = {}
    params, opt = build()
    for step in range(1, 9):
        grads(params, step)
        opt.step()
        if step == 6:
            replicas = [p.detach().clone() for p in params]
            with opt.shared_parameters() as shown:
                out["shown"] = shown
                out["theta"] = [p.detach().clone() for p in params]
                out["anchors"] = [opt.state[p]["anchor"].clone() for p in params]
            out["back"] = all(torch.equal(p, r) for p, r in zip(params, replicas, strict=True))
            opt.show_shared_parameters()  # until the next step, as a framework's save hook does
            out["saved_replicas"] = [v["replica"].clone() for v in opt.state_dict()["state"].values()]
            out["replicas"] = replicas
    out["A"] = [p.detach().clone() for p in params]
    params, opt = build()
    for step in range(1, 9):
        grads(params, step)
        opt.step()
    out["B"] = [p.detach().clone() for p in params]
    params, opt = build(seed=100)  # another initialisation: the model file replaces it
    with torch.no_grad():
        for p, theta in zip(params, out["theta"], strict=True):
            p.copy_(theta)
    opt.continue_at(6)
    sent = []
    for step in (7, 8):
        grads(params, step)
        opt.step()
        sent.append(opt.comm_stats()["last"]["collectives"])
    out["C"], out["C_sent"], out["C_step"] = [p.detach().clone() for p in params], sent, opt.global_step
    return out


@pytest.mark.slow
def test_frameworks_see_the_shared_parameters_and_resume_from_a_model_only_checkpoint() -> None:
    """In a window's middle ``shared_parameters()`` shows θ of the last outer step — the same on every rank
    — and puts each rank's replica back; ``show_shared_parameters()`` lasts until the next step, which then
    continues bitwise (a state saved meanwhile holds the replicas); ``continue_at(6)`` after a model-only
    checkpoint keeps the windows' place: the window restarts and its outer step falls at step 8, after which
    the ranks agree."""
    r0, r1 = run_workers(worker_shared_parameters, 2, timeout=120)
    for r in (r0, r1):
        assert r["shown"] and r["back"]
        assert all(torch.equal(a, b) for a, b in zip(r["theta"], r["anchors"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(r["saved_replicas"], r["replicas"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(r["A"], r["B"], strict=True))  # showing changed nothing
        assert r["C_step"] == 8 and r["C_sent"][0] == 0 and r["C_sent"][1] > 0  # the outer step at 8
    assert all(torch.equal(a, b) for a, b in zip(r0["theta"], r1["theta"], strict=True))  # θ is shared
    assert not all(torch.equal(a, b) for a, b in zip(r0["replicas"], r1["replicas"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(r0["C"], r1["C"], strict=True))  # agree after step 8


def test_the_window_flags_are_host_flags_and_survive_a_state_dict(one_rank: None) -> None:
    """``state[p]["window_grad"]`` (this rank had a gradient for ``p`` in the window) is a 0-dim bool on the
    CPU, not a tensor made on the parameter's device and dtype (on a GPU: an allocation and a fill kernel
    per parameter per window); it is set only for the parameters that had a gradient, and a state dict
    taken in the window's middle carries it."""
    from lioncub.collectives import exchange_when_alone

    gen = torch.Generator().manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    with exchange_when_alone():
        opt = LionCub(ps, lr=0.01, variant="1bit", local_steps=LocalSteps(h=4))
    for step in range(2):
        for i, p in enumerate(ps[:2]):  # the third parameter has no gradient in this window
            p.grad = torch.cos(p.detach() * (step + i + 1))
        opt.step()
    flags = [opt.state[p].get("window_grad") for p in ps]
    assert flags[2] is None
    for flag in flags[:2]:
        assert (flag.device, flag.dtype, flag.shape) == (torch.device("cpu"), torch.bool, ())
    saved = opt.state_dict()
    with exchange_when_alone():
        again = LionCub(ps, lr=0.01, variant="1bit", local_steps=LocalSteps(h=4))
    again.load_state_dict(saved)
    assert [("window_grad" in again.state[p]) for p in ps] == [True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_pseudo_gradient_in_the_anchor_is_anchor_minus_p_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pseudo_gradient_in_anchor``: the parameter gets the anchor's bits and the anchor those of
    ``anchor - p`` (signed zeros, NaN, Inf and subnormals included), across pieces of the exchange."""
    from lioncub.optim import local_steps

    monkeypatch.setattr(local_steps, "SWAP_CHUNK", 7)  # pieces of 7: several, the last one short
    gen = torch.Generator().manual_seed(11)
    anchor = torch.randn(5, 9, generator=gen).to(dtype)
    p = anchor.clone()
    p.view(-1)[::3] += torch.randn(15, generator=gen).to(dtype)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40], dtype=torch.float64)
    p.view(-1)[:6], anchor.view(-1)[:6] = special.to(dtype), special.flip(0).to(dtype)
    p.view(-1)[6], anchor.view(-1)[6] = -0.0, 0.0  # 0 − (−0) = +0
    want_delta, want_p = anchor - p, anchor.clone()
    assert local_steps.pseudo_gradient_in_anchor(p, anchor)
    bits = (
        torch.int16
        if dtype == torch.bfloat16
        else {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    )
    assert torch.equal(anchor.view(bits), want_delta.view(bits))
    assert torch.equal(p.view(bits), want_p.view(bits))
    assert not local_steps.pseudo_gradient_in_anchor(p.t(), anchor.t().contiguous())  # not contiguous: left


def worker_outer_memory(rank: int, world: int) -> dict:
    """Local steps with H = 2 on ``world`` ranks: during each outer step, whether every parameter's ``.grad``
    (Δ) is its anchor's storage; then a window whose Δ is NaN under ``nonfinite="raise"``: the state after
    the error."""
    from lioncub.optim import outer
    from lioncub.optim.step_check import Checks, NonFiniteGradientError

    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (3000, 17, 64)]
    opt = LionCub(
        params, lr=0.01, variant="1bit", local_steps=LocalSteps(h=2), checks=Checks(nonfinite="raise")
    )
    seen: list[bool] = []
    rule = opt.policy.rule  # this optimizer's outer rule (patched on the object: the worker process lives on)
    assert isinstance(rule, outer.SignOuter)
    rule_step = rule.step

    def watched(inputs: outer.OuterInputs) -> frozenset[int] | None:  # Δ looked at as the outer step starts
        seen.append(all(p.grad.data_ptr() == inputs.state[p]["anchor"].data_ptr() for p in params))
        return rule_step(inputs)

    rule.step = watched  # type: ignore[method-assign]
    for step in range(1, 5):
        for i, p in enumerate(params):
            p.grad = torch.sin(p.detach() * (i + 2) + step + rank)
        opt.step()
    user = [torch.full_like(p, 7.0) for p in params]
    for step in (5, 6):
        for p, g in zip(params, user, strict=True):
            p.grad = g
        if step == 6:
            with torch.no_grad():
                params[0][5] = float("nan")  # θ_r: Δ is NaN on this rank
        error = ""
        try:
            opt.step()
        except NonFiniteGradientError as err:
            error = type(err).__name__
    return {
        "seen": seen,
        "error": error,
        "anchors_are_params": all(
            torch.equal(p.detach().view(torch.int32), opt.state[p]["anchor"].view(torch.int32))
            for p in params
        ),
        "user_grads_back": all(p.grad is g for p, g in zip(params, user, strict=True)),
    }


def test_the_outer_step_keeps_the_pseudo_gradient_in_the_anchors() -> None:
    """At an outer step Δ lives in the anchors' storage (no tensor of the model's size next to the user's
    gradients); an outer step that raises (a NaN Δ under ``nonfinite="raise"``) leaves the anchors at θ_t,
    the parameters' values, and the user's gradients in place."""
    for got in run_workers(worker_outer_memory, 2):
        assert got["seen"] == [True, True, True]
        assert got["error"] == "NonFiniteGradientError"
        assert got["anchors_are_params"] and got["user_grads_back"]


def test_the_outer_rules_are_the_named_ones() -> None:
    """Every outer rule of ``OUTER_RULES`` (torch) is a row of ``OUTER_RULE_FACTS`` (torch-free names), with
    the same facts: a dense rule needs a dense exchange, a sign rule takes the sign steps' lr and betas."""
    from lioncub.optim.config import OUTER_RULE_FACTS
    from lioncub.optim.outer import OUTER_RULES, SignOuter

    assert list(OUTER_RULES) == list(OUTER_RULE_FACTS)
    for name, rule in OUTER_RULES.items():
        assert rule.dense == OUTER_RULE_FACTS[name].dense, name
        assert issubclass(rule, SignOuter) == OUTER_RULE_FACTS[name].sign, name
