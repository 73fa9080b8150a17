r"""What every vote on the signs of Lion's pre-sign update shares: its contribution and its apply.

On rank i, for every parameter of a bucket (``g`` negated under ``maximize``, ``None`` = zeros):

* contribution: ``c_i = β1·m_i + (1−β1)·g_i`` into the bucket's flat buffer, or — on the fused CPU path
  (``Ballot.backend.fused``) — the vote's :class:`~lioncub.collectives.formats.Payload` written straight
  from ``(m_i, g_i)`` in one pass, together with the next momentum ``β2·m_i + (1−β2)·g_i`` in a scratch
  tensor (``m_i`` itself is not written: a skipped step keeps it);
* apply: ``p ← p·(1 − lr·wd) − lr·u`` with the update ``u`` every rank agrees on, then
  ``m_i ← β2·m_i + (1−β2)·g_i`` — on the fused path from the undecoded
  :class:`~lioncub.collectives.protocol.Result` in one pass over ``(p, m, g)``, the next momentum taken
  by swapping storages (``exp_avg`` keeps its identity; a view of it taken before the step does not
  follow); on GPUs (``"triton"``) with :func:`lioncub.ops.kernels.apply_votes_multi_`, one launch for
  the bucket (the contribution likewise, :func:`lioncub.ops.kernels.lion_directions_`); else in torch.
  Every path gives the same bits.

A subclass states its payload (:meth:`SignVote.payload_format`) and its collective
(:meth:`~lioncub.collectives.protocol.Vote.start`, returning its result format).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from lioncub.collectives.base import Comm
from lioncub.collectives.formats import Decoded, Payload
from lioncub.collectives.protocol import Ballot, Hyper, ParamState, Result, Vote
from lioncub.ops import kernels, native
from lioncub.ops.quantize import max_abs
from lioncub.ops.update import apply_update_converting_, update_momentum_
from lioncub.transports import ZERO_VOTES

__all__ = ["SignVote", "fits_backend", "flat_views", "gradient"]


def flat_views(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's view into ``flat`` (1-D), the parameters laid out one after another in order.

    ``flat`` must hold at least ``sum(p.numel())`` elements; the views have the parameters' shapes and
    share ``flat``'s storage and dtype."""
    views, pos = [], 0
    for p in params:
        views.append(flat[pos : pos + p.numel()].view_as(p))
        pos += p.numel()
    return views


def gradient(p: torch.Tensor, g: torch.Tensor | None, maximize: bool) -> torch.Tensor:
    """The gradient Lion descends: ``g`` (zeros for ``None``), negated under ``maximize``."""
    if g is None:
        return torch.zeros_like(p)
    if g.is_sparse:
        raise RuntimeError("LionCub does not support sparse gradients")
    return -g if maximize else g


def _like(t: torch.Tensor | None, p: torch.Tensor) -> bool:
    """``t`` is ``None`` or a plain dense contiguous tensor of ``p``'s dtype and device."""
    return t is None or (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.dtype == p.dtype
        and t.device == p.device
        and t.is_contiguous()
    )


def fits_backend(
    ballot: Ballot, state: ParamState, grads: Sequence[torch.Tensor | None] | None = None
) -> bool:
    """Whether this step's momenta and gradients (``grads``, else each ``p.grad``) meet what the bucket's
    fused backend assumes (dense, contiguous, the parameter's dtype and device; O(1) per tensor): where one
    does not, the step takes the torch path, which gives the same bits."""
    if not (ballot.backend.fused or ballot.backend.votes_kernel):
        return False
    gs = [p.grad for p in ballot.params] if grads is None else grads
    return all(_like(state.momentum(p), p) and _like(g, p) for p, g in zip(ballot.params, gs, strict=True))


class SignVote(Vote):
    """A vote whose ranks contribute ``c = β1·m + (1−β1)·g`` and apply the agreed update ``u`` as Lion
    applies ``sign(c)`` (see the module docstring)."""

    def __init__(self, comm: Comm, zero_vote: str = "split") -> None:
        super().__init__(comm)
        if zero_vote not in ZERO_VOTES:
            raise ValueError(f"zero_vote={zero_vote!r}: allowed values are {list(ZERO_VOTES)}")
        #: how an exact zero of ``c`` votes where a vote is one bit (:class:`lioncub.optim.VoteConfig`)
        self.zero_vote = zero_vote
        self._scratch: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # id(m): (m, next)

    def zeros_vote_plus(self, step: int) -> bool:
        """Whether this rank's exact zeros vote "+" at optimizer step ``step`` in a one-bit vote: always
        (``zero_vote="plus"``, the papers' code), or where rank + step is even (``"split"``)."""
        return self.zero_vote == "plus" or (self.comm.rank + step) % 2 == 0

    def votes(self, local: torch.Tensor, step: int) -> torch.Tensor:
        """This rank's one-bit votes of ``local`` as uint8 0/1 (:meth:`zeros_vote_plus` for exact zeros)."""
        vote = torch.ge if self.zeros_vote_plus(step) else torch.gt
        return vote(local, 0).view(torch.uint8)

    def payload_format(self) -> Payload | None:
        """The payload the fused contribution writes from ``(m, g)`` (``None``: the vote needs ``c``)."""
        return None

    def payload(self, key: object, d: int) -> torch.Tensor:
        """The reusable payload buffer of a bucket of ``d`` elements."""
        fmt = self.payload_format()
        if fmt is None:
            raise ValueError(f"{self!r} takes no encoded payload")
        return self.buffer(key, "payload", fmt.numel(d), fmt.dtype)

    # -- 1. the contribution -----------------------------------------------------------------------

    @torch.no_grad()
    def contribute(self, ballot, grads, state, *, step, keep_copy=False):
        if ballot.backend.fused and fits_backend(ballot, state, grads):
            self._contribute_fused(ballot, grads, state, step, keep_copy)
            return
        if ballot.backend.votes_kernel and fits_backend(ballot, state, grads):
            # GPU: one launch per bucket (per distinct β1, maximize), the same bits as the loop below
            for (beta1, maximize), members in _by_hyper(ballot, state, lambda h: (h.beta1, h.maximize)):
                kernels.lion_directions_(
                    ballot.local,
                    [start for _, start in members],
                    [state.momentum(p) for p, _ in members],
                    [grads[i] for i in _indices(ballot, members)],
                    beta1=beta1,
                    negate=maximize,
                )
        else:
            for p, g, view in zip(ballot.params, grads, flat_views(ballot.local, ballot.params), strict=True):
                h = state.hyper(p)
                grad = gradient(p, g, h.maximize)
                torch.mul(state.momentum(p), h.beta1, out=view).add_(grad, alpha=1.0 - h.beta1)
        ballot.peak = max_abs(ballot.local).float()
        ballot.direction = ballot.local.clone() if keep_copy else None

    def _contribute_fused(
        self,
        ballot: Ballot,
        grads: Sequence[torch.Tensor | None],
        state: ParamState,
        step: int,
        keep_copy: bool,
    ) -> None:
        d = ballot.local.numel()
        whole = sum(ballot.segments) == d
        fmt = None if keep_copy or not whole else self.payload_format()
        payload = None if fmt is None else self.buffer(ballot.key, "payload", fmt.numel(d), fmt.dtype)
        peaks: list[float] = []
        nexts: list[tuple[torch.Tensor, float] | None] = []
        pos = 0
        for p, g, view in zip(ballot.params, grads, flat_views(ballot.local, ballot.params), strict=True):
            h = state.hyper(p)
            m, gr = state.momentum(p), (None if g is None else g.detach())
            nxt = self._next_momentum(m)
            nexts.append(None if nxt is None else (nxt, h.beta2))
            if fmt is None:
                peaks.append(
                    native.direction(
                        m, gr, h.beta1, out=view, negate=h.maximize, next_momentum=nxt, beta2=h.beta2
                    )
                )
            else:
                assert payload is not None  # made with fmt
                peaks.append(
                    fmt.write(
                        m, gr, h.beta1, out=payload, position=pos, negate=h.maximize, next_momentum=nxt,
                        beta2=h.beta2, zeros_vote_plus=self.zeros_vote_plus(step),
                    )
                )  # fmt: skip
            pos += p.numel()
        if fmt is not None:
            assert payload is not None  # made with fmt
            fmt.finish(payload, d)
        peak = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
        ballot.peak = torch.tensor(peak, dtype=torch.float32)
        ballot.payload, ballot.next_momenta = payload, nexts
        ballot.direction = ballot.local.clone() if keep_copy else None

    def _next_momentum(self, m: torch.Tensor) -> torch.Tensor | None:
        """A reusable tensor like ``m`` for its next value (the fused apply then swaps the two storages:
        the momentum is written once, in the contribution pass, and a skipped step keeps the old one);
        ``None`` where ``m`` does not own its whole storage (a view: its storage is not swapped)."""
        if m.storage_offset() != 0 or m.untyped_storage().nbytes() != m.numel() * m.element_size():
            return None
        entry = self._scratch.get(id(m))
        if entry is not None and entry[0]() is m and entry[1].shape == m.shape and entry[1].dtype == m.dtype:
            return entry[1]
        for key in [k for k, (ref, _) in self._scratch.items() if ref() is None]:
            del self._scratch[key]  # momenta replaced since (load_state_dict)
        scratch = torch.empty_like(m, memory_format=torch.contiguous_format)
        self._scratch[id(m)] = (weakref.ref(m), scratch)
        return scratch

    # -- 4. the apply ------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, ballot, state, *, untouched=frozenset(), keep_update=False):
        assert ballot.pending is not None, "apply() before post()"
        result = ballot.pending.result()
        copy = None
        if keep_update:
            result = Decoded(result.decode())
            copy = result.update.clone()
        backend = ballot.backend if fits_backend(ballot, state) else kernels.STEP_BACKENDS["torch"]
        if backend.fused and result.fused_for(ballot.local.dtype):
            pos = 0
            for i, p in enumerate(ballot.params):
                if id(p) not in untouched:
                    nxt = ballot.next_momenta[i] if ballot.next_momenta else None
                    self._apply_fused(p, result, pos, state, nxt)
                pos += p.numel()
            return copy
        u = result.decode()
        if backend.votes_kernel and not u.dtype.is_floating_point:
            # GPU: p·(1 − lr·wd) − lr·u and m ← β2·m + (1−β2)·g in one pass over the whole bucket (one
            # launch per distinct lr, weight decay, β2, maximize), the same bits as apply_votes_ per tensor
            def key(h: Hyper) -> tuple:
                return (h.lr, h.weight_decay, h.beta2, h.maximize)

            for (lr, wd, beta2, maximize), members in _by_hyper(ballot, state, key, untouched):
                ps = [p for p, _ in members]
                kernels.apply_votes_multi_(
                    [p.data for p in ps],
                    u,
                    [start for _, start in members],
                    lr=lr,
                    weight_decay=wd,
                    exp_avgs=[state.momentum(p) for p in ps],
                    grads=[None if p.grad is None else p.grad.detach() for p in ps],
                    beta2=beta2,
                    negate_grad=maximize,
                )
            return copy
        for p, view in zip(ballot.params, flat_views(u, ballot.params), strict=True):
            if id(p) not in untouched:
                self._apply_unfused(p, view, state.momentum(p), state.hyper(p))
        return copy

    def _apply_fused(
        self,
        p: torch.Tensor,
        result: Result,
        position: int,
        state: ParamState,
        nxt: tuple[torch.Tensor, float] | None,
    ) -> None:
        """One parameter's apply in one pass; the momentum from the contribution pass where it was computed
        with the ``β2`` of now (swapped in), else updated in the same pass."""
        h, m = state.hyper(p), state.momentum(p)
        fresh = nxt[0] if nxt is not None and nxt[1] == h.beta2 else None
        momentum = None
        if fresh is None:
            g = None if p.grad is None else p.grad.detach()
            momentum = native.Momentum(m, g, h.beta2, h.maximize)
        result.apply_fused(p.data, position, lr=h.lr, weight_decay=h.weight_decay, momentum=momentum)
        if fresh is not None:
            _swap_storage(m, fresh)

    @staticmethod
    def _apply_unfused(p: torch.Tensor, u: torch.Tensor, m: torch.Tensor, h: Hyper) -> None:
        g = gradient(p, p.grad, h.maximize)
        apply_update_converting_(p, u, lr=h.lr, weight_decay=h.weight_decay)
        update_momentum_(m, g, h.beta2)


def _by_hyper(
    ballot: Ballot,
    state: ParamState,
    key: Callable[[Hyper], Hashable],
    untouched: frozenset[int] | set[int] = frozenset(),
) -> list[tuple[Any, list[tuple[torch.Tensor, int]]]]:
    """The bucket's parameters (with their start in the flat layout) grouped by ``key`` of their
    hyperparameters, in order; ``untouched`` ids left out."""
    groups: dict[Hashable, list[tuple[torch.Tensor, int]]] = {}
    pos = 0
    for p in ballot.params:
        if id(p) not in untouched:
            groups.setdefault(key(state.hyper(p)), []).append((p, pos))
        pos += p.numel()
    return list(groups.items())


def _indices(ballot: Ballot, members: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """The positions in ``ballot.params`` of ``members``' parameters."""
    index = {id(p): i for i, p in enumerate(ballot.params)}
    return [index[id(p)] for p, _ in members]


def _swap_storage(m: torch.Tensor, fresh: torch.Tensor) -> None:
    """``m`` takes ``fresh``'s storage (its next value); ``fresh`` keeps ``m``'s old storage as the next
    step's scratch. The tensor object ``m`` (the optimizer's ``state[p]["exp_avg"]``) stays the same."""
    old = torch.empty(0, dtype=m.dtype)
    old.set_(m)  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
    m.set_(fresh)  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
    fresh.set_(old)  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
