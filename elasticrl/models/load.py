"""Loading a causal LM and its tokenizer from a local folder (never a hub at run time)."""
from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model folder's tokenizer; ``chat_template`` (``data.chat_template``: a Jinja template
    or the path of a file holding one) replaces its own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if chat_template:
        is_file = "{" not in chat_template and Path(chat_template).is_file()
        tok.chat_template = Path(chat_template).read_text() if is_file else chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _zero3_context(ds_config: dict | None):
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        return HfDeepSpeedConfig(ds_config)  # must stay alive through from_pretrained
    return None


def _attention() -> dict:
    """The attention kernel of trained and scoring models, where the device has a faster one
    than transformers' default (``backend.attention``)."""
    from elasticrl import backend

    name = backend.attention()
    return {"attn_implementation": name} if name else {}


def _quantized(quantize: str, compute_dtype: torch.dtype) -> dict:
    """from_pretrained's arguments for a 4-bit frozen base (``model.lora.quantize: nf4``, QLoRA):
    bitsandbytes NF4 with double-quantized scales, on this rank's device; the heads stay whole."""
    if quantize == "none":
        return {}
    from transformers import BitsAndBytesConfig

    from elasticrl import backend

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=["lm_head", "score"]),
        "device_map": {"": str(backend.current_device())}}


def _one_4bit_layout(model):
    """On AVX512-BF16 CPUs bitsandbytes repacks a 4-bit weight for its inference kernel at the
    first no-grad forward (scales rounded to bf16), after which no-grad log-probs and the training
    forward differ (~6e-3 in a layer's output here) and the weight no longer dequantizes as
    stored: keep the one layout, whose forwards agree exactly."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def load_value_model(path: str | Path, trust_remote_code: bool = False, ds_config: dict | None = None,
                     quantize: str = "none", compute_dtype: torch.dtype = torch.float32):
    """A model with a scalar head on every position (critic, reward model).

    Uses the architecture's sequence-classification class with one label, so the result
    saves and loads as a standard Hugging Face reward model. From a causal-LM checkpoint
    the head starts random (seeded); from a reward-model checkpoint it is loaded.
    """
    from transformers import AutoModelForSequenceClassification

    keep_alive = _zero3_context(ds_config)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True,
        **_attention(), **_quantized(quantize, compute_dtype))
    del keep_alive
    if quantize != "none":
        _one_4bit_layout(model)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def token_values(model, input_ids, attention_mask, packed: bool = False, position_ids=None):
    """Scalar head applied at every position: [B, T] (of a LoRA critic: its adapters, its head);
    ``packed``: the right-padded rows' tokens laid end to end (``scoring.packed_forward``);
    ``position_ids``: the positions of a sequence-parallel slice (``engine.sequence``)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper
    base = getattr(model, model.base_model_prefix)
    if position_ids is not None:
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    elif packed:
        from elasticrl.models.scoring import packed_forward

        hidden = packed_forward(lambda **kw: base(**kw, use_cache=False).last_hidden_state, input_ids, attention_mask)
    else:
        hidden = base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def load_causal_lm(path: str | Path, trust_remote_code: bool = False, ds_config: dict | None = None,
                   quantize: str = "none", compute_dtype: torch.dtype = torch.float32):
    """Load fp32 weights (DeepSpeed keeps fp32 masters and casts the module for bf16), or with
    ``quantize`` (QLoRA) the linear layers' in 4 bits.

    With a ZeRO-3 ``ds_config`` the weights are partitioned while loading (zero.Init), so a
    rank never holds the whole model.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per rank and model, interleaved by Ray: noise
    keep_alive = _zero3_context(ds_config)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=trust_remote_code,
                                                 use_safetensors=True, **_attention(),  # never a pickled checkpoint
                                                 **_quantized(quantize, compute_dtype))
    del keep_alive
    return _one_4bit_layout(model) if quantize != "none" else model


def with_lora(model, lora, value_head: bool = False):
    """``model`` with peft's LoRA adapters on ``lora.target_modules`` (``model.lora``): the base
    frozen, the adapters (B starts at zero, so the model starts as the base) trainable; a value
    model's (``value_head``) scalar head trains whole, without an adapter."""
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules
    head = {"modules_to_save": ["score"], "exclude_modules": ["score"]} if value_head else {}
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules=targets[0] if targets == ["all-linear"] else targets, **head)
    return get_peft_model(model, config)
