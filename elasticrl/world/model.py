"""The tiny Llama: sizes by preset, weights drawn from a seeded generator.

Weights are drawn parameter by parameter in name order from one `torch.Generator`, not by
transformers' init, so the bytes depend only on the seed and the preset.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from elasticrl.spec.presets import PRESETS, VOCAB_SIZE


def tiny_config(preset: str, tokenizer) -> LlamaConfig:
    hidden, layers, heads, kv_heads, inter = PRESETS[preset]
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(preset: str, tokenizer, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_config(preset, tokenizer))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model.eval()
