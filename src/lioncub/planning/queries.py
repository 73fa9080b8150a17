"""Questions asked of the cost model over several variants (:mod:`lioncub.planning.costmodel`): every
prediction (:func:`table`, :func:`cluster_table`), the fastest (:func:`winner`), the link rate in bytes/s
where two variants cost the same (:func:`crossover_bandwidth`), the winner over a range of rates
(:func:`regimes`) and the speedups over a baseline (:func:`speedups`). Torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from lioncub.optim.config import PRESETS
from lioncub.planning.flat import Prediction, Variant, allowed, predict, resolve_config
from lioncub.planning.machine import Cluster, Compute, Network
from lioncub.planning.nodes import TOPOLOGIES, ClusterPrediction, predict_cluster

__all__ = ["cluster_table", "crossover_bandwidth", "regimes", "speedups", "table", "winner"]


def table(
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    variants: Iterable[Variant] | None = None,
    **options: Any,
) -> list[Prediction]:
    """Predictions for ``variants`` (default: every preset, in order); ``options`` as :func:`predict`."""
    return [
        predict(v, d, n_workers, network, compute, **options)
        for v in (PRESETS if variants is None else variants)
    ]


def winner(
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    variants: Iterable[Variant] | None = None,
    **options: Any,
) -> Prediction:
    """The allowed variant with the smallest predicted ``total_s`` (the first one on a tie)."""
    every = table(d, n_workers, network, compute, variants, **options)
    rows = [p for p in every if p.allowed]
    if not rows:
        why = "; ".join(f"{p.variant}: {p.reason}" for p in every)
        fits = [name for name in PRESETS if allowed(name, n_workers)[0]]
        raise ValueError(
            f"no variant is allowed for N={n_workers} ({why}); presets that allow N={n_workers}: {fits}"
        )
    return min(rows, key=lambda p: p.total_s)


def _as_network(latency: float | Network) -> Network:
    if isinstance(latency, Network):
        return latency
    return Network(float(latency), 1.0, 1.0)


def crossover_bandwidth(
    a: Variant,
    b: Variant,
    d: int,
    n_workers: int,
    latency: float | Network,
    compute: Compute | None = None,
    **options: Any,
) -> float | None:
    """Link rate (bytes/s) at which ``a`` and ``b`` cost the same, or None if they never do.

    Every prediction is ``K + W/B`` in the link rate B, so the crossing is ``B = −ΔW/ΔK``. ``latency`` is α
    in seconds or a :class:`Network` (whose latencies and efficiencies are kept; its rate is ignored).
    Raises ``ValueError`` if either variant is not allowed for N workers.
    """
    net = _as_network(latency).with_bandwidth(1.0)
    pa = predict(a, d, n_workers, net, compute, **options)
    pb = predict(b, d, n_workers, net, compute, **options)
    for p in (pa, pb):
        if not p.allowed:
            raise ValueError(f"{p.variant} is not allowed for N={n_workers}: {p.reason}")
    ka, kb = pa.latency_s + pa.compute_s, pb.latency_s + pb.compute_s
    dk = ka - kb
    dw = pa.bandwidth_s - pb.bandwidth_s  # at B = 1 byte/s, bandwidth_s is W
    if abs(dk) <= 1e-12 * max(ka, kb) or abs(dw) <= 1e-12 * max(pa.bandwidth_s, pb.bandwidth_s):
        return None  # equal up to rounding: parallel lines never cross
    rate = -dw / dk
    return rate if rate > 0 and math.isfinite(rate) else None


def regimes(
    d: int,
    n_workers: int,
    latency: float | Network,
    compute: Compute | None = None,
    variants: Iterable[Variant] | None = None,
    lo_Bps: float = 10e6 / 8,
    hi_Bps: float = 400e9 / 8,
    **options: Any,
) -> list[tuple[float, float, str]]:
    """The winner over link rates ``[lo_Bps, hi_Bps]`` (bytes/s): ``[(from, to, variant), ...]``."""
    net = _as_network(latency)
    names = [p.variant for p in table(d, n_workers, net, compute, variants, **options) if p.allowed]
    by_name = {resolve_config(v)[0]: v for v in (PRESETS if variants is None else variants)}
    cuts = {lo_Bps, hi_Bps}
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            rate = crossover_bandwidth(by_name[x], by_name[y], d, n_workers, net, compute, **options)
            if rate is not None and lo_Bps < rate < hi_Bps:
                cuts.add(rate)
    edges = sorted(cuts)
    out: list[tuple[float, float, str]] = []
    for lo, hi in itertools.pairwise(edges):
        mid = math.sqrt(lo * hi)
        best = winner(d, n_workers, net.with_bandwidth(mid), compute, by_name.values(), **options).variant
        if out and out[-1][2] == best:
            out[-1] = (out[-1][0], hi, best)
        else:
            out.append((lo, hi, best))
    return out


def speedups(rows: Sequence[Prediction], baseline: str = "32bit") -> dict[str, float]:
    """``baseline``'s total time / each allowed variant's (empty if the baseline is not among ``rows``)."""
    base = next((p for p in rows if p.variant == baseline and p.allowed), None)
    if base is None:
        return {}
    return {p.variant: base.total_s / p.total_s for p in rows if p.allowed and p.total_s > 0}


def cluster_table(
    d: int,
    cluster: Cluster,
    compute: Compute | None = None,
    variants: Iterable[Variant] | None = None,
    topologies: Iterable[str] = TOPOLOGIES,
    **options: Any,
) -> list[ClusterPrediction]:
    """Predictions for every variant (default: every preset) × topology, in that order."""
    return [
        predict_cluster(v, d, cluster, t, compute, **options)
        for v in (PRESETS if variants is None else variants)
        for t in topologies
    ]
