"""Pure tensor functions, the lowest layer: quantizers (:mod:`~lioncub.ops.quantize`), bit and lane
packing (:mod:`~lioncub.ops.packing`) and fused kernels with a bit-exact torch fallback
(:mod:`~lioncub.ops.kernels`). Nothing here communicates."""
