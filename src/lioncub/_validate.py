"""The argument checks every layer shares. Each answers one question about a value (``bool`` is never a
number here, though Python says it is an ``int``); the caller raises with its own option name and allowed
values, or uses :func:`check_int` / :func:`check_number`, which raise
``ValueError`` naming them. :class:`OptionError` is the ``ValueError`` of one option of the Python API
said in parts (whose option, its value, the problem), so that the command line can name the option by its
flag without reading the text. Imports nothing of lioncub and not torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = ["NO_VALUE", "Named", "OptionError", "check_int", "check_number", "is_int", "is_number"]


class _Unset(enum.Enum):
    NO_VALUE = "NO_VALUE"


#: :class:`Named`'s and :class:`OptionError`'s ``value`` where a message names an option without a value
NO_VALUE: Any = _Unset.NO_VALUE


@dataclass(frozen=True)
class Named:
    """An option a message names: ``option`` of ``owner`` (the class or function that takes it:
    ``"LocalSteps"``, ``"LionCub"``, ...), with ``value`` (``outer='vote'``) or alone (:data:`NO_VALUE`)."""

    owner: str
    option: str
    value: Any = NO_VALUE

    def python(self) -> str:
        """As the Python API writes it: ``outer='vote'``, or ``diagnostics_every``."""
        return self.option if self.value is NO_VALUE else f"{self.option}={self.value!r}"


class OptionError(ValueError):
    """A bad ``value`` of the option ``option`` of ``owner`` (``"LocalSteps"``, ``"VoteConfig"``,
    ``"LionCub"``, ``"MomentumSync"``, ``"Checks"``): ``str()`` is
    ``{prefix}{option}={value!r}{sep}{problem}``
    (``LocalSteps: outer_lr=0 must be a finite number > 0``; ``value`` :data:`NO_VALUE`: the option alone).

    ``problem`` may name other options as ``{key}`` fields, each a :class:`Named` in ``named`` (``"with
    {h}: ..."``, ``h=Named("LionCub", "local_steps", 4)``; then a literal brace is doubled), written
    ``name=value`` here and by :meth:`render`'s ``spell`` elsewhere (``lioncub train`` writes flags:
    :func:`lioncub.train.parts.flag_message`)."""

    def __init__(
        self,
        owner: str,
        option: str,
        value: Any,
        problem: str,
        *,
        sep: str = " ",
        prefix: str = "",
        **named: Named,
    ) -> None:
        self.owner, self.option, self.value, self.problem = owner, option, value, problem
        self.sep, self.prefix, self.named = sep, prefix, named
        super().__init__(self.render(Named.python))

    @property
    def subject(self) -> Named:
        """The option at fault (with its value) as a :class:`Named`."""
        return Named(self.owner, self.option, self.value)

    def render(self, spell: Callable[[Named], str], prefix: str | None = None) -> str:
        """The message with every option (the subject and those ``problem`` names) written by ``spell``,
        after ``prefix`` (default: :attr:`prefix`)."""
        problem = (
            self.problem.format(**{k: spell(n) for k, n in self.named.items()})
            if self.named
            else self.problem
        )
        return f"{self.prefix if prefix is None else prefix}{spell(self.subject)}{self.sep}{problem}"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its parts (a rank's error crosses processes)."""
        parts = (self.owner, self.option, self.value, self.problem, self.sep, self.prefix, self.named)
        return (_option_error, parts)


def _option_error(
    owner: str, option: str, value: Any, problem: str, sep: str, prefix: str, named: dict[str, Named]
) -> OptionError:
    return OptionError(owner, option, value, problem, sep=sep, prefix=prefix, **named)


def is_int(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """``value`` is an ``int`` (not a ``bool``) within ``[low, high]`` (``None``: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def is_number(
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> TypeGuard[float]:
    """``value`` is an ``int`` or ``float`` (not a ``bool``, not NaN), finite unless ``finite=False``, and
    within the bounds given (``ge``: ≥, ``gt``: >, ``le``: ≤, ``lt``: <)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    if finite and not math.isfinite(value):
        return False
    return (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )


def check_int(option: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` if :func:`is_int`, else ``ValueError`` ``"{option}={value!r} must be an int >= low …"``."""
    if not is_int(value, low, high):
        bounds = " and ".join(
            b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b
        )
        raise ValueError(f"{option}={value!r} must be an int{' ' + bounds if bounds else ''}")
    return value


def check_number(
    option: str,
    value: Any,
    what: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` if :func:`is_number` with these bounds, else ``ValueError`` ``"{option}={value!r} must be
    {what}"`` (``what`` states the allowed values, e.g. ``"a finite number > 0"``)."""
    if not is_number(value, ge=ge, gt=gt, le=le, lt=lt, finite=finite):
        raise ValueError(f"{option}={value!r} must be {what}")
    return value
