"""Sizes of the embedded tiny world, without torch: what the planner needs to know of it."""

VOCAB_SIZE = 128  # the character-level tokenizer: 6 specials + 96 characters, padded to a multiple of 8 for TP

# name: (hidden, layers, heads, kv_heads, intermediate). head_dim is 64 everywhere; head
# counts divide by 2 (and most by 4) so vLLM can shard them with tensor parallelism.
PRESETS = {
    "0.5m": (128, 2, 2, 2, 352),
    "2m": (256, 3, 4, 2, 640),
    "8m": (384, 5, 6, 2, 1024),
    "20m": (512, 7, 8, 4, 1408),
    "44m": (512, 14, 8, 4, 1536),  # the GRPO step benchmark's (benchmarks/rl_step.py)
    "50m": (768, 7, 12, 4, 2048),  # 44 M parameters in fact; the name stays for the figures measured on it
    "51m": (768, 8, 12, 4, 2048),  # 50.5 M: the sharded-state memory test's (test_sharded_state.py)
}
