"""Every ``LIONCUB_*`` environment variable in one table, :data:`VARIABLES`: its type, its default, what it
means, who sets it and which modules read it. lioncub reads them only through :func:`get` (the text, or the
default), :func:`text` (one with a default) and the typed :func:`seconds` and :func:`positive`, always with
the name written out;
``tests/test_layers.py`` checks that no other module reads a ``LIONCUB_`` name from ``os.environ`` and that
each variable is read exactly by its :attr:`Variable.readers`. Standard library only (layer 0).

``LIONCUB_PG_TIMEOUT`` has no default: unset, a wait is bounded by the process group's own timeout. The
600 s that ``lioncub train``'s ranks fall back to (``lioncub.train.rank``) is the timeout of the group
they create, the same as ``--collective-timeout``'s default, not a default of the variable: a
:class:`lioncub.collectives.Comm` in a user's group keeps that group's bound.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

__all__ = ["VARIABLES", "Variable", "get", "positive", "seconds", "text"]


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``default`` is the text used when it is unset (None: unset means "not
    given", see ``meaning``); ``readers`` are the modules that read it (none: lioncub only sets it, for the
    rank's own program); ``set_by`` names the command that sets it for the ranks ("" where only users do)."""

    name: str
    type: str
    default: str | None
    meaning: str
    readers: tuple[str, ...]
    set_by: str = ""


_LAUNCH = "lioncub launch"
_GROUPS = "lioncub train --fault-tolerant"

#: every ``LIONCUB_*`` variable lioncub reads or sets, by name
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "LIONCUB_CPU_KERNELS", "switch", "1",
            "0, off, false, no or empty: the torch code instead of the fused C kernels (the same bits)",
            ("lioncub.ops.native_build", "lioncub.ops.native"),
        ),
        Variable(
            "LIONCUB_CPU_PREFETCH", "switch", None,
            "1 or 0: the C kernels prefetch in software or not (unset: off on AMD CPUs, on elsewhere); "
            "speed only, never bits",
            ("lioncub.ops.native_build",),
        ),
        Variable(
            "LIONCUB_KERNEL_CACHE", "path", None,
            "where the compiled C kernels are cached (unset or empty: $XDG_CACHE_HOME/lioncub, else "
            "~/.cache/lioncub)",
            ("lioncub.ops.native_build",),
        ),
        Variable(
            "LIONCUB_PG_TIMEOUT", "seconds", None,
            "the bound of every LionCub collective's wait on gloo (unset or empty: the process group's own "
            "timeout); lioncub train's ranks also create their group with it (600 s when unset)",
            ("lioncub.collectives.base", "lioncub.train.rank", "lioncub.train.replica_group"),
            "lioncub launch --collective-timeout, lioncub train/compare --collective-timeout",
        ),
        Variable(
            "LIONCUB_NNODES", "int", None,
            "the number of emulated nodes M of the job (topology='hierarchical'/'auto', lioncub calibrate)",
            ("lioncub.optim.topology", "lioncub.planning.auto", "lioncub.cli.calibrate"),
            f"{_LAUNCH} --link or --nnodes",
        ),
        Variable(
            "LIONCUB_NODE", "int", None, "this rank's emulated node (for the rank's own program)", (),
            f"{_LAUNCH} --link or --nnodes",
        ),
        Variable(
            "LIONCUB_LINK_BPS", "bits/s", None,
            "the rate of each emulated link (a node's NIC under --nnodes): lioncub calibrate's reference",
            ("lioncub.planning.measure",), f"{_LAUNCH} --link",
        ),
        Variable(
            "LIONCUB_INTRA_LINK_BPS", "bits/s", None,
            "the rate inside an emulated node: lioncub calibrate --nnodes's reference for that level",
            ("lioncub.planning.measure",), f"{_LAUNCH} --intra-link",
        ),
        Variable(
            "LIONCUB_CALIBRATION", "path", None,
            "the calibration JSON (lioncub calibrate) that variant='auto' and topology='auto' predict for "
            "when no network is given",
            ("lioncub.planning.auto",),
        ),
        Variable(
            "LIONCUB_LAUNCH_ID", "text", None,
            "the launch this rank belongs to (names its network; the run directory's job)",
            ("lioncub.train.prepare",), _LAUNCH,
        ),
        Variable(
            "LIONCUB_RESTART_COUNT", "int", None,
            "the launch's attempt, 0 first (--restarts); torchrun's TORCHELASTIC_RESTART_COUNT wins",
            ("lioncub.train.prepare",), _LAUNCH,
        ),
        Variable(
            "LIONCUB_STATE_DIR", "path", "/run/lioncub/launch",
            "where lioncub launch records the emulated networks it built (lioncub launch --cleanup reads it)",
            ("lioncub.launch.netns",),
        ),
        Variable(
            "LIONCUB_PRELOAD", "switch", "1",
            "0: lioncub train/compare/calibrate start each rank as a fresh interpreter, not forked from a "
            "preloaded one",
            ("lioncub.train.driver", "lioncub.cli.calibrate"),
        ),
        Variable(
            "LIONCUB_THREADS", "int", "1", "torch's intra-op threads in each rank of lioncub train",
            ("lioncub.train.rank", "lioncub.train.replica_group"),
        ),
        Variable(
            "LIONCUB_GROUP", "int", None, "this process's replica group in a fault-tolerant run",
            ("lioncub.train.replica_group",), _GROUPS,
        ),
        Variable(
            "LIONCUB_GROUP_LIFE", "int", "0",
            "0 at a replica group's first start, k at its k-th start again (--rejoin)",
            ("lioncub.train.replica_group",), _GROUPS,
        ),
        Variable(
            "LIONCUB_LIGHTHOUSE", "url", None, "the torchft lighthouse of a fault-tolerant run",
            ("lioncub.train.replica_group",), _GROUPS,
        ),
        Variable(
            "LIONCUB_GROUP_HOST", "text", "localhost",
            "the address the other replica groups reach this one at (its namespace's, behind a link)",
            ("lioncub.train.replica_group",), _GROUPS,
        ),
        Variable(
            "LIONCUB_DATA", "path", None,
            "the data root prepared by lioncub data fetch (unset or empty: <repo>/.data in a clone, else "
            "$XDG_DATA_HOME/lioncub or ~/.local/share/lioncub)",
            ("lioncub.train.fetch",),
        ),
    )
}  # fmt: skip


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not in lioncub.env.VARIABLES: add it there first") from None


def get(name: str) -> str | None:
    """The text of ``$name`` as set (an empty text included), else the table's default (maybe None)."""
    text = os.environ.get(name)
    return _variable(name).default if text is None else text


def text(name: str) -> str:
    """:func:`get` for a variable that has a default (``KeyError`` otherwise): never None."""
    value = get(name)
    if value is None:
        raise KeyError(f"{name} has no default in lioncub.env.VARIABLES: use get()")
    return value


def seconds(name: str) -> datetime.timedelta | None:
    """``$name`` as a duration in seconds; None when unset or empty (``ValueError`` if not a number)."""
    text = get(name)
    return datetime.timedelta(seconds=float(text)) if text else None


def positive(name: str) -> float | None:
    """``$name`` as a finite number > 0; None when unset or empty. ``ValueError`` naming the variable, its
    unit and who sets it otherwise."""
    var, text = _variable(name), get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        by = f" (set by `{var.set_by}`)" if var.set_by else ""
        raise ValueError(f"{name}={text!r} must be a positive number of {var.type}{by}")
    return value
