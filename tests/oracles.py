"""Oracles shared by several test files: plain single-process simulations of N workers.

The N-worker simulation of LionCub (:func:`simulate`, the vote of each preset in :func:`sim_vote`) is written
independently of the optimizer and the collectives: per-worker momenta, the vote of every element computed
from counts and sums in int64, the tie rule from the step parity. Only the quantizers (tested on their own
against a float64 numpy oracle) are shared. :func:`worker_run_presets` is the same run on real gloo ranks
(``dist_utils.run_workers``), which the tests compare with :func:`simulate` bit for bit.
:func:`node_majority_oracle` is the vote of ``topology="node-majority"``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lioncub.ops import quantize
from lioncub.optim import PRESETS, LionCub, resolve_variant

SHAPES = [(37,), (13, 11), (5,), (3, 7, 2), (64,)]  # 37 + 143 + 5 + 42 + 64 = 291 elements
GROUPS = [([0, 1, 2], 0.01, 0.1), ([3, 4], 0.003, 0.0)]  # (param indices, lr, weight_decay)
BETAS = (0.9, 0.99)
STEPS = 6
ALL_PRESETS = sorted(PRESETS)
DENSE = ("32bit", "16bit")

#: a vote rule: ``(preset, the N workers' directions, step, N) -> update`` (as :func:`sim_vote`)
Vote = Callable[[str, list[torch.Tensor], int, int], torch.Tensor]


def lr_factor(epoch: int) -> float:
    return 1.0 / (1 + epoch)  # LambdaLR: the lr of step t (t = 1, 2, ...) is base / t


def initial_params(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    # rank-dependent start: the optimizer must broadcast rank 0's values
    return [torch.randn(s, generator=g, dtype=torch.float64) + 0.5 * rank for s in SHAPES]


def param_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """``params`` (one per shape of :data:`SHAPES`) in the param groups of :data:`GROUPS`."""
    return [{"params": [params[i] for i in idx], "lr": lr, "weight_decay": wd} for idx, lr, wd in GROUPS]


def local_grad(
    rank: int, step: int, index: int, param: torch.Tensor, grid_for: int = 0
) -> torch.Tensor | None:
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


# -------------------------------------------------------------------------------------- the simulation


def one_bit_votes(cs: list[torch.Tensor], step: int, zeros: str = "split") -> list[torch.Tensor]:
    """Each worker's one-bit vote (int64 0/1) of its direction: ``c > 0``, and an exact zero "+" where
    ``rank + step`` is even (``zeros="split"``, lioncub's default) or always (``"plus"``, the papers')."""
    return [
        ((c > 0) | ((c == 0) & (zeros == "plus" or (r + step) % 2 == 0))).to(torch.int64)
        for r, c in enumerate(cs)
    ]


def sim_vote(preset: str, cs: list[torch.Tensor], step: int, n: int, alone: bool = True) -> torch.Tensor:
    """The update of one parameter tensor from the N workers' directions ``cs`` (float64); ``alone``: one
    worker takes the one-process shortcut (``sign(c)``), else it votes as N workers do."""
    plus = sum(one_bit_votes(cs, step))  # the one-bit votes: exact zeros split by rank and step
    margin = 2 * plus - n
    if preset == "1bit":
        if n == 1 and alone:
            return torch.sign(cs[0])
        tie = 1.0 if step % 2 == 1 else -1.0
        return torch.where(margin > 0, 1.0, torch.where(margin < 0, -1.0, tie)).to(torch.float64)
    if preset in ("4bit", "dlion-mavo"):
        return torch.sign(cs[0]) if n == 1 and alone else torch.sign(margin).to(torch.float64)
    if preset == "8bit-sign":
        return torch.sign(sum(torch.sign(c).to(torch.int64) for c in cs)).to(torch.float64)
    if preset == "dlion-avg":
        return sum(torch.sign(c).to(torch.int64) for c in cs).to(torch.float64) / n
    if preset == "8bit":
        s = 127 // n
        total = sum(quantize.quantize_l1(c, s).to(torch.int64) for c in cs)
        assert int(total.abs().max()) <= 127  # the int8 sum cannot overflow
        return torch.sign(total).to(torch.float64)
    raise AssertionError(preset)


def simulate(preset: str, n: int, vote: Vote | None = None, alone: bool = True) -> list[torch.Tensor]:
    """Every rank's parameters after ``STEPS`` steps of ``preset`` on ``n`` workers (float64); ``vote``
    replaces :func:`sim_vote` for the voting presets; ``alone=False``: one worker votes (and, for the
    dense presets, rounds through the wire dtype) as N workers do, instead of taking Lion's step."""
    theta = initial_params(0)
    dense = preset in DENSE
    moms = [[torch.zeros_like(p) for p in theta] for _ in range(1 if dense else n)]
    lr_of = {i: (lr, wd) for idx, lr, wd in GROUPS for i in idx}
    for step in range(1, STEPS + 1):
        grads = [
            [
                g
                if (g := local_grad(r, step, i, theta[i], n if dense else 0)) is not None
                else torch.zeros_like(theta[i])
                for i in range(len(theta))
            ]
            for r in range(n)
        ]
        for i, p in enumerate(theta):
            lr = lr_of[i][0] * lr_factor(step - 1)
            wd = lr_of[i][1]
            if dense:
                wire = torch.float64 if preset == "32bit" or (n == 1 and alone) else torch.bfloat16
                g = sum(grads[r][i].to(wire) / n for r in range(n)).to(torch.float64)
                m = moms[0][i]
                u = torch.sign(BETAS[0] * m + (1 - BETAS[0]) * g)
                moms[0][i] = BETAS[1] * m + (1 - BETAS[1]) * g
            else:
                cs = [BETAS[0] * moms[r][i] + (1 - BETAS[0]) * grads[r][i] for r in range(n)]
                if n == 1 and alone:  # one process: LionCub is exactly Lion, whatever the preset
                    u = torch.sign(cs[0])
                else:
                    u = vote(preset, cs, step, n) if vote else sim_vote(preset, cs, step, n, alone)
                for r in range(n):
                    moms[r][i] = BETAS[1] * moms[r][i] + (1 - BETAS[1]) * grads[r][i]
            # p·(1 − lr·wd) − lr·u, with torch's add(alpha=) so that a fused multiply-add rounds alike
            theta[i] = (p * (1 - lr * wd)).add_(u, alpha=-lr)
    return theta


def node_majority_oracle(nodes: int) -> Vote:
    """The vote of ``topology="node-majority"`` (1bit) on ``nodes`` nodes of ``n // nodes`` ranks: each
    node's majority with the tie rule, then the majority of the nodes with the tie rule."""

    def vote(preset: str, cs: list[torch.Tensor], step: int, n: int) -> torch.Tensor:
        per_node, tie = n // nodes, 1 if step % 2 == 1 else -1
        node_votes = []
        votes = one_bit_votes(cs, step)  # the ranks' own votes (rank = node·L + local)
        for j in range(nodes):
            plus = sum(votes[j * per_node : (j + 1) * per_node])
            margin = 2 * plus - per_node
            node_votes.append(torch.where(margin == 0, tie, torch.sign(margin)))
        margin = 2 * sum((v > 0).to(torch.int64) for v in node_votes) - nodes
        return torch.where(margin == 0, tie, torch.sign(margin)).to(torch.float64)

    return vote


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
) -> dict:
    """:func:`simulate`'s run of every preset in ``presets`` with LionCub on this rank (``topology``: over an
    ``(nodes, world // nodes)`` device mesh; ``exchange_alone``: built under
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
        for step in range(1, STEPS + 1):
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
