"""KV cache bookkeeping: cache specs, block and state pools, the block manager, memory plan, cache tensors."""
