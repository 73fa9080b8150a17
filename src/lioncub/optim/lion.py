r"""The Lion optimizer (EvoLved Sign Momentum, Chen et al. 2023) for a single process.

For every parameter :math:`p` with gradient :math:`g` (negated when ``maximize=True``) and momentum
:math:`m` (``state[p]["exp_avg"]``, initialised to zeros), one step with learning rate :math:`\eta`,
coefficients :math:`(\beta_1, \beta_2)` and decoupled weight decay :math:`\lambda` is, element-wise::

    c = beta1 * m + (1 - beta1) * g          # interpolation, used only for the direction
    p = p * (1 - lr * wd)                    # decoupled weight decay (skipped when lr * wd == 0)
    p = p - lr * sign(c)                     # sign(0) == 0, as torch.sign
    m = beta2 * m + (1 - beta2) * g          # momentum update from the OLD m

The update is composed of the three pieces of :mod:`lioncub.ops.update` (``lion_direction``,
``apply_update_``, ``update_momentum_``; a distributed optimizer recombines them, replacing ``sign(c)`` by a
vote over workers), and :func:`lion_update_` applies the whole step to lists of tensors, either tensor by
tensor or with ``torch._foreach_*`` kernels. Both paths run the same sequence of floating-point operations, so
they give bitwise identical results. On CPU, float32 and float64 tensors (parameter, gradient and momentum of
one dtype, contiguous) take a fused C kernel instead (:func:`lioncub.ops.native.lion`: one pass over ``p``,
``g`` and ``m``, the same operations, bit for bit; chosen by :func:`lioncub.ops.kernels.step_backend_for`,
switched off by ``LIONCUB_CPU_KERNELS=0``).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import torch
from torch import Tensor

from lioncub.ops import kernels, native
from lioncub.ops.update import apply_update_, lion_direction, update_momentum_

__all__ = [
    "Lion",
    "apply_update_",
    "check_no_duplicates",
    "default_foreach",
    "lion_direction",
    "lion_update_",
    "update_group_",
    "update_momentum_",
]


def _check_lists(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor]) -> None:
    if not len(params) == len(grads) == len(exp_avgs):
        raise ValueError(
            f"params, grads and exp_avgs must have the same length, got "
            f"{len(params)}, {len(grads)} and {len(exp_avgs)}"
        )


def _lion_update_single_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    for param, grad, exp_avg in zip(params, grads, exp_avgs, strict=True):
        work_dtype = exp_avg.dtype
        g = grad.neg() if maximize else grad
        if g.dtype != work_dtype:
            g = g.to(work_dtype)
        cast_back = param.dtype != work_dtype
        work_param = param.to(work_dtype) if cast_back else param

        update = lion_direction(exp_avg, g, beta1).sign_()
        apply_update_(work_param, update, lr=lr, weight_decay=weight_decay)
        update_momentum_(exp_avg, g, beta2)

        if cast_back:
            param.copy_(work_param)


def _foreach_scale_(tensors: list[Tensor], factor: float) -> None:
    """``tensors[i] *= factor``, rounding exactly like ``Tensor.mul_(factor)``.

    On CPU, in-place ``torch._foreach_mul_`` with a Python scalar first rounds the scalar to the
    tensors' dtype (bf16/fp16), unlike ``Tensor.mul_``; a 0-dim float64 tensor avoids that.
    """
    if tensors[0].device.type == "cpu":
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float64))
    else:
        torch._foreach_mul_(tensors, factor)


def _lion_update_foreach_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    # Group by (device, parameter dtype, momentum dtype): the foreach kernels want homogeneous lists.
    buckets: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, (param, exp_avg) in enumerate(zip(params, exp_avgs, strict=True)):
        buckets.setdefault((param.device, param.dtype, exp_avg.dtype), []).append(i)

    for (_device, param_dtype, work_dtype), idx in buckets.items():
        ps = [params[i] for i in idx]
        ms = [exp_avgs[i] for i in idx]
        gs = torch._foreach_neg([grads[i] for i in idx]) if maximize else [grads[i] for i in idx]
        gs = [g if g.dtype == work_dtype else g.to(work_dtype) for g in gs]
        cast_back = param_dtype != work_dtype
        work_ps = [p.to(work_dtype) for p in ps] if cast_back else ps

        # Same op sequence as lion_direction / apply_update_ / update_momentum_.
        update = torch._foreach_mul(ms, beta1)
        torch._foreach_add_(update, gs, alpha=1.0 - beta1)
        torch._foreach_sign_(update)
        if lr * weight_decay != 0:
            _foreach_scale_(work_ps, 1.0 - lr * weight_decay)
        torch._foreach_add_(work_ps, update, alpha=-lr)
        _foreach_scale_(ms, beta2)
        torch._foreach_add_(ms, gs, alpha=1.0 - beta2)

        if cast_back:
            torch._foreach_copy_(ps, work_ps)


def lion_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    foreach: bool = True,
) -> None:
    """Apply one Lion step in place to lists of tensors (see the module docstring for the formulas).

    Args:
        params: parameters, updated in place; any shapes, floating dtypes.
        grads: gradients, ``grads[i].shape == params[i].shape``; not modified.
        exp_avgs: momenta, ``exp_avgs[i].shape == params[i].shape``; updated in place. The arithmetic
            runs in ``exp_avgs[i].dtype``; when it differs from ``params[i].dtype`` the parameter is
            converted to it, updated, and copied back (rounded) into ``params[i]``.
        lr, beta1, beta2, weight_decay: hyperparameters (not validated here).
        maximize: ascend instead of descend (uses ``-grad``).
        foreach: use the multi-tensor ``torch._foreach_*`` kernels (grouped by device and dtypes)
            instead of a loop over tensors. Both give bitwise identical results. Tensors that the fused
            CPU kernel takes (see the module docstring) run it whatever ``foreach`` says.
    """
    _check_lists(params, grads, exp_avgs)
    if not params:
        return
    fused = [
        kernels.step_backend_for(p, g, m) == "cpu" for p, g, m in zip(params, grads, exp_avgs, strict=True)
    ]
    if any(fused):  # CPU: one pass over (p, g, m) per tensor
        for p, g, m in itertools.compress(zip(params, grads, exp_avgs, strict=True), fused):
            native.lion(
                p.data,
                g.detach(),
                m,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                negate=maximize,
            )
        rest = [i for i, f in enumerate(fused) if not f]
        if not rest:
            return
        params, grads, exp_avgs = ([xs[i] for i in rest] for xs in (params, grads, exp_avgs))
    impl = _lion_update_foreach_ if foreach else _lion_update_single_
    impl(
        params,
        grads,
        exp_avgs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        maximize=maximize,
    )


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _as_float(name: str, value: Any, allowed: str) -> float:
    # float(True) == 1.0 and float("1e-3") == 0.001: almost certainly mistakes, refused where they are set
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"Invalid {name}: {value!r} (expected {allowed})")
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"Invalid {name}: {value!r} (expected {allowed})") from None
    return out


def _check_nonneg_finite(name: str, value: Any) -> None:
    allowed = "a finite number >= 0"
    v = _as_float(name, value, allowed)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"Invalid {name}: {value!r} (expected {allowed})")


def _check_betas(betas: Any) -> None:
    allowed = "a pair (beta1, beta2) of numbers with 0 <= beta < 1"
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected {allowed})")
    for i, beta in enumerate(betas):
        v = _as_float(f"betas[{i}]", beta, "0 <= beta < 1")
        if not (0.0 <= v < 1.0):  # also rejects NaN
            raise ValueError(f"Invalid betas[{i}]: {beta!r} in betas={betas!r} (expected 0 <= beta < 1)")


def check_lion_hyperparameters(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the option for a bad ``lr``, ``betas`` or ``weight_decay``."""
    _check_nonneg_finite("lr", group["lr"])
    _check_betas(group["betas"])
    _check_nonneg_finite("weight_decay", group["weight_decay"])


def check_no_duplicates(params: Sequence[Tensor], group_index: int) -> None:
    """``ValueError`` naming both places when a param group lists one parameter twice (torch.optim only
    warns; an optimizer would then update it twice per step, and a fused step would lose its momentum)."""
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:
            first = _param_name(group_index, seen[id(p)])
            raise ValueError(
                f"{_param_name(group_index, i)} is the parameter already at {first}: list every parameter "
                "once (model.parameters() does; a tied weight is one parameter)"
            )
        seen[id(p)] = i


def _check_hyperparameters(group: dict[str, Any]) -> None:
    check_lion_hyperparameters(group)
    if group["foreach"] is not None and not isinstance(group["foreach"], bool):
        raise ValueError(f"Invalid foreach: {group['foreach']!r} (expected None, True or False)")
    if not isinstance(group["maximize"], bool):
        raise ValueError(f"Invalid maximize: {group['maximize']!r} (expected True or False)")
    dtype = group["momentum_dtype"]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"Invalid momentum_dtype: {dtype!r} (expected None or a floating torch.dtype)")


def default_foreach(params: Iterable[Tensor]) -> bool:
    """Whether the ``torch._foreach_*`` kernels serve these parameters (CPU or CUDA, strided)."""
    return all(p.device.type in ("cpu", "cuda") and p.layout == torch.strided for p in params)


def _param_name(group_index: int, param_index: int) -> str:
    return f"param_groups[{group_index}]['params'][{param_index}]"


# --------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------


def _without_dynamo(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer.<name>`` without the lazy ``torch._dynamo`` import of its decorator while no
    one has imported dynamo (importing it costs ~1.2 s of CPU per process, at an optimizer's construction
    and first ``zero_grad``); the decorated method once it is imported (under ``torch.compile``)."""
    decorated = getattr(torch.optim.Optimizer, name)
    raw = getattr(decorated, "__wrapped__", decorated)

    def method(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return (decorated if "torch._dynamo" in sys.modules else raw)(self, *args, **kwargs)

    return functools.wraps(decorated)(method)


_ADD_PARAM_GROUP = _without_dynamo("add_param_group")


class LeanOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose ``add_param_group``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` import ``torch._dynamo`` only where something else did (the same methods), and whose
    ``add_param_group`` refuses a parameter listed twice in the group before torch.optim warns of it."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and isinstance(param_group.get("params"), (list, tuple)):
            check_no_duplicates(param_group["params"], len(self.param_groups))  # torch.optim only warns
        _ADD_PARAM_GROUP(self, param_group)

    zero_grad = _without_dynamo("zero_grad")
    state_dict = _without_dynamo("state_dict")
    load_state_dict = _without_dynamo("load_state_dict")


class Lion(LeanOptimizer):
    """Lion: ``p <- p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m <- beta2 * m + (1 - beta2) * g``.

    Args:
        params: iterable of parameters or of dicts defining parameter groups. Each group may set its
            own ``lr``, ``betas``, ``weight_decay``, ``foreach``, ``maximize`` and ``momentum_dtype``;
            they are read from the group on every step, so LR schedulers work.
        lr: learning rate, finite and ``>= 0`` (Lion usually wants 3-10x smaller than AdamW).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``; beta1 interpolates the direction, beta2 is the
            momentum decay.
        weight_decay: decoupled weight decay coefficient, finite and ``>= 0`` (multiplied by ``lr``).
        foreach: ``True`` for the multi-tensor ``torch._foreach_*`` path, ``False`` for a per-tensor
            loop, ``None`` (default) for foreach when all parameters are dense and on CPU or CUDA.
            Both paths give bitwise identical results.
        maximize: maximise the objective (the gradient is negated).
        momentum_dtype: dtype of ``state[p]["exp_avg"]``; ``None`` keeps the parameter dtype. When
            set (e.g. ``torch.float32`` for bf16 parameters) the update is computed in that dtype and
            the result is rounded back into the parameter.

    State per parameter: ``"exp_avg"`` (momentum, shape of ``p``) and ``"step"`` (a Python ``int``,
    the number of updates applied to ``p``).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        momentum_dtype: torch.dtype | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "weight_decay": weight_decay,
            "foreach": foreach,
            "maximize": maximize,
            "momentum_dtype": momentum_dtype,
        }
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            native.available()  # builds or loads the fused CPU kernel now, not in the first step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated like the constructor arguments; complex parameters are rejected)."""
        if isinstance(param_group, dict):  # otherwise the base class raises its TypeError
            _check_hyperparameters({key: param_group.get(key, value) for key, value in self.defaults.items()})
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        try:
            check_no_duplicates(self.param_groups[-1]["params"], group_index)
            for i, p in enumerate(self.param_groups[-1]["params"]):
                if torch.is_complex(p):
                    raise ValueError(
                        f"Lion does not support complex parameters: {_param_name(group_index, i)} has dtype "
                        f"{p.dtype}; view it as real with torch.view_as_real"
                    )
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore from a pickle or state dict, back-filling options missing in older versions."""
        super().__setstate__(state)
        for key, value in (("foreach", None), ("maximize", False), ("momentum_dtype", None)):
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        for param_state in self.state.values():
            step = param_state.get("step")
            if isinstance(step, Tensor):
                param_state["step"] = int(step.item())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping ``exp_avg`` in ``momentum_dtype`` where a group sets one.

        ``torch.optim.Optimizer`` casts floating state to the parameter dtype; for groups with a
        ``momentum_dtype`` the momentum is re-read from ``state_dict`` so no precision is lost.
        """
        super().load_state_dict(state_dict)
        saved_state = state_dict["state"]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            dtype = group["momentum_dtype"]
            if dtype is None:
                continue
            for p, param_id in zip(group["params"], saved_group["params"], strict=True):
                saved = saved_state.get(param_id)
                if saved is not None and "exp_avg" in saved:
                    self.state[p]["exp_avg"] = saved["exp_avg"].to(device=p.device, dtype=dtype, copy=True)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float | Tensor] | None = None) -> float | Tensor | None:
        """Perform one update of every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it is
                called with gradients enabled before the update.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group_index, group in enumerate(self.param_groups):
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            for param_index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse or grad.layout != torch.strided:
                    raise RuntimeError(
                        f"Lion does not support sparse gradients: {_param_name(group_index, param_index)} "
                        f"has a gradient with layout {grad.layout}"
                    )
                if torch.is_complex(p) or torch.is_complex(grad):
                    raise RuntimeError(
                        f"Lion does not support complex tensors: {_param_name(group_index, param_index)} "
                        f"(param dtype {p.dtype}, grad dtype {grad.dtype})"
                    )
                state = self.state[p]
                momentum_dtype = group["momentum_dtype"] or p.dtype
                if "exp_avg" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=momentum_dtype, memory_format=torch.preserve_format
                    )
                elif state["exp_avg"].dtype != momentum_dtype:
                    state["exp_avg"] = state["exp_avg"].to(momentum_dtype)
                state["step"] = int(state.get("step", 0)) + 1
                params.append(p)
                grads.append(grad)
                exp_avgs.append(state["exp_avg"])

            if params:
                update_group_(group, params, grads, exp_avgs)
        return loss


def update_group_(
    group: dict[str, Any], params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor]
) -> None:
    """:func:`lion_update_` of ``params`` with the hyperparameters of their param group (``lr``,
    ``betas``, ``weight_decay``, ``maximize``; ``foreach`` where the group sets it, else
    :func:`default_foreach`)."""
    foreach = group.get("foreach")
    beta1, beta2 = group["betas"]
    lion_update_(
        params,
        grads,
        exp_avgs,
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        weight_decay=float(group["weight_decay"]),
        maximize=bool(group["maximize"]),
        foreach=default_foreach(params) if foreach is None else foreach,
    )
