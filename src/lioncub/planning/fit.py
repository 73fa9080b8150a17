"""The line ``time = a + b·bytes`` that :mod:`lioncub.planning.measure` fits to each collective's
timings (seconds against bytes through the busiest link), and how its log reports the fit.

A fit needs more sizes than parameters to say how well the line fits: with two sizes the line passes
through both points and its residual is 0 whatever was measured. Such a fit is *underdetermined*
(``OpFit.dof == 0``): the log shows its residual as ``n/a`` and warns once, naming the ops. A fit whose
slope is not positive (the time did not grow with the payload) has no payload rate (``n/a``), with one
warning too. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["OpFit", "fit_alpha_beta", "fit_warnings", "format_fit"]


@dataclass(frozen=True)
class OpFit:
    """``time = intercept_s + seconds_per_byte · bytes`` for one collective, and how well it fits."""

    intercept_s: float
    seconds_per_byte: float
    rel_rms_residual: float  # sqrt(mean(((t − fit) / t)²)) over the sizes
    dof: int | None = None  # points − fitted parameters; 0: the line passes through every point

    @property
    def ok(self) -> bool:
        """The slope is positive and finite: the op has a payload rate."""
        return self.seconds_per_byte > 0 and math.isfinite(self.seconds_per_byte)

    @property
    def has_residual(self) -> bool:
        """More points than parameters: the residual says how well the line fits (unknown dof: assumed)."""
        return self.dof is None or self.dof > 0


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> OpFit:
    """Least-squares fit of ``t = a + b·x`` to ``(x bytes, t seconds)`` minimising relative errors, a ≥ 0.

    Needs at least two distinct sizes; with a negative intercept the line is refitted through 0 (one
    parameter). ``dof`` is the number of points minus the parameters fitted: with 0 (two sizes, both
    parameters) the line passes through every point and the residual of 0 says nothing.
    """
    x = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if len(set(x.tolist())) < 2:
        raise ValueError("fitting a + b·bytes needs at least two distinct sizes")
    if np.any(t <= 0):
        raise ValueError("every measured time must be > 0")
    w = 1.0 / t  # rows scaled by 1/t: least squares on the relative error
    design = np.stack([w, x * w], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    params = 2
    if a < 0:
        a, b = 0.0, float(np.sum(x * w * 1.0) / np.sum((x * w) ** 2))
        params = 1
    resid = (t - (a + b * x)) / t
    return OpFit(float(a), float(b), float(math.sqrt(np.mean(resid**2))), len(points) - params)


def format_fit(op: str, fit: OpFit) -> str:
    """The log line of one op's fit; ``n/a`` where the fit cannot tell (no slope, no residual)."""
    rate = f"{8 / fit.seconds_per_byte / 1e6:9.1f} Mbit/s" if fit.ok else "n/a (no positive slope)"
    resid = f"{fit.rel_rms_residual:6.1%}" if fit.has_residual else "n/a (underdetermined)"
    return f"{op:>14}: intercept {fit.intercept_s * 1e3:8.3f} ms, payload {rate}, residual {resid}"


def fit_warnings(fits: dict[str, OpFit], n_sizes: int) -> list[str]:
    """At most one warning line for the underdetermined fits and one for those without a payload rate."""
    lines = []
    flat = [op for op, fit in fits.items() if not fit.has_residual]
    if flat:
        if len(flat) == len(fits):
            which = "every fit is"
        elif len(flat) == 1:
            which = f"the fit of {flat[0]} is"
        else:
            which = f"the fits of {', '.join(flat)} are"
        lines.append(
            f"warning: {which} underdetermined: with {n_sizes} payload sizes the line time = a + b·bytes "
            "passes through every point, so no residual tells how well it fits (shown n/a); give at least "
            "3 --sizes"
        )
    bad = [op for op, fit in fits.items() if not fit.ok]
    if bad:
        lines.append(
            f"warning: no positive slope for {', '.join(bad)} (the time did not grow with the payload): no "
            "payload rate (n/a), and `lioncub cost` uses the network's values for "
            f"{'it' if len(bad) == 1 else 'them'}; use larger --sizes or more --repeats"
        )
    return lines
