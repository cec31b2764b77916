"""Workers: each owns a device, a model replica (or shard) and its KV cache."""
