"""The ``("node", "local")`` layout of a data-parallel group, for votes laid over nodes
(``VoteConfig.topology``, :mod:`lioncub.collectives.hierarchical`).

Ranks are numbered node by node (rank = node·L + local), as torchrun numbers them: a
:class:`torch.distributed.device_mesh.DeviceMesh` of shape ``(M, L)`` with dimension names
``("node", "local")`` is passed as ``LionCub(process_group=mesh)``, or built here over the default group
from the launcher's environment (:func:`mesh_from_environment`). :func:`vote_groups`: the groups a
``LionCub`` votes on, from its ``process_group`` argument (a group, a mesh, a ``Comm``, or none).
"""

from __future__ import annotations

import os
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lioncub import env
from lioncub.collectives import Comm
from lioncub.collectives.base import Exchange
from lioncub.optim.config import VoteConfig

__all__ = ["MESH_DIMS", "is_mesh", "mesh_from_environment", "node_groups", "vote_groups"]

#: the dimension names of a node mesh
MESH_DIMS = ("node", "local")


def is_mesh(value: object) -> bool:
    return isinstance(value, DeviceMesh)


def mesh_from_environment(topology: str, device: torch.device | None = None) -> DeviceMesh:
    """The ``(M, L)`` node mesh of the default group (collective): M from ``$LIONCUB_NNODES`` where
    ``lioncub launch`` emulates the nodes (with ``--nproc N --link`` every rank is a node of its own),
    else L from torchrun's ``$LOCAL_WORLD_SIZE``. Every rank's L is compared first (one all-gather of an
    int32 per rank), so that nodes of uneven size, or a value some ranks lack, raise the same error on
    every rank instead of leaving some waiting for a mesh the others never build. ``device``: the
    parameters' (the mesh and that gather live on its device type; default: :class:`Comm`'s)."""
    world = dist.get_world_size()
    local, said = _ranks_per_node(world)
    everyone = Comm(None, device=device)
    mine = torch.tensor([local], dtype=torch.int32, device=everyone.device)
    every = torch.empty(world, 1, dtype=torch.int32, device=everyone.device)
    everyone.all_gather(every, mine, "node size check").wait()
    sizes = every.reshape(-1).cpu().tolist()
    if len(set(sizes)) > 1 or sizes[0] < 1:
        seen = everyone.all_gather_object(said, "node size gather")
        table = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise ValueError(
            f"topology={topology!r}: the ranks do not agree on one node size that divides the world of "
            f"{world} ranks ({table}). Pass process_group=a DeviceMesh with dims {MESH_DIMS}, or launch "
            "nodes of equal size with torchrun (which sets $LOCAL_WORLD_SIZE) or lioncub launch --nnodes M "
            "--nproc-per-node L"
        )
    shape = (world // sizes[0], sizes[0])
    return init_device_mesh(everyone.device.type, shape, mesh_dim_names=MESH_DIMS)


def _ranks_per_node(world: int) -> tuple[int, str]:
    """(L, what this rank's environment says), L = 0 where the environment gives no node size that divides
    the world."""
    nodes = env.get("LIONCUB_NNODES")
    if nodes is not None:
        said = f"$LIONCUB_NNODES={nodes!r}"
        ok = nodes.isdigit() and 1 <= int(nodes) <= world and world % int(nodes) == 0
        return (world // int(nodes) if ok else 0), said
    local = os.environ.get("LOCAL_WORLD_SIZE")
    said = "$LOCAL_WORLD_SIZE unset" if local is None else f"$LOCAL_WORLD_SIZE={local!r}"
    ok = local is not None and local.isdigit() and 1 <= int(local) <= world and world % int(local) == 0
    return (int(local) if ok and local is not None else 0), said


def node_groups(
    mesh: DeviceMesh, exchange: Exchange, device: torch.device | None = None
) -> tuple[dist.ProcessGroup | None, Comm, Comm]:
    """(the flat group of all the mesh's ranks — ``None`` for the whole world —, the intra-node
    :class:`Comm`, the inter-node :class:`Comm`) of this rank, on ``device`` (default: :class:`Comm`'s).
    Collective when the mesh is not the world."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(
            f"process_group: a DeviceMesh must have the dims {MESH_DIMS} (a topology over nodes) or "
            f"('replicate', 'shard') (FSDP2's parameters, docs/shards.md), not {mesh.mesh_dim_names}"
        )
    ranks = mesh.mesh.flatten().tolist()
    flat = None if ranks == list(range(dist.get_world_size())) else dist.new_group(ranks=ranks)
    intra = Comm(mesh.get_group("local"), device=device, exchange=exchange)
    inter = Comm(mesh.get_group("node"), device=device, exchange=exchange)
    return flat, intra, inter


def vote_groups(
    config: VoteConfig, process_group: Any, device: torch.device, broadcast_init: bool
) -> tuple[Comm, tuple[Comm, Comm] | None]:
    """(this rank's :class:`Comm` of the flat group, the node groups of a topology other than flat) for
    :class:`~lioncub.optim.LionCub`'s ``process_group`` argument; a given ``Comm`` as it is
    (``broadcast_init``: ``Checks.broadcast_init``, refused on a comm whose members change)."""
    group, levels = _groups(config, process_group, device)
    if isinstance(group, Comm):
        if broadcast_init and not group.fixed_members:
            raise ValueError(
                "checks=Checks(broadcast_init=True) on a comm whose members change (GroupComm): a group "
                "that joins later has nobody to broadcast with; pass Checks(broadcast_init=False) and give "
                "the groups their initial values otherwise (lioncub.integrations.torchft heals them)"
            )
        return group, levels
    if group is False:
        return Comm.single(device), levels
    return Comm(group, device=device, exchange=_exchange(config)), levels


def _exchange(config: VoteConfig) -> Exchange:
    """``config.exchange``, one of :data:`~lioncub.collectives.base.Exchange`'s values (``VoteConfig`` checks
    it; its field is a ``str``)."""
    return cast(Exchange, config.exchange)


def _groups(
    config: VoteConfig, process_group: Any, device: torch.device
) -> tuple[dist.ProcessGroup | Comm | Literal[False] | None, tuple[Comm, Comm] | None]:
    """(the flat group — ``False`` when there is no process group at all —, the (intra-node, inter-node)
    groups, on ``device``, of a topology other than flat) for the ``process_group`` argument."""
    if isinstance(process_group, Comm):
        if config.topology != "flat" or process_group.device != device:
            why = (
                f"; a {type(process_group).__name__} on {process_group.backend} exchanges "
                f"{process_group.device} tensors (torchft's replica groups vote over ProcessGroupGloo on the "
                "CPU: keep the model on the CPU)"
                if not process_group.fixed_members
                else ""
            )
            raise ValueError(
                f"process_group: a Comm (on {process_group.device}) votes flat on its own device; here the "
                f"topology is {config.topology!r} and the parameters are on {device}{why}"
            )
        return process_group, None
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return False, None
    if config.topology == "flat":
        if is_mesh(process_group):
            raise ValueError(
                f"process_group: a DeviceMesh with dims {MESH_DIMS} is for a topology other than 'flat' "
                f"(VoteConfig.topology), one with dims ('replicate', 'shard') for FSDP2's parameters "
                f"(docs/shards.md); this one has dims {process_group.mesh_dim_names}"
            )
        return process_group, None
    mesh = process_group if is_mesh(process_group) else None
    if mesh is None and process_group is not None:
        raise ValueError(
            f"topology={config.topology!r}: process_group must be a DeviceMesh with dims "
            f"{MESH_DIMS} (or None: built from torchrun's $LOCAL_WORLD_SIZE)"
        )
    mesh = mesh or mesh_from_environment(config.topology, device)
    flat, intra, inter = node_groups(mesh, _exchange(config), device)
    return flat, (intra, inter)
