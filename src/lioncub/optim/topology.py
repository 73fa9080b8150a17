"""Who votes with whom: ``LionCub``'s one ``process_group`` argument (:func:`who_votes`), and the
``("node", "local")`` layout of a data-parallel group for votes laid over nodes (``VoteConfig.topology``,
:mod:`lioncub.collectives.hierarchical`).

The argument, resolved by :func:`who_votes` into :class:`Voters` (the flat group the votes travel on, the
node mesh of a topology over nodes, and which part of the model this rank votes on):

* ``None`` — the default process group (every rank votes with every other). Under a launcher
  (``$WORLD_SIZE`` > 1 and ``$RANK`` set) with no default group initialised this is refused, naming
  ``init_process_group``: a job that forgot it would train one model per rank, silently;
* :data:`LOCAL` (``"local"``) — this process alone: no vote, every step is ``Lion``'s (also under a
  launcher, for who means it);
* a ``ProcessGroup`` — the flat case: its ranks vote with each other (a
  :class:`~lioncub.collectives.GroupComm`, a group whose members change, is one too:
  :mod:`lioncub.integrations.torchft`);
* a ``DeviceMesh`` with a replicate dimension, and optionally a shard dimension (:data:`MESH_SHAPES`):
  ``("replicate",)`` votes flat over it; ``("replicate", "shard")``: the ranks of one ``"replicate"``
  group hold the same part of the model and vote on it, the ranks of one ``"shard"`` group hold one
  replica between them — on FSDP2's parameters each rank's part is its local shards
  (:mod:`lioncub.optim.shards`), on plain tensors (DDP inside the shard group) its share of whole tensors,
  broadcast to the shard group after every step; ``("node", "local")`` is the replicate dimension laid over
  M nodes of L ranks, for a ``topology`` other than flat (numbered node by node, rank = node·L + local, as
  torchrun numbers them; default: built over the default group from the launcher's environment,
  :func:`mesh_from_environment`).

A :class:`VoteMesh` gives a replicate and a shard dimension as groups where a ``DeviceMesh`` cannot hold
them (the replicate dimension a group whose members change: torchft's replica groups of several ranks).

Deprecated: a plain :class:`~lioncub.collectives.Comm` (fixed members) — pass its process group
(``comm.group``, or ``None`` for the default one) instead.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lioncub import env
from lioncub.collectives import Comm
from lioncub.collectives.base import Exchange
from lioncub.optim.callers import caller_stacklevel
from lioncub.optim.config import VoteConfig

__all__ = [
    "LOCAL",
    "MESH_DIMS",
    "MESH_SHAPES",
    "Part",
    "VoteMesh",
    "Voters",
    "is_mesh",
    "mesh_from_environment",
    "node_groups",
    "refuse_forgotten_init",
    "vote_groups",
    "who_votes",
]

#: the dimension names of a node mesh
MESH_DIMS = ("node", "local")
#: ``LionCub(process_group=LOCAL)``: this process alone (no vote), also under a launcher
LOCAL = "local"
#: the dims a ``DeviceMesh`` given as ``process_group`` may have: the replicate dimension, optionally a shard
#: dimension; or the replicate dimension laid over nodes (a topology other than flat)
MESH_SHAPES = (("replicate",), ("replicate", "shard"), MESH_DIMS)
#: which part of the model a rank votes on (:class:`Voters`)
Part = Literal["whole", "shards", "shares"]
_SHAPES = (
    f"None (the default group), {LOCAL!r} (this process alone), a ProcessGroup, a DeviceMesh with dims "
    + ", ".join(map(str, MESH_SHAPES))
    + " or a VoteMesh"
)


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


@dataclass(frozen=True)
class Voters:
    """``process_group`` resolved (:func:`who_votes`): who this rank votes with, on which part of the model.

    Attributes:
        group: the flat group the votes travel on — a ``ProcessGroup``, ``None`` (the default group), a
            :class:`~lioncub.collectives.Comm` the caller built, or ``False``: this process alone.
        nodes: the ``("node", "local")`` mesh of a topology over nodes (``None``: built from the
            environment where the topology needs one).
        mesh: the ``("replicate", "shard")`` mesh (``None``: no shard dimension).
        part: which part of the model this rank votes on — ``"whole"`` (all of it), ``"shards"`` (its
            local shards of FSDP2's ``DTensor`` s), ``"shares"`` (its share of whole tensors, the model
            replicated in the shard group: DDP inside it).
    """

    group: dist.ProcessGroup | Comm | Literal[False] | None
    nodes: DeviceMesh | None = None
    mesh: DeviceMesh | None = None
    part: Part = "whole"
    #: ``"shares"``: the shard group (a replica's ranks) and who broadcasts the shares (:class:`VoteMesh`)
    shard_group: dist.ProcessGroup | None = None
    broadcast: Literal["step", "caller"] = "step"


@dataclass(frozen=True)
class VoteMesh:
    """A replicate and a shard dimension given as groups, for groups a ``DeviceMesh`` cannot hold: the
    replicate dimension a :class:`~lioncub.collectives.GroupComm` whose members change
    (:mod:`lioncub.integrations.torchft`'s replica groups of several ranks), the shard dimension the
    ranks of this rank's replica. On plain parameters (DDP inside the shard group) each rank votes on its
    share of whole tensors with the ranks of ``replicate``, as with a ``("replicate", "shard")`` mesh
    (docs/shards.md, "DDP inside"); on FSDP2's parameters, on its local shards (no broadcast: FSDP2 gathers
    them), ``shard`` then the mesh of this replica alone: dims ``("replicate", "shard")``, shape ``(1, S)``,
    the model sharded over ``shard["shard"]`` (its ``state_dict()`` is this replica's, R = 1).

    Args:
        replicate: the ranks that own the same share (shard), one per replica (a ``ProcessGroup``, a
            ``GroupComm``, or ``None``: the default group).
        shard: the ranks of this rank's replica, one per share (``None``: the default group); on FSDP2's
            parameters the ``(1, S)`` mesh of this replica.
        broadcast: ``"step"`` — ``step()`` broadcasts the shares to the replica after each step;
            ``"caller"`` — the caller does (``opt.shares.broadcast()``, collective in ``shard``), e.g. only
            once its replica's ranks agree that the step stands. Nothing is broadcast on shards.
    """

    replicate: dist.ProcessGroup | Comm | None
    shard: dist.ProcessGroup | DeviceMesh | None
    broadcast: Literal["step", "caller"] = "step"


def who_votes(process_group: object, topology: str = "flat", *, sharded: bool = False) -> Voters:
    """:class:`Voters` of ``LionCub``'s ``process_group`` argument (the shapes of the module docstring);
    ``topology``: ``VoteConfig.topology``; ``sharded``: whether the parameters are ``DTensor`` s. Nothing
    collective. ``ValueError`` naming the accepted shapes for anything else; ``RuntimeError`` naming
    ``init_process_group`` for ``None`` under a launcher with no default group."""
    if isinstance(process_group, VoteMesh):
        return _vote_mesh_voters(process_group, topology, sharded)
    if isinstance(process_group, Comm):
        if process_group.fixed_members:
            warnings.warn(
                "LionCub(process_group=a Comm) is deprecated: pass its process group (comm.group; None for "
                "the default group) or a DeviceMesh (lioncub.optim.topology): LionCub builds its own Comm "
                "on the parameters' device",
                DeprecationWarning,
                stacklevel=caller_stacklevel(),
            )
        return Voters(process_group)
    if isinstance(process_group, str):
        if process_group != LOCAL:
            raise ValueError(
                f"process_group={process_group!r}: the one string accepted is {LOCAL!r} ({_SHAPES})"
            )
        return Voters(False)
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is None and not initialised:
        refuse_forgotten_init()
        return Voters(False)
    if isinstance(process_group, DeviceMesh):
        return _mesh_voters(process_group, topology, sharded)
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group: a {type(process_group).__name__} is not one of {_SHAPES}")
    if topology != "flat" and process_group is not None:
        raise ValueError(
            f"topology={topology!r}: process_group must be a DeviceMesh with dims {MESH_DIMS} (or None: "
            "built from torchrun's $LOCAL_WORLD_SIZE)"
        )
    return Voters(process_group)


def _vote_mesh_voters(given: VoteMesh, topology: str, sharded: bool) -> Voters:
    one_replica = (
        isinstance(given.shard, DeviceMesh)
        and given.shard.mesh_dim_names == ("replicate", "shard")
        and given.shard.size(0) == 1
    )
    if sharded and not one_replica:
        raise TypeError(
            "process_group=VoteMesh(...) is for plain parameters with shard=a process group (DDP inside the "
            "shard group); FSDP2's parameters take the DeviceMesh with dims ('replicate', 'shard') they were "
            "sharded over, or VoteMesh(replicate, shard=the mesh of this replica alone: dims ('replicate', "
            f"'shard'), shape (1, S)), not shard={given.shard!r}"
        )
    if one_replica and not sharded:
        raise TypeError(
            "process_group=VoteMesh(replicate, shard=a DeviceMesh) is for FSDP2's parameters (DTensors "
            "sharded over shard['shard']); these are plain tensors: give shard=the replica's process group"
        )
    if given.broadcast not in ("step", "caller"):
        raise ValueError(f"VoteMesh(broadcast={given.broadcast!r}): allowed values are 'step', 'caller'")
    replicate = given.replicate
    if isinstance(replicate, Comm) and replicate.fixed_members:
        raise ValueError("VoteMesh(replicate=a Comm): give its process group (a GroupComm is accepted)")
    if topology != "flat":
        raise ValueError(
            f"topology={topology!r} on a VoteMesh's shares of whole tensors: the vote is flat over its "
            f"replicate group; a topology over nodes takes a DeviceMesh with dims {MESH_DIMS}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group=VoteMesh(...): init_process_group first (the shards share over it)")
    if isinstance(given.shard, DeviceMesh):  # FSDP2's shards: this replica's mesh, the vote on replicate
        return Voters(replicate, mesh=given.shard, part="shards")
    return Voters(replicate, part="shares", shard_group=given.shard, broadcast=given.broadcast)


def _mesh_voters(mesh: DeviceMesh, topology: str, sharded: bool) -> Voters:
    dims = mesh.mesh_dim_names
    if dims == MESH_DIMS:
        if topology == "flat":
            raise ValueError(
                f"process_group: a DeviceMesh with dims {MESH_DIMS} is for a topology other than 'flat' "
                f"(VoteConfig.topology), one with dims ('replicate', 'shard') for FSDP2's parameters "
                f"(docs/shards.md); this one has dims {dims}"
            )
        return Voters(None, nodes=mesh)
    if dims == ("replicate",):
        if topology != "flat":
            raise ValueError(
                f"topology={topology!r}: a DeviceMesh with dims ('replicate',) votes flat; lay the replicate "
                f"dimension over nodes with a DeviceMesh with dims {MESH_DIMS}"
            )
        return Voters(mesh.get_group("replicate"))
    if dims == ("replicate", "shard"):
        shard_group = None if sharded else mesh.get_group("shard")
        return Voters(
            mesh.get_group("replicate"),
            mesh=mesh,
            part="shards" if sharded else "shares",
            shard_group=shard_group,
        )
    raise ValueError(
        "process_group: a DeviceMesh must have the dims ('replicate',) (a flat vote), ('replicate', "
        f"'shard') for FSDP2's parameters or DDP inside the shard dimension (docs/shards.md), or "
        f"{MESH_DIMS} (a topology over nodes); this one has dims {dims}"
    )


def refuse_forgotten_init() -> None:
    """Under a launcher (``$WORLD_SIZE`` > 1, ``$RANK`` set) with no default process group: a
    ``RuntimeError`` naming ``init_process_group`` (each rank would otherwise train a model of its own)."""
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK")
    if rank is None or not world.isdigit() or int(world) <= 1:
        return
    raise RuntimeError(
        f"rank {rank} of WORLD_SIZE={world}: LionCub has no process group to vote over: call "
        "torch.distributed.init_process_group(...) before building the optimizer (each rank would otherwise "
        f"train a model of its own, silently); process_group={LOCAL!r} runs this process alone on purpose"
    )


def vote_groups(
    config: VoteConfig, process_group: object, device: torch.device, broadcast_init: bool
) -> tuple[Comm, tuple[Comm, Comm] | None]:
    """(this rank's :class:`Comm` of the flat group, the node groups of a topology other than flat) for
    :class:`~lioncub.optim.LionCub`'s ``process_group`` argument (or its :class:`Voters`); a given
    ``Comm`` as it is (``broadcast_init``: ``Checks.broadcast_init``, refused on a comm whose members
    change)."""
    who = process_group if isinstance(process_group, Voters) else who_votes(process_group, config.topology)
    group, levels = _groups(config, who, device)
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
    config: VoteConfig, who: Voters, device: torch.device
) -> tuple[dist.ProcessGroup | Comm | Literal[False] | None, tuple[Comm, Comm] | None]:
    """(the flat group — ``False`` when there is no process group at all —, the (intra-node, inter-node)
    groups, on ``device``, of a topology other than flat) for ``who``."""
    group = who.group
    if isinstance(group, Comm):
        if config.topology != "flat" or group.device != device:
            why = (
                f"; a {type(group).__name__} on {group.backend} exchanges {group.device} tensors (torchft's "
                "replica groups vote over ProcessGroupGloo on the CPU: keep the model on the CPU)"
                if not group.fixed_members
                else ""
            )
            raise ValueError(
                f"process_group: a Comm (on {group.device}) votes flat on its own device; here the "
                f"topology is {config.topology!r} and the parameters are on {device}{why}"
            )
        return group, None
    if group is False or config.topology == "flat" or who.part != "whole":
        return group, None  # a shard mesh's topology is refused by the shards' checks
    mesh = who.nodes or mesh_from_environment(config.topology, device)
    flat, intra, inter = node_groups(mesh, _exchange(config), device)
    return flat, (intra, inter)
