"""A character-level tokenizer for the tiny world, built with `tokenizers`.

Every printable ASCII character is one token, so digits stay separate (arithmetic is
learnable by a tiny model) and the vocabulary is fixed by construction: the same ids on
every machine, nothing downloaded.
"""
from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from elasticrl.spec.presets import VOCAB_SIZE

PAD, BOS, EOS, UNK, USER, ASSISTANT = "<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"
SPECIALS = [PAD, BOS, EOS, UNK, USER, ASSISTANT]

# User turns, then the assistant's answer closed by eos. Only user/assistant roles exist in
# the tiny world; a system message is folded into the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|user|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    chars = [c for c in string.printable if c.isprintable()] + ["\n"]  # 95 printable + newline
    reserved = [f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(SPECIALS) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars + reserved)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS + reserved)  # never split, skipped when decoding
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        extra_special_tokens={"user_token": USER, "assistant_token": ASSISTANT},
        padding_side="left", model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
