"""lioncub: data-parallel training with the Lion optimizer over slow networks.

Layers, one package each (a lower layer never imports a higher one)::

    ops                      quantizers, bit/lane packing, fused kernels: pure tensor functions
    collectives              vote algorithms over a torch.distributed process group
    optim                    Lion, LionCub, its vote engine, DDP hooks, momentum sync, diagnostics
    planning                 α–β cost model, calibration, variant="auto"
    train · launch · report  workloads and the training loop · ranks behind emulated links · tables, plots
    cli                      the ``lioncub`` command (``python -m lioncub``), one module per subcommand

Beneath them all, ``units`` (rates, sizes, durations) and ``_validate`` (the shared argument checks) import
nothing of lioncub, and ``rundir`` (run directories: what lioncub wrote, what it may delete, one writer at a
time) only the standard library.

The top-level names are imported lazily, so ``import lioncub.launch`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0.dev0"

if TYPE_CHECKING:  # the lazy names below, for type checkers (tests/test_typing.py: the two lists agree)
    from lioncub.collectives import CollectiveError as CollectiveError
    from lioncub.optim.config import PRESETS as PRESETS
    from lioncub.optim.config import VoteConfig as VoteConfig
    from lioncub.optim.config import resolve_variant as resolve_variant
    from lioncub.optim.lion import Lion as Lion
    from lioncub.optim.lioncub import Checks as Checks
    from lioncub.optim.lioncub import LionCub as LionCub
    from lioncub.optim.lioncub import ReplicaDivergenceError as ReplicaDivergenceError
    from lioncub.optim.local_steps import LocalSteps as LocalSteps
    from lioncub.optim.sync import MomentumSync as MomentumSync
    from lioncub.planning.auto import auto_topology as auto_topology
    from lioncub.planning.auto import auto_variant as auto_variant

_EXPORTS = {
    "Checks": "lioncub.optim.lioncub",
    "Lion": "lioncub.optim.lion",
    "LionCub": "lioncub.optim.lioncub",
    "LocalSteps": "lioncub.optim.local_steps",
    "MomentumSync": "lioncub.optim.sync",
    "PRESETS": "lioncub.optim.config",
    "ReplicaDivergenceError": "lioncub.optim.lioncub",
    "VoteConfig": "lioncub.optim.config",
    "resolve_variant": "lioncub.optim.config",
    "auto_variant": "lioncub.planning.auto",
    "auto_topology": "lioncub.planning.auto",
    "CollectiveError": "lioncub.collectives",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lioncub' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
