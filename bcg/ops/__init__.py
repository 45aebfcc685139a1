"""What models call: the attention islands and their FlashAttention/SDPA paths, the static attention of whole-graph
capture, KV-cache writes, the forward context the islands read, and the bridge buffers that carry island tensors."""
