"""Model runtime: paged KV cache, attention backends, model runner and sampler."""
