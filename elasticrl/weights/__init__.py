"""Moving weights: sharded safetensors on disk (and, later, transports into vLLM)."""
