"""The N-worker oracle: plain single-process simulations of N data-parallel workers, the one module that
the tests and the benchmarks import (``benchmarks/scale_sim.py`` and ``benchmarks/local_sim.py`` put
``tests/`` on their path).

* The vote rules, each written once, on the N workers' directions stacked along dim 0 (``C``, ``[N, ...]``):
  every worker's vote, counted and summed in int64, the tie rule from the step parity; :func:`preset_vote`
  picks a preset's, :func:`sim_vote` takes the directions as a list. Only the quantizers (tested on their
  own against a float64 numpy oracle) are lioncub's. They are written independently of the optimizer and
  the collectives, which the tests compare with them bit for bit.
* :func:`simulate_steps`: N workers each keeping its own Lion momentum (the dense presets: one momentum of
  the mean gradient, global Lion), an update every step, with the optimizer's roundings.
* :func:`simulate_local_steps`: local steps, H inner Lion steps per worker and then the outer step of a rule.
* :class:`WorkloadWorkers`: the N workers of a lioncub workload that the benchmarks simulate (their
  gradients, the lr schedule, the steps' loss).
* The tests' problem (:data:`SHAPES`, :data:`GROUPS`, :func:`local_grad`, ...) with :func:`simulate` and
  :func:`simulate_local` on it; :func:`worker_run_presets`, the same run with LionCub on gloo ranks
  (``processes.run_workers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lioncub.ops import quantize
from lioncub.optim import PRESETS, LionCub, resolve_variant
from lioncub.optim.config import DENSE_RULES

SHAPES = [(37,), (13, 11), (5,), (3, 7, 2), (64,)]  # 37 + 143 + 5 + 42 + 64 = 291 elements
GROUPS = [([0, 1, 2], 0.01, 0.1), ([3, 4], 0.003, 0.0)]  # (param indices, lr, weight_decay)
BETAS = (0.9, 0.99)
#: the sign rules' outer betas (β1ᵒ, β2ᵒ) where none are given (``docs/local-steps.md``)
OUTER_BETAS = (0.9, 0.96)
STEPS = 6
ALL_PRESETS = sorted(PRESETS)
DENSE = ("32bit", "16bit")

#: a vote rule: ``(preset, the N workers' directions, step, N) -> update`` (as :func:`sim_vote`)
Vote = Callable[[str, list[Tensor], int, int], Tensor]
#: ``(rank, step, the rank's parameters) -> each tensor's gradient on that rank`` (None: it has none)
Grads = Callable[[int, int, list[Tensor]], list[Tensor | None]]
#: ``(step, tensor index) -> (lr, weight decay)`` of that step
Hyper = Callable[[int, int], tuple[float, float]]


# ---------------------------------------------------------------------------------------- the vote rules


def tie_sign(step: int) -> int:
    """The alternating tie rule of the 1-bit vote: +1 on odd steps, −1 on even steps."""
    return 1 if step % 2 == 1 else -1


def one_bit_votes(C: Tensor, step: int, zeros: str = "split") -> Tensor:
    """Each worker's one-bit vote (int64 0/1, ``[N, ...]``): ``c > 0``, and an exact zero "+" where
    ``rank + step`` is even (``zeros="split"``, lioncub's default) or always (``"plus"``, the papers')."""
    rank = torch.arange(C.shape[0]).view(-1, *[1] * (C.dim() - 1))
    zero_plus = (rank + step) % 2 == 0 if zeros == "split" else torch.ones_like(rank, dtype=torch.bool)
    return ((C > 0) | ((C == 0) & zero_plus)).to(torch.int64)


def _margin(C: Tensor, step: int) -> Tensor:
    """2·#{votes "+"} − N per element (int64)."""
    return 2 * one_bit_votes(C, step).sum(0) - C.shape[0]


def majority_1bit(C: Tensor, step: int) -> Tensor:
    """``1bit``: the majority of the one-bit votes, ties by :func:`tie_sign` (±1 in ``C``'s dtype)."""
    margin = _margin(C, step)
    return torch.where(margin == 0, tie_sign(step), torch.sign(margin)).to(C.dtype)


def majority_ties_zero(C: Tensor, step: int) -> Tensor:
    """``4bit``, ``dlion-mavo``: the majority of the one-bit votes, 0 on a tie."""
    return torch.sign(_margin(C, step)).to(C.dtype)


def sign_of_sign_sum(C: Tensor) -> Tensor:
    """``8bit-sign``: the sign of the sum of the workers' signs (0 on a tie)."""
    return torch.sign(torch.sign(C).to(torch.int64).sum(0)).to(C.dtype)


def average_of_signs(C: Tensor) -> Tensor:
    """``dlion-avg``, Distributed Lion's average: ``Σ_r sign(c_r) / N`` in ``C``'s dtype."""
    return torch.sign(C).to(torch.int64).sum(0).to(C.dtype) / C.shape[0]


def l1_vote(C: Tensor, levels: int, bound: int | None = None) -> Tensor:
    """The sign of the sum of the workers' L1 levels (``quantize_l1(c_r, levels)`` of the whole tensor),
    summed in rank order; ``bound``: the largest sum the wire holds (asserted)."""
    total = sum(quantize.quantize_l1(c, levels).to(torch.int64) for c in C)
    assert isinstance(total, Tensor)
    assert bound is None or int(total.abs().max()) <= bound  # the integer sum cannot overflow
    return torch.sign(total).to(C.dtype)


def node_majority(C: Tensor, step: int, per_node: int) -> Tensor:
    """``topology="node-majority"``: each node's 1-bit majority of its ``per_node`` ranks (rank = node·L +
    local), then the 1-bit majority of the nodes; both with the tie rule."""
    nodes, tie = C.shape[0] // per_node, tie_sign(step)
    votes = one_bit_votes(C, step).view(nodes, per_node, *C.shape[1:])
    margin = 2 * votes.sum(1) - per_node
    node_votes = torch.where(margin == 0, tie, torch.sign(margin))  # [nodes, ...], ±1
    margin = 2 * (node_votes > 0).to(torch.int64).sum(0) - nodes
    return torch.where(margin == 0, tie, torch.sign(margin)).to(C.dtype)


def preset_vote(preset: str, C: Tensor, step: int) -> Tensor:
    """The update of ``preset``'s vote from the N workers' directions ``C`` (as N workers vote, N = 1
    too)."""
    if preset == "1bit":
        return majority_1bit(C, step)
    if preset in ("4bit", "dlion-mavo"):
        return majority_ties_zero(C, step)
    if preset == "8bit-sign":
        return sign_of_sign_sum(C)
    if preset == "dlion-avg":
        return average_of_signs(C)
    if preset == "8bit":
        return l1_vote(C, 127 // C.shape[0], bound=127)  # ⌊127/N⌋ levels each: an int8 sum
    raise AssertionError(preset)


def sim_vote(preset: str, cs: list[Tensor], step: int, n: int, alone: bool = True) -> Tensor:
    """:func:`preset_vote` of the directions ``cs`` (one per worker) in float64; ``alone``: one worker of a
    majority preset takes the one-process shortcut (``sign(c)``), else it votes as N workers do."""
    if n == 1 and alone and preset in ("1bit", "4bit", "dlion-mavo"):
        return torch.sign(cs[0])
    return preset_vote(preset, torch.stack(cs), step).to(torch.float64)


def node_majority_oracle(nodes: int) -> Vote:
    """:func:`node_majority` on ``nodes`` nodes of ``n // nodes`` ranks, as a :data:`Vote`."""

    def vote(preset: str, cs: list[Tensor], step: int, n: int) -> Tensor:
        return node_majority(torch.stack(cs), step, n // nodes).to(torch.float64)

    return vote


# --------------------------------------------------------------------------- the steps, as lioncub rounds


def direction(momentum: Tensor, grad: Tensor, beta1: float) -> Tensor:
    """Lion's pre-sign update ``m·β1 + (1−β1)·g``."""
    return momentum.mul(beta1).add_(grad, alpha=1 - beta1)


def next_momentum(momentum: Tensor, grad: Tensor, beta2: float) -> Tensor:
    """Lion's momentum ``m·β2 + (1−β2)·g``."""
    return momentum.mul(beta2).add_(grad, alpha=1 - beta2)


def applied(param: Tensor, update: Tensor, lr: float, weight_decay: float) -> Tensor:
    """``p·(1 − lr·wd) − lr·u`` with torch's ``add(alpha=)`` (a fused multiply-add rounds alike)."""
    return (param * (1 - lr * weight_decay)).add_(update.to(param.dtype), alpha=-lr)


def dense_mean(tensors: list[Tensor], wire: torch.dtype) -> Tensor:
    """The dense presets' mean: each tensor in the wire dtype divided by N, summed in rank order, back in
    the tensors' dtype."""
    n = len(tensors)
    total = tensors[0].to(wire).div(n)
    for t in tensors[1:]:
        total = total.add(t.to(wire).div(n))
    return total.to(tensors[0].dtype)


def _wire(preset: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if preset == "32bit" else torch.bfloat16


@dataclass
class Workers:
    """What :func:`simulate_steps` leaves: the parameters every worker holds (identical replicas), each
    worker's momenta (None: a tensor never trained) and the dense presets' one momentum."""

    theta: list[Tensor]
    momenta: list[list[Tensor | None]]
    shared: list[Tensor | None]

    def momentum(self, preset: str, rank: int = 0) -> list[Tensor | None]:
        """The momenta ``rank``'s optimizer holds: the shared ones for the dense presets."""
        return self.shared if preset in DENSE else self.momenta[rank]


#: ``(step, θ after it, each tensor's directions [N, ...] and update)`` after every step (None: untouched)
StepHook = Callable[[int, list[Tensor], list[Tensor | None], list[Tensor | None]], None]


def simulate_steps(
    preset: str,
    n: int,
    theta: list[Tensor],
    steps: int,
    grads: Grads,
    hyper: Hyper,
    *,
    betas: tuple[float, float] = BETAS,
    vote: Vote | None = None,
    alone: bool = True,
    on_step: StepHook | None = None,
) -> Workers:
    """``steps`` steps of ``preset`` on ``n`` workers from ``theta`` (rank 0's values, broadcast): each
    worker's direction from its own momentum and gradient; the update is ``vote`` (default: the preset's,
    :func:`sim_vote`) of the N directions, or for the dense presets the sign of the one momentum's direction
    on :func:`dense_mean` in the wire dtype (bf16 for ``16bit``). A tensor no rank has a gradient for is not
    touched (its momenta neither); a rank without one contributes zeros. ``alone`` (N = 1): Lion's step,
    exactly; ``alone=False``: one worker votes, and rounds through the wire, as N workers do."""
    beta1, beta2 = betas
    theta = list(theta)
    momenta: list[list[Tensor | None]] = [[None] * len(theta) for _ in range(n)]
    shared: list[Tensor | None] = [None] * len(theta)
    for step in range(1, steps + 1):
        given = [grads(r, step, theta) for r in range(n)]
        stacked: list[Tensor | None] = [None] * len(theta)
        updates: list[Tensor | None] = [None] * len(theta)
        for i, p in enumerate(theta):
            if all(given[r][i] is None for r in range(n)):
                continue
            gs = [g if (g := given[r][i]) is not None else torch.zeros_like(p) for r in range(n)]
            ms = [m if (m := momenta[r][i]) is not None else torch.zeros_like(p) for r in range(n)]
            cs = [direction(ms[r], gs[r], beta1) for r in range(n)]
            if preset in DENSE:
                g = dense_mean(gs, p.dtype if n == 1 and alone else _wire(preset, p.dtype))
                m = shared[i] if shared[i] is not None else torch.zeros_like(p)
                u = torch.sign(direction(m, g, beta1))
                shared[i] = next_momentum(m, g, beta2)
            elif n == 1 and alone:  # one process: LionCub is exactly Lion, whatever the preset
                u = torch.sign(cs[0])
            else:
                u = vote(preset, cs, step, n) if vote else sim_vote(preset, cs, step, n, alone)
            for r in range(n):
                momenta[r][i] = next_momentum(ms[r], gs[r], beta2)
            lr, wd = hyper(step, i)
            theta[i] = applied(p, u, lr, wd)
            stacked[i], updates[i] = torch.stack(cs), u
        if on_step is not None:
            on_step(step, theta, stacked, updates)
    return Workers(theta, momenta, shared)


#: ``(step, the outer parameters θ, every rank's parameters)`` after every step
LocalHook = Callable[[int, list[Tensor], list[list[Tensor]]], None]


def simulate_local_steps(
    variant: str,
    outer: str,
    n: int,
    h: int,
    outer_lr: float,
    theta: list[Tensor],
    steps: int,
    grads: Grads,
    hyper: Hyper,
    *,
    betas: tuple[float, float] = BETAS,
    outer_betas: tuple[float, float] = OUTER_BETAS,
    inner_momentum: str = "reset",
    on_step: LocalHook | None = None,
) -> list[list[Tensor]]:
    """Every rank's parameters after ``steps`` steps from ``theta`` (rank 0's values, broadcast): H inner
    Lion steps per rank without weight decay (a None gradient leaves a tensor alone, as Lion), then the
    outer step on Δ_r = θ_t − θ_r followed by the window's decay D = Π (1 − lr_k·wd) over its H inner
    steps, then the inner momenta zeroed (``reset``), left (``keep``) or averaged over the ranks in fp32
    (``average``: the sum in rank order, divided by N). The outer steps (``outer_betas`` (β1ᵒ, β2ᵒ), ηᵒ =
    outer_lr·H·lr): ``vote``, ``variant``'s vote of ``c_r = β1ᵒ·M_r + (1 − β1ᵒ)·Δ_r``, then ``M_r ←
    β2ᵒ·M_r + (1 − β2ᵒ)·Δ_r``; ``dsm``, the sign of the same on the mean Δ̄ (:func:`dense_mean` in
    ``variant``'s wire) with one momentum; ``diloco``, Nesterov SGD on Δ̄ (μ = 0.9, ``θ ← θ_t −
    outer_lr·(Δ̄ + μv)``)."""
    beta1, beta2 = betas
    thetas = [[p.clone() for p in theta] for _ in range(n)]
    anchor = [p.clone() for p in theta]
    m_in = [[torch.zeros_like(p) for p in theta] for _ in range(n)]
    m_out = [[torch.zeros_like(p) for p in theta] for _ in range(n)]
    buf: list[Tensor | None] = [None] * len(anchor)
    decay = [1.0] * len(anchor)  # the window's weight decay so far, the same on every rank
    for step in range(1, steps + 1):
        for i in range(len(anchor)):
            lr, wd = hyper(step, i)
            decay[i] *= 1.0 - lr * wd
        for r in range(n):
            given = grads(r, step, thetas[r])
            for i, p in enumerate(thetas[r]):
                g = given[i]
                if g is None:
                    continue
                u = torch.sign(direction(m_in[r][i], g, beta1))
                thetas[r][i] = p.clone().add_(u, alpha=-hyper(step, i)[0])  # no decay: the window's, later
                m_in[r][i] = next_momentum(m_in[r][i], g, beta2)
        if step % h == 0:
            for i in range(len(anchor)):
                deltas = [anchor[i] - thetas[r][i] for r in range(n)]
                eta = outer_lr * h * hyper(step, i)[0]
                anchor[i] = _outer_step(
                    variant, outer, step // h, i, anchor[i], deltas, m_out, buf, eta, outer_lr, outer_betas
                )
                anchor[i] = anchor[i] * decay[i] if decay[i] != 1.0 else anchor[i]
            thetas = [[a.clone() for a in anchor] for _ in range(n)]
            decay = [1.0] * len(anchor)
            if inner_momentum == "reset":
                m_in = [[torch.zeros_like(m) for m in ms] for ms in m_in]
            elif inner_momentum == "average":
                for i in range(len(anchor)):
                    total = m_in[0][i].float()
                    for r in range(1, n):
                        total = total + m_in[r][i].float()
                    for r in range(n):
                        m_in[r][i] = total.div(n).to(m_in[r][i].dtype)
        if on_step is not None:
            on_step(step, anchor, thetas)
    return thetas


def _outer_step(
    variant: str,
    outer: str,
    t: int,
    i: int,
    anchor: Tensor,
    deltas: list[Tensor],
    m_out: list[list[Tensor]],
    buf: list[Tensor | None],
    eta: float,
    outer_lr: float,
    outer_betas: tuple[float, float],
) -> Tensor:
    """Outer step ``t`` of tensor ``i`` (before the window's decay): the new θ; ``m_out`` (the ranks' outer
    momenta; ``dsm``: rank 0's is the one) and ``buf`` (DiLoCo's) move."""
    n = len(deltas)
    if outer in DENSE_RULES:
        mean = dense_mean(deltas, _wire(variant, anchor.dtype))
        if outer == "diloco":
            buf[i] = mean.clone() if (b := buf[i]) is None else b.mul_(0.9).add_(mean)
            return anchor.add(mean.add(buf[i], alpha=0.9), alpha=-outer_lr)  # type: ignore[arg-type]
        u = torch.sign(direction(m_out[0][i], mean, outer_betas[0]))
        m_out[0][i] = next_momentum(m_out[0][i], mean, outer_betas[1])
    else:
        cs = [direction(m_out[r][i], deltas[r], outer_betas[0]) for r in range(n)]
        u = sim_vote(variant, cs, t, n)
        for r in range(n):
            m_out[r][i] = next_momentum(m_out[r][i], deltas[r], outer_betas[1])
    return anchor.add(u.to(anchor.dtype), alpha=-eta)


# ------------------------------------------------------------------- a workload's workers (the benchmarks)


class WorkloadWorkers:
    """N workers of a lioncub workload in one process, for :func:`simulate_steps` and
    :func:`simulate_local_steps` (``benchmarks/scale_sim.py``, ``benchmarks/local_sim.py``): each worker's
    gradient at its own parameters on its own batch (:meth:`grads`), the lr schedule of ``lioncub train``
    (:meth:`hyper`: every param group's lr times ``lr_scale``) and the steps' mean training loss.

    Args:
        wl: the workload (built for ``world_size=n``); ``model``: its model, whose parameters are loaded
            with each worker's values in turn.
        n, seed, data_mode: the workers, and their samplers' seed and mode (as the workload's ranks).
        steps: the run's steps (the schedule's length; its warm-up is ``lioncub train``'s default).
    """

    def __init__(
        self,
        wl: Any,
        model: torch.nn.Module,
        n: int,
        *,
        seed: int,
        data_mode: str,
        steps: int,
        lr_scale: float = 1.0,
    ) -> None:
        from lioncub.train.config import RunConfig, lr_factor  # the benchmarks' import, not the tests'

        self.schedule = lr_factor
        self.wl, self.model, self.n, self.steps = wl, model, n, steps
        self.params = list(model.parameters())
        self.samplers = [
            wl.data.sampler(wl.batch_size, wl.block_size, rank=r, world_size=n, seed=seed, mode=data_mode)
            for r in range(n)
        ]
        group_of = {id(p): g for g in wl.param_groups(model) for p in g["params"]}
        self.peak = [lr_scale * float(group_of[id(p)]["lr"]) for p in self.params]
        self.weight_decay = [float(group_of[id(p)]["weight_decay"]) for p in self.params]
        self.warmup = RunConfig(steps=steps).warmup
        self._loss = 0.0

    def load(self, theta: list[Tensor]) -> None:
        """The model's parameters set to ``theta``."""
        with torch.no_grad():
            for p, t in zip(self.params, theta, strict=True):
                p.copy_(t)

    def grads(self, r: int, step: int, theta: list[Tensor]) -> list[Tensor | None]:
        """Worker r's gradient at ``theta`` on its own batch (as ``lioncub train``: ``train_batch(step - 1)``)
        (:data:`Grads`); its loss counts towards the step's."""
        self.load(theta)
        wl = self.wl
        x, y = wl.data.windows("train", self.samplers[r].indices(step - 1), wl.block_size)
        self.model.zero_grad(set_to_none=True)
        loss = wl.loss(self.model, (x, y))
        loss.backward()
        self._loss += loss.item()
        return [p.grad for p in self.params]

    def hyper(self, step: int, i: int) -> tuple[float, float]:
        """(lr, weight decay) of tensor ``i`` at ``step``: warm-up, then the cosine to 0.1 (:data:`Hyper`)."""
        return self.peak[i] * self.schedule(step, self.steps, self.warmup, 0.1), self.weight_decay[i]

    def step_loss(self) -> float:
        """The mean training loss of the workers' gradients since the last call."""
        loss, self._loss = self._loss / self.n, 0.0
        return loss


# ------------------------------------------------------------------------------------ the tests' problem


def lr_factor(epoch: int) -> float:
    return 1.0 / (1 + epoch)  # LambdaLR: the lr of step t (t = 1, 2, ...) is base / t


def initial_params(rank: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(1234)
    # rank-dependent start: the optimizer must broadcast rank 0's values
    return [torch.randn(s, generator=g, dtype=torch.float64) + 0.5 * rank for s in SHAPES]


def param_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """``params`` (one per shape of :data:`SHAPES`) in the param groups of :data:`GROUPS`."""
    return [{"params": [params[i] for i in idx], "lr": lr, "weight_decay": wd} for idx, lr, wd in GROUPS]


def local_grad(rank: int, step: int, index: int, param: Tensor, grid_for: int = 0) -> Tensor | None:
    """Rank-dependent 'gradient' of parameter ``index`` at ``step``, with exact zeros and a None.

    ``grid_for=N`` draws gradients on the grid ``k·N/64`` (|k| ≤ 3): their means over N workers are
    exact in any summation order and in bf16, so the dense presets can be compared exactly too.
    """
    if index == 2 and step == 2 and rank % 2 == 1:
        return None  # treated as a zero gradient
    g = torch.Generator().manual_seed(100_000 * rank + 1000 * step + index)
    if grid_for:
        k = torch.randint(-3, 4, param.shape, generator=g).to(torch.float64)
        return k * grid_for / 64
    grad = torch.randn(param.shape, generator=g, dtype=torch.float64) + 0.3 * param
    if index == 0:
        grad.view(-1)[: 5 + rank] = 0.0  # exact zeros: with m = 0 at step 1 they make c exactly 0
    return grad


def group_hyper(step: int, i: int) -> tuple[float, float]:
    """The (lr, weight decay) of tensor ``i`` at ``step`` in :data:`GROUPS` under :func:`lr_factor`."""
    lr, wd = next((lr, wd) for idx, lr, wd in GROUPS if i in idx)
    return lr * lr_factor(step - 1), wd


def simulate(
    preset: str, n: int, vote: Vote | None = None, alone: bool = True, steps: int = STEPS
) -> list[Tensor]:
    """Every rank's parameters after ``steps`` steps of ``preset`` on ``n`` workers (float64) of the tests'
    problem (:func:`simulate_steps`; the dense presets' gradients on :func:`local_grad`'s grid)."""
    grid = n if preset in DENSE else 0

    def grads(rank: int, step: int, theta: list[Tensor]) -> list[Tensor | None]:
        return [
            g if (g := local_grad(rank, step, i, p, grid)) is not None else torch.zeros_like(p)
            for i, p in enumerate(theta)
        ]

    return simulate_steps(
        preset, n, initial_params(0), steps, grads, group_hyper, vote=vote, alone=alone
    ).theta


def simulate_local(
    variant: str, outer: str, n: int, h: int, outer_lr: float, steps: int, inner_momentum: str = "reset"
) -> list[list[Tensor]]:
    """:func:`simulate_local_steps` of the tests' problem (:func:`local_grad` without the grid)."""

    def grads(rank: int, step: int, theta: list[Tensor]) -> list[Tensor | None]:
        return [local_grad(rank, step, i, p) for i, p in enumerate(theta)]

    return simulate_local_steps(
        variant,
        outer,
        n,
        h,
        outer_lr,
        initial_params(0),
        steps,
        grads,
        group_hyper,
        inner_momentum=inner_momentum,
    )


# ------------------------------------------------------------------------ the same run on gloo ranks


def worker_run_presets(
    rank: int,
    world: int,
    presets: list[str],
    bucket_mb: float,
    exchange: str = "auto",
    topology: str = "flat",
    nodes: int = 1,
    exchange_alone: bool = False,
    steps: int = STEPS,
) -> dict:
    """:func:`simulate`'s run of every preset in ``presets`` with LionCub on this rank, ``steps`` steps
    (``topology``: over an ``(nodes, world // nodes)`` device mesh; ``exchange_alone``: built under
    :func:`lioncub.collectives.exchange_when_alone`): each preset's parameters, comm stats, buckets and vote
    class."""
    import contextlib

    from lioncub.collectives import exchange_when_alone

    out = {}
    group = None
    if topology != "flat":  # an (M, L) node mesh: rank = node·L + local
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("node", "local"))
    for preset in presets:
        params = [torch.nn.Parameter(p) for p in initial_params(rank)]
        with exchange_when_alone() if exchange_alone else contextlib.nullcontext():
            opt = LionCub(
                param_groups(params),
                betas=BETAS,
                variant=resolve_variant(preset, exchange=exchange, topology=topology),
                bucket_mb=bucket_mb,
                process_group=group,
            )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        for step in range(1, steps + 1):
            grid = world if preset in DENSE else 0
            for i, p in enumerate(params):
                p.grad = local_grad(rank, step, i, p.detach(), grid)
            opt.step()
            sched.step()
        out[preset] = {
            "params": [p.detach().clone() for p in params],
            "stats": opt.comm_stats(),
            "buckets": opt.bucket_numels,
            "vote": type(opt.engine.vote).__name__,
        }
    return out
