"""The ``("node", "local")`` layout of a data-parallel group, for votes laid over nodes
(``VoteConfig.topology``, :mod:`lioncub.collectives.hierarchical`).

Ranks are numbered node by node (rank = node·L + local), as torchrun numbers them: a
:class:`torch.distributed.device_mesh.DeviceMesh` of shape ``(M, L)`` with dimension names
``("node", "local")`` is passed as ``LionCub(process_group=mesh)``, or built here over the default group
from the launcher's environment (:func:`mesh_from_environment`).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lioncub.collectives import Comm

__all__ = ["MESH_DIMS", "is_mesh", "mesh_from_environment", "node_groups"]

#: the dimension names of a node mesh
MESH_DIMS = ("node", "local")


def is_mesh(value: object) -> bool:
    return isinstance(value, DeviceMesh)


def mesh_from_environment(topology: str) -> DeviceMesh:
    """The ``(M, L)`` node mesh of the default group (collective): M from ``$LIONCUB_NNODES`` where
    ``lioncub launch`` emulates the nodes (with ``--nproc N --link`` every rank is a node of its own),
    else L from torchrun's ``$LOCAL_WORLD_SIZE``."""
    world = dist.get_world_size()
    nodes = os.environ.get("LIONCUB_NNODES", "")
    local = (
        str(world // int(nodes))
        if nodes.isdigit() and int(nodes) >= 1
        else os.environ.get("LOCAL_WORLD_SIZE", "")
    )
    if not local.isdigit() or int(local) < 1 or world % int(local):
        raise ValueError(
            f"topology={topology!r}: pass process_group=a DeviceMesh with dims {MESH_DIMS}, or launch with "
            f"torchrun (or lioncub launch --nnodes M --nproc-per-node L), which sets $LOCAL_WORLD_SIZE; "
            f"here $LOCAL_WORLD_SIZE={local!r} and the world has {world} ranks"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (world // int(local), int(local)), mesh_dim_names=MESH_DIMS)


def node_groups(mesh: DeviceMesh, exchange: str) -> tuple[dist.ProcessGroup | None, Comm, Comm]:
    """(the flat group of all the mesh's ranks — ``None`` for the whole world —, the intra-node
    :class:`Comm`, the inter-node :class:`Comm`) of this rank. Collective when the mesh is not the world."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(
            f"process_group: a DeviceMesh must have the dims {MESH_DIMS}, not {mesh.mesh_dim_names}"
        )
    ranks = mesh.mesh.flatten().tolist()
    flat = None if ranks == list(range(dist.get_world_size())) else dist.new_group(ranks=ranks)
    intra = Comm(mesh.get_group("local"), exchange=exchange)  # type: ignore[arg-type]
    inter = Comm(mesh.get_group("node"), exchange=exchange)  # type: ignore[arg-type]
    return flat, intra, inter
