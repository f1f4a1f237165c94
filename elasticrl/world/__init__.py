"""The embedded tiny world: a deterministic tiny Llama, tokenizer and arithmetic data."""
from elasticrl.world.build import content_hash, world_dir, world_paths

__all__ = ["content_hash", "world_dir", "world_paths"]
