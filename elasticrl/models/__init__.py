"""Loading Hugging Face causal LMs and tokenizers, and greedy evaluation."""
from elasticrl.models.load import load_causal_lm, load_tokenizer, torch_dtype

__all__ = ["load_causal_lm", "load_tokenizer", "torch_dtype"]
