"""Where a warning of an integration points: the user's line (``trainer.fit(...)``, ``trainer.train()``,
``LionCubTrainer(...)``), not lioncub's nor the framework's (:func:`user_stacklevel`). Standard library
only: it reads where the already imported packages live, it imports none."""

from __future__ import annotations

import os
import sys
import sysconfig

__all__ = ["user_stacklevel"]


def _folder(package: str) -> str | None:
    """The directory of ``package`` (with a trailing separator) if it is imported, else None."""
    path = getattr(sys.modules.get(package), "__file__", None)
    return os.path.join(os.path.dirname(os.path.abspath(path)), "") if path else None


def user_stacklevel(*frameworks: str) -> int:
    """The ``stacklevel`` for ``warnings.warn(..., stacklevel=user_stacklevel("lightning"))`` that names the
    first frame outside lioncub, torch, the ``frameworks``' packages (their top-level names, e.g.
    ``"transformers"``, ``"accelerate"``, ``"lightning"``) and the standard library: the user's call that led
    there, through however many of the framework's own frames."""
    packages = tuple(f for f in map(_folder, ("lioncub", "torch", *frameworks)) if f)
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "")

    def internal(path: str) -> bool:
        if path.startswith(packages):
            return True  # a system Python's site-packages lie inside its stdlib folder: not the stdlib
        return path.startswith(stdlib) and not {"site-packages", "dist-packages"} & set(path.split(os.sep))

    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and internal(os.path.abspath(frame.f_code.co_filename)):
        frame = frame.f_back
        level += 1
    return level
