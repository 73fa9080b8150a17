"""A run's model sharded inside each emulated node (``lioncub train --fsdp``, docs/shards.md "From the
command line").

With ``--nnodes M --nproc-per-node L --fsdp`` the world's ranks (numbered node by node) form the 2-D mesh
``("replicate", "shard")`` of shape ``(M, L)`` (:func:`node_mesh`): a node's L ranks are one group of the
``"shard"`` dimension and shard the model with FSDP2 (:func:`shard_model`: ``fully_shard`` on every block
of an ``nn.ModuleList`` -- the GPT's transformer blocks -- then on the root); the ranks that hold the same
shard in the M nodes are one group of ``"replicate"``, the vote's (``LionCub(process_group=mesh)``). Each
node is one voter, its gradient the node's mean (FSDP2's reduce-scatter); the NIC carries one vote per
node, split over the node's ranks by shard.

What a step sends inside a node (:func:`fsdp_intra_bytes`, added to a step record's ``intra_bytes``):
FSDP2's all-gather of each unit's parameters in the forward and again in the backward (the blocks reshard
after their forward; the root does not) and the reduce-scatter of the gradients -- per rank ``L − 1``
times its padded shard each, fp32. Not counted: the step's one int32 all-reduce over the node's ranks
(agreeing on a skipped step) and, for quantized votes, the all-gather of a bucket's contributions
(:class:`lioncub.optim.shards.ShardQuantizedVote`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lioncub.optim.ddp import GradientTraffic
from lioncub.optim.shards import SHARD_DIMS

__all__ = [
    "HsdpTraffic",
    "fsdp_intra_bytes",
    "full_model_state",
    "hsdp_traffic",
    "node_mesh",
    "reshard",
    "shard_model",
    "sharded_state",
]


def node_mesh(nnodes: int, per_node: int, device: torch.device) -> DeviceMesh:
    """The mesh of dims :data:`~lioncub.optim.shards.SHARD_DIMS` of shape ``(nnodes, per_node)`` over the
    initialised world (rank = node · per_node + local rank). Collective."""
    if dist.get_world_size() != nnodes * per_node:
        raise ValueError(f"--fsdp: {dist.get_world_size()} ranks are not {nnodes} nodes × {per_node}")
    return init_device_mesh(device.type, (nnodes, per_node), mesh_dim_names=SHARD_DIMS)


def _units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own, before the root: each element of an ``nn.ModuleList``
    (the GPT's blocks)."""
    return [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, replicate: bool = False, reduce_dtype: torch.dtype | None = None
) -> nn.Module:
    """``fully_shard`` each unit of ``model`` (:func:`_units`), then the root, over ``mesh["shard"]``;
    returns the root (``model`` itself, its parameters now ``DTensor`` shards). ``replicate``: over the
    whole mesh instead (HSDP: FSDP2 all-reduces each gradient shard between the nodes, the DDP baselines'
    mean over every rank), the gradients reduced in ``reduce_dtype`` (default: theirs). Collective."""
    target = mesh if replicate else mesh["shard"]
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for unit in _units(model):
        fully_shard(unit, mesh=target, mp_policy=policy)
    fully_shard(model, mesh=target, mp_policy=policy)
    return model


def reshard(model: nn.Module) -> None:
    """Free every unsharded parameter (an evaluation's forward leaves the root gathered: FSDP2 does not
    reshard the root after its forward), so ``model.parameters()`` are the shards again."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _padded_bytes(params: Sequence[torch.Tensor], shards: int) -> int:
    """Bytes of one rank's padded shards of ``params`` (FSDP2's ``⌈D/S⌉`` rows of each)."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.ndim else 1
        row = p.numel() // rows if rows else 0
        total += -(-rows // shards) * row * p.element_size()
    return total


def _unit_bytes(model: nn.Module, shards: int) -> list[tuple[bool, int]]:
    """Each FSDP2 unit of ``model`` (its blocks, then the root): whether it is the root, and the bytes of
    one rank's padded shards of its own parameters."""
    seen: set[int] = set()
    units = []
    for unit in [*_units(model), model]:
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append((unit is model, _padded_bytes(params, shards)))
    return units


def fsdp_intra_bytes(model: nn.Module, shards: int, reduce_bytes: int = 4) -> int:
    """Bytes one rank sends inside its node per training step for FSDP2 (module docstring): ``shards − 1``
    times its padded shard, for each all-gather (a block's: forward and backward; the root's: forward) and
    for the reduce-scatter of the gradients (``reduce_bytes`` per element). ``model``: the sharded model."""
    units = _unit_bytes(model, shards)
    gathers = sum(size * (1 if root else 2) for root, size in units)
    scatter = sum(size for _, size in units) * reduce_bytes // 4
    return (shards - 1) * (gathers + scatter)


@dataclass
class HsdpTraffic(GradientTraffic):
    """The bytes a rank of the sharded DDP baseline (HSDP) hands to FSDP2's all-reduce between the nodes:
    at every step one all-reduce per unit of its gradient shard (ring: ``2·(M−1)/M`` of it, both ways), the
    units' shard sizes ``units`` (elements)."""

    units: list[int] = field(default_factory=list)

    def take(self) -> tuple[float, float, int]:
        """A step's (sent, received, collectives)."""
        for numel in self.units:
            self.add(numel)
        return super().take()


def hsdp_traffic(model: nn.Module, nnodes: int, shards: int, wire: torch.dtype) -> HsdpTraffic:
    """The :class:`HsdpTraffic` of ``model`` sharded over ``shards`` ranks per node, its gradients reduced
    in ``wire``."""
    units = [size // 4 for _, size in _unit_bytes(model, shards)]  # fp32 parameters: elements
    return HsdpTraffic(nnodes, wire.itemsize, units=units)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The whole model's state dict on rank 0, on the CPU (the other ranks: ``{}``), keyed as the unsharded
    model's ``state_dict()``: what ``model.pt`` holds. Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: the model's and the optimizer's state as ``get_state_dict`` gives
    them (this rank's shards, ``DTensor`` s; LionCub's momenta of every replica, docs/shards.md
    "Checkpoints"), for ``dcp.save``. Collective."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}
