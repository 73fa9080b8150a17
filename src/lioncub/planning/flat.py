"""One vote over N workers on one level of links: which variant (:func:`resolve_config`), whether its lanes
hold the N-way sum (:func:`allowed`), the collectives it runs (:func:`plan`), and the predicted time per
step (:func:`predict`). The bytes of every collective are :meth:`VoteConfig.wire_bytes
<lioncub.optim.config.VoteConfig.wire_bytes>` (:mod:`lioncub.transports`); this module adds which
collective carries them, its messages and the compute around it. :func:`charge` is the step's sum that
:func:`lioncub.planning.nodes.predict_cluster` shares. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, TypedDict, TypeVar

from lioncub import transports
from lioncub._validate import is_int
from lioncub.optim.config import PRESETS, VoteConfig
from lioncub.planning.machine import Compute, Network

__all__ = [
    "Collective",
    "Prediction",
    "Variant",
    "allowed",
    "plan",
    "predict",
    "resolve_config",
    "wire_bytes",
]

#: a preset name (``"8bit"``) or a :class:`~lioncub.optim.config.VoteConfig`
Variant = str | VoteConfig


# ----------------------------------------------------------------------------------------- variants


def _wire_key(config: VoteConfig) -> tuple[str, str, int | str | None, int]:
    """What of ``config`` the model prices: transport, aggregation, lane width (the transport's default
    where not given; None without lanes) and the dense wire's bits (32 otherwise)."""
    facts = transports.FACTS[config.transport]
    bits = (facts.default_bits if config.bits is None else config.bits) if facts.widths else None
    return config.transport, config.aggregation, bits, config.wire_bits if config.transport == "dense" else 32


def resolve_config(variant: Variant) -> tuple[str, VoteConfig]:
    """``(name, config)`` for a preset name or a ``VoteConfig``: a config named by the preset that puts the
    same on the wire, else ``transport-aggregation[-Pbit][-Wbit]``. Torch-free: checks only what the model
    reads (the transport and the lane width)."""
    if isinstance(variant, str):
        if variant not in PRESETS:
            raise ValueError(f"variant={variant!r} is not one of {list(PRESETS)}")
        return variant, PRESETS[variant]
    if variant.transport not in transports.TRANSPORTS:
        raise ValueError(f"transport={variant.transport!r} is not a known transport")
    widths = transports.FACTS[variant.transport].widths
    if widths and variant.bits not in (*widths, "auto", None):
        raise ValueError(f"bits={variant.bits!r} must be 2, 4, 8 or 'auto' for {variant.transport}")
    key = _wire_key(variant)
    name = next((k for k, preset in PRESETS.items() if _wire_key(preset) == key), None)
    if name is None:
        transport, aggregation, bits, wire_bits = key
        name = f"{transport}-{aggregation}" + (f"-{bits}bit" if bits is not None else "")
        name += f"-{wire_bits}bit" if transport == "dense" else ""
    return name, variant


def allowed(variant: Variant, n_workers: int) -> tuple[bool, str]:
    """Whether the variant's lanes can hold the N-way sum; ``(False, why)`` otherwise
    (:meth:`VoteConfig.capacity <lioncub.optim.config.VoteConfig.capacity>`)."""
    return resolve_config(variant)[1].capacity(n_workers)


def check_d(d: int) -> int:
    """``d``, or ``ValueError``: parameters voted on per step, an int >= 1."""
    if not is_int(d, 1):
        raise ValueError(f"d={d!r} must be an int >= 1 (parameters)")
    return d


# ------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Collective:
    """One collective of a step, as the model charges it.

    ``messages``: α terms on the critical path; ``link_bytes``: bytes through the busiest link direction;
    ``sent``/``recv``: bytes of the busiest rank; ``reduce_bytes``: bytes reduced locally (γ);
    ``count``: times per step (buckets; ``1/k`` for an amortised sync).
    """

    op: str
    messages: int
    link_bytes: float
    sent: float
    recv: float
    reduce_bytes: float = 0.0
    count: float = 1.0

    def seconds(self, network: Network, compute: Compute) -> tuple[float, float, float]:
        """(latency, bandwidth, reduction) seconds per step."""
        return (
            self.count * self.messages * network.alpha(self.op),
            self.count * self.link_bytes / network.rate(self.op),
            self.count * self.reduce_bytes * compute.reduce_s_per_byte,
        )


def ring(op: str, sent: float, n: int) -> Collective:
    """A ring allreduce over N ranks in which each rank sends (and receives) ``sent`` bytes:
    ``2(N−1)`` messages, and ``(N−1)/N`` of the payload — half of ``sent`` — reduced locally."""
    return Collective(op, 2 * (n - 1), sent, sent, sent, reduce_bytes=sent / 2)


def ring_bytes(payload: float, n: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``payload`` bytes over N ranks: ``2(N−1)/N·payload``."""
    return 2 * (n - 1) / n * payload


def _server(config: VoteConfig, d: int, n: int, rank: int) -> list[Collective]:
    """The parameter server: N−1 messages into the root, then N−1 out; the root's link is the bottleneck."""
    root = config.server_root
    out_of_root, into_root = config.wire_bytes(d, n, root)
    if rank == root:
        mine = (0.0, into_root), (out_of_root, 0.0)
    else:
        up, down = config.wire_bytes(d, n, rank)
        mine = (up, 0.0), (0.0, down)
    (gather_sent, gather_recv), (scatter_sent, scatter_recv) = mine
    return [
        Collective("gather_root", n - 1, into_root, gather_sent, gather_recv),
        Collective("scatter_root", n - 1, out_of_root, scatter_sent, scatter_recv),
    ]


def plan(
    config: VoteConfig, d: int, n: int, rank: int | None = None
) -> tuple[list[Collective], dict[str, float]]:
    """The collectives of one vote of ``d`` elements as ``rank`` (default: the busiest, the server's root)
    runs them, and its compute (:class:`Compute` field → elements)."""
    t = config.transport
    work: dict[str, float] = {"quantize_s_per_elem": d} if t == "quantized" else {}
    if n == 1:  # nothing travels; the votes still take a sign (the quantized vote still quantizes)
        return [], ({} if t == "dense" else {"elementwise_s_per_elem": d, **work})
    rank = config.server_root if rank is None else rank
    sent = config.wire_bytes(d, n, rank)[0]
    if t == "dense":
        passes = 1 if config.wire_bits == 32 else 2  # copy/scale (+ cast back)
        op = {32: "allreduce_f32", 16: "allreduce_bf16"}.get(config.wire_bits, "allreduce_f32")
        return [ring(op, sent, n)], {"elementwise_s_per_elem": passes * d}
    if t == "int8":  # signs to int8, then the sign (or the mean) of the sum
        return [ring("allreduce_i8", sent, n)], {"elementwise_s_per_elem": 2 * d}
    if t == "quantized" and config.lane_bits(n) == 8:  # signed int8 levels, then the sign of the sum
        return [ring("allreduce_i8", sent, n)], {**work, "elementwise_s_per_elem": d}
    if t in ("lanes", "quantized"):
        work.update(lane_pack_s_per_elem=d, lane_unpack_s_per_elem=d)
        return [ring("allreduce_u8", sent, n)], work
    if t == "1bit":  # pairwise all-to-all, then all-gather: half the bytes each
        phases = [Collective(op, n - 1, sent / 2, sent / 2, sent / 2) for op in ("all_to_all", "all_gather")]
        padded = transports.FACTS[t].padded_numel(d, n)  # N slices of padded/N votes counted, result packed
        return phases, {"pack_s_per_elem": d, "count_s_per_elem": padded, "unpack_s_per_elem": d}
    up = config.wire_bytes(d, n, config.server_root + 1)[0]  # a worker's packed votes
    work = {
        "pack_s_per_elem": d,
        "count_s_per_elem": n * up * 8,  # at the root: N workers' votes
        "lane_pack_s_per_elem": d,
        "lane_unpack_s_per_elem": d,
    }
    return _server(config, d, n, rank), work


def wire_bytes(variant: Variant, d: int, n_workers: int, rank: int = 0) -> tuple[float, float]:
    """(sent, received) bytes of ``rank`` for one vote of ``d`` elements: the sum over the collectives of
    :func:`plan` (equal to :meth:`VoteConfig.wire_bytes <lioncub.optim.config.VoteConfig.wire_bytes>`)."""
    _, config = resolve_config(variant)
    ok, why = config.capacity(n_workers)
    if not ok:
        raise ValueError(why)
    colls, _ = plan(config, d, n_workers, rank)
    return sum(c.sent for c in colls), sum(c.recv for c in colls)


# ------------------------------------------------------------------------------ a step, summed once


class Counted(Protocol):
    """What :func:`charge` needs of an item: a frozen dataclass with a ``count`` (times per step)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def count(self) -> float: ...


#: a :class:`Collective` or a :class:`~lioncub.planning.nodes.Phase`
Item = TypeVar("Item", bound=Counted)


class Step(NamedTuple):
    """What :func:`charge` sums: every collective (or phase) of a step with its count, and the seconds."""

    items: tuple[Any, ...]
    latency_s: float
    bandwidth_s: float
    compute_s: float
    sync_s: float

    def total(self, attr: str) -> float:
        """``attr`` (bytes) summed over the step, each item times its count."""
        total: float = sum(c.count * getattr(c, attr) for c in self.items)
        return total


def buckets(d: int, bucket_numel: int | None) -> list[tuple[int, int]]:
    """(elements, how many) of the buckets a flat vector of d elements is split into."""
    if bucket_numel is None:
        return [(d, 1)]
    if not is_int(bucket_numel, 1):
        raise ValueError(f"bucket_numel={bucket_numel!r} must be None (one bucket) or an int >= 1")
    if bucket_numel >= d:
        return [(d, 1)]
    full, rest = divmod(d, bucket_numel)
    return [(bucket_numel, full)] + ([(rest, 1)] if rest else [])


def sync_params_of(d: int, sync_every: int | None, sync_params: int | None) -> int:
    """Parameters the momentum sync covers (``d`` unless ``sync_params``), after checking both options."""
    if sync_params is not None:
        if sync_every is None:
            raise ValueError(
                f"sync_params={sync_params!r} needs sync_every (how often those parameters are synchronised)"
            )
        if not is_int(sync_params, 0, d):
            raise ValueError(f"sync_params={sync_params!r} must be an int within [0, d={d}] (parameters)")
    if sync_every is not None and not is_int(sync_every, 1):
        raise ValueError(f"sync_every={sync_every!r} must be an int >= 1 (steps)")
    return d if sync_params is None else sync_params


def charge(
    bucket_plan: Callable[[int], tuple[Sequence[Item], dict[str, float]]],
    lift: Callable[[Collective], Item],
    seconds: Callable[[Item], tuple[float, float, float]],
    d: int,
    n: int,
    compute: Compute,
    *,
    sync_every: int | None = None,
    sync_params: int | None = None,
    bucket_numel: int | None = None,
    local_steps: int | None = None,
) -> Step:
    """One step of ``d`` elements on N ranks: ``bucket_plan(size)`` (the collectives and the compute of one
    bucket) for every bucket — once every ``local_steps`` steps with local steps (the vote's bytes and time
    per inner step) —, and the momentum sync, a flat fp32 ring allreduce of ``sync_params`` every
    ``sync_every`` steps (``lift`` turns it into the caller's item); ``seconds(item)`` prices an item
    (latency, bandwidth, reduction seconds)."""
    d_sync = sync_params_of(d, sync_every, sync_params)
    if local_steps is not None and not is_int(local_steps, 1):
        raise ValueError(f"local_steps={local_steps!r} must be None or an int >= 1 (inner steps per vote)")
    every = local_steps or 1
    items: list[Item] = []
    compute_s = 0.0
    for size, count in buckets(d, bucket_numel):
        bucket, work = bucket_plan(size)
        items += [dataclasses.replace(c, count=c.count * count / every) for c in bucket]
        compute_s += count * sum(getattr(compute, k) * v for k, v in work.items()) / every
    sync: list[Item] = []
    if sync_every is not None and n > 1 and d_sync:
        fp32 = ring("allreduce_f32", ring_bytes(4 * d_sync, n), n)
        sync = [dataclasses.replace(lift(fp32), count=1 / sync_every)]
    latency = bandwidth = sync_s = 0.0
    for i, c in enumerate(items + sync):
        lat, bw, red = seconds(c)
        latency, bandwidth, compute_s = latency + lat, bandwidth + bw, compute_s + red
        if i >= len(items):
            sync_s += lat + bw + red
    return Step(tuple(items + sync), latency, bandwidth, compute_s, sync_s)


# --------------------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class StepCost:
    """Predicted cost of one optimizer step's vote for one variant (seconds; bytes per rank per step).

    ``total_s = latency_s + bandwidth_s + compute_s``; ``sync_s`` is the part of it due to the amortised
    momentum sync. Bytes are those of the busiest rank (the server's root). A variant that is not
    ``allowed`` has NaN times and bytes and ``reason`` says why.
    """

    variant: str
    d: int
    allowed: bool
    reason: str
    latency_s: float
    bandwidth_s: float
    compute_s: float
    sync_s: float
    bytes_sent: float
    bytes_recv: float

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s + self.compute_s

    @property
    def communication_s(self) -> float:
        return self.latency_s + self.bandwidth_s


class CostFields(TypedDict):
    """:class:`StepCost`'s seconds and bytes, as keyword arguments."""

    latency_s: float
    bandwidth_s: float
    compute_s: float
    sync_s: float
    bytes_sent: float
    bytes_recv: float


def cost_fields(step: Step | None) -> CostFields:
    """The seconds and bytes of ``step`` as :class:`StepCost`'s keyword arguments (NaN for ``None``: not
    allowed)."""
    if step is None:
        nan = math.nan
        return CostFields(
            latency_s=nan, bandwidth_s=nan, compute_s=nan, sync_s=nan, bytes_sent=nan, bytes_recv=nan
        )
    return CostFields(
        latency_s=step.latency_s,
        bandwidth_s=step.bandwidth_s,
        compute_s=step.compute_s,
        sync_s=step.sync_s,
        bytes_sent=step.total("sent"),
        bytes_recv=step.total("recv"),
    )


@dataclass(frozen=True)
class Prediction(StepCost):
    """:class:`StepCost` on N workers, each with its own link; ``collectives``: what was charged."""

    n_workers: int
    collectives: tuple[Collective, ...] = ()


def predict(
    variant: Variant,
    d: int,
    n_workers: int,
    network: Network,
    compute: Compute | None = None,
    *,
    sync_every: int | None = None,
    sync_params: int | None = None,
    bucket_numel: int | None = None,
    local_steps: int | None = None,
) -> Prediction:
    """Predicted per-step cost of ``variant`` (preset name or ``VoteConfig``); with ``local_steps`` H, per
    inner step: one vote every H steps.

    Args:
        d: parameters voted on per step.
        n_workers: N.
        network: α, link rate and efficiencies.
        compute: local per-element costs (default: none).
        sync_every: k, synchronise the momentum (fp32 allreduce) every k steps (None: never).
        sync_params: parameters synchronised (default: all d).
        bucket_numel: the vector travels in buckets of this many elements (LionCub's ``bucket_mb``); each
            bucket pays its own latency (and 1-bit padding). None: one bucket.
    """
    name, config = resolve_config(variant)
    n = n_workers
    ok, why = config.capacity(n)
    check_d(d)
    if not ok:
        return Prediction(name, d, False, why, **cost_fields(None), n_workers=n)
    compute = compute or Compute()
    step = charge(
        lambda size: plan(config, size, n),
        lambda c: c,
        lambda c: c.seconds(network, compute),
        d,
        n,
        compute,
        sync_every=sync_every,
        sync_params=sync_params,
        bucket_numel=bucket_numel,
        local_steps=local_steps,
    )
    return Prediction(name, d, True, "", **cost_fields(step), n_workers=n, collectives=step.items)
