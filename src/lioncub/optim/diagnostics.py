"""The paper's diagnostics of a vote (Lion Cub §3.9): how the variant's update compares with the
full-precision vote, how often the vote ties, how far the workers' momenta drift apart, and the shape of
the pre-sign update.

Pure functions on tensors (this module's first half) and their distributed versions over a
:class:`~lioncub.collectives.Comm` (the second half), which :class:`~lioncub.optim.LionCub` calls at the
steps its ``diagnostics_every`` names. Off (the default) they cost nothing: no collective, no copy.

Definitions, per parameter tensor and overall (element-weighted):

* ``match``: fraction of elements where ``sign(u) == sign(Σ_i c_i)`` — the variant's update ``u`` against
  the full-precision vote (Fig. 4); ``flip``: fraction where ``sign(u) == −sign(Σ_i c_i) ≠ 0``; the rest
  are elements where exactly one of them is 0.
* ``tie``: fraction of elements where the sign vote ``Σ_i sign(c_i)`` is 0 (Table 3; needs even N to be
  non-zero, except where some ``c_i`` are exactly 0).
* ``momentum_max_std``: ``sqrt(max_elements(mean_i m_i² − (mean_i m_i)²))`` over the workers (Fig. 6).
* ``max_over_mean``: ``max|c| / mean|c|`` of this rank's pre-sign update; ``kurtosis``:
  ``E[(c − μ)^4] / σ^4`` (3 for a Gaussian; Fig. 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lioncub.collectives import Comm

__all__ = ["agreement", "collect", "momentum_spread", "shape", "tie_rate"]


def agreement(update: torch.Tensor, reference_sum: torch.Tensor) -> tuple[float, float]:
    """(match, flip) rates of ``sign(update)`` against ``sign(reference_sum)`` (same shape, any dtype)."""
    if update.shape != reference_sum.shape:
        raise ValueError(f"update {tuple(update.shape)} and reference {tuple(reference_sum.shape)} differ")
    n = update.numel()
    if n == 0:
        return math.nan, math.nan
    su, sr = torch.sign(update.double()), torch.sign(reference_sum.double())
    match = int((su == sr).sum()) / n
    flip = int(((su == -sr) & (sr != 0)).sum()) / n
    return match, flip


def tie_rate(vote_sum: torch.Tensor) -> float:
    """Fraction of exact zeros of the summed signs ``Σ_i sign(c_i)``."""
    return int((vote_sum == 0).sum()) / vote_sum.numel() if vote_sum.numel() else math.nan


def momentum_spread(mean: torch.Tensor, mean_of_squares: torch.Tensor) -> float:
    """``sqrt(max(E[m²] − E[m]²))`` over the elements, the variance clipped at 0 (rounding)."""
    var = (mean_of_squares.double() - mean.double().square()).clamp_min(0)
    return math.sqrt(float(var.max())) if var.numel() else math.nan


def shape(c: torch.Tensor) -> tuple[float, float]:
    """(max|c| / mean|c|, kurtosis) of a pre-sign update; NaN where undefined (all zeros, one element)."""
    x = c.detach().double().reshape(-1)
    a = x.abs()
    mean_abs = float(a.mean()) if x.numel() else 0.0
    ratio = float(a.max()) / mean_abs if mean_abs > 0 else math.nan
    centred = x - x.mean()
    var = float(centred.square().mean()) if x.numel() > 1 else 0.0
    kurt = float(centred.pow(4).mean()) / var**2 if var > 0 else math.nan
    return ratio, kurt


# ------------------------------------------------------------------------------------------ distributed


def collect(
    comm: Comm,
    names: Sequence[str],
    directions: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
) -> dict[str, dict[str, float]]:
    """All diagnostics for the tensors ``names`` (collective: every rank calls it with the same layout).

    ``directions``: this rank's pre-sign updates ``c_i``; ``updates``: the variant's aggregated update
    ``u`` (identical on every rank); ``momenta``: this rank's momenta after the step. Issues three allreduces
    over all tensors at once: c (fp32), sign(c) (int32) and m with m² (fp64: in fp32 E[m²] − E[m]² cancels).
    Returns ``{name: {...}, "overall": {...}}`` with the keys of the module docstring.
    """
    n = comm.world_size
    sizes = [c.numel() for c in directions]
    flat_c = torch.cat([c.detach().reshape(-1).float() for c in directions])
    signs = torch.sign(flat_c).to(torch.int32)
    m = torch.cat([t.detach().reshape(-1).double() for t in momenta])  # fp64: E[m²] − E[m]² cancels
    moments = torch.cat([m, m.square()])
    if not comm.alone:
        handles = [
            comm.all_reduce(flat_c, "diagnostics: full-precision vote"),
            comm.all_reduce(signs, "diagnostics: sign vote"),
            comm.all_reduce(moments, "diagnostics: momentum moments"),
        ]
        for h in handles:
            h.wait()
    moments /= n
    mean_m, mean_m2 = moments[: m.numel()], moments[m.numel() :]
    out: dict[str, dict[str, float]] = {}
    totals = {"match": 0.0, "flip": 0.0, "tie": 0.0}
    pos = 0
    for name, size, c, u in zip(names, sizes, directions, updates, strict=True):
        sl = slice(pos, pos + size)
        match, flip = agreement(u.reshape(-1), flat_c[sl])
        tie = tie_rate(signs[sl])
        ratio, kurt = shape(c)
        out[name] = {
            "match": match,
            "flip": flip,
            "tie": tie,
            "momentum_max_std": momentum_spread(mean_m[sl], mean_m2[sl]),
            "max_over_mean": ratio,
            "kurtosis": kurt,
        }
        for key in totals:
            totals[key] += out[name][key] * size
        pos += size
    total = max(1, pos)
    out["overall"] = {key: value / total for key, value in totals.items()}
    out["overall"]["momentum_max_std"] = momentum_spread(mean_m, mean_m2)
    return out
