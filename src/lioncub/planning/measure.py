"""Measure the cost model's constants on the current process group (``lioncub calibrate``; the result is a
:mod:`~lioncub.planning.calibration`): α and efficiency per collective, and
the per-element compute costs of this CPU.

Every rank calls :func:`calibrate` (collectively). For each collective of
:data:`lioncub.planning.machine.OPS` and each payload size it times ``warmup`` + ``repeats`` runs, each
started after a barrier, takes the maximum over the ranks (allreduce MAX) and the median over the repeats,
and fits ``time = a + b·bytes`` by least squares on the relative error (every size weighs the same), with
``bytes`` the bytes through the busiest link direction as the model counts them and ``a >= 0``. Then ``α = a
/ messages`` and the op's payload rate is ``1/b`` bytes/s. The exchanges are those the vote classes use:
ring allreduce (``dist.all_reduce``), pairwise all-to-all and all-gather through
:class:`~lioncub.collectives.Comm`, and point-to-point sends into and out of rank 0.

A fit (:mod:`lioncub.planning.fit`) with no more sizes than parameters is *underdetermined*
(``OpFit.dof == 0``: residual ``n/a`` in the log, one warning naming the ops). A fit whose slope is not
positive has no payload rate (``n/a``, ``ok`` false in the JSON; ``lioncub cost`` then uses the network's
values for that op), with one warning too. The JSON keeps every field (``rel_rms_residual`` stays a
number) and adds ``dof``.

The link rate comes from ``$LIONCUB_LINK_BPS`` (set by ``lioncub launch --link``); without one the
fitted fp32 allreduce rate is the reference (its efficiency is 1).

On M nodes of L ranks (``nodes=`` a ``("node", "local")`` mesh) each level is fitted on its own: the NIC
from every op run among the ranks of one local rank across the nodes — all L such groups at once, since
they share each node's NIC, so a point's bytes are L times one rank's — and the node from every op run
among the ranks of each node, all nodes at once (rate ``$LIONCUB_INTRA_LINK_BPS``, set by ``lioncub
launch --intra-link``, or the fitted fp32 allreduce's); and the NIC once more as the flat schemes use it,
from every op run over all M·L ranks (a point's bytes: those through the busiest NIC,
:func:`~lioncub.planning.nodes.nic_share`): a ring over node-ordered ranks sends one flow each way
through a NIC where the inter-node groups send L, and the pairwise exchanges send L·(N−L), so each
pattern gets its own α and rate (at 2 × 2 and 100 Mbit/s: 89.6 % of the line for the inter-node fp32
allreduce, 92.8 % for the flat one). :meth:`Calibration.cluster
<lioncub.planning.calibration.Calibration.cluster>` gives the two-level model.

The local reduction of the allreduces is part of their measured rate, so the calibration sets
``reduce_s_per_byte = 0``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lioncub import env
from lioncub._validate import is_int, is_number
from lioncub.collectives import Comm
from lioncub.ops import packing, quantize
from lioncub.optim.topology import node_groups
from lioncub.planning.calibration import Calibration
from lioncub.planning.fit import OpFit, fit_alpha_beta, fit_warnings, format_fit
from lioncub.planning.machine import OPS, Compute, Network, OpCost
from lioncub.planning.nodes import nic_share
from lioncub.transports import quantized_levels

__all__ = [
    "DEFAULT_SIZES",
    "LINK_SIZES",
    "OpFit",
    "calibrate",
    "fit_alpha_beta",
    "fit_warnings",
    "format_fit",
    "init_from_env",
    "measure_compute",
]

#: payload sizes in bytes without a shaped link: 64 KiB .. 16 MiB
DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
#: payload sizes under a shaped link: well above tbf's bucket (2 ms of the rate by default), whose burst makes
#: smaller transfers look faster than the link
LINK_SIZES = (1 << 20, 4 << 20, 16 << 20)


def init_from_env(timeout_s: float = 300.0) -> bool:
    """Initialise the default gloo group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT unless done already.

    Returns True if this call initialised it (the caller then destroys it).
    """
    if not is_number(timeout_s, gt=0):
        raise RuntimeError(
            f"timeout_s={timeout_s!r} must be a finite number of seconds > 0 (--collective-timeout)"
        )
    if dist.is_initialized():
        return False
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"no process group and {', '.join(missing)} not set: run under `lioncub launch --nproc N "
            "[--link RATE] -- python -m lioncub.cli.calibrate ...` (or torchrun)"
        )
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


# ------------------------------------------------------------------------------------------ network


def _messages(op: str, n: int) -> int:
    return 2 * (n - 1) if op.startswith("allreduce") else n - 1


def _op_runner(op: str, comm: Comm, size: int) -> tuple[Callable[[], object], float]:
    """A function running ``op`` once on a payload of about ``size`` bytes, and its link bytes."""
    n, r = comm.world_size, comm.rank
    if op.startswith("allreduce"):
        dtype = {
            "allreduce_f32": torch.float32,
            "allreduce_bf16": torch.bfloat16,
            "allreduce_i8": torch.int8,
            "allreduce_u8": torch.uint8,
        }[op]
        numel = max(1, size // torch.empty((), dtype=dtype).element_size())
        tensor = torch.zeros(numel, dtype=dtype)
        nbytes = numel * tensor.element_size()
        return (lambda: comm.all_reduce(tensor, op).wait()), 2 * (n - 1) / n * nbytes
    chunk = max(1, size // n)
    if op == "all_to_all":
        inp = torch.zeros(n, chunk, dtype=torch.uint8)
        out = torch.empty_like(inp)
        return (lambda: comm.all_to_all(out, inp, op).wait()), (n - 1) * chunk
    if op == "all_gather":
        inp = torch.zeros(chunk, dtype=torch.uint8)
        out = torch.empty(n, chunk, dtype=torch.uint8)
        return (lambda: comm.all_gather(out, inp, op).wait()), (n - 1) * chunk
    bufs = torch.zeros(n, chunk, dtype=torch.uint8)
    if op == "gather_root":
        sends = [] if r == 0 else [(0, bufs[r])]
        recvs = [(j, bufs[j]) for j in range(1, n)] if r == 0 else []
    elif op == "scatter_root":
        sends = [(j, bufs[j]) for j in range(1, n)] if r == 0 else []
        recvs = [] if r == 0 else [(0, bufs[r])]
    else:
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    return (lambda: comm.exchange_p2p(sends, recvs, op).wait()), (n - 1) * chunk


def _time_op(
    op: str,
    comm: Comm,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    *,
    scale: float = 1.0,
    everyone: Comm | None = None,
) -> list[tuple[float, float]]:
    """(link bytes, median over repeats of the max over ranks, s) per size.

    Every rank of ``everyone`` (default ``comm``; the whole job when ``comm`` is one level of a node
    mesh) runs ``op`` on its own ``comm`` at once, after a barrier of ``everyone``. The link bytes are
    ``scale`` times one rank's: the bytes through the busiest shared link (a node's NIC) per byte of a
    rank's traffic."""
    sync = (comm if everyone is None else everyone).group
    runs: list[float] = []
    link: list[float] = []
    for size in sizes:
        fn, nbytes = _op_runner(op, comm, size)
        link.append(scale * nbytes)
        for i in range(warmup + repeats):
            dist.barrier(group=sync)
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                runs.append(time.perf_counter() - t0)
    times = torch.tensor(runs, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=sync)
    per_size = times.view(len(sizes), repeats)
    return [(link[k], statistics.median(per_size[k].tolist())) for k in range(len(sizes))]


# ------------------------------------------------------------------------------------------ compute


def _per_elem(
    fn: Callable[[], object], numel: int, repeats: int, sync: Callable[[], object] | None = None
) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / numel


def measure_compute(
    numel: int, n_workers: int, repeats: int = 5, sync: Callable[[], object] | None = None
) -> dict[str, float]:
    """Seconds per element of the local kernels of the votes on ``numel`` fp32 elements (this process).

    ``sync`` (e.g. a barrier) runs before every timed call, so that ranks sharing a machine run each
    kernel at the same time and compete for cores and memory bandwidth as they do in a step.

    Keys: the :class:`~lioncub.planning.machine.Compute` fields (``reduce_s_per_byte`` = 0, see the module
    docstring) and ``add_s_per_byte`` (an fp32 ``add_``, for reference).
    """
    n = max(2, n_workers)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    y = torch.randn(numel, generator=gen)
    levels = max(1, quantized_levels(8, n))  # the int8 level budget (1 where N > 127 allows none)
    level_buf = torch.empty(numel, dtype=torch.int8)
    packed = packing.pack_signs(x, pad_to=8 * n)
    slice_bytes = packed.numel() // n
    votes_out = torch.empty(numel, dtype=torch.int8)
    lanes = packing.pack_lanes(torch.ge(x, 0).view(torch.uint8), 4)
    lane_signs = tuple(int(v > 0) - int(v < 0) for v in (2 * c - n for c in range(16)))

    # the kernels the vote classes run (lioncub.collectives), with their reused output buffers
    def count() -> torch.Tensor:  # OneBitVote's middle: count the N workers' votes of a slice, repack
        counts = packing.count_votes(packed.view(n, slice_bytes), slice_bytes * 8)
        return packing.pack_majority(counts, n, True)

    out = {
        "quantize_s_per_elem": _per_elem(
            lambda: quantize.quantize("l1", x, levels, clip_multiple=2.0, chunk_size=None, out=level_buf),
            numel,
            repeats,
            sync,
        ),
        "elementwise_s_per_elem": _per_elem(lambda: torch.sign(x).to(torch.int8), numel, repeats, sync),
        "pack_s_per_elem": _per_elem(
            lambda: packing.pack_signs(x, pad_to=8 * n, out=packed), numel, repeats, sync
        ),
        "unpack_s_per_elem": _per_elem(
            lambda: packing.unpack_signs(packed, numel, torch.int8, out=votes_out), numel, repeats, sync
        ),
        "count_s_per_elem": _per_elem(count, packed.numel() * 8, repeats, sync),
        "lane_pack_s_per_elem": _per_elem(
            lambda: packing.pack_lanes(torch.ge(x, 0).view(torch.uint8), 4), numel, repeats, sync
        ),
        "lane_unpack_s_per_elem": _per_elem(
            lambda: packing.map_lanes(lanes, 4, numel, lane_signs), numel, repeats, sync
        ),
        "add_s_per_byte": _per_elem(lambda: y.add_(x), numel * 4, repeats, sync),
    }
    out["reduce_s_per_byte"] = 0.0
    return out


# ------------------------------------------------------------------------------------------- driver


class _Timing(NamedTuple):
    """What each level times: the collectives, the payload sizes (bytes), timed and untimed runs per size."""

    ops: Sequence[str]
    sizes: Sequence[int]
    repeats: int
    warmup: int


def _fit_level(
    comm: Comm,
    timing: _Timing,
    link_bps: float | None,
    *,
    scale: Callable[[str], float] = lambda op: 1.0,
    everyone: Comm | None = None,
    label: str = "",
    log: Callable[[str], None] | None = None,
) -> tuple[Network, dict[str, Any]]:
    """Time ``timing.ops`` on ``comm`` and fit one level's :class:`Network` (α and efficiency per op) and the
    per-op JSON details. ``link_bps``: the level's link rate (None: the fp32 allreduce's fitted rate is
    the reference, efficiency 1); ``scale(op)``: the shared link's bytes per byte of a rank's traffic."""
    ops, sizes, repeats, warmup = timing
    fits: dict[str, tuple[OpFit, list[tuple[float, float]]]] = {}
    for op in ops:
        points = _time_op(op, comm, sizes, repeats, warmup, scale=scale(op), everyone=everyone)
        fits[op] = (fit_alpha_beta(points), points)
        if log is not None:
            log(label + format_fit(op, fits[op][0]))
    if log is not None:
        for line in fit_warnings({op: fit for op, (fit, _) in fits.items()}, len(sizes)):
            log(label + line)
    if link_bps is not None:
        bandwidth_Bps = link_bps / 8
    else:
        ref = fits["allreduce_f32"][0]
        if not ref.ok:  # a ValueError: `lioncub calibrate` reports it in one line (exit 2)
            raise ValueError(
                f"{label}the fp32 allreduce fit has no positive slope, so the link rate is unknown: use "
                "larger --sizes or more --repeats (or give the link's rate)"
            )
        bandwidth_Bps = 1 / ref.seconds_per_byte
    per_op: dict[str, OpCost] = {}
    per_op_doc: dict[str, Any] = {}
    for op, (fit, points) in fits.items():
        m = _messages(op, comm.world_size)
        doc: dict[str, Any] = {
            "ok": fit.ok,
            "messages": m,
            "intercept_s": fit.intercept_s,
            "seconds_per_byte": fit.seconds_per_byte,
            "rel_rms_residual": fit.rel_rms_residual,
            "dof": fit.dof,
            "points": [[b, t] for b, t in points],
        }
        if fit.ok:
            cost = OpCost(fit.intercept_s / m, 1 / fit.seconds_per_byte / bandwidth_Bps)
            per_op[op] = cost
            doc.update(
                latency_s=cost.latency_s, efficiency=cost.efficiency, payload_Bps=1 / fit.seconds_per_byte
            )
        per_op_doc[op] = doc
    ref_op = per_op.get("allreduce_f32")
    network = Network(
        ref_op.latency_s if ref_op else 0.0,
        bandwidth_Bps,
        ref_op.efficiency if ref_op else 1.0,
        per_op,
    )
    return network, per_op_doc


def calibrate(
    sizes: Sequence[int] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    *,
    ops: Sequence[str] = OPS,
    compute_numel: int = 1 << 22,
    link_bps: float | None = None,
    group: dist.ProcessGroup | None = None,
    nodes: DeviceMesh | None = None,
    intra_link_bps: float | None = None,
    log: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure on ``group`` (collective: every rank calls it; every rank gets the same result).

    Args:
        sizes: payload sizes in bytes, at least two distinct ones (default :data:`LINK_SIZES` under a
            link, :data:`DEFAULT_SIZES` otherwise).
        repeats, warmup: timed and untimed runs per size.
        ops: the collectives to time (a subset of :data:`lioncub.planning.machine.OPS`; must include
            ``allreduce_f32`` unless ``link_bps`` is known).
        compute_numel: elements of the compute benchmarks (0: skip them; the compute costs are then 0).
        link_bps: the link rate in bits/s (default ``$LIONCUB_LINK_BPS``; None: unknown). With ``nodes``:
            each node's NIC.
        group: the process group (default: the whole job); not with ``nodes``.
        nodes: a ``("node", "local")`` DeviceMesh of M nodes of L ranks (M, L >= 2) over the whole job
            (:func:`lioncub.optim.topology.mesh_from_environment` builds it from the launcher's
            environment): both levels are measured. The NIC level times every op among the ranks of the
            same local rank, all L groups at once (they share the NIC; its bytes are L times a rank's);
            the node level among the ranks of each node, all M nodes at once; then the NIC as the flat
            schemes use it, every op over all ranks. The result's ``network`` is the NIC's, ``intra`` a
            rank's link inside its node, ``flat`` the NIC under the whole group's collectives.
        intra_link_bps: with ``nodes``, the rate of a rank's link inside its node (default
            ``$LIONCUB_INTRA_LINK_BPS``; None: the fitted fp32 allreduce rate is the reference).
        log: called with a line per measured op (e.g. ``print`` on rank 0).
    """
    sizes, link_bps, intra_link_bps = _settings(
        sizes, repeats, warmup, ops, compute_numel, link_bps, group, nodes, intra_link_bps
    )
    timing = _Timing(ops, sizes, repeats, warmup)
    if nodes is None:
        fitted = _one_level(Comm(group, exchange="p2p"), timing, link_bps, log)
    else:
        fitted = _two_levels(nodes, timing, link_bps, intra_link_bps, log)
    everyone = fitted.everyone
    n = everyone.world_size
    measured: dict[str, float] = {}
    if compute_numel > 0:
        local = measure_compute(
            compute_numel, n, max(3, repeats), sync=lambda: dist.barrier(group=everyone.group)
        )
        keys = sorted(local)
        vals = torch.tensor([local[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=everyone.group)
        measured = dict(zip(keys, vals.tolist(), strict=True))
    compute = Compute(**{k: v for k, v in measured.items() if k in Compute.__dataclass_fields__})
    raw = {
        **fitted.docs,
        "compute_info": {k: v for k, v in measured.items() if k not in Compute.__dataclass_fields__},
        "settings": {
            "sizes": list(sizes),
            "repeats": repeats,
            "warmup": warmup,
            "compute_numel": compute_numel,
            "backend": everyone.backend,
            "exchange": everyone.exchange,
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return Calibration(
        fitted.network, compute, n, link_bps, raw, fitted.intra, fitted.nnodes, intra_link_bps, fitted.flat
    )


def _settings(
    sizes: Sequence[int] | None,
    repeats: int,
    warmup: int,
    ops: Sequence[str],
    compute_numel: int,
    link_bps: float | None,
    group: dist.ProcessGroup | None,
    nodes: DeviceMesh | None,
    intra_link_bps: float | None,
) -> tuple[list[int], float | None, float | None]:
    """:func:`calibrate`'s arguments checked: (the sizes sorted, the link rate and the intra-node link
    rate in bits/s, from the environment where not given)."""
    if not is_int(repeats, 1):
        raise ValueError(f"repeats={repeats!r} must be an int >= 1 (timed runs per size)")
    if not is_int(warmup, 0):
        raise ValueError(f"warmup={warmup!r} must be an int >= 0 (untimed runs per size)")
    if not is_int(compute_numel, 0):
        raise ValueError(
            f"compute_numel={compute_numel!r} must be an int >= 0 (0: skip the compute benchmarks)"
        )
    for name, rate in (("link_bps", link_bps), ("intra_link_bps", intra_link_bps)):
        if rate is not None and not (isinstance(rate, (int, float)) and 0 < rate < math.inf):
            raise ValueError(f"{name}={rate!r} must be None or a finite number of bits/s > 0")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; known: {list(OPS)}")
    if link_bps is None:
        link_bps = env.positive("LIONCUB_LINK_BPS")
    if nodes is not None:
        if group is not None:
            raise ValueError("calibrate: give either group= or nodes= (a node mesh over the whole job)")
        if intra_link_bps is None:
            intra_link_bps = env.positive("LIONCUB_INTRA_LINK_BPS")
        if intra_link_bps is None and "allreduce_f32" not in ops:
            raise ValueError(
                "without a known intra-node link rate, ops must include allreduce_f32 (the reference)"
            )
    elif intra_link_bps is not None:
        raise ValueError("intra_link_bps applies only with nodes= (a node mesh)")
    if sizes is None:
        sizes = LINK_SIZES if link_bps is not None else DEFAULT_SIZES
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ValueError(f"sizes={list(sizes)} must hold at least two distinct positive sizes")
    if link_bps is None and "allreduce_f32" not in ops:
        raise ValueError("without a known link rate, ops must include allreduce_f32 (the reference)")
    return sorted(set(int(s) for s in sizes)), link_bps, intra_link_bps


class _Fitted(NamedTuple):
    """The fitted levels: the network (a node's NIC on nodes), the per-op JSON of every level, the whole
    job's ranks, and on nodes the link inside a node, the NIC under the flat collectives and M."""

    network: Network
    docs: dict[str, Any]
    everyone: Comm
    intra: Network | None = None
    flat: Network | None = None
    nnodes: int | None = None


def _payloads(sizes: Sequence[int]) -> str:
    return ", ".join(f"{s / 1024:g} KiB" for s in sizes)


def _one_level(
    comm: Comm, timing: _Timing, link_bps: float | None, log: Callable[[str], None] | None
) -> _Fitted:
    """Every rank's own link: every op over all the ranks of ``comm``."""
    n = comm.world_size
    if n < 2:
        raise ValueError("calibrating the network needs at least 2 ranks (lioncub launch --nproc 2 or more)")
    if log is not None:
        link = f"{link_bps / 1e6:g} Mbit/s links" if link_bps is not None else "no known link rate"
        log(f"{n} ranks, {link}; payloads {_payloads(timing.sizes)}")
    network, per_op_doc = _fit_level(comm, timing, link_bps, log=log)
    return _Fitted(network, {"per_op": per_op_doc}, comm)


def _two_levels(
    nodes: DeviceMesh,
    timing: _Timing,
    link_bps: float | None,
    intra_link_bps: float | None,
    log: Callable[[str], None] | None,
) -> _Fitted:
    """M nodes of L ranks: the NIC (the L groups of one local rank each, at once), the node (every
    node's ranks, at once) and the NIC under the flat collectives (all ranks)."""
    flat, intra, inter = node_groups(nodes, "p2p")
    everyone = Comm(flat, exchange="p2p")
    n, nnodes, ell = everyone.world_size, inter.world_size, intra.world_size
    if nnodes < 2 or ell < 2 or n != nnodes * ell:
        raise ValueError(
            f"nodes: a mesh of {nnodes} nodes × {ell} ranks; a two-level calibration needs at least 2 "
            "nodes of at least 2 ranks (calibrate one link per rank without nodes=)"
        )
    if log is not None:
        nic = f"{link_bps / 1e6:g} Mbit/s" if link_bps is not None else "an unknown rate"
        inside = f"{intra_link_bps / 1e6:g} Mbit/s" if intra_link_bps is not None else "an unknown rate"
        layout = f"{nnodes} nodes × {ell} ranks, NIC {nic}, links inside a node {inside}"
        log(f"{layout}; payloads {_payloads(timing.sizes)}")
    network, per_op_doc = _fit_level(
        inter, timing, link_bps, scale=lambda op: ell, everyone=everyone, label="[NIC] ", log=log
    )
    intra_net, intra_doc = _fit_level(
        intra, timing, intra_link_bps, everyone=everyone, label="[node] ", log=log
    )
    flat_net, flat_doc = _fit_level(
        everyone,
        timing,
        link_bps,
        scale=lambda op: nic_share(op, nnodes, ell),
        label="[all ranks, NIC] ",
        log=log,
    )
    docs = {"per_op": per_op_doc, "intra_per_op": intra_doc, "flat_per_op": flat_doc}
    return _Fitted(network, docs, everyone, intra_net, flat_net, nnodes)
