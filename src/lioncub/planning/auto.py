"""``variant="auto"``: the cost model's predicted fastest preset for this model size, N and network, and,
given a step's compute, whether to vote every step or every H local steps (:mod:`lioncub.planning.schedule`).

Before the optimizer exists, every rank calls :func:`auto_variant` (collective: rank 0 decides, every rank
follows) and builds :class:`~lioncub.optim.LionCub` with the chosen preset::

    choice = auto_variant(model.parameters(), network="1gbit")   # or a `lioncub calibrate` JSON
    opt = LionCub(model.parameters(), lr=3e-4, variant=choice.variant)

:func:`choose_variant` is the same decision for a given size and N, without a process group. With
``compute_s`` (a step's forward, backward and optimizer seconds, measured on the job) the choice also
says whether a vote every step or one every H local steps reaches a loss sooner (``choice.local_steps``;
:func:`choose_local_steps`)::

    choice = auto_variant(model.parameters(), network="2mbit", compute_s=0.19)
    opt = LionCub(model.parameters(), lr=3e-4, variant=choice.variant, local_steps=choice.local_steps)

The network comes from, in order: the ``network`` argument (a ``lioncub calibrate`` JSON file, a
:class:`~lioncub.planning.costmodel.Calibration`, a :class:`~lioncub.planning.costmodel.Network`, or a link
rate such as
``"1gbit"`` with the latency ``latency_s``), else the calibration file named by the environment variable
``LIONCUB_CALIBRATION``. Without either the choice would be a guess, so it is refused with an error that
says what to pass. Compute costs come from the calibration, else :data:`DEFAULT_CPU_COMPUTE`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lioncub import env
from lioncub._validate import is_int, is_number
from lioncub.optim.config import PRESETS
from lioncub.planning import costmodel
from lioncub.planning.costmodel import Calibration, Compute, Network, Prediction
from lioncub.planning.schedule import ScheduleChoice, choose_schedule

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "AUTO_ENV",
    "AutoChoice",
    "auto_topology",
    "auto_variant",
    "check_candidates",
    "choose_local_steps",
    "choose_topology",
    "choose_variant",
    "resolve_network",
]

_log = logging.getLogger("lioncub")

AUTO_ENV = "LIONCUB_CALIBRATION"
DEFAULT_LATENCY_S = 50e-6

NetworkSpec = str | os.PathLike[str] | Calibration | Network | None


@dataclass(frozen=True)
class AutoChoice:
    """The chosen preset, why, and every prediction it was chosen from (seconds per step); with a step's
    compute given, ``local_steps``: H for ``LionCub(local_steps=...)``, or ``None`` for a vote every step
    (and ``schedule``: every candidate H)."""

    variant: str
    reason: str
    predictions: tuple[Prediction, ...]
    local_steps: int | None = None
    schedule: ScheduleChoice | None = None


def resolve_network(spec: NetworkSpec, latency_s: float = DEFAULT_LATENCY_S) -> tuple[Network, Compute, str]:
    """(network, compute costs, a short description) for ``spec`` (see the module docstring)."""
    option = "network"
    if spec is None:
        path = env.get("LIONCUB_CALIBRATION")
        if not path:
            raise ValueError(
                "variant='auto' needs the network to predict for: pass network= a calibration JSON "
                "written by `lioncub calibrate`, or a link rate such as '1gbit' (with latency_s=), "
                f"or set {AUTO_ENV}=path/to/calibration.json"
            )
        spec, option = path, f"${AUTO_ENV}"
    if not is_number(latency_s, ge=0):
        raise ValueError(f"latency_s={latency_s!r} must be a finite number of seconds >= 0 (e.g. 50e-6)")
    if isinstance(spec, Calibration):
        return spec.network, spec.compute, "calibration"
    if isinstance(spec, Network):
        return spec, costmodel.DEFAULT_CPU_COMPUTE, "given network"
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec.endswith(".json")):
        try:
            cal = costmodel.load_calibration(spec)
        except ValueError as exc:
            raise ValueError(
                f"{option}={str(spec)!r}: {exc} (expected a JSON file written by `lioncub calibrate`)"
            ) from None
        return cal.network, cal.compute, f"calibration {Path(spec).name}"
    if isinstance(spec, str):
        rate = costmodel.parse_bandwidth(spec, option)
        net = Network.from_rate(rate * 8, latency_s)
        return net, costmodel.DEFAULT_CPU_COMPUTE, f"{spec} links, α = {latency_s * 1e6:g} µs"
    raise TypeError(
        f"network={spec!r} must be a calibration path, a Calibration, a Network or a rate like '1gbit'"
    )


def check_candidates(candidates: Sequence[str] | None) -> tuple[str, ...]:
    """The candidate presets as a tuple (default: every preset); unknown names are refused."""
    names = tuple(PRESETS) if candidates is None else tuple(candidates)
    unknown = [c for c in names if c not in PRESETS]
    if unknown or not names or isinstance(candidates, str):
        raise ValueError(
            f"candidates={candidates!r}: give a non-empty list of presets from {sorted(PRESETS)}"
        )
    return names


def choose_variant(
    d: int,
    n_workers: int,
    network: NetworkSpec = None,
    *,
    latency_s: float = DEFAULT_LATENCY_S,
    candidates: Sequence[str] | None = None,
    bucket_numel: int | None = None,
    compute_s: float | None = None,
    steps_factor: Mapping[int, float] | None = None,
) -> AutoChoice:
    """The allowed candidate (default: every preset) with the smallest predicted time per step; with
    ``compute_s``, also a vote every step or every H steps for it (:func:`choose_local_steps`).

    Args:
        d: parameters voted on per step.
        n_workers: N.
        network, latency_s: see :func:`resolve_network`.
        candidates: preset names to choose from.
        bucket_numel: elements per bucket (each bucket pays its own latency).
        compute_s: a step's compute in seconds (forward, backward, optimizer), measured on the job; None:
            no choice of H (a vote every step).
        steps_factor: f(H) by H (:data:`lioncub.planning.schedule.STEPS_FACTOR`).
    """
    names = check_candidates(candidates)
    net, compute, where = resolve_network(network, latency_s)
    rows = tuple(costmodel.table(d, n_workers, net, compute, names, bucket_numel=bucket_numel))
    ok = sorted((p for p in rows if p.allowed), key=lambda p: p.total_s)
    if not ok:
        raise ValueError(f"variant='auto': none of {list(names)} is allowed for N={n_workers}")
    best = ok[0]
    others = ", ".join(f"{p.variant} {p.total_s * 1e3:.3g} ms" for p in ok[1:4])
    refused = "; ".join(f"{p.variant}: {p.reason}" for p in rows if not p.allowed)
    workers = f"{n_workers} worker" + ("s" if n_workers != 1 else "")
    reason = (
        f"variant='auto' chose {best.variant!r} for {d:,} parameters on {workers} over {where}: "
        f"predicted {best.total_s * 1e3:.3g} ms/step of communication and codec"
        + (f" (next: {others})" if others else "")
        + (f"; not allowed: {refused}" if refused else "")
    )
    if compute_s is None:
        return AutoChoice(best.variant, reason, rows)
    schedule = choose_schedule(compute_s, best.total_s, steps_factor)
    reason += f"; {schedule.reason}"
    return AutoChoice(best.variant, reason, rows, schedule.local_steps, schedule)


def choose_local_steps(
    variant: str,
    d: int,
    n_workers: int,
    network: NetworkSpec = None,
    *,
    compute_s: float,
    latency_s: float = DEFAULT_LATENCY_S,
    bucket_numel: int | None = None,
    steps_factor: Mapping[int, float] | None = None,
) -> ScheduleChoice:
    """A vote of ``variant`` every step or every H local steps (:mod:`lioncub.planning.schedule`), with
    one vote's time predicted by the cost model for ``d`` parameters on ``n_workers`` over ``network``
    (:func:`resolve_network`) and ``compute_s`` the step's compute (seconds)."""
    net, compute, _ = resolve_network(network, latency_s)
    vote = costmodel.predict(variant, d, n_workers, net, compute, bucket_numel=bucket_numel)
    if not vote.allowed:
        raise ValueError(f"variant={variant!r}: {vote.reason}")
    return choose_schedule(compute_s, vote.total_s, steps_factor)


def auto_variant(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    process_group: dist.ProcessGroup | None = None,
    network: NetworkSpec = None,
    latency_s: float = DEFAULT_LATENCY_S,
    candidates: Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    compute_s: float | None = None,
    steps_factor: Mapping[int, float] | None = None,
) -> AutoChoice:
    """:func:`choose_variant` for the parameters that require grad (``params`` as for the optimizer) on the
    ranks of ``process_group`` (default: the default group), with LionCub's buckets of ``bucket_mb`` MiB;
    with ``compute_s`` (rank 0's is used) also ``local_steps``.

    Collective: rank 0 decides and logs its reason to the ``"lioncub"`` logger, every rank takes its
    answer (the others' :attr:`AutoChoice.reason` names rank 0); an error on rank 0 is raised there and a
    ``RuntimeError`` on the others, never a hang."""
    import torch

    from lioncub.collectives import Comm

    comm = Comm(process_group)
    names = check_candidates(candidates)
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    d = sum(t.numel() for t in tensors if t.requires_grad)
    choice: AutoChoice | None = None
    error: Exception | None = None
    if comm.rank == 0:
        try:
            choice = choose_variant(
                d,
                comm.world_size,
                network,
                latency_s=latency_s,
                candidates=names,
                bucket_numel=max(1, int(bucket_mb * 2**20) // 4),
                compute_s=compute_s,
                steps_factor=steps_factor,
            )
        except (ValueError, TypeError, OSError) as err:
            error = err
    decided = [-1, 0] if choice is None else [names.index(choice.variant), choice.local_steps or 0]
    decision = torch.tensor(decided, dtype=torch.int64)
    if comm.world_size > 1:
        decision = decision.to(comm.device)
        comm.broadcast(decision, 0, "variant='auto' decision").wait()
    if error is not None:
        raise error
    index, h = (int(x) for x in decision.tolist())
    if index < 0:
        raise RuntimeError(f"rank {comm.rank}: variant='auto' failed on rank 0 (see rank 0's error)")
    if choice is None:  # not rank 0: the same preset and H, the reason is rank 0's
        variant = names[index]
        schedule = f", a vote every {h} steps" if h else ""
        return AutoChoice(variant, f"variant='auto': rank 0 chose {variant!r}{schedule}", (), h or None)
    _log.info("%s", choice.reason)
    return choice


def choose_topology(
    variant: str,
    d: int,
    cluster: costmodel.Cluster,
    compute: Compute | None = None,
    *,
    bucket_numel: int | None = None,
) -> tuple[str, str]:
    """``topology="auto"``: the exact topology (``"flat"`` or ``"hierarchical"``, which give the same
    updates bit for bit) with the smaller predicted time per step of ``variant`` on ``cluster``, and why.
    ``"node-majority"`` changes the estimator, so it is never chosen here. A pure function of its
    arguments: every rank computes the same answer without communicating."""
    rows = [
        costmodel.predict_cluster(variant, d, cluster, t, compute, bucket_numel=bucket_numel)
        for t in ("flat", "hierarchical")
    ]
    ok = [r for r in rows if r.allowed]
    best = min(ok, key=lambda r: r.total_s)
    shown = ", ".join(f"{r.topology} {r.total_s * 1e3:.3g} ms" for r in ok)
    refused = "; ".join(f"{r.topology}: {r.reason}" for r in rows if not r.allowed)
    reason = (
        f"topology='auto' chose {best.topology!r} for {variant} with {d:,} parameters on {cluster.nnodes} "
        f"nodes × {cluster.nproc_per_node} ranks: predicted {shown} per step"
        + (f"; not allowed: {refused}" if refused else "")
    )
    return best.topology, reason


def _node_layout(nnodes: int | None, nproc_per_node: int | None) -> tuple[int, int]:
    """(M, L): as given, else from the job (``$LIONCUB_NNODES`` of ``lioncub launch``, else torchrun's
    ``$LOCAL_WORLD_SIZE``; the world size from the default group or ``$WORLD_SIZE``)."""
    if (nnodes is None) != (nproc_per_node is None):
        raise ValueError(
            f"nnodes={nnodes!r}, nproc_per_node={nproc_per_node!r}: give both (M nodes of L ranks) or "
            "neither (read from the job's environment)"
        )
    if nnodes is not None and nproc_per_node is not None:
        for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
            if not is_int(value, 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        return nnodes, nproc_per_node
    import torch.distributed as dist

    world_text = str(dist.get_world_size()) if dist.is_initialized() else os.environ.get("WORLD_SIZE", "1")
    nodes, local = env.get("LIONCUB_NNODES") or "", os.environ.get("LOCAL_WORLD_SIZE", "")
    world = int(world_text) if world_text.isdigit() else 1
    if nodes.isdigit() and int(nodes) >= 1 and world % int(nodes) == 0:
        return int(nodes), world // int(nodes)
    if local.isdigit() and int(local) >= 1 and world % int(local) == 0:
        return world // int(local), int(local)
    return world, 1


def auto_topology(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    variant: str,
    *,
    network: NetworkSpec = None,
    intra: str | Network | None = None,
    latency_s: float = DEFAULT_LATENCY_S,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    bucket_mb: float = 25.0,
) -> tuple[str, str]:
    """``topology="auto"`` for the library: the exact topology (``"flat"`` or ``"hierarchical"``) the
    two-level cost model predicts faster for ``variant`` on the parameters that require grad, and why.
    Call it before the optimizer, on every rank (a pure function of its arguments and the environment, so
    every rank gets the same answer without communicating)::

        topology, why = auto_topology(model.parameters(), "8bit", network="nodes.json")
        opt = LionCub(model.parameters(), lr=3e-4, variant=resolve_variant("8bit", topology=topology))

    Args:
        network: the NIC between the nodes, as :func:`resolve_network` takes it; a two-level calibration
            (``lioncub calibrate --nnodes``) gives both levels.
        intra: a rank's link inside its node, a rate such as ``"400gbit"`` or a ``Network`` (default: a
            two-level calibration's, else 400 Gbit/s at 5 µs).
        nnodes: M, and ``nproc_per_node`` L (default: the job's — ``$LIONCUB_NNODES`` of ``lioncub launch``,
            else torchrun's ``$LOCAL_WORLD_SIZE``); with one rank per node or one node there is nothing to
            choose: ``"flat"``.
    """
    m, ell = _node_layout(nnodes, nproc_per_node)
    ok, why = costmodel.topology_allowed(variant, "flat", m * ell)
    if not ok:
        raise ValueError(f"variant={variant!r}: {why}")
    if m == 1 or ell == 1:
        return "flat", f"topology='auto' chose 'flat': {m} node(s) of {ell} rank(s), nothing to lay out"
    if not is_number(bucket_mb, gt=0):
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a finite number of MiB > 0")
    path = env.get("LIONCUB_CALIBRATION") if network is None else network
    source = None
    if isinstance(path, os.PathLike) or (isinstance(path, str) and path.endswith(".json")):
        try:  # loaded here: a two-level calibration also gives the link inside a node
            network = costmodel.load_calibration(path)
        except ValueError as exc:
            option = "network" if network is not None else f"${AUTO_ENV}"
            raise ValueError(
                f"{option}={str(path)!r}: {exc} (expected a JSON file written by `lioncub calibrate`)"
            ) from None
        source = f"calibration {Path(path).name}"
    inter, compute, where = resolve_network(network, latency_s)
    where = source or where
    if isinstance(intra, str):
        intra_net = Network.from_rate(
            costmodel.parse_bandwidth(intra, "intra") * 8,
            costmodel.parse_duration(costmodel.DEFAULT_INTRA_LATENCY),
        )
    elif isinstance(intra, Network):
        intra_net = intra
    elif intra is None and isinstance(network, Calibration) and network.intra is not None:
        intra_net = network.intra
    elif intra is None:
        intra_net = Network.from_rate(
            costmodel.parse_bandwidth(costmodel.DEFAULT_INTRA_BANDWIDTH) * 8,
            costmodel.parse_duration(costmodel.DEFAULT_INTRA_LATENCY),
        )
    else:
        raise TypeError(f"intra={intra!r} must be None, a rate such as '400gbit' or a Network")
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    d = sum(t.numel() for t in tensors if t.requires_grad)
    if d < 1:
        raise ValueError("params: no parameter requires grad, so there is nothing to vote on")
    cluster = costmodel.Cluster(m, ell, inter, intra_net)
    choice, reason = choose_topology(
        variant, d, cluster, compute, bucket_numel=max(1, int(bucket_mb * 2**20) // 4)
    )
    return choice, f"{reason} ({where})"
