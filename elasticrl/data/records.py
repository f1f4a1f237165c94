"""Reading JSON-lines data, formatting prompts, and a resumable sample order.

The order of samples is a pure function of (seed, global sample index): step ``s`` of a
run with global batch ``B`` reads samples ``s*B .. s*B+B-1`` of an endless stream of
seeded epoch permutations. A resumed run (at any world size) therefore continues exactly
where it stopped, with nothing but the step number saved.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from elasticrl.files import write_text


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    records = []
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    for lineno, raw in enumerate(text.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start} of the line); save the file "
                             "as UTF-8") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object (one record per line), got "
                             f"{type(rec).__name__} {line.strip()[:40]}")
        missing = [k for k in required if k not in rec]
        if missing:
            raise ValueError(f"{path}:{lineno}: missing key(s) {missing}; set data.*_key in the "
                             f"spec to the names your file uses (it has {sorted(rec)})")
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def format_prompt(tokenizer, prompt: str, apply_chat_template: bool) -> str:
    if apply_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
    return prompt


def tokenize_sft(tokenizer, prompt: str, response: str, apply_chat_template: bool,
                 max_length: int) -> tuple[list[int], int]:
    """Token ids of prompt+response+eos and how many leading ids belong to the prompt."""
    prompt_text = format_prompt(tokenizer, prompt, apply_chat_template)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:max_length]
    return ids, min(len(prompt_ids), len(ids))


def write_jsonl(path: str | Path, rows: list[dict]) -> str:
    """One JSON object per line, written atomically (temp name, then rename); returns the path."""
    return str(write_text(path, "".join(json.dumps(r) + "\n" for r in rows)))


def sample_indices(num_records: int, seed: int, start: int, count: int, shuffle: bool = True) -> list[int]:
    """Global sample positions [start, start+count) mapped to record indices: each epoch a
    seeded permutation, or (``shuffle=False``, ``data.shuffle``) the records in file order."""
    if not shuffle:
        return [pos % num_records for pos in range(start, start + count)]
    out = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, num_records)
        perm = _epoch_permutation(num_records, seed, epoch)
        out.append(int(perm[offset]))
    return out


def row_share(num_rows: int, num_parts: int, part: int) -> slice:
    """Part ``part`` of ``num_rows`` rows split over ``num_parts`` as evenly as possible (later
    parts get the larger shares): the one rule by which ranks and engines divide a batch."""
    return slice(part * num_rows // num_parts, (part + 1) * num_rows // num_parts)


_perm_cache: dict[tuple[int, int, int], torch.Tensor] = {}


def _epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        if len(_perm_cache) > 4:
            _perm_cache.clear()
        _perm_cache[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return _perm_cache[key]


def pad_batch(seqs: list[list[int]], pad_id: int, prompt_lens: list[int] | None = None):
    """Right-padded ``input_ids``, ``attention_mask`` and loss ``labels`` (-100 = no loss).

    Labels mask the prompt and the padding, so the loss covers only response tokens.
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        start = prompt_lens[i] if prompt_lens else 0
        labels[i, start: len(s)] = torch.tensor(s[start:])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
