"""The calibration file of ``lioncub calibrate`` (:mod:`lioncub.planning.measure` measures it): the
network with α (seconds per message) and efficiency per collective, the compute costs (seconds per element
or byte), and for nodes of several ranks the link inside a node and the NIC under the whole group's
collectives. :func:`load_calibration` reads and validates one; :meth:`Calibration.save` writes it. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lioncub._validate import is_int, is_number
from lioncub.planning.machine import OPS, Cluster, Compute, Network, OpCost

__all__ = ["CALIBRATION_VERSION", "Calibration", "calibration_from_json", "load_calibration"]

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What ``lioncub calibrate`` measured: the network (with per-op fits) and the compute costs.

    A calibration of M nodes of L ranks (``nnodes`` set, ``intra`` not None) has two levels: ``network``
    is a node's NIC to the other nodes (the rate of all its ranks together) and ``intra`` a rank's link to
    the ranks of its own node; :meth:`cluster` lays them out as a :class:`Cluster`. Otherwise ``network``
    is each rank's own link and ``intra`` is None.
    """

    network: Network
    compute: Compute
    world_size: int
    link_bps: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    intra: Network | None = None
    nnodes: int | None = None
    intra_link_bps: float | None = None
    flat: Network | None = None

    def __post_init__(self) -> None:
        if (self.intra is None) != (self.nnodes is None):
            raise ValueError("Calibration: intra and nnodes go together (a two-level calibration has both)")
        if self.nnodes is not None and not (
            is_int(self.nnodes, 2) and self.world_size % self.nnodes == 0 and self.world_size > self.nnodes
        ):
            raise ValueError(
                f"Calibration: nnodes={self.nnodes!r} must be an int >= 2 dividing world_size="
                f"{self.world_size} into nodes of at least 2 ranks"
            )

    @property
    def nproc_per_node(self) -> int | None:
        return None if self.nnodes is None else self.world_size // self.nnodes

    def cluster(self, nnodes: int | None = None, nproc_per_node: int | None = None) -> Cluster:
        """The two levels as a :class:`Cluster` of ``nnodes`` × ``nproc_per_node`` (default: the layout
        calibrated). Needs a two-level calibration."""
        if self.intra is None or self.nnodes is None:
            raise ValueError(
                "this calibration has one level (a link per rank); calibrate on nodes of several ranks "
                "(`lioncub calibrate --nnodes M --nproc-per-node L`) for both levels"
            )
        return Cluster(
            self.nnodes if nnodes is None else nnodes,
            self.world_size // self.nnodes if nproc_per_node is None else nproc_per_node,
            self.network,
            self.intra,
            self.flat,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (``raw`` entries such as fit details are kept)."""
        doc = dict(self.raw)
        doc.update(
            version=CALIBRATION_VERSION,
            world_size=self.world_size,
            link_bps=self.link_bps,
            network=_network_json(self.network),
        )
        doc["per_op"] = _per_op_json(doc.get("per_op", {}), self.network)
        if self.intra is not None:
            doc.update(
                nnodes=self.nnodes,
                intra_link_bps=self.intra_link_bps,
                intra_network=_network_json(self.intra),
            )
            doc["intra_per_op"] = _per_op_json(doc.get("intra_per_op", {}), self.intra)
        if self.flat is not None:
            doc["flat_network"] = _network_json(self.flat)
            doc["flat_per_op"] = _per_op_json(doc.get("flat_per_op", {}), self.flat)
        doc["compute"] = dataclasses.asdict(self.compute)
        return doc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")


def _network_json(network: Network) -> dict[str, float]:
    return {
        "latency_s": network.latency_s,
        "bandwidth_Bps": network.bandwidth_Bps,
        "efficiency": network.efficiency,
    }


def _per_op_json(fits: Any, network: Network) -> dict[str, dict[str, Any]]:
    """The per-op fit details of ``fits`` with each op's α and efficiency from ``network``."""
    per_op = {k: dict(v) for k, v in dict(fits).items()}
    for op, cost in network.per_op.items():
        per_op.setdefault(op, {}).update(latency_s=cost.latency_s, efficiency=cost.efficiency)
    return per_op


def _network_from_json(doc: Mapping[str, Any], net_key: str, ops_key: str, where: str) -> Network:
    net = doc.get(net_key)
    if not isinstance(net, Mapping):
        raise ValueError(f"{where}: {net_key!r} must be an object with latency_s and bandwidth_Bps")
    per_op: dict[str, OpCost] = {}
    for op, fit in dict(doc.get(ops_key) or {}).items():
        if op not in OPS:
            continue  # written by a newer calibrate: not used by this model
        if not isinstance(fit, Mapping):
            raise ValueError(f"{where}: {ops_key}[{op!r}] must be an object")
        if fit.get("ok", True) is False:
            continue  # the fit failed (e.g. a slope <= 0): fall back to the network's values
        per_op[op] = OpCost(
            _number(fit, "latency_s", f"{where}: {ops_key}[{op!r}]"),
            _number(fit, "efficiency", f"{where}: {ops_key}[{op!r}]", positive=True),
        )
    return Network(
        _number(net, "latency_s", f"{where}: {net_key}"),
        _number(net, "bandwidth_Bps", f"{where}: {net_key}", positive=True),
        _number(net, "efficiency", f"{where}: {net_key}", positive=True) if "efficiency" in net else 1.0,
        per_op,
    )


def _number(doc: Mapping[str, Any], key: str, where: str, *, positive: bool = False) -> float:
    value = doc.get(key)
    if not is_number(value):
        raise ValueError(f"{where}: {key!r} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {key!r} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def calibration_from_json(doc: Mapping[str, Any], where: str = "calibration") -> Calibration:
    """Validate and read a calibration document (see :func:`load_calibration`)."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected a JSON object")
    if doc.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"{where}: version {doc.get('version')!r} is not {CALIBRATION_VERSION}")
    network = _network_from_json(doc, "network", "per_op", where)
    comp = doc.get("compute") or {}
    if not isinstance(comp, Mapping):
        raise ValueError(f"{where}: 'compute' must be an object")
    known = {f.name for f in dataclasses.fields(Compute)}
    compute = Compute(**{k: _number(comp, k, f"{where}: compute") for k in comp if k in known})
    world = doc.get("world_size")
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"{where}: 'world_size' must be an int >= 1, got {world!r}")
    link = doc.get("link_bps")
    link_bps = None if link is None else _number(doc, "link_bps", where, positive=True)
    if doc.get("nnodes") is None:
        return Calibration(network, compute, world, link_bps, dict(doc))
    nnodes = doc["nnodes"]
    if not (is_int(nnodes, 2) and world % nnodes == 0 and world > nnodes):
        raise ValueError(
            f"{where}: 'nnodes' must be an int >= 2 dividing world_size={world} into nodes of at least 2 "
            f"ranks, got {nnodes!r}"
        )
    intra = _network_from_json(doc, "intra_network", "intra_per_op", where)
    intra_link = doc.get("intra_link_bps")
    intra_bps = None if intra_link is None else _number(doc, "intra_link_bps", where, positive=True)
    flat = _network_from_json(doc, "flat_network", "flat_per_op", where) if "flat_network" in doc else None
    return Calibration(network, compute, world, link_bps, dict(doc), intra, nnodes, intra_bps, flat)


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read a JSON file written by ``lioncub calibrate`` (raises ``ValueError`` naming the file)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration {path} is not valid JSON: {exc}") from None
    return calibration_from_json(doc, str(path))
