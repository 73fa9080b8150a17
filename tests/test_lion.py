"""Tests for :mod:`lioncub.optim.lion` against an independent float64 closed-form reference."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from lioncub.optim.lion import (
    Lion,
    apply_update_,
    lion_direction,
    lion_update_,
    update_momentum_,
)

STEPS = 50

# Three groups with different hyperparameters. The "dyadic" group uses betas (0.5, 0.5) and integer
# gradients in [-4, 4]: its momentum is then exact in float64 for 50 steps (and in float32 for ~22),
# so a gradient of exactly -m makes c == 0 and exercises sign(0) == 0.
GROUP_SPECS = [
    {"shapes": [(5, 3), (7,)], "lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "kind": "normal"},
    {"shapes": [(4, 4)], "lr": 3e-3, "betas": (0.95, 0.98), "weight_decay": 0.0, "kind": "normal"},
    {"shapes": [(6,)], "lr": 5e-3, "betas": (0.5, 0.5), "weight_decay": 0.01, "kind": "dyadic"},
]


def lr_factor(epoch: int) -> float:
    return (0.5 ** (epoch // 10)) * (1.0 + 0.25 * (epoch % 3))


def reference_step(p, m, g, *, lr, beta1, beta2, wd, maximize):
    """Plain float64 numpy Lion step. Returns (new_p, new_m, c)."""
    if maximize:
        g = -g
    c = beta1 * m + (1.0 - beta1) * g
    p = p * (1.0 - lr * wd)
    p = p - lr * np.sign(c)
    m = beta2 * m + (1.0 - beta2) * g
    return p, m, c


def _f32(a: np.ndarray) -> np.ndarray:
    """Round to float32-representable values, kept as float64."""
    return a.astype(np.float32).astype(np.float64)


def run_against_reference(dtype, *, steps, trick_steps, maximize, foreach, param_tol, mom_tol):
    rng = np.random.default_rng(1234)
    ref_p, ref_m, torch_params, groups = [], [], [], []
    for spec in GROUP_SPECS:
        group_params = []
        for shape in spec["shapes"]:
            init = _f32(rng.normal(size=shape))
            ref_p.append(init.copy())
            ref_m.append(np.zeros(shape))
            t = torch.tensor(init, dtype=dtype, requires_grad=True)
            torch_params.append(t)
            group_params.append(t)
        groups.append(
            {
                "params": group_params,
                "lr": spec["lr"],
                "betas": spec["betas"],
                "weight_decay": spec["weight_decay"],
            }
        )
    owner = [gi for gi, spec in enumerate(GROUP_SPECS) for _ in spec["shapes"]]
    # Elements whose gradient is always exactly zero: c stays 0, only weight decay acts.
    always_zero = [rng.random(p.shape) < 0.1 for p in ref_p]

    opt = Lion(groups, maximize=maximize, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lr_factor)
    n_zero_c = 0
    for t in range(1, steps + 1):
        for i, p in enumerate(torch_params):
            spec = GROUP_SPECS[owner[i]]
            if spec["kind"] == "normal":
                g = _f32(rng.normal(size=p.shape))
                g[rng.random(p.shape) < 0.2] = 0.0
                if t == 1:
                    g.flat[:4] = 0.0  # zero grad with zero momentum: c == 0 at step 1
            else:
                g = rng.integers(-4, 5, size=p.shape).astype(np.float64)
                if t in trick_steps:
                    sign = -1.0 if maximize else 1.0  # the optimizer sees -g when maximizing
                    g.flat[:3] = -sign * ref_m[i].flat[:3]
            g[always_zero[i]] = 0.0
            p.grad = torch.tensor(g, dtype=dtype)

            lr = spec["lr"] * lr_factor(t - 1)
            beta1, beta2 = spec["betas"]
            ref_p[i], ref_m[i], c = reference_step(
                ref_p[i],
                ref_m[i],
                g,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                wd=spec["weight_decay"],
                maximize=maximize,
            )
            n_zero_c += int(np.count_nonzero(c == 0))
            if spec["kind"] == "dyadic" and t in trick_steps:
                assert np.all(c.flat[:3] == 0)

        opt.step()
        sched.step()
        for i, p in enumerate(torch_params):
            torch.testing.assert_close(
                p.detach().double(), torch.from_numpy(ref_p[i]), rtol=param_tol, atol=param_tol
            )
            torch.testing.assert_close(
                opt.state[p]["exp_avg"].double(), torch.from_numpy(ref_m[i]), rtol=mom_tol, atol=mom_tol
            )
            assert opt.state[p]["step"] == t
    assert n_zero_c > 0


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_float64_matches_reference_exactly(foreach, maximize):
    # Parameters depend only on sign(c), the weight-decay factor and lr, so they match exactly;
    # the momentum may differ in the last bit where the kernel fuses a multiply-add.
    run_against_reference(
        torch.float64,
        steps=STEPS,
        trick_steps={3, 7, 12, 20, 33, 49},
        maximize=maximize,
        foreach=foreach,
        param_tol=0.0,
        mom_tol=1e-13,
    )


@pytest.mark.parametrize("foreach", [True, False])
def test_float32_matches_reference(foreach):
    run_against_reference(
        torch.float32,
        steps=STEPS,
        trick_steps={3, 7, 12, 20},
        maximize=False,
        foreach=foreach,
        param_tol=2e-5,
        mom_tol=2e-5,
    )


def test_sign_of_zero_is_zero():
    p = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    opt = Lion([p], lr=0.1)
    p.grad = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    opt.step()
    assert p.tolist() == [1.0, -2.1, 3.1]
    assert opt.state[p]["exp_avg"][0].item() == 0.0


# --------------------------------------------------------------------------------------------------
# foreach vs per-tensor
# --------------------------------------------------------------------------------------------------


def _make_params(dtypes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (8,), (2, 2, 3), (1,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen).to(dt) for i, dt in enumerate(dtypes)]


def _random_grads(params, gen):
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        g[torch.rand(p.shape, generator=gen) < 0.2] = 0.0
        grads.append(g.to(p.dtype))
    return grads


def _run(params, steps, seed=1, **kwargs):
    params = [p.clone().requires_grad_(True) for p in params]
    opt = Lion(
        [
            {"params": params[: len(params) // 2], "lr": 1e-2, "weight_decay": 0.1},
            {"params": params[len(params) // 2 :], "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0},
        ],
        **kwargs,
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, g in zip(params, _random_grads(params, gen), strict=True):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    ("dtypes", "momentum_dtype"),
    [
        ([torch.float32] * 4, None),
        ([torch.bfloat16] * 4, None),
        ([torch.float16] * 4, None),
        ([torch.bfloat16] * 4, torch.float32),
        ([torch.float32, torch.bfloat16, torch.float16, torch.float32], None),
    ],
)
@pytest.mark.parametrize("maximize", [False, True])
def test_foreach_and_per_tensor_bitwise_identical(dtypes, momentum_dtype, maximize):
    init = _make_params(dtypes)
    pa, oa = _run(init, 20, foreach=True, maximize=maximize, momentum_dtype=momentum_dtype)
    pb, ob = _run(init, 20, foreach=False, maximize=maximize, momentum_dtype=momentum_dtype)
    for a, b in zip(pa, pb, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
        assert torch.equal(oa.state[a]["exp_avg"], ob.state[b]["exp_avg"])


def test_default_foreach_uses_foreach_kernels(monkeypatch):
    monkeypatch.setenv("LIONCUB_CPU_KERNELS", "0")  # the torch path (float32 CPU takes the C kernel)
    calls = []
    real = torch._foreach_sign_
    monkeypatch.setattr(torch, "_foreach_sign_", lambda xs: (calls.append(len(xs)), real(xs))[1])
    init = _make_params([torch.float32] * 4)
    _run(init, 1)  # foreach=None
    assert calls
    calls.clear()
    _run(init, 1, foreach=False)
    assert not calls


# --------------------------------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------------------------------


def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    ("dtype", "momentum_dtype"), [(torch.float32, None), (torch.bfloat16, torch.float32)]
)
def test_state_dict_round_trip_lockstep(dtype, momentum_dtype):
    init = _make_params([dtype] * 4)
    pa, oa = _run(init, 5, momentum_dtype=momentum_dtype)
    pb = [p.detach().clone().requires_grad_(True) for p in pa]
    ob = Lion([{"params": pb[:2]}, {"params": pb[2:]}], lr=0.5)  # hyperparameters come from the state dict
    ob.load_state_dict(_roundtrip(oa.state_dict()))
    for a, b in zip(pa, pb, strict=True):
        assert oa.state[a]["step"] == ob.state[b]["step"] == 5
        assert isinstance(ob.state[b]["step"], int)
        assert ob.state[b]["exp_avg"].dtype == (momentum_dtype or dtype)
        assert torch.equal(oa.state[a]["exp_avg"], ob.state[b]["exp_avg"])
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"]

    gen = torch.Generator().manual_seed(99)
    for _ in range(10):
        grads = _random_grads(pa, gen)
        for a, b, g in zip(pa, pb, grads, strict=True):
            a.grad = g.clone()
            b.grad = g.clone()
        oa.step()
        ob.step()
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(oa.state[a]["exp_avg"], ob.state[b]["exp_avg"])
        assert oa.state[a]["step"] == ob.state[b]["step"] == 15


def test_setstate_backfills_defaults_for_old_state_dicts():
    init = _make_params([torch.float32] * 4)
    _, oa = _run(init, 2)
    sd = oa.state_dict()
    for group in sd["param_groups"]:
        for key in ("foreach", "maximize", "momentum_dtype"):
            del group[key]
    for s in sd["state"].values():
        s["step"] = torch.tensor(float(s["step"]))  # older optimizers stored a tensor
    pb = [p.detach().clone().requires_grad_(True) for p in init]
    ob = Lion([{"params": pb[:2]}, {"params": pb[2:]}], foreach=True, maximize=True)
    ob.load_state_dict(sd)
    for group in ob.param_groups:
        assert group["foreach"] is None
        assert group["maximize"] is False
        assert group["momentum_dtype"] is None
    assert all(s["step"] == 2 and isinstance(s["step"], int) for s in ob.state.values())
    for p in pb:
        p.grad = torch.ones_like(p)
    ob.step()
    assert all(s["step"] == 3 for s in ob.state.values())


# --------------------------------------------------------------------------------------------------
# behaviour
# --------------------------------------------------------------------------------------------------


def test_closure_returns_loss_and_enables_grad():
    w = torch.tensor([1.0, -1.0], requires_grad=True)
    opt = Lion([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() == pytest.approx(2.0)
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, -0.9]))
    assert opt.step() is None


def test_maximize_flips_direction():
    p0 = torch.tensor([0.5, -0.5, 2.0])
    g = torch.tensor([1.0, -3.0, 0.25])
    a = p0.clone().requires_grad_(True)
    b = p0.clone().requires_grad_(True)
    oa = Lion([a], lr=0.1, weight_decay=0.2, maximize=True)
    ob = Lion([b], lr=0.1, weight_decay=0.2)
    for _ in range(3):
        a.grad = g.clone()
        b.grad = -g
        oa.step()
        ob.step()
        assert torch.equal(a, b)
        assert torch.equal(oa.state[a]["exp_avg"], ob.state[b]["exp_avg"])  # both track -g
    c = p0.clone().requires_grad_(True)
    oc = Lion([c], lr=0.1, maximize=True)
    c.grad = g.clone()
    oc.step()
    torch.testing.assert_close(c.detach(), p0 + 0.1 * torch.sign(g))


def test_momentum_dtype_float32_with_bf16_params():
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(16, generator=gen).bfloat16().requires_grad_(True)
    opt = Lion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, momentum_dtype=torch.float32)
    ref_p = p.detach().clone()
    ref_m = torch.zeros(16, dtype=torch.float32)
    for _ in range(10):
        g = torch.randn(16, generator=gen).bfloat16()
        p.grad = g
        opt.step()
        # fp32 math on the up-cast parameter, rounded back to bf16 each step
        g32 = g.float()
        c = 0.9 * ref_m + 0.1 * g32
        ref_p = (ref_p.float() * (1 - 1e-2 * 0.1) - 1e-2 * torch.sign(c)).bfloat16()
        ref_m = 0.99 * ref_m + 0.01 * g32
        assert p.dtype == torch.bfloat16
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(p.detach(), ref_p, rtol=0, atol=1e-2)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_m, rtol=1e-5, atol=1e-6)


def test_param_groups_and_lr_read_each_step():
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    opt = Lion([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.25)
    a.grad = torch.ones(2)
    b.grad = torch.ones(2)
    opt.step()
    assert a.tolist() == [-0.25, -0.25]
    assert b.tolist() == [-0.5, -0.5]
    opt.param_groups[0]["lr"] = 0.125
    opt.step()
    assert a.tolist() == [-0.375, -0.375]


# --------------------------------------------------------------------------------------------------
# functional helpers
# --------------------------------------------------------------------------------------------------


def test_functional_helpers():
    m = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    g = torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64)
    c = lion_direction(m, g, 0.75)
    assert c.data_ptr() != m.data_ptr()
    assert c.tolist() == [1.5, -1.0, 0.0]
    assert m.tolist() == [1.0, -2.0, 0.0]

    p = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    out = apply_update_(p, torch.sign(c), lr=0.5, weight_decay=0.5)
    assert out is p
    assert p.tolist() == [0.25, 2.0, 3.0]

    out = update_momentum_(m, g, 0.5)
    assert out is m
    assert m.tolist() == [2.0, 0.0, 0.0]


@pytest.mark.parametrize("foreach", [True, False])
def test_lion_update_matches_composition(foreach):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs = [torch.randn_like(p) for p in params]
    want_p = [p.clone() for p in params]
    want_m = [m.clone() for m in exp_avgs]
    for p, g, m in zip(want_p, grads, want_m, strict=True):
        update = lion_direction(m, -g, 0.9).sign_()
        apply_update_(p, update, lr=1e-2, weight_decay=0.3)
        update_momentum_(m, -g, 0.99)
    lion_update_(
        params,
        grads,
        exp_avgs,
        lr=1e-2,
        beta1=0.9,
        beta2=0.99,
        weight_decay=0.3,
        maximize=True,
        foreach=foreach,
    )
    for a, b in zip(params + exp_avgs, want_p + want_m, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same length"):
        lion_update_(params, grads[:1], exp_avgs, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0)


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": math.inf}, "lr"),
        ({"lr": "fast"}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"weight_decay": math.inf}, "weight_decay"),
        ({"weight_decay": math.nan}, "weight_decay"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": (0.9, 0.99, 0.999)}, "betas"),
        ({"betas": 0.9}, "betas"),
        ({"betas": (1.0, 0.99)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"betas": (0.9, math.nan)}, r"betas\[1\]"),
        ({"momentum_dtype": torch.int32}, "momentum_dtype"),
        ({"foreach": "yes"}, "foreach"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        Lion([p], **kwargs)
    with pytest.raises(ValueError, match=match):
        Lion([{"params": [p], **kwargs}])


def test_error_messages_name_value_and_range():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid lr: -0\.5 \(expected a finite number >= 0\)"):
        Lion([p], lr=-0.5)
    with pytest.raises(ValueError, match=r"Invalid betas\[0\]: 1\.5.*0 <= beta < 1"):
        Lion([p], betas=(1.5, 0.9))


def test_sparse_gradient_raises_with_index():
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    opt = Lion([{"params": [a]}, {"params": [a.new_zeros(1).requires_grad_(True), b]}])
    a.grad = torch.ones(3)
    b.grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True)
    with pytest.raises(RuntimeError, match=r"sparse.*param_groups\[1\]\['params'\]\[1\]"):
        opt.step()


def test_complex_param_or_grad_raises():
    with pytest.raises(ValueError, match=r"complex.*param_groups\[0\]\['params'\]\[1\]"):
        Lion([torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.complex64, requires_grad=True)])
    p = torch.zeros(2, requires_grad=True)
    opt = Lion([p])
    z = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1  # the rejected group is not kept
    # Bypass construction-time validation: step() checks again.
    opt.param_groups[0]["params"].append(z)
    p.grad = torch.ones(2)
    z.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=r"complex.*param_groups\[0\]\['params'\]\[1\]"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# convergence
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("foreach", [True, False])
def test_converges_on_quadratic(foreach):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(10, generator=gen)
    w = torch.zeros(10, requires_grad=True)
    opt = Lion([w], lr=0.02, betas=(0.9, 0.99), foreach=foreach)

    def loss_fn():
        return ((w - target) ** 2).sum()

    initial = loss_fn().item()
    for _ in range(200):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert loss_fn().item() < 0.01 * initial
