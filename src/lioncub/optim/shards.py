"""The vote on shards: :class:`~lioncub.optim.LionCub` over FSDP2's parameters (docs/shards.md).

``fully_shard(module, mesh=mesh["shard"])`` makes each parameter a ``DTensor`` placed ``Shard(0)`` on the
1-D shard mesh: rank s of a replica holds rows ``[s·c, (s+1)·c)`` of dim 0 (``c = ⌈D/S⌉``; the last
ranks fewer, or none), as ``to_local()``, and after the backward the gradient's ``to_local()`` is the
replica's mean gradient of those rows. The rank votes on its local shard with the ranks that hold the
same shard in the other replicas: one group of the mesh's ``"replicate"`` dimension. The user says so
with ``LionCub(process_group=mesh)``, ``mesh`` a 2-D ``DeviceMesh`` with dims :data:`SHARD_DIMS`.

How the optimizer's parts see the shards (:class:`ShardView`, the :class:`~lioncub.optim.context.
OptimizerView` they are handed): each ``DTensor`` parameter ``P`` has an *alias*, a plain tensor that
shares the storage of ``P.to_local()`` (FSDP2's sharded storage, padding never included) and stands for
``P`` everywhere a part reads a parameter — buckets, kernels, anchors, replicas, checksums. The alias is
made once and kept (its ``id`` keys the layout); where FSDP2 re-points its local tensor (its
``reset_sharded_param``) the alias is re-pointed (``set_``) at the next refresh — a cast or a move to
another device after the optimizer was built is refused (its momenta would be the old ones). Its ``.grad``
is ``P.grad.to_local()``, read at every step (FSDP2 makes a new gradient per backward) and dropped after
it. Per-parameter state stays in ``optimizer.state[P]`` (plain local tensors: momenta, anchors,
replicas), so ``state_dict()`` and the param groups keep the model's parameters. Updates are written
in place into the local shards; FSDP2 all-gathers them at the next forward. Nothing is broadcast.

Bit for bit the unsharded vote of the same voters: the elementwise votes are so by construction. A
quantizer with a normaliser (``transport="quantized"``: L1, L0, L∞, Lp, log, qsgd; per tensor or per
chunk) needs the whole tensor's (or chunk's) norm. Partial sums of shards cannot give it: the unsharded
L1 sum is a float32 sum in cache-sized pieces (and the C / Triton kernels reduce in their own order), so
``Σ_s Σ|x_s|`` differs from it in the last bits, and so would a level where ``c/M`` sits on a rounding
boundary. :class:`ShardQuantizedVote` instead all-gathers the bucket's contributions over the shard group
(one all-gather of the bucket per step, inside the node; transient), quantizes the whole tensors exactly as
the unsharded vote does, and keeps its own shard's levels; only those travel between the replicas.

What a step adds on shards: one all-reduce of an int32 over the shard group (the replica's ranks agree
on skipping a step with NaN/Inf, :meth:`ShardView.agree_skip`; one host read, its verdict), and for
quantized votes the all-gather above. On GPUs (docs/gpu.md) both groups' exchanges run on the
parameters' device over the mesh's backend for it (NCCL); nothing is staged on the host. Refused
(:func:`check_shard_options`): a topology other than flat, the vote diagnostics (per tensor statistics of
shards), ``overlap_with`` (a DDP hook; FSDP2 has none of DDP's buckets).

The same mesh with plain parameters is DDP inside the shard dimension (:class:`ShareView`): a rank's part
is a share of whole tensors (:func:`share_owners`), voted on with its ``"replicate"`` group and
broadcast to its replica after the step (:func:`broadcast_shares`); with ``VoteMesh(..., broadcast=
"caller")`` the caller broadcasts (the fault-tolerant replica groups of several ranks, once a step stands).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lioncub._validate import is_int
from lioncub.collectives import Comm, QuantizedVote, Vote
from lioncub.ops.quantize import max_abs
from lioncub.optim.config import VoteConfig
from lioncub.optim.topology import MESH_DIMS, Part, VoteMesh, Voters

__all__ = [
    "SHARD_DIMS",
    "Piece",
    "ShardQuantizedVote",
    "ShardView",
    "ShareView",
    "agree_skip",
    "broadcast_shares",
    "check_shard_options",
    "is_shard_mesh",
    "part_view",
    "refuse_unsharded_mesh",
    "shard_piece",
    "share_owners",
]

#: the dimension names of the mesh of sharded replicas (``LionCub(process_group=mesh)``)
SHARD_DIMS = ("replicate", "shard")

_SUPPORTED = (
    "LionCub votes on FSDP2's parameters: DTensors placed (Shard(0),) on the 'shard' dimension of "
    f"process_group=a 2-D DeviceMesh with dims {SHARD_DIMS} (fully_shard(module, mesh=mesh['shard'])) "
    "or a VoteMesh(replicate, shard=such a mesh of one replica), or on plain tensors that every rank "
    "holds whole"
)


def is_shard_mesh(value: object) -> bool:
    """Whether ``value`` is a mesh of sharded replicas (a ``DeviceMesh`` with dims :data:`SHARD_DIMS`)."""
    return isinstance(value, DeviceMesh) and value.mesh_dim_names == SHARD_DIMS


@dataclass(frozen=True)
class Piece:
    """Where a rank's shard lies in its whole tensor, flat (row-major): ``start``, its first element;
    ``numel``, the whole tensor's elements; ``counts``, each shard rank's elements (FSDP2's dim-0 chunks)."""

    start: int
    numel: int
    counts: tuple[int, ...]


def shard_piece(shape: Sequence[int], shards: int, rank: int) -> Piece:
    """The :class:`Piece` of shard ``rank`` of ``shards`` of a tensor of ``shape`` split on dim 0 as FSDP2
    splits it (``torch.chunk``: ``⌈D/S⌉`` rows per rank, the last ranks fewer or none)."""
    rows = shape[0]
    row = math.prod(shape[1:])
    per = -(-rows // shards) if rows else 0
    counts = [max(0, min(per, rows - s * per)) * row for s in range(shards)]
    return Piece(sum(counts[:rank]), rows * row, tuple(counts))


def check_shard_options(config: VoteConfig, diagnostics_every: int, part: Part = "shards") -> None:
    """The options that do not work on a mesh's ``part`` (``"shards"``: FSDP2's; ``"shares"``: whole
    tensors with DDP inside the shard dimension); each error names the option and what is supported."""
    on = (
        "sharded parameters"
        if part == "shards"
        else "a ('replicate', 'shard') mesh's shares of whole tensors"
    )
    held = "shards of the tensors" if part == "shards" else "a share of the tensors"
    if config.topology != "flat":
        raise ValueError(
            f"topology={config.topology!r} on {on}: the vote on shards is flat over the mesh's "
            f"'replicate' dimension (each group of it is the ranks that hold one shard); a topology over "
            f"nodes takes a mesh with dims {MESH_DIMS} and parameters every rank holds and votes on whole"
        )
    if diagnostics_every:
        raise ValueError(
            f"diagnostics_every={diagnostics_every}: the vote diagnostics are per-tensor statistics of the "
            f"whole model and a rank votes on {held}; drop diagnostics_every on {on}"
        )


class _Owner(Protocol):
    """What the view reads of the optimizer (its param groups, state and step count)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[torch.Tensor, Any]: ...

    @property
    def global_step(self) -> int: ...


class _AliasState(MutableMapping[torch.Tensor, Any]):
    """``optimizer.state`` keyed by the aliases: ``state[alias]`` is ``optimizer.state[P]`` (created on
    first use, as the optimizer's ``defaultdict``)."""

    def __init__(self, view: ShardView) -> None:
        self._view = view

    def _key(self, alias: torch.Tensor) -> torch.Tensor:
        owner = self._view.owner(alias)
        if owner is None:
            raise KeyError("not a parameter of this optimizer")
        return owner

    def __getitem__(self, alias: torch.Tensor) -> Any:
        return self._view.optimizer.state[self._key(alias)]

    def __setitem__(self, alias: torch.Tensor, value: Any) -> None:
        self._view.optimizer.state[self._key(alias)] = value

    def __delitem__(self, alias: torch.Tensor) -> None:
        del self._view.optimizer.state[self._key(alias)]

    def __contains__(self, alias: object) -> bool:
        owner = self._view.owner(alias) if isinstance(alias, torch.Tensor) else None
        return owner is not None and owner in self._view.optimizer.state

    def get(self, alias: torch.Tensor, default: Any = None) -> Any:
        if alias not in self:
            return default
        return self[alias]

    def __iter__(self) -> Iterator[torch.Tensor]:
        aliases = self._view.aliases
        return iter([aliases[id(p)] for p in list(self._view.optimizer.state) if id(p) in aliases])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ShardView:
    """The optimizer as its parts see it on shards (:class:`~lioncub.optim.context.OptimizerView`): param
    groups whose ``"params"`` are the aliases of the local shards (the other keys: the optimizer's, as of
    the last :meth:`refresh`), state keyed by the aliases, the step count.

    Args:
        optimizer: whose param groups hold the ``DTensor`` parameters.
        mesh: the 2-D mesh of :data:`SHARD_DIMS`.
        device: the parameters' device (the shard group's exchanges run there).
    """

    def __init__(self, optimizer: _Owner, mesh: DeviceMesh, device: torch.device) -> None:
        self.optimizer = optimizer
        self.mesh = mesh
        self.shard_mesh = mesh["shard"]
        #: the group of the ranks that hold one shard in every replica (the vote's)
        self.vote_group: dist.ProcessGroup = mesh.get_group("replicate")
        #: the ranks of this replica, one per shard (norms, and agreeing on a skipped step)
        self.shard_comm = Comm(mesh.get_group("shard"), device=device)
        self.shards = self.shard_mesh.size()
        self.shard_rank = self.shard_mesh.get_local_rank()
        #: ``id(P)`` → the alias of ``P``'s local shard
        self.aliases: dict[int, torch.Tensor] = {}
        self._owners: dict[int, DTensor] = {}
        self._pieces: dict[int, Piece] = {}
        self._signatures: dict[int, tuple[Any, ...]] = {}
        self._groups: list[dict[str, Any]] = []
        self.state: MutableMapping[torch.Tensor, Any] = _AliasState(self)
        self.refresh(grads=False)

    # -- the OptimizerView -------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        return self.optimizer.global_step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups with the aliases for ``"params"`` (as of the last refresh)."""
        return self._groups

    # -- aliases -----------------------------------------------------------------------------------

    def owner(self, alias: torch.Tensor) -> DTensor | None:
        """The ``DTensor`` parameter whose alias ``alias`` is (``None``: not an alias)."""
        return self._owners.get(id(alias))

    def alias(self, p: torch.Tensor, where: str = "a parameter") -> torch.Tensor:
        """The alias of parameter ``p``'s local shard (made and checked at the first call; ``where``: its
        place in the param groups, for the messages)."""
        alias = self.aliases.get(id(p))
        if alias is None:
            self._check(p, where)
        assert isinstance(p, DTensor)  # _check refused the rest
        if alias is None:
            local = p.to_local()
            alias = torch.empty(0, dtype=local.dtype, device=local.device)
            self.aliases[id(p)] = alias
            self._owners[id(alias)] = p
            piece = shard_piece(p.shape, self.shards, self.shard_rank)
            if local.numel() != piece.counts[self.shard_rank]:
                raise ValueError(
                    f"LionCub: {where} (a DTensor of shape {tuple(p.shape)}) holds {local.numel()} elements "
                    f"on shard rank {self.shard_rank} of {self.shards}, not FSDP2's dim-0 chunk of "
                    f"{piece.counts[self.shard_rank]}. {_SUPPORTED}"
                )
            self._pieces[id(alias)] = piece
        self._point(p, alias)
        return alias

    def weight(self, alias: torch.Tensor) -> int:
        """The elements ``alias`` counts for the bucket cap: its padded shard's (the largest shard's), the
        same on every shard rank, so that a replica's ranks cut the same buckets (the quantized vote
        gathers each bucket over them)."""
        return max(self._pieces[id(alias)].counts, default=0)

    def piece(self, alias: torch.Tensor) -> Piece:
        """Where ``alias``'s shard lies in its whole tensor."""
        return self._pieces[id(alias)]

    def _point(self, p: DTensor, alias: torch.Tensor) -> None:
        """Keep ``alias`` on ``p``'s local shard (re-pointed where FSDP2 replaced it), ``requires_grad`` as
        ``p``'s."""
        local = p.to_local()
        signature = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(local.shape),
            local.stride(),
            local.dtype,
            local.device,
        )
        if self._signatures.get(id(alias)) != signature:
            if alias.dtype != local.dtype or alias.device != local.device:
                raise RuntimeError(
                    f"LionCub: a sharded parameter of shape {tuple(p.shape)} became {local.dtype} on "
                    f"{local.device} after LionCub was built for {alias.dtype} on {alias.device}: its "
                    "momenta and vote buckets are the old ones. Cast or move the model first, then build "
                    "the optimizer"
                )
            with torch.no_grad():
                alias.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
            self._signatures[id(alias)] = signature
        if alias.requires_grad != p.requires_grad:
            alias.requires_grad_(p.requires_grad)

    def _check(self, p: torch.Tensor, where: str) -> None:
        """Refuse a parameter that is not FSDP2's ``Shard(0)`` on this mesh's shard dimension."""
        if not isinstance(p, DTensor):
            raise TypeError(
                f"LionCub: {where} is a plain {type(p).__name__} of shape {tuple(p.shape)} among DTensor "
                f"parameters: an optimizer's parameters are all sharded or all whole. {_SUPPORTED}"
            )
        if tuple(p.placements) != (Shard(0),):
            raise TypeError(
                f"LionCub: {where} is a DTensor of shape {tuple(p.shape)} placed {tuple(p.placements)} "
                f"(tensor parallelism, Replicate or Partial placements are not voted on). {_SUPPORTED}"
            )
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.mesh.tolist() != self.shard_mesh.mesh.tolist():
            raise ValueError(
                f"LionCub: {where} is a DTensor of shape {tuple(p.shape)} on the mesh {mesh.mesh.tolist()}, "
                f"not on the shard dimension of process_group's mesh ({self.shard_mesh.mesh.tolist()} on "
                f"this rank). {_SUPPORTED}"
            )

    def refresh(self, *, grads: bool = True) -> None:
        """Re-read the param groups (their hyperparameters, parameters added since) and point every alias
        at its shard; ``grads``: each alias's ``.grad`` is its parameter's ``grad.to_local()`` now."""
        groups = []
        for gi, group in enumerate(self.optimizer.param_groups):
            params = group["params"]
            aliases = [self.alias(p, f"param_groups[{gi}]['params'][{i}]") for i, p in enumerate(params)]
            if grads:
                for p, alias in zip(params, aliases, strict=True):
                    alias.grad = None if p.grad is None else p.grad.to_local()
            groups.append({**group, "params": aliases})
        self._groups = groups

    def release(self) -> None:
        """Drop the aliases' ``.grad`` (the parameters keep theirs): no gradient held twice between steps."""
        for group in self._groups:
            for alias in group["params"]:
                alias.grad = None

    def agree_skip(self, overflow: bool) -> bool:
        """Whether any rank of this replica has NaN/Inf in its gradient shards (or a GradScaler overflow):
        one all-reduce (MAX) of an int32 over the shard group, so that every shard of a replica skips a
        step together (the vote's own check then skips it in every replica)."""
        return agree_skip(self.shard_comm, self._groups, overflow)

    def names(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[int, str]:
        """``id(alias)`` → the model's name of its parameter."""
        return {id(self.alias(p)): n for n, p in named}

    def pieces_of(self, buckets: Callable[[], Sequence[Any]]) -> Callable[[Hashable], list[Piece]]:
        """For :class:`ShardQuantizedVote`: a bucket's key → the :class:`Piece` of each of its parameters
        (``buckets``: the layout's buckets now)."""

        def pieces(key: Hashable) -> list[Piece]:
            bucket = next(b for b in buckets() if b.key == key)
            return [self.piece(p) for p in bucket.params]

        return pieces

    def vote(self, vote: Vote, config: VoteConfig, pieces: Callable[[Hashable], list[Piece]]) -> Vote:
        """``vote`` as it runs on shards: a quantized vote's levels of whole tensors
        (:class:`ShardQuantizedVote`), any other vote as it is (elementwise)."""
        if not isinstance(vote, QuantizedVote):
            return vote
        return ShardQuantizedVote(
            vote.comm,
            vote.quantizer,
            vote.bits,
            clip_multiple=config.clip_multiple,
            chunk_size=config.chunk_size,
            options=config.quantizer_options,
            seed=config.seed,
            shard_comm=self.shard_comm,
            pieces=pieces,
        )


class ShardQuantizedVote(QuantizedVote):
    """:class:`~lioncub.collectives.QuantizedVote` on shards: a bucket's contributions are all-gathered
    over the shard group, the whole tensors quantized as the unsharded vote quantizes them (their
    normalisers per tensor or chunk, bit for bit), and this rank's shard's levels kept; the vote between
    the replicas carries those only.

    Args (beyond :class:`~lioncub.collectives.QuantizedVote`'s):
        shard_comm: the ranks of this replica, one per shard.
        pieces: a bucket's key → the :class:`Piece` of each of its parameters, in order.
    """

    def __init__(
        self,
        comm: Comm,
        quantizer: str,
        bits: Any,
        *,
        shard_comm: Comm,
        pieces: Callable[[Hashable], list[Piece]],
        **options: Any,
    ) -> None:
        super().__init__(comm, quantizer, bits, **options)
        self.shard_comm = shard_comm
        self._pieces_of = pieces

    def levels_of(
        self, local: torch.Tensor, segments: Sequence[int] | None, key: Hashable | None = None
    ) -> torch.Tensor:
        """This rank's levels of ``local`` (a bucket of shards, ``segments`` their sizes), each normalised
        as its whole tensor is."""
        pieces = self._pieces_of(key)
        rank, shards = self.shard_comm.rank, self.shard_comm.world_size
        sizes = [p.counts[rank] for p in pieces]
        if list(segments or [local.numel()]) != sizes:
            raise ValueError(f"the bucket's segments {segments} are not its shards' sizes {sizes}")
        totals = [sum(p.counts[s] for p in pieces) for s in range(shards)]
        width = max(totals)
        mine = torch.zeros(width, dtype=local.dtype, device=local.device)
        mine[: local.numel()].copy_(local)
        every = torch.empty(shards, width, dtype=local.dtype, device=local.device)
        self.shard_comm.all_gather(every, mine, "shard contributions (quantizer norms)").wait()
        parts, starts = [], [0] * shards
        for p in pieces:
            for s in range(shards):
                parts.append(every[s, starts[s] : starts[s] + p.counts[s]])
                starts[s] += p.counts[s]
        whole = torch.cat(parts) if parts else local.new_empty(0)
        # no key: the whole tensors' levels are transient (a buffer kept per bucket would hold the whole
        # model's elements on every rank, S times its shards'; docs/gpu.md)
        levels = super().levels_of(whole, [p.numel for p in pieces], None)
        out = torch.empty(local.numel(), dtype=levels.dtype, device=local.device)
        pos = base = 0
        for p, n in zip(pieces, sizes, strict=True):
            out[pos : pos + n].copy_(levels[base + p.start : base + p.start + n])
            pos, base = pos + n, base + p.numel
        return out


def agree_skip(shard_comm: Comm, groups: Sequence[dict[str, Any]], overflow: bool) -> bool:
    """Whether any rank of ``shard_comm`` has NaN/Inf in the gradients of ``groups``' parameters (or a
    GradScaler overflow): one all-reduce (MAX) of an int32 over it; one host read, the verdict."""
    grads = [a.grad for g in groups for a in g["params"] if a.grad is not None and a.grad.numel()]
    device = shard_comm.device
    flag = torch.full((1,), int(overflow), dtype=torch.int32, device=device)
    if grads and not overflow:  # on the device: the one host read is the verdict's
        if device.type == "cuda":  # multi-tensor launches, not ~4 per gradient shard (as lion_step)
            peaks = torch.stack([t.float() for t in torch._foreach_norm(grads, float("inf"))])
        else:  # on CPU the inf norm is ~11x slower than aminmax, the same values
            peaks = torch.stack([max_abs(g).float().to(device) for g in grads])
        flag = (~torch.isfinite(peaks).all()).to(torch.int32).reshape(1)
    shard_comm.all_reduce(flag, "shard non-finite agreement", op=dist.ReduceOp.MAX).wait()
    return bool(flag.item())


def share_owners(params: Sequence[torch.Tensor], parts: int, loads: list[int] | None = None) -> list[int]:
    """Which of ``parts`` ranks owns each tensor of ``params`` (a list, in its order) when each rank votes
    on a share of whole tensors: largest first, each to the rank with the fewest elements so far (ties:
    the lowest rank); ``loads`` (each rank's elements so far, updated in place) continues an earlier
    assignment, so that tensors added later leave the earlier ones where they were. The same on every
    rank for the same shapes."""
    if not is_int(parts, 1):
        raise ValueError(f"parts={parts!r} must be an int >= 1")
    load = [0] * parts if loads is None else loads
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner = min(range(parts), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += params[i].numel()
    return owners


def broadcast_shares(
    shares: Sequence[tuple[int, Sequence[torch.Tensor]]], rank: int, group: dist.ProcessGroup | None
) -> None:
    """Each ``(owner, tensors)`` of ``shares`` from rank ``owner`` of ``group`` (None: the default group)
    to its other ranks, copied in place there (``rank``: this rank's in ``group``); one broadcast per
    owner and dtype, the tensors flattened into one buffer on their device. Collective in ``group``."""
    with torch.no_grad():
        for owner, tensors in shares:
            src = dist.get_global_rank(group, owner) if group is not None else owner
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                same = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                dist.broadcast(flat, src=src, group=group)
                if owner != rank:
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()


class ShareView:
    """The optimizer as its parts see it with DDP inside the shard dimension (plain parameters, every rank
    holding the whole model, a replica's ranks averaging its gradients): param groups of this rank's
    share of whole tensors (:func:`share_owners` over the shard group's ranks, fixed at construction;
    parameters added later continue the assignment), the optimizer's own state. The rank votes on its share
    with the ranks that own the same share in the other replicas (the ``"replicate"`` group) and
    :meth:`broadcast` s it to its replica after the step.

    Args:
        optimizer: whose param groups hold the plain parameters.
        shard_group: the ranks of this replica, one per share (a mesh's ``"shard"`` group; ``None``: the
            default group).
        device: the parameters' device (the shard group's agreement runs there).
        after_step: whether ``step()`` broadcasts the shares (else its caller does: :class:`~lioncub.optim.
            topology.VoteMesh`'s ``broadcast="caller"``).
    """

    def __init__(
        self, optimizer: _Owner, shard_group: dist.ProcessGroup | None, device: torch.device, after_step: bool
    ) -> None:
        self.optimizer = optimizer
        #: the ranks of this replica, one per share (agreeing on a skipped step, the broadcast)
        self.shard_group = shard_group
        self.shard_comm = Comm(shard_group, device=device)
        self.shards = dist.get_world_size(shard_group)
        self.shard_rank = dist.get_rank(shard_group)
        self.after_step = after_step
        self._owners: dict[int, int] = {}
        self._loads = [0] * self.shards
        self._groups: list[dict[str, Any]] = []
        self.refresh(grads=False)

    @property
    def global_step(self) -> int:
        return self.optimizer.global_step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups with this rank's share for ``"params"`` (as of the last refresh)."""
        return self._groups

    @property
    def state(self) -> MutableMapping[torch.Tensor, Any]:
        return self.optimizer.state

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is in this rank's share."""
        return self._owners[id(p)] == self.shard_rank

    def refresh(self, *, grads: bool = True) -> None:
        """Re-read the param groups (their hyperparameters; parameters added since get owners). ``grads``:
        unused (the parameters' own gradients are voted on)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        new = [p for p in params if id(p) not in self._owners]
        for p, owner in zip(new, share_owners(new, self.shards, self._loads), strict=True):
            if isinstance(p, DTensor):
                raise TypeError(
                    f"LionCub: a DTensor of shape {tuple(p.shape)} among plain parameters: an optimizer's "
                    f"parameters are all sharded or all whole. {_SUPPORTED}"
                )
            self._owners[id(p)] = owner
        self._groups = [
            {**g, "params": [p for p in g["params"] if self.owns(p)]} for g in self.optimizer.param_groups
        ]

    def release(self) -> None:
        """Nothing to drop: the gradients are the parameters' own."""

    def agree_skip(self, overflow: bool) -> bool:
        """As :meth:`ShardView.agree_skip`, over this rank's share: a replica's shares skip together."""
        return agree_skip(self.shard_comm, self._groups, overflow)

    def broadcast(self) -> None:
        """Every rank's share to the others of its replica (collective in the shard group)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        shares = [(r, [p for p in params if self._owners[id(p)] == r]) for r in range(self.shards)]
        broadcast_shares(shares, self.shard_rank, self.shard_group)


def part_view(optimizer: _Owner, who: Voters, device: torch.device) -> ShardView | ShareView | None:
    """What the optimizer's parts see of its parameters for ``who`` (``process_group`` resolved by
    :func:`~lioncub.optim.topology.who_votes`): a :class:`ShardView` (FSDP2's shards), a
    :class:`ShareView` (DDP inside the shard dimension), or ``None`` (all of them)."""
    if who.part == "shards":
        assert who.mesh is not None  # who_votes gives the part with its mesh
        return ShardView(optimizer, who.mesh, device)
    if who.part == "shares":
        return ShareView(optimizer, who.shard_group, device, after_step=who.broadcast == "step")
    return None


def refuse_unsharded_mesh(optimizer: _Owner, process_group: object) -> bool:
    """Whether the parameters are ``DTensor`` s; raises, naming what is supported, where they are and
    ``process_group`` is not a mesh of :data:`SHARD_DIMS` (it does not say which ranks hold a shard)."""
    params = [
        (f"param_groups[{gi}]['params'][{i}]", p)
        for gi, g in enumerate(optimizer.param_groups)
        for i, p in enumerate(g["params"])
    ]
    sharded = [where for where, p in params if isinstance(p, DTensor)]
    one_replica = isinstance(process_group, VoteMesh) and is_shard_mesh(process_group.shard)
    if sharded and not (is_shard_mesh(process_group) or one_replica):
        given = (
            f"a DeviceMesh with dims {process_group.mesh_dim_names}"
            if isinstance(process_group, DeviceMesh)
            else f"process_group={type(process_group).__name__ if process_group is not None else None}"
        )
        raise TypeError(
            f"LionCub: {sharded[0]} is a DTensor ({len(sharded)} of the {len(params)} parameters are) and "
            f"{given} does not say which ranks hold the same shard. {_SUPPORTED}"
        )
    return bool(sharded)
