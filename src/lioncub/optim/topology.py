"""The ``("node", "local")`` layout of a data-parallel group, for votes laid over nodes
(``VoteConfig.topology``, :mod:`lioncub.collectives.hierarchical`).

Ranks are numbered node by node (rank = node·L + local), as torchrun numbers them: a
:class:`torch.distributed.device_mesh.DeviceMesh` of shape ``(M, L)`` with dimension names
``("node", "local")`` is passed as ``LionCub(process_group=mesh)``, or built here over the default group
from the launcher's environment (:func:`mesh_from_environment`).
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lioncub import env
from lioncub.collectives import Comm

__all__ = ["MESH_DIMS", "is_mesh", "mesh_from_environment", "node_groups"]

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
    mesh: DeviceMesh, exchange: str, device: torch.device | None = None
) -> tuple[dist.ProcessGroup | None, Comm, Comm]:
    """(the flat group of all the mesh's ranks — ``None`` for the whole world —, the intra-node
    :class:`Comm`, the inter-node :class:`Comm`) of this rank, on ``device`` (default: :class:`Comm`'s).
    Collective when the mesh is not the world."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(
            f"process_group: a DeviceMesh must have the dims {MESH_DIMS}, not {mesh.mesh_dim_names}"
        )
    ranks = mesh.mesh.flatten().tolist()
    flat = None if ranks == list(range(dist.get_world_size())) else dist.new_group(ranks=ranks)
    intra = Comm(cast(dist.ProcessGroup, mesh.get_group("local")), device=device, exchange=exchange)
    inter = Comm(cast(dist.ProcessGroup, mesh.get_group("node")), device=device, exchange=exchange)
    return flat, intra, inter
