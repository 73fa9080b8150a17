"""Votes between replica groups that come and go, on torchft (the ``ft`` extra, docs/install.md).

A *replica group* is one process (or L processes: below) training a full replica. The groups vote with
each other over torchft's reconfigurable process group: torchft's lighthouse forms a quorum of the groups
alive at each step (or, with local steps, at each window's start), the vote's N is the quorum's size, a
group that leaves is left out at the next quorum, and one that joins (or rejoins) heals from a live peer
first. No job restarts.

One step (:class:`ReplicaGroup`), in the caller's loop::

    group = ReplicaGroup(lighthouse="http://localhost:29510", index=0, max_groups=4)
    opt = LionCub(model.parameters(), lr=3e-4, variant="1bit", process_group=group.comm,
                  checks=Checks(broadcast_init=False))
    group.attach(opt)
    for batch in batches:
        group.begin()                      # quorum (and heal) at a step or window boundary
        model(batch).backward()
        committed = group.step()           # the vote; applied only if the quorum committed it

1. :meth:`ReplicaGroup.begin` — at a commit boundary (every step; with local steps H, every H steps) this
   group's state is copied aside (the *snapshot*: parameters, the optimizer's state dict), then
   ``Manager.start_quorum()``: a group whose committed count is behind the quorum's (a new group, one that
   rejoins, one whose last step was not committed) receives a live peer's snapshot through torchft's
   checkpoint transport and loads it (:meth:`ReplicaGroup.heal`): the parameters and the optimizer's
   shared state bit for bit (its step, with local steps the outer state), its own momenta by
   ``momentum_on_heal`` (``"peer"``: the peer's copy; ``"zeros"``). A peer whose settings differ (variant,
   update rule, local steps, betas, weight decay, the parameters' shapes) is refused there, naming the
   setting: the joining group raises :class:`SettingsMismatchError` and the others go on without it.
   Then the :class:`~lioncub.collectives.GroupComm` takes this group's rank in the quorum and its size.
2. :meth:`ReplicaGroup.step` — the optimizer's step (the vote over the quorum; with local steps an inner
   step, the window's last one voting), then at a commit boundary ``Manager.should_commit()``. **All or
   none:** a group whose exchange failed (a peer died during it: :class:`~lioncub.collectives.base.
   CollectiveError`) reports the error and puts its snapshot back; a group the quorum does not commit
   puts it back too. A step (window) that is not committed is *skipped*, never retried: its batch is
   consumed and the next batch makes the step again; the optimizer's step count and torchft's committed
   count advance only on commit, so no step is applied twice or lost, and a group left behind heals from a
   peer that went on.

The tie rule across a changing N: N is the quorum's size at that step; the 1-bit vote's tie (even N)
alternates with the step, and the ``split`` zero rule uses each group's rank in the quorum, so every
participant decides a tie alike whatever N was before. The votes size their lanes and levels for
``max_groups`` (a preset that cannot hold it, ``4bit`` over 15, is refused at :meth:`attach`).

**Groups of several ranks** (``group_world_size`` L > 1; ``lioncub train --fault-tolerant --nnodes M``):
DDP inside the group, the group one voter, each rank's optimizer over ``VoteMesh(group.comm, group_pg,
broadcast="caller")``: it votes on its share of the parameters (``opt.shares``), which the group broadcasts
once the step stands (:mod:`lioncub.integrations.group_shares`). torchft forms the quorum per group, heals a
group's ranks (rank ℓ from rank ℓ of the peer) and commits a step only if every rank of the group commits
it (``should_commit``): a failed exchange on one rank puts the whole group's step back. Or FSDP2 inside the
group: the model sharded over the group's own ``(1, L)`` mesh and ``LionCub(params,
process_group=VoteMesh(group.comm, mesh))`` (docs/shards.md): each rank votes on its local shards with the
same shard rank of the other groups, nothing is broadcast, and a heal is shard by shard -- rank ℓ takes
rank ℓ's local shards and its optimizer state of them (:func:`portable_state`, :func:`load_portable`).

**On the CPU only.** The groups vote over torchft's gloo process group (``ProcessGroupGloo``) on CPU
tensors: the model and the optimizer stay on the CPU, and parameters on another device (CUDA) are refused
at :meth:`ReplicaGroup.attach` (and at :meth:`ReplicaGroup.begin`, should they move later), naming the
parameter and its device. ``lioncub train --fault-tolerant`` trains on the CPU and refuses ``--device
cuda`` before anything starts.

Costs: the snapshot is one copy of the parameters and of the optimizer's state per commit boundary (host
memory of 2 × (parameters + momenta), a memory copy each step without local steps, each window with).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import re
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, Union, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lioncub._validate import is_int, is_number
from lioncub.collectives import GroupComm
from lioncub.collectives.base import CollectiveError
from lioncub.integrations.common import require
from lioncub.integrations.group_shares import agree_on_heal, shard  # shard: deprecated, re-exported
from lioncub.optim.lioncub import LionCub
from lioncub.optim.shard_state import is_checkpoint_form
from lioncub.optim.shards import ShareView

__all__ = [
    "MOMENTA_ON_HEAL",
    "Agreement",
    "DiLoCoGroup",
    "Heal",
    "LighthouseStatus",
    "ReplicaGroup",
    "ReplicaGroupError",
    "SettingsMismatchError",
    "from_storable",
    "lighthouse_status",
    "load_portable",
    "params_digest",
    "portable_state",
    "quorum_rules_problem",
    "settings_of",
    "shard",
    "storable",
]

_log = logging.getLogger("lioncub")

#: what a healed group's own momenta become
MOMENTA_ON_HEAL = ("peer", "zeros")
_STATE_KEY = "lioncub"


class ReplicaGroupError(RuntimeError):
    """The quorum could not be formed or joined in time (the lighthouse gone, fewer groups than the
    minimum); the message names the group, the operation and the timeout."""


class SettingsMismatchError(ReplicaGroupError):
    """A peer this group would heal from trains with other settings; the message names the setting."""


@dataclass(frozen=True)
class Heal:
    """One heal of this group: to optimizer step ``step`` (the peer's), from the group ``source`` (in a
    group of several ranks: the sources of its ranks, comma-separated), ``nbytes`` of tensors received (by
    all the group's ranks), in ``seconds`` (the quorum and the transfer)."""

    step: int
    source: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Agreement:
    """What :meth:`ReplicaGroup.finish` found: this group (``replica_id``), each member of the last
    quorum's digest of its parameters (``digests``: replica id -> SHA-256), the job's ``max_groups``, and
    the error that kept the others' digests from arriving ("" if none)."""

    replica_id: str
    digests: dict[str, str]
    max_groups: int
    error: str = ""

    @property
    def participants(self) -> int:
        """The last quorum's size (as far as its digests arrived)."""
        return len(self.digests)

    @property
    def agrees(self) -> bool:
        """Every member of the last quorum holds this group's parameters, and the quorum had another
        member (a group that ran its last step alone in a job of several agrees with nobody)."""
        mine = self.digests[self.replica_id]
        alone = self.participants == 1 and self.max_groups > 1
        return not self.error and not alone and all(d == mine for d in self.digests.values())

    def describe(self) -> str:
        """One line: who agrees with whom."""
        if self.error:
            return f"the other members' digests did not arrive ({self.error}): agreement unknown"
        if self.participants == 1 and self.max_groups > 1:
            return "its last quorum had no other group: it ran alone, and agrees with nobody"
        differ = sorted(r for r, d in self.digests.items() if d != self.digests[self.replica_id])
        if differ:
            return f"its parameters differ from those of {', '.join(differ)} (of its last quorum)"
        members = ", ".join(sorted(self.digests))
        return f"its parameters equal those of every member of its last quorum ({members})"


def params_digest(params: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the bytes of ``params``, in order (CPU tensors): equal digests, bitwise equal values."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class LighthouseStatus:
    """What a torchft lighthouse's ``/status`` page says (:func:`lighthouse_status`): its page (``text``),
    how many groups have asked for the next quorum (``asking``), how many heartbeat to it
    (``heartbeating``: groups alive, in a quorum or not) and its ``min_replicas`` (None: not said)."""

    text: str
    asking: int
    heartbeating: int
    min_replicas: int | None


_ASKING = re.compile(r"\[(\d+)/\d+ participants healthy\]")
_BEATING = re.compile(r"\[(\d+) heartbeating\]")
_MIN = re.compile(r"need min_replicas (\d+)")


def lighthouse_status(lighthouse: str, timeout_s: float = 5.0) -> LighthouseStatus:
    """The lighthouse's ``/status`` page read within ``timeout_s`` (an empty page, every count 0, when it
    cannot be read)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=timeout_s) as page:
            text = page.read().decode(errors="replace")
    except OSError:
        text = ""
    asking, beating, least = (p.search(text) for p in (_ASKING, _BEATING, _MIN))
    return LighthouseStatus(
        text,
        int(asking[1]) if asking else 0,
        int(beating[1]) if beating else 0,
        int(least[1]) if least else None,
    )


def quorum_rules_problem(status: LighthouseStatus, max_groups: int) -> str | None:
    """What in a lighthouse's rules (its ``/status``) keeps a job of at most ``max_groups`` groups from
    ever forming a quorum: a ``min_replicas`` above ``max_groups`` (None: nothing, or the page says
    nothing)."""
    if status.min_replicas is not None and status.min_replicas > max_groups:
        return (
            f"the lighthouse needs min_replicas {status.min_replicas} groups for a quorum and this job has "
            f"at most max_groups={max_groups}: no quorum could ever form; start the lighthouse with "
            f"min_replicas <= {max_groups} (docs/fault-tolerance.md gives 1 and join_timeout_ms 60000)"
        )
    return None


@dataclass(frozen=True)
class _Piece:
    """A ``DTensor`` of a state dict without its mesh (:func:`portable_state`): this rank's local piece and
    what rebuilds it on another replica's mesh of the same shape."""

    local: torch.Tensor
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _unmesh(tree: Any) -> Any:
    """A copy of ``tree`` whose tensors are clones and whose ``DTensor`` s are :class:`_Piece` s."""
    if isinstance(tree, DTensor):
        local = tree.to_local().detach().clone()
        return _Piece(local, tuple(tree.placements), tuple(tree.shape), tuple(tree.stride()))
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _unmesh(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unmesh(v) for v in tree)
    return copy.deepcopy(tree)


def _onto(tree: Any, mesh: DeviceMesh | None) -> Any:
    """:func:`_unmesh`'s ``tree`` back, a copy, each :class:`_Piece` a ``DTensor`` on ``mesh``."""
    if isinstance(tree, _Piece):
        if mesh is None:
            raise ValueError("a state of FSDP2's shards cannot be loaded into an optimizer of whole tensors")
        return DTensor.from_local(
            tree.local.clone(), mesh, tree.placements, run_check=False, shape=torch.Size(tree.shape),
            stride=tree.stride,
        )  # fmt: skip
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _onto(v, mesh) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_onto(v, mesh) for v in tree)
    return copy.deepcopy(tree)


def portable_state(optimizer: LionCub) -> dict[str, Any]:
    """``optimizer.state_dict()`` as a heal carries it to another group (and a snapshot keeps it): a copy
    that holds no live tensor of the optimizer's. On FSDP2's shards (a ``VoteMesh`` whose shard dimension is
    the replica's own ``(1, S)`` mesh) every ``DTensor`` of the checkpoint form is this rank's local piece
    and its layout, without the mesh, so that rank ℓ of a peer group loads it on its own mesh
    (:func:`load_portable`)."""
    return dict(_unmesh(optimizer.state_dict()))


def load_portable(optimizer: LionCub, state: dict[str, Any]) -> None:
    """Load a :func:`portable_state` (this rank's, or the same shard rank's of a peer replica) into
    ``optimizer`` (``allow_world_size_change``: the quorum's N and rank may differ); ``state`` is left as it
    was."""
    mesh = optimizer.shards.mesh if optimizer.shards is not None else None
    optimizer.load_state_dict(_onto(state, mesh), allow_world_size_change=True)


#: the key that marks a :class:`_Piece` in :func:`storable`'s form
_PIECE_KEY = "lioncub_dtensor_piece"


def _placement(p: Placement) -> list[StateTree]:
    if type(p) is Shard:
        return ["shard", p.dim]
    if type(p) is Replicate:
        return ["replicate"]
    raise ValueError(f"a DTensor placed {p!r} cannot be stored: only Shard(dim) and Replicate() are")


#: a state tree as :func:`portable_state` makes it and :func:`storable` stores it: tensors, DTensor pieces and
#: plain values in nested dicts, lists and tuples
StateTree: TypeAlias = Union[
    "_Piece", torch.Tensor, dict[str, "StateTree"], list["StateTree"], tuple["StateTree", ...],
    int, float, str, None,
]


def storable(state: dict[str, StateTree]) -> dict[str, StateTree]:
    """:func:`portable_state`'s ``state`` (or any state of its form) as ``torch.load(weights_only=True)``
    reads it back: each :class:`_Piece` a dict of plain values (its local tensor, placements as
    ``["shard", dim]``/``["replicate"]``, shape and stride as lists); shares the tensors of ``state``.
    :func:`from_storable` is its inverse. ``ValueError`` for a placement other than those."""
    return {k: _stored(v) for k, v in state.items()}


def from_storable(state: dict[str, StateTree]) -> dict[str, StateTree]:
    """:func:`storable`'s ``state`` back in :func:`portable_state`'s form (for :func:`load_portable`)."""
    return {k: _unstored(v) for k, v in state.items()}


def _stored(tree: StateTree) -> StateTree:
    if isinstance(tree, _Piece):
        return {_PIECE_KEY: tree.local, "placements": [_placement(p) for p in tree.placements],
                "shape": list(tree.shape), "stride": list(tree.stride)}  # fmt: skip
    if isinstance(tree, dict):
        return {k: _stored(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_stored(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_stored(v) for v in tree)
    return tree


def _piece(stored: dict[str, StateTree]) -> _Piece:
    """The :class:`_Piece` that :func:`_stored` wrote as ``stored`` (the casts: the form it writes)."""
    placements = cast(list[list[int | str]], stored["placements"])
    places = tuple(Shard(int(p[1])) if p[0] == "shard" else Replicate() for p in placements)
    shape, stride = (tuple(cast(list[int], stored[k])) for k in ("shape", "stride"))
    return _Piece(cast(torch.Tensor, stored[_PIECE_KEY]), places, shape, stride)


def _unstored(tree: StateTree) -> StateTree:
    if isinstance(tree, dict) and _PIECE_KEY in tree:
        return _piece(tree)
    if isinstance(tree, dict):
        return {k: _unstored(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unstored(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_unstored(v) for v in tree)
    return tree


def _nbytes(tree: Any) -> int:
    if isinstance(tree, _Piece):
        return _nbytes(tree.local)
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


def _transport(host: str, timeout: datetime.timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what a healing group fetches a peer's state from), advertised
    at ``host`` rather than the machine's name, which names every network namespace of a host alike."""
    from torchft.checkpointing import HTTPTransport

    class _At(HTTPTransport[dict[str, Any]]):  # what a Manager sends: a state dict
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # its server writes an access line per request to stderr (BaseHTTPRequestHandler), a few per
            # heal: errors only (its handler class is this transport's own)
            handler = self._server.RequestHandlerClass
            handler.log_request = _no_access_line  # type: ignore[attr-defined]  # a BaseHTTPRequestHandler subclass, typed as its factory

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return _At(timeout=timeout, num_chunks=0)


def _no_access_line(handler: Any, code: Any = "-", size: Any = "-") -> None:
    """``BaseHTTPRequestHandler.log_request`` that writes nothing (its ``log_error`` still writes)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Snapshot:
    params: list[torch.Tensor]
    optimizer: dict[str, Any]


class _Member:
    """What a replica group is to torchft, shared by :class:`ReplicaGroup` and :class:`DiLoCoGroup`: its
    ``manager`` and the store it keeps for the group (``_store``)."""

    manager: Any
    _store: Any

    def register_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """More state a healed group takes from its peer (an lr scheduler, a data loader's position):
        ``save()`` at the peer, ``load(value)`` here (torchft's ``register_state_dict_fn``)."""
        self.manager.register_state_dict_fn(key, load, save)

    @property
    def quorum_rank(self) -> int | None:
        """This group's rank in the last quorum (None: not a participant)."""
        rank: int | None = self.manager.participating_rank()
        return rank

    @property
    def lighthouse_id(self) -> str:
        """The name the lighthouse knows this group by (``g0:`` and a UUID of this start), which its
        ``Manager`` keeps in the group's store."""
        from torchft.manager import REPLICA_ID_KEY

        name: str = self._store.get(REPLICA_ID_KEY).decode()
        return name


@dataclass
class ReplicaGroup(_Member):
    """This process as one replica group of a torchft job (see the module docstring).

    Args:
        lighthouse: the torchft lighthouse's address (``http://host:port``).
        index: this group's number in the job, unique, in ``[0, max_groups)``: its rank while the optimizer
            is built (a stochastic quantizer's stream is seeded with it, as a rank's).
        max_groups: the most groups that will vote at once (the votes are sized for it).
        replica_id: this group's name for torchft and the messages (default ``g{index}``).
        min_groups: a step commits only with at least this many groups in the quorum.
        momentum_on_heal: a healed group's momenta: ``"peer"`` (the peer's copy) or ``"zeros"``.
        timeout_s: bound of every collective, heal and commit (seconds).
        quorum_timeout_s: bound of forming a quorum (seconds): past it :meth:`begin` raises
            :class:`ReplicaGroupError` (the lighthouse gone, fewer than ``min_groups`` groups).
        host: the address the other groups reach this one at (its store, its manager and the heals it
            serves); on one machine ``localhost``, across hosts or network namespaces its own address.
        init_sync: at the first quorum every group but the first heals from it (torchft's ``init_sync``),
            which makes the initial values equal whatever they were; ``False`` where every group builds
            the same initial values itself (a model from one seed), saving that transfer.
        group_rank: this rank's place in its group of several ranks, of ``group_world_size`` ranks (module
            docstring); ``0, 1`` for a group of one process.
        store: with ``group_world_size`` > 1, the group's own ``TCPStore`` as ``host:port`` (e.g. the
            ``MASTER_ADDR:MASTER_PORT`` of the group's ``torch.distributed`` world), which every rank of the
            group and the other groups reach; each group needs its own.
        group_pg: with ``group_world_size`` > 1, the process group of this group's ranks, where the shares
            are broadcast (default: the default group).

    Attributes:
        comm: the :class:`~lioncub.collectives.GroupComm` to build the optimizer on.
        manager: torchft's ``Manager`` of this group.
        participants: the quorum's size at the last :meth:`begin`.
        heals: every :class:`Heal` of this group.
        committed, skipped: the steps (windows) committed and skipped.
    """

    lighthouse: str
    index: int
    max_groups: int
    replica_id: str = ""
    min_groups: int = 1
    momentum_on_heal: str = "peer"
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    host: str = "localhost"
    init_sync: bool = True
    group_rank: int = 0
    group_world_size: int = 1
    store: str = ""
    group_pg: Any = None
    comm: GroupComm = field(init=False)
    manager: Any = field(init=False)
    participants: int = field(init=False, default=0)
    heals: list[Heal] = field(init=False, default_factory=list)
    committed: int = field(init=False, default=0)
    skipped: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        require(["torchft"], "ft", "lioncub.integrations.torchft")
        if not is_int(self.max_groups, 1):
            raise ValueError(f"max_groups={self.max_groups!r} must be an int >= 1")
        if not is_int(self.index, 0) or self.index >= self.max_groups:
            raise ValueError(f"index={self.index!r} must be an int in [0, max_groups={self.max_groups})")
        self.replica_id = self.replica_id or f"g{self.index}"
        if not is_int(self.min_groups, 1) or self.min_groups > self.max_groups:
            raise ValueError(
                f"min_groups={self.min_groups!r} must be an int in [1, max_groups={self.max_groups}]"
            )
        if self.momentum_on_heal not in MOMENTA_ON_HEAL:
            raise ValueError(
                f"momentum_on_heal={self.momentum_on_heal!r}: allowed values are {list(MOMENTA_ON_HEAL)}"
            )
        for name in ("timeout_s", "quorum_timeout_s"):
            if not is_number(getattr(self, name), gt=0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number of seconds > 0")
        store_host, store_port = self._check_group()
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = TCPStore(
            store_host, store_port, is_master=not self.store, wait_for_workers=False, timeout=timeout
        )
        pg = self._pg = ProcessGroupGloo(timeout=timeout)
        # the votes are sized for max_groups: the optimizer is built on a comm of that size, as rank `index`
        self.comm = GroupComm(pg, rank=self.index, world_size=self.max_groups, timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self.heal,
            state_dict=self._peer_state,
            min_replica_size=self.min_groups,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=self.group_world_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
            hostname=self.host,
            init_sync=self.init_sync,
            checkpoint_transport=_transport(self.host, timeout),
        )
        self._optimizer: LionCub | None = None
        self._snapshot: _Snapshot | None = None
        self._settings: dict[str, Any] = {}
        self._healed: tuple[str, int] | None = None
        self.left_out: str | None = None  # why this group sits out the current step (its heal failed)
        self._alone_since: float | None = None  # alone in its quorums while other groups heartbeat, since
        self._rules_checked = False  # the lighthouse's quorum rules (quorum_rules_problem)

    def _check_group(self) -> tuple[str, int]:
        """Check the group-of-ranks arguments; the store's (host, port) (new for a group of one process)."""
        size, rank = self.group_world_size, self.group_rank
        if not is_int(size, 1):
            raise ValueError(f"group_world_size={size!r} must be an int >= 1")
        if not is_int(rank, 0) or rank >= size:
            raise ValueError(f"group_rank={rank!r} must be an int in [0, group_world_size={size})")
        if size == 1 and not self.store:
            return self.host, _free_port()
        host, _, port = str(self.store).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"store={self.store!r}: with group_world_size={size} give the group's own TCPStore as "
                "'host:port' (e.g. its MASTER_ADDR:MASTER_PORT)"
            )
        return host, int(port)

    # -- setup ---------------------------------------------------------------------------------------

    def attach(self, optimizer: LionCub, params: Sequence[torch.Tensor] | None = None) -> None:
        """Vote with ``optimizer``, a :class:`~lioncub.optim.LionCub` built on :attr:`comm` (with
        ``Checks(broadcast_init=False)``: the groups' initial values come from the heal, not a broadcast).
        In a group of several ranks the optimizer holds all the model's parameters over
        ``VoteMesh(group.comm, group_pg, broadcast="caller")`` (each rank votes on its share, broadcast to
        the group once a step stands or a heal landed) or, on FSDP2's shards, ``VoteMesh(group.comm,
        mesh)`` (docs/shards.md). Parameters off the CPU are refused (``ValueError`` naming the first and
        its device): the groups vote on CPU tensors (module docstring). ``params``: deprecated, unused (the
        optimizer holds all the parameters and knows its share)."""
        if params is not None:
            warnings.warn(
                "ReplicaGroup.attach(optimizer, params): params is deprecated and unused; in a group of "
                "several ranks build LionCub(model.parameters(), process_group=VoteMesh(group.comm, "
                "group_pg, broadcast='caller')) and call attach(optimizer)",
                DeprecationWarning,
                stacklevel=2,
            )
        if not isinstance(optimizer, LionCub) or optimizer.comm is not self.comm:
            raise ValueError(
                "attach: give the LionCub built with process_group=group.comm (the group's GroupComm), or "
                "in a group of several ranks VoteMesh(group.comm, group_pg, broadcast='caller')"
            )
        where = f"replica group {self.replica_id}: attach"
        refuse_off_cpu([p for g in optimizer.param_groups for p in g["params"]], where)
        if self.group_world_size > 1 and optimizer.shards is None:  # on FSDP2's shards nothing to share
            self._check_shares(optimizer.shares)
        self._optimizer = optimizer
        self._settings = {**settings_of(optimizer), "ranks_per_group": self.group_world_size}
        # the one-time "did DDP average the gradients?" comparison is a collective of a fresh optimizer's
        # first step: a group joining later would run it alone (groups have no DDP between them anyway)
        optimizer.round.skip_gradient_comparison()
        self.comm.reconfigure(0, 1)

    def _check_shares(self, shares: ShareView | None) -> None:
        """Refuse, in a group of several ranks, an optimizer whose shares are not this group's: built
        without ``VoteMesh(group.comm, group_pg, broadcast="caller")``, over another shard group, or
        broadcasting in its own ``step()`` (before the group's ranks agree that the step stands)."""
        size, rank = self.group_world_size, self.group_rank
        fix = "LionCub(model.parameters(), process_group=VoteMesh(group.comm, group_pg, broadcast='caller'))"
        where = f"attach: rank {rank} of replica group {self.replica_id}, a group of {size} ranks"
        if shares is None:
            raise ValueError(f"{where}: build the optimizer as {fix}: each rank votes on its share")
        if (shares.shards, shares.shard_rank) != (size, rank):
            raise ValueError(
                f"{where}: the optimizer's shard group has {shares.shards} ranks and this is its rank "
                f"{shares.shard_rank}; give VoteMesh the group's process group (group_pg) as shard"
            )
        if shares.after_step:
            raise ValueError(
                f"{where}: VoteMesh(..., broadcast='step') shares a step before the group's ranks agree that "
                "it stands; use broadcast='caller' (the group broadcasts after the commit)"
            )

    @property
    def optimizer(self) -> LionCub:
        if self._optimizer is None:
            raise ValueError(f"replica group {self.replica_id}: attach(optimizer) first")
        return self._optimizer

    @property
    def boundary(self) -> bool:
        """The next step starts a commit boundary: every step, or with local steps a window's first."""
        local = self.optimizer.local_steps
        return local is None or self.optimizer.global_step % local.h == 0

    @property
    def step_ends_boundary(self) -> bool:
        """The next :meth:`step` ends a commit boundary (it commits or puts back): every step, or with
        local steps a window's last."""
        local = self.optimizer.local_steps
        return local is None or (self.optimizer.global_step + 1) % local.h == 0

    # -- the step ------------------------------------------------------------------------------------

    def begin(self) -> int:
        """Before the forward pass: at a commit boundary, the snapshot, the quorum (a heal if this group is
        behind) and the comm's new rank and size. The quorum's size (N of the coming vote). Parameters moved
        off the CPU since :meth:`attach` are refused (``ValueError``), before the quorum."""
        opt = self.optimizer
        if not self.boundary:
            return self.participants
        refuse_off_cpu(self._params(), f"replica group {self.replica_id}: begin")
        if not self._rules_checked:  # once: a lighthouse whose quorum can never form is refused at once
            problem = quorum_rules_problem(lighthouse_status(self.lighthouse), self.max_groups)
            if problem is not None:
                raise ReplicaGroupError(f"replica group {self.replica_id}: {problem}")
            self._rules_checked = True
        if self._alone_since is not None:
            self._await_peers()
        self._snapshot = self._take()
        started = time.perf_counter()
        self._healed = None
        try:
            self.manager.start_quorum(timeout=datetime.timedelta(seconds=self.quorum_timeout_s))
        except SettingsMismatchError:
            raise
        except Exception as err:
            raise ReplicaGroupError(
                f"replica group {self.replica_id}: no quorum within {self.quorum_timeout_s:g} s (lighthouse "
                f"{self.lighthouse}, at least {self.min_groups} group(s)): {type(err).__name__}: {err}"
            ) from err
        failed = self.manager.errored()
        self.left_out = None
        if self._in_group_any(failed is not None):  # a group of ranks sits out whole
            return self._leave(failed or ReplicaGroupError("another rank of the group could not heal"))
        healed = self._healed
        if self.group_world_size > 1:  # the group's ranks healed alike (each from its peer rank), or none
            healed = agree_on_heal(self._healed, self.group_world_size, self.group_pg)
        if healed is not None:
            self._broadcast_shares()
            source, nbytes = healed
            self.heals.append(Heal(opt.global_step, source, nbytes, time.perf_counter() - started))
            self._snapshot = self._take()
        rank = self.manager.participating_rank()
        if rank is None:
            raise ReplicaGroupError(f"replica group {self.replica_id}: not a participant of the quorum")
        self.participants = self.manager.num_participants()
        if self.participants == 1 and self.max_groups > 1 and healed is None:
            beating = lighthouse_status(self.lighthouse).heartbeating
            if self._in_group_any(beating > 1):  # peers alive, not in this quorum: a replica of its own
                self._alone_since = self._alone_since or time.monotonic()
                self.left_out = f"alone in its quorum while {beating} groups heartbeat to the lighthouse"
                return self.participants
        self._alone_since = None
        self.comm.reconfigure(rank, self.participants)
        return self.participants

    def _in_group_any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of this group (collective in a group of several ranks, so that
        its ranks decide alike; a group of one process: ``flag``)."""
        if self.group_world_size == 1:
            return flag
        import torch.distributed as dist

        held = torch.tensor([int(flag)], dtype=torch.int64, device="cpu")  # the group's gloo group
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self.group_pg)
        return bool(held.item())

    def _await_peers(self) -> None:
        """After a quorum that had this group alone while other groups heartbeat to the lighthouse (its
        join timeout shorter than a step, say, or a group that came back while the others were inside a
        window): wait until another group asks for a quorum, so that the next one has them (and heals
        whoever is behind), or until no other group heartbeats (they are gone: training alone is the
        job's). ``ReplicaGroupError`` after ``quorum_timeout_s`` alone (a group that finished without
        :meth:`shutdown` heartbeats on)."""
        while True:
            status = lighthouse_status(self.lighthouse)
            if status.asking >= 1 or status.heartbeating <= 1:
                return
            assert self._alone_since is not None
            if time.monotonic() - self._alone_since > self.quorum_timeout_s:
                raise ReplicaGroupError(
                    f"replica group {self.replica_id}: alone in its quorums for {self.quorum_timeout_s:g} s "
                    f"while {status.heartbeating} groups heartbeat to the lighthouse {self.lighthouse} "
                    "without asking for one (a group that finished without shutdown()?): it does not train "
                    "a replica of its own"
                )
            time.sleep(0.02)

    def _leave(self, failed: object) -> int:
        """The quorum's heal (or the process group's setup) failed -- the peer it healed from died during
        the transfer, say: this group must not vote with a state it did not get. It sits this step (window)
        out: its process group is aborted, so that the others' exchanges with it fail at once instead of
        waiting for it, and :meth:`step` skips (nothing voted, nothing applied; torchft does not commit an
        errored group). At the next quorum it heals again, from a live peer. The quorum's size."""
        cause = getattr(failed, "original_exception", failed)  # torchft's ExceptionWithTraceback: its cause
        self.left_out = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        _log.warning(
            "replica group %s: the quorum's heal failed (%s); it sits this step out and heals at the next "
            "quorum",
            self.replica_id,
            self.left_out,
        )
        self._pg.abort()
        self.participants = self.manager.num_participants()
        return self.participants

    def step(self) -> bool:
        """The optimizer's step; at a commit boundary's end, the commit. Whether the step stands: False
        when it was put back (not committed, or this group's exchange failed) or when this group sits the
        step out (:attr:`left_out`: its heal failed; nothing is voted)."""
        opt = self.optimizer
        ends = self.step_ends_boundary
        failed: Exception | None = None
        if self.left_out is not None:
            if self.manager.errored() is None:  # alone while peers heartbeat: not an error to torchft
                self.manager.report_error(ReplicaGroupError(self.left_out))
            self.manager.should_commit(timeout=datetime.timedelta(seconds=self.timeout_s))  # False: errored
            self._put_back()
            self.skipped += 1
            return False
        try:
            opt.step()
        except CollectiveError as err:
            failed = err
            _log.warning("replica group %s: the vote failed (%s); the step is skipped", self.replica_id, err)
            self.manager.report_error(err)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not ends and failed is None:
            stands = True
        elif self.manager.should_commit(timeout=timeout) and failed is None:
            self.committed += 1
            stands = True
        else:
            self._put_back()
            self.skipped += 1
            stands = False
        self._broadcast_shares()  # the group's ranks agree on the commit (should_commit): share what stands
        return stands

    def finish(self) -> Agreement:
        """After the last step, called by every member of the last quorum (collective over it): the SHA-256
        of each member's parameters (in a group of several ranks, of this rank's share: rank ℓ of every
        group compares shares), all-gathered, and whether this group agrees with them
        (:class:`Agreement`). A group that ran its last step alone, or whose peers do not answer within
        ``timeout_s``, does not agree; either is logged as a warning."""
        opt = self.optimizer
        digest = params_digest(self._tensors())
        try:
            digests = self.comm.all_gather_object((self.replica_id, digest), "finish: the replicas' digests")
        except CollectiveError as err:
            agreement = Agreement(self.replica_id, {self.replica_id: digest}, self.max_groups, str(err))
        else:
            agreement = Agreement(self.replica_id, dict(digests), self.max_groups)
        if not agreement.agrees:
            _log.warning(
                "replica group %s at step %d: %s", self.replica_id, opt.global_step, agreement.describe()
            )
        return agreement

    def shutdown(self) -> None:
        """Leave the job: stop this group's manager (the others go on at their next quorum)."""
        self.manager.shutdown(wait=False)

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of this group beside the model and the optimizer: torchft's committed
        count (``step``, ``batches_committed``), which decides who heals whom at the next quorum, and the
        steps (windows) committed and skipped."""
        return {**self.manager.state_dict(), "committed": self.committed, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s (a resume from a checkpoint, before the first :meth:`begin`)."""
        counts = {"step": int(state["step"]), "batches_committed": int(state["batches_committed"])}
        self.manager.load_state_dict(counts)
        self.committed, self.skipped = int(state["committed"]), int(state["skipped"])

    # -- snapshot and heal ---------------------------------------------------------------------------

    def _broadcast_shares(self) -> None:
        """In a group of several ranks voting on shares of whole tensors, each rank's share to the others
        of the group (``opt.shares.broadcast()``, collective in ``group_pg``); else nothing."""
        shares = self.optimizer.shares
        if shares is not None:
            shares.broadcast()

    def _params(self) -> list[torch.Tensor]:
        """The parameters this rank votes on: all of the optimizer's, or its share (``opt.shares``)."""
        groups = self.optimizer.shares.param_groups if self.optimizer.shares else self.optimizer.param_groups
        return [p for g in groups for p in g["params"]]

    def _tensors(self) -> list[torch.Tensor]:
        """The parameters as this rank holds them: FSDP2's ``DTensor`` s as their local shards (views of
        the sharded storage: copying into them writes the parameters)."""
        return [p.to_local() if isinstance(p, DTensor) else p for p in self._params()]

    def _take(self) -> _Snapshot:
        return _Snapshot([p.detach().clone() for p in self._tensors()], portable_state(self.optimizer))

    def _put_back(self) -> None:
        snap = self._snapshot
        if snap is None:
            raise ReplicaGroupError(f"replica group {self.replica_id}: no snapshot to put back")
        with torch.no_grad():
            for p, saved in zip(self._tensors(), snap.params, strict=True):
                p.copy_(saved)
        load_portable(self.optimizer, snap.optimizer)

    def _peer_state(self) -> dict[str, Any]:
        """What a healing peer receives: this group's snapshot at the boundary (copies: torchft serves them
        while this group trains on), its name and settings."""
        snap = self._snapshot if self._snapshot is not None else self._take()
        return {
            "source": self.replica_id,
            "settings": self._settings,
            "params": snap.params,
            "optimizer": snap.optimizer,
        }

    def heal(self, state: dict[str, Any]) -> None:
        """Load a peer's state (torchft calls it at the quorum that heals this group): refuse other settings
        (:class:`SettingsMismatchError`, naming the first that differs), then the peer's parameters and
        optimizer state; the momenta by ``momentum_on_heal``."""
        difference = first_difference(self._settings, state["settings"])
        if difference is not None:
            name, ours, theirs = difference
            raise SettingsMismatchError(
                f"replica group {self.replica_id} cannot join: its {name} is {ours}, the job's (group "
                f"{state['source']}) is {theirs}; start it with the job's settings"
            )
        with torch.no_grad():
            for p, value in zip(self._tensors(), state["params"], strict=True):
                p.copy_(value)
        opt = self.optimizer
        peer = dict(state["optimizer"])  # this group keeps its own stochastic-rounding stream
        if "lioncub" in peer:
            peer["lioncub"] = {**peer["lioncub"], "generator": opt.state_dict()["lioncub"]["generator"]}
        else:  # on shards: the record in the first param group (docs/shards.md, "Checkpoints")
            own = portable_state(opt)["param_groups"][0][_STATE_KEY]["generator"]
            groups = [dict(g) for g in peer["param_groups"]]
            groups[0] = {**groups[0], _STATE_KEY: {**groups[0][_STATE_KEY], "generator": own}}
            peer["param_groups"] = groups
        load_portable(opt, peer)
        if self.momentum_on_heal == "zeros":
            for p in self._params():
                if "exp_avg" in opt.state.get(p, {}):
                    opt.state[p]["exp_avg"].zero_()
        self._healed = (str(state["source"]), _nbytes(state["params"]) + _nbytes(state["optimizer"]))


class DiLoCoGroup(_Member):
    """torchft's own ``DiLoCo`` (``torchft.local_sgd``) as one replica group, with the step interface of
    :class:`ReplicaGroup` (``begin``, ``step``, ``boundary``, ``step_ends_boundary``, ``participants``,
    ``heals``, ``committed``, ``skipped``): the peer that ``lioncub train --variant torchft-diloco`` runs in
    lioncub's harness. ``inner`` (e.g. lioncub's :class:`~lioncub.optim.Lion`) steps every step; every
    ``h`` steps torchft forms a quorum, heals a group that is behind (the parameters, its outer state and
    what :meth:`register_state` adds: the inner optimizer's state with the peer's, as torchft's own
    examples do) and averages the pseudo-gradients into Nesterov SGD (``outer_lr``, ``outer_momentum``).

    What torchft does and lioncub's ``outer="diloco"`` does not: the quorum is formed at a window's *end*
    (so a group that joins trains a window of its own first, which the heal then replaces), and a window
    whose allreduce fails restores the window's start and is skipped. Without failures and without weight
    decay the two take the same steps bit for bit (tests/test_replica_groups.py).
    """

    def __init__(
        self,
        lighthouse: str,
        index: int,
        max_groups: int,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        h: int,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        timeout_s: float = 30.0,
        host: str = "localhost",
    ) -> None:
        require(["torchft"], "ft", "lioncub.integrations.torchft.DiLoCoGroup")
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        if not is_int(h, 1):
            raise ValueError(f"h={h!r} must be an int >= 1 (the steps between syncs)")
        self.replica_id, self.h, self.model, self.inner = f"g{index}", h, model, inner
        timeout = datetime.timedelta(seconds=timeout_s)
        port = _free_port()
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load_model,
            state_dict=lambda: {"model": self.model.state_dict()}, min_replica_size=1, use_async_quorum=False,
            init_sync=False, rank=0, world_size=1, store_addr=host, store_port=port, hostname=host,
            lighthouse_addr=lighthouse, replica_id=self.replica_id, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, checkpoint_transport=_transport(host, timeout),
        )  # fmt: skip
        self.manager.register_state_dict_fn("inner", self.inner.load_state_dict, self.inner.state_dict)
        #: the outer step's optimizer (its momentum buffers are outer state)
        self.outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True)
        self._diloco = DiLoCo(
            self.manager, [model], inner, self.outer, sync_every=h, backup_device=torch.device("cpu"),
            pin_memory=False,
        )  # fmt: skip
        self._diloco.__enter__()
        self._steps = 0  # inner steps since this group's last sync
        self._healed = False
        self.participants = max_groups  # until the first quorum says otherwise
        self.heals: list[Heal] = []
        self.committed = self.skipped = 0

    def _load_model(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self._healed = True

    def backup(self) -> list[torch.Tensor]:
        """The copy of the parameters torchft's DiLoCo keeps on the CPU (the last sync's, restored when a
        window's allreduce fails): state beside the inner and the outer optimizers."""
        fragments = getattr(self._diloco, "_fragments", ())
        return [t for f in fragments for t in getattr(f, "original_parameters", {}).values()]

    @property
    def boundary(self) -> bool:
        return self._steps == 0

    @property
    def step_ends_boundary(self) -> bool:
        return self._steps + 1 == self.h

    def begin(self) -> int:
        """Nothing before a step (torchft's quorum comes at the window's end); the last quorum's size."""
        return self.participants

    def step(self) -> bool:
        """The inner step; at a window's end torchft's quorum, heal and sync. Whether it stands (a window
        whose sync failed is restored to its start)."""
        before = self.manager.current_step()
        ends = self.step_ends_boundary
        started = time.perf_counter()
        self._healed = False
        self.inner.step()
        self._steps = (self._steps + 1) % self.h
        if not ends:
            return True
        self.participants = self.manager.num_participants()
        synced = self.manager.current_step() > before
        if self._healed:
            # the model, the window's anchor, the outer momentum and the inner state
            nbytes = _nbytes(self.model.state_dict()) * 3 + _nbytes(self.inner.state_dict())
            seconds = time.perf_counter() - started  # the window's last step: the quorum, heal and sync
            step = (self.manager.current_step() - int(synced)) * self.h  # the step it healed to
            self.heals.append(Heal(step, "a peer", nbytes, seconds))
        if synced or self._healed:
            self.committed += 1
            return True
        self.skipped += 1
        return False

    def shutdown(self) -> None:
        self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


# -- what every group of a job must share ----------------------------------------------------------------
# the optimizer's settings, compared before a heal (settings_of, first_difference), and CPU parameters
# (refuse_off_cpu: the groups vote over torchft's gloo process group)


def settings_of(optimizer: LionCub) -> dict[str, Any]:
    """What every group of a job must share: the variant, its update rule, the local steps, each param
    group's betas, weight decay and maximize flag, and each parameter's shape and dtype (the learning rate
    is not compared: it follows the step, which the heal brings along)."""
    sd = optimizer.state_dict()
    meta = (
        json.loads(sd["param_groups"][0][_STATE_KEY]["record"]) if is_checkpoint_form(sd) else sd["lioncub"]
    )
    return {
        "variant": meta["variant"],
        "rule": meta["rule"],
        "local_steps": meta["local_steps"],
        "groups": [
            {"betas": list(g["betas"]), "weight_decay": g["weight_decay"], "maximize": g["maximize"]}
            for g in optimizer.param_groups
        ],
        "params": [[list(p.shape), str(p.dtype)] for g in optimizer.param_groups for p in g["params"]],
    }


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first setting of :func:`settings_of` that differs, as (its name, ours, theirs), or None."""
    for key in ours:
        mine, other = ours[key], theirs.get(key)
        if mine == other:
            continue
        if key in ("groups", "params") and isinstance(other, list) and len(mine) == len(other):
            i = next(i for i in range(len(mine)) if mine[i] != other[i])
            if key == "params":
                return f"parameter {i} (shape, dtype)", repr(tuple(mine[i])), repr(tuple(other[i]))
            field = next(f for f in mine[i] if mine[i][f] != other[i].get(f))
            show = tuple if field == "betas" else (lambda v: v)
            return f"param group {i}'s {field}", repr(show(mine[i][field])), repr(show(other[i].get(field)))
        return key, repr(mine), repr(other)
    return None


def refuse_off_cpu(params: Sequence[torch.Tensor], where: str) -> None:
    """``ValueError`` naming the first of ``params`` that is not a CPU tensor: the replica groups exchange
    CPU tensors over torchft's gloo process group."""
    for i, p in enumerate(params):
        if p.device.type != "cpu":
            raise ValueError(
                f"{where}: parameter {i} is on {p.device}; the replica groups vote over torchft's gloo "
                "process group (ProcessGroupGloo) on CPU tensors, so parameters on another device (CUDA) are "
                "not supported: keep the model and its optimizer on the CPU"
            )
