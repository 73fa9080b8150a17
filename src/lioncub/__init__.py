"""lioncub: data-parallel training with the Lion optimizer over slow networks.

Layers (a lower layer never imports a higher one)::

    quantize, packing        pure tensor functions
    collectives              vote algorithms over a torch.distributed process group
    optim                    Lion and LionCub state and step
    train, launch, cli       workloads, emulated network, user interface

The top-level names are imported lazily, so ``import lioncub.launch`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Lion": "lioncub.optim",
    "LionCub": "lioncub.optim",
    "PRESETS": "lioncub.optim",
    "ReplicaDivergenceError": "lioncub.optim",
    "CollectiveError": "lioncub.collectives",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lioncub' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
