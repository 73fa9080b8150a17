"""lioncub: data-parallel training with the Lion optimizer over slow networks.

Layers (a lower layer never imports a higher one)::

    quantize, packing        pure tensor functions
    collectives              vote algorithms over a torch.distributed process group
    optim                    Lion and LionCub state and step
    train, launch, cli       workloads, emulated network, user interface
"""

from lioncub.optim.lion import Lion

__all__ = ["Lion"]
__version__ = "0.1.0"
