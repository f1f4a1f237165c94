"""Model architecture as the memory model needs it: sizes, not weights.

A job's model comes from ``model.path``: its ``config.json`` when the folder exists here (for
a Hub id ORG/NAME, its snapshot in this machine's Hugging Face cache, never downloaded), else
a known published architecture named by the path's last component (so a spec for a cluster
can be planned on a laptop without the weights), else the embedded tiny preset.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elasticrl.files import read_json
from elasticrl.spec import hub
from elasticrl.spec.presets import PRESETS, VOCAB_SIZE


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """One decoder layer: q, o (h x h), k, v (h x kv_dim), gated MLP (3 h x I), 2 norms."""
        kv_dim = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate \
            + 2 * self.hidden

    def params(self, head: str = "lm") -> int:
        """All parameters; ``head='value'`` swaps the LM head for a scalar value head."""
        embed = self.vocab * self.hidden
        out = (0 if self.tied else embed) if head == "lm" else self.hidden
        return embed + self.layers * self.layer_params() + self.hidden + out

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """LoRA adapters of rank r: r x (in + out) per adapted linear layer (``targets``: peft's
        module names, or ['all-linear']: the seven of each decoder layer, not the head)."""
        kv = self.kv_heads * self.head_dim
        shapes = {"q_proj": (self.hidden, self.hidden), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                  "o_proj": (self.hidden, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                  "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}
        chosen = shapes if targets == ["all-linear"] else {k: v for k, v in shapes.items() if k in targets}
        return rank * self.layers * sum(i + o for i, o in chosen.values())

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV cache of one token over all layers: K and V, kv_heads x head_dim each."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


# Published configs (config.json of each model on the Hugging Face hub). The OpenRLHF paper's
# "34B LLaMA 2" is Code Llama 34B, the only released 34B of that family.
KNOWN = {
    "llama-2-7b": Arch(4096, 32, 32, 32, 11008, 32000),
    "llama-2-13b": Arch(5120, 40, 40, 40, 13824, 32000),
    "codellama-34b": Arch(8192, 48, 64, 8, 22016, 32000),
    "llama-2-70b": Arch(8192, 80, 64, 8, 28672, 32000),
    "llama-3.1-8b": Arch(4096, 32, 32, 8, 14336, 128256),
    "llama-3.1-70b": Arch(8192, 80, 64, 8, 28672, 128256),
    "qwen2.5-7b": Arch(3584, 28, 28, 4, 18944, 152064),
    "deepseek-r1-distill-qwen-7b": Arch(3584, 28, 28, 4, 18944, 152064),  # the DAPO runs' model (Qwen2.5-Math-7B)
}


def _known(path: str) -> Arch | None:
    """The known architecture whose name starts the path's last component, longest first
    ('Llama-2-70b-sft' is llama-2-70b, 'llama-2-7b-rm' is llama-2-7b)."""
    name = Path(path.rstrip("/")).name.lower().removeprefix("meta-")
    for key in sorted(KNOWN, key=len, reverse=True):
        if name == key or name.startswith(key + "-"):
            return KNOWN[key]
    return None


def from_config(cfg: dict) -> Arch:
    heads = cfg["num_attention_heads"]
    return Arch(cfg["hidden_size"], cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads", heads),
                cfg["intermediate_size"], cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))


def arch_of(model_path: str | None, tiny_preset: str) -> Arch:
    """The architecture a job trains (see the module doc for the order of sources)."""
    if model_path is None:
        hidden, layers, heads, kv_heads, inter = PRESETS[tiny_preset]
        return Arch(hidden, layers, heads, kv_heads, inter, VOCAB_SIZE)
    folder = hub.cached(model_path) if hub.is_hub_id(model_path) else model_path  # a Hub id this cache holds
    config = Path(folder or model_path) / "config.json"
    if config.is_file():
        cfg = read_json(config, "give the folder of a Hugging Face model (its config.json is damaged: copy it again)")
        try:
            return from_config(cfg)
        except KeyError as exc:
            raise ValueError(f"{config}: no {exc.args[0]!r}; elasticrl plans decoder-only causal LMs (Llama, Qwen2, "
                             "Mistral, ...)") from None
    known = _known(model_path)
    if known is None:
        raise ValueError(f"model.path: {model_path!r} is neither a local model folder nor a known architecture "
                         f"({', '.join(sorted(KNOWN))}); plan where the weights are, or use one of those names")
    return known
