"""What the models call: attention islands, fused kernels, KV writes, forward context and bridge buffers."""
