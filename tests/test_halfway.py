"""Exact half-way inputs: the normalised quantizers compute ``round((x / M) · (s / k))``, as the authors'
code, in every backend (round half to even, never a precomputed float32 scale).

A level ``(x / M) · (s / k)`` that lies exactly half-way between two integers must round to the even one.
Scaling by a precomputed ``float32(s / (k·M))`` instead lands a hair above or below such points and
rounds them either way: every 1-element tensor with an odd level budget s and k = 2 (x / M = ±1, level
±s/2; s = 63, 31, 15 for 2, 4, 8 workers at 8 bits) got a level off by one in 12-15 % of cases.

The inputs (``tests/halfway_cases.py``) are built so that M = μ·2^p (μ a small odd integer) is known in
advance and ``x / M`` is a dyadic ratio with few bits: the exact level is computed in float64, and every
backend (the numpy CPU path, the torch path that CUDA runs, ``lioncub.ops.kernels.quantize_l1``'s torch
backend; the torch path as a GPU runs it, reading nothing on the host; the Triton kernel in
``tests/kernels_interp.py``, case ``quantize_l1_halfway``) must give it bit for bit. Then the vote
(simulated ranks) and ``LionCub`` on two gloo ranks with a scalar parameter (the minimal example,
``MINIMAL``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from halfway_cases import BUDGETS, FLOATS, MINIMAL, Case, halfway_cases, level_budget
from lioncub.collectives import QuantizedVote
from lioncub.ops import kernels, normalizers
from lioncub.ops import quantize as Q
from profiles import examples
from sim_comm import run_vote

from processes import run_workers


@contextlib.contextmanager
def off_the_cpu() -> Iterator[None]:
    """The quantizers as a GPU runs them without Triton: float64 sums in pieces, and the scaling in
    float64 rounded to the work dtype without reading it on the host."""
    with (
        mock.patch.object(Q, "_reads_free", lambda t: False),
        mock.patch.object(normalizers, "on_host", lambda t: False),
    ):
        yield


def settings_for(count: int) -> settings:
    return settings(max_examples=examples(count), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def backends(case: Case, name: str, **options) -> dict[str, torch.Tensor]:
    """The levels of every CPU backend: per group (chunk_size), per segment, numpy and torch paths."""
    x, chunk, s = case.x, case.chunk, case.s
    options = options | ({"clip_multiple": case.k} if name != "log" else {})
    got = {"numpy, chunk_size": Q.quantize(name, x, s, chunk_size=chunk, **options)}
    got["numpy, per call"] = torch.cat([Q.quantize(name, g, s, **options) for g in x.split(chunk)])
    with mock.patch.object(Q, "_numpy_path", lambda t: False):  # the device-generic torch path
        got["torch, chunk_size"] = Q.quantize(name, x, s, chunk_size=chunk, **options)
    with off_the_cpu():
        got["off the CPU (no host reads), chunk_size"] = Q.quantize(name, x, s, chunk_size=chunk, **options)
    if name == "l1":
        for chunked in (True, False):
            got[f"kernels torch backend, chunked={chunked}"] = kernels.quantize_l1(
                x,
                s,
                clip_multiple=case.k,
                chunk_size=chunk if chunked else None,
                segments=None if chunked else [chunk] * (x.numel() // chunk),
                backend="torch",
            )
    return got


def assert_levels(case: Case, got: dict[str, torch.Tensor]) -> None:
    for what, q in got.items():
        q = q.to(torch.int64).numpy()
        bad = np.flatnonzero(q != case.want)
        assert bad.size == 0, (
            f"{what}: s={case.s} k={case.k} {case.x.dtype}: levels {q[bad[:5]].tolist()} at "
            f"{bad[:5].tolist()} for x = {case.x[bad[:5]].tolist()}, want {case.want[bad[:5]].tolist()}"
        )


# ------------------------------------------------------------------------------------- the quantizers


def test_the_minimal_example() -> None:
    """8bit, N = 2 (s = 63): each scalar lands on ±31.5 and rounds to the even ±32."""
    for dtype in FLOATS:
        x = torch.tensor(MINIMAL, dtype=dtype)
        assert Q.quantize_l1(x, 63, chunk_size=1).tolist() == [32, -32]
        assert [Q.quantize_l1(v, 63).item() for v in x] == [32, -32]
        assert kernels.quantize_l1(x, 63, segments=[1, 1], backend="torch").tolist() == [32, -32]


def test_halfway_rounds_to_even_in_both_directions() -> None:
    x = torch.tensor([1.0, -1.0])  # M = 1, s = 3, k = 2: levels ±1.5 -> ±2
    assert Q.quantize_l1(x, 3).tolist() == [2, -2]
    x = torch.tensor([0.25, 1.75, -0.75, -1.25])  # M = 1, s = 2, k = 1: 0.5, 3.5, -1.5, -2.5 -> clip
    assert Q.quantize_l1(x, 2, clip_multiple=1.0).tolist() == [0, 2, -2, -2]
    x = torch.tensor([0.125, 1.875, -0.375, -1.625])  # M = 1, s = 4, k = 2: 0.25, 3.75, -0.75, -3.25
    assert Q.quantize_l1(x, 4).tolist() == [0, 4, -1, -3]
    x = torch.tensor([0.25, 1.75, -0.75, -1.25])  # M = 1, s = 4, k = 2: 0.5, 3.5, -1.5, -2.5
    assert Q.quantize_l1(x, 4).tolist() == [0, 4, -2, -2]


@settings_for(200)
@given(halfway_cases("l1"))
def test_l1_halfway_levels_in_every_backend(case: Case) -> None:
    assert_levels(case, backends(case, "l1"))


@settings_for(150)
@given(st.sampled_from(["linf", "lp", "l0"]), st.data())
def test_other_normalisations_halfway_levels(name: str, data: st.DataObject) -> None:
    """L∞, Lp and L0 share the L1 quantizer's scaling: the same rule (L0 over float64 is left out: its
    geometric mean ``exp(mean log |x|)`` of equal magnitudes can be off by an ulp)."""
    dtypes = FLOATS if name != "l0" else FLOATS[:3]
    case = data.draw(halfway_cases(name, dtypes))
    options = {"p": data.draw(st.sampled_from([1.5, 3.0]))} if name == "lp" else {}
    assert_levels(case, backends(case, name, **options))


#: a group's values per dtype: any finite float64 that stays finite in the dtype (at most its largest
#: value; the subnormal ones lifted to its smallest normal by the test), instead of any finite float64 and
#: a rejection of those that overflow (~40 % of the draws were rejected)
FINITE_VALUES = {
    dtype: st.lists(
        st.floats(-torch.finfo(dtype).max, torch.finfo(dtype).max, allow_subnormal=False),
        min_size=1,
        max_size=20,
    )
    for dtype in FLOATS
}


@settings_for(200)
@given(
    st.sampled_from(["l1", "linf", "lp", "l0"]).flatmap(
        lambda name: st.tuples(st.just(name), st.sampled_from(FLOATS if name != "l0" else FLOATS[:3]))
    ),
    st.sampled_from([b for b in BUDGETS if b < 1000]),
    st.data(),
)
def test_scalar_groups_land_on_s_over_k(name_dtype, s, data) -> None:
    """A group of one element (a scalar parameter, or chunk_size=1) has x / M = ±1 exactly: its level is
    ``sign(x) · round(s / 2)``, half-way for every odd s (L0 over float64 left out, as in
    test_other_normalisations_halfway_levels)."""
    name, dtype = name_dtype
    x = torch.tensor(data.draw(FINITE_VALUES[dtype]), dtype=torch.float64).to(dtype)
    assert bool(torch.isfinite(x).all())  # at most the dtype's largest value: rounds to a finite one
    tiny = torch.finfo(dtype).tiny
    x = torch.where(x.abs() < tiny, torch.full_like(x, tiny), x)  # normal, nonzero
    sign = np.sign(x.double().numpy())
    want = (sign * np.rint(s / 2)).astype(np.int64)
    options = {"p": 1.5} if name == "lp" else {}
    got = Q.quantize(name, x, s, chunk_size=1, **options).to(torch.int64).numpy()
    assert np.array_equal(got, want), f"{name} {dtype} s={s}: {got.tolist()} for {x.tolist()}"
    with mock.patch.object(Q, "_numpy_path", lambda t: False):
        assert np.array_equal(Q.quantize(name, x, s, chunk_size=1, **options).to(torch.int64).numpy(), want)
    with off_the_cpu():
        assert np.array_equal(Q.quantize(name, x, s, chunk_size=1, **options).to(torch.int64).numpy(), want)
    if name == "l1":
        got = kernels.quantize_l1(x, s, segments=[1] * x.numel(), backend="torch")
        assert np.array_equal(got.to(torch.int64).numpy(), want)


# ------------------------------------------------------------------------------------------ the vote


def _vote(values: list[float], bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quantized L1 vote of N simulated ranks, each holding one vector of scalar parameters."""
    locals_ = [torch.tensor(v, dtype=dtype).reshape(-1) for v in values]
    segments = [1] * locals_[0].numel()
    return run_vote(lambda comm: QuantizedVote(comm, "l1", bits), locals_, step=1, segments=segments)[0]


def test_the_minimal_example_through_the_vote() -> None:
    """Levels (32, −32) sum to 0: no update. Scaled by float32(s / (k·M)) they were (32, −31): +1."""
    assert _vote([[MINIMAL[0]], [MINIMAL[1]]], 8).tolist() == [0]


#: the magnitudes of the vote's scalars per dtype: normal (nonzero and finite in the dtype), or near 1
MAGNITUDES = {
    dtype: st.floats(torch.finfo(dtype).tiny, torch.finfo(dtype).max) | st.floats(0.5, 2.0)
    for dtype in FLOATS[:3]
}


@settings_for(200)
@given(st.integers(2, 16), st.sampled_from([8, 4, 2]), st.integers(1, 6), st.data())
def test_scalar_parameters_vote_the_majority_of_signs(n: int, bits: int, d: int, data) -> None:
    """Every rank's scalar lands on ±round(s/2): the vote is the sign of the sum of the signs (0 on a
    tie), whatever the magnitudes (and 0 where round(s/2) is 0). A rank's d signs are the bits of one drawn
    integer (all positive, all negative, any mix: one choice, not d list elements)."""
    assume(level_budget(n, bits) > 0)
    dtype = data.draw(st.sampled_from(FLOATS[:3]))
    mags = np.array(data.draw(st.lists(MAGNITUDES[dtype], min_size=n * d, max_size=n * d))).reshape(n, d)
    negative = np.array(data.draw(st.lists(st.integers(0, (1 << d) - 1), min_size=n, max_size=n)))
    negative = negative[:, None] >> np.arange(d) & 1
    values = np.where(negative == 1, -mags, mags).tolist()
    level = np.rint(level_budget(n, bits) / 2)  # s = 1 (e.g. 4 bits, 4 workers): 0.5 rounds to 0, no vote
    want = np.sign(level * np.sign(np.array(values)).sum(0)).astype(np.int8)
    got = _vote(values, bits, dtype)
    assert got.tolist() == want.tolist(), f"N={n} bits={bits}: {got.tolist()} for {values}"


# ------------------------------------------------------------------------ LionCub, a scalar parameter


def worker_scalar_parameter(rank: int, world: int, variant: str) -> list[torch.Tensor]:
    from lioncub.optim import LionCub

    scalar = torch.nn.Parameter(torch.tensor(1.0))
    vector = torch.nn.Parameter(torch.zeros(3))
    opt = LionCub([scalar, vector], lr=0.1, betas=(0.0, 0.99), variant=variant)
    scalar.grad = torch.tensor(MINIMAL[rank])  # β1 = 0: c = g
    vector.grad = torch.tensor([1.0, -2.0, 4.0]) * (1 if rank == 0 else -1) + torch.tensor([0.0, 0.0, 1.0])
    opt.step()
    return [scalar.detach().clone(), vector.detach().clone()]


def test_lioncub_scalar_parameter_on_two_ranks() -> None:
    """The minimal example end to end: 8bit, 2 gloo ranks, a scalar parameter with
    c = (+0.8797774, −0.3): levels (32, −32), u = 0, the parameter stays (it moved by −lr before)."""
    results = run_workers(worker_scalar_parameter, 2, "8bit")
    for scalar, vector in results:
        assert scalar.item() == 1.0
        # vector: c = (1, −2, 5) and (−1, 2, −3), mean |c| = 8/3 and 2: levels (12, −24, 59) and
        # (−16, 32, −47) (31.5 -> 32: half-way too), sums (−4, 8, 12): u = (−1, +1, +1)
        assert torch.equal(vector, torch.tensor([0.1, -0.1, -0.1]))
