"""Loading a causal LM and its tokenizer from a local folder (never a hub at run time)."""
from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, trust_remote_code: bool = False, ds_config: dict | None = None):
    """Load fp32 weights (DeepSpeed keeps fp32 masters and casts the module for bf16).

    With a ZeRO-3 ``ds_config`` the weights are partitioned while loading (zero.Init), so a
    rank never holds the whole model.
    """
    from transformers import AutoModelForCausalLM

    keep_alive = None
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must live through from_pretrained
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    del keep_alive
    return model
