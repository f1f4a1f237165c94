"""Rollout: vLLM engines as Ray actors, a pool that spreads batches over them."""
