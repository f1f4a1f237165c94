"""Pure tensor math (no Ray, torch.distributed, DeepSpeed or vLLM imports)."""
