"""What models call: the attention islands and their FlashAttention/SDPA paths, the static attention of whole-graph
capture, KV-cache writes, the forward context the islands read, the bridge buffers that carry island tensors, and
the fused kernels of the non-matmul ops (``bcg.ops.kernels``)."""
