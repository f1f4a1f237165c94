"""A second embedded world shaped like a real one: what a user brings from the Hub.

A byte-level BPE tokenizer trained here with ``tokenizers`` (ChatML specials and template, as
Qwen's), a Qwen2-architecture model saved with plain ``transformers`` ``save_pretrained``
(the ``config.json`` fields a Qwen folder has), and word problems whose solutions end in a
``\\boxed{}`` answer: multi-turn SFT conversations, RL prompts and held-out prompts, as
parquet files and as ``datasets.save_to_disk`` folders. Nothing in it is elasticrl's own
format, so training on it goes through the code paths a user's model and data take.

Make one:  python -m elasticrl.world.wordmath DIR   (the tests use ``wordmath_dir()``)
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from elasticrl.files import atomic_folder

FORMAT_VERSION = 1
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = "You are a helpful assistant."
# ChatML as Qwen2's template writes it: a default system turn, each turn closed by <|im_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards"]
# (question, working) per operator; the answer follows as "The answer is \boxed{c}."
PROBLEMS = {
    "+": ("{n} has {a} {t}. {n} gets {b} more. How many {t} does {n} have now?", "{a} + {b} = {c}."),
    "-": ("{n} has {a} {t} and gives {b} away. How many {t} are left?", "{a} - {b} = {c}."),
    "*": ("There are {a} bags with {b} {t} in each. How many {t} are there?", "{a} * {b} = {c}."),
}


def problem(rng: random.Random) -> tuple[str, str, str]:
    """(question, solution, answer) of a random word problem."""
    op = rng.choice("+-*")
    a, b = (rng.randint(2, 12), rng.randint(2, 9)) if op == "*" else (rng.randint(10, 60), rng.randint(1, 9))
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    question, working = PROBLEMS[op]
    fill = {"n": rng.choice(NAMES), "t": rng.choice(THINGS), "a": a, "b": b, "c": c}
    return question.format(**fill), working.format(**fill) + f" The answer is \\boxed{{{c}}}.", str(c)


def make_records(seed: int, num_train: int = 2000, num_eval: int = 64) -> dict[str, list[dict]]:
    """SFT conversations of 1-3 problems (a system turn in some), RL prompts and held-out
    prompts with answers; held-out questions never appear in training."""
    rng = random.Random(seed)
    evals, seen = [], set()
    while len(evals) < num_eval:
        q, _, ans = problem(rng)
        if q not in seen:
            seen.add(q)
            evals.append({"messages": [{"role": "user", "content": q}], "answer": ans})

    def fresh():
        while True:
            q, sol, ans = problem(rng)
            if q not in seen:
                return q, sol, ans

    sft, prompts = [], []
    for _ in range(num_train):
        turns = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            q, sol, _ = fresh()
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": sol}]
        sft.append({"messages": turns})
        q, _, ans = fresh()
        prompts.append({"messages": [{"role": "user", "content": q}], "answer": ans})
    return {"sft": sft, "rl_prompts": prompts, "eval": evals}


def build_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE trained on ``texts``, split as Qwen2's tokenizer splits (digits one by
    one), with ChatML specials and template. The word problems' few hundred words stop the
    merges early: the vocabulary is about 420 tokens, not ``vocab_size``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left", model_max_length=4096)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer, seed: int):
    """A small Qwen2 (head_dim 64, grouped-query attention, q/k/v biases), weights drawn from
    one seeded generator."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = (len(tokenizer) + 63) // 64 * 64  # padded, as real vocabularies are, for tensor parallelism
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, torch_dtype="float32",
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else
                        torch.randn(param.shape, generator=gen) * 0.02)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def build(out: Path, seed: int = 0) -> Path:
    """Write the world into ``out``: model/ and data/{sft,rl_prompts,eval}.parquet plus a
    save_to_disk folder of each (data/<name>/)."""
    import datasets

    datasets.disable_progress_bars()
    records = make_records(seed)
    texts = [m["content"] for rows in records.values() for r in rows for m in r["messages"]]
    tok = build_tokenizer(texts)
    build_model(tok, seed).save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in records.items():
        ds = datasets.Dataset.from_list(rows)
        ds.to_parquet(str(out / "data" / f"{name}.parquet"))
        ds.save_to_disk(str(out / "data" / name))
    (out / "MANIFEST.json").write_text(json.dumps({"format": FORMAT_VERSION, "seed": seed}))
    return out


def wordmath_dir(seed: int = 0) -> Path:
    """The world in the elasticrl cache, built once (atomically) per format and seed."""
    from elasticrl.world.build import cache_root

    final = cache_root() / f"wordmath-v{FORMAT_VERSION}-seed{seed}"
    if not (final / "MANIFEST.json").is_file():
        with atomic_folder(final, keep_existing=True) as tmp:
            build(tmp, seed)
    return final


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m elasticrl.world.wordmath DIR")
    with atomic_folder(Path(sys.argv[1])) as tmp:
        build(tmp)
    print(f"{sys.argv[1]}: model/, data/sft.parquet, data/rl_prompts.parquet, data/eval.parquet and their "
          "save_to_disk folders")
