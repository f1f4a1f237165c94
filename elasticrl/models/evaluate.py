"""Greedy answers to held-out prompts with the training model (SFT-time evaluation).

Every rank decodes its share; all ranks run the same number of ``generate`` calls, because
a ZeRO-3 or AutoTP forward is a collective.
"""
from __future__ import annotations

import math

import torch

from elasticrl.data.records import format_prompt, prompt_of, prompt_text
from elasticrl.rewards.functions import load_function
from elasticrl.rewards.verifiers import full_marks, verifier_path


@torch.no_grad()
def greedy_accuracy(model, tokenizer, records, spec, *, max_new_tokens: int, dp_rank: int, dp_size: int,
                    synced: bool, device, batch_size: int = 64) -> tuple[int, int]:
    """(correct, total) over this rank's share of ``records``, as the job's verifier
    (``rewards.verifier``, here in this process) judges the answers."""
    data, verify = spec.data, load_function(verifier_path(spec), "rewards.verifier")
    mine = records[dp_rank::dp_size]
    per_rank = math.ceil(len(records) / dp_size)
    num_batches = math.ceil(per_rank / batch_size)
    correct = total = 0
    was_training = model.training
    model.eval()
    for b in range(num_batches):
        batch = mine[b * batch_size:(b + 1) * batch_size]
        real = len(batch)
        if not batch:  # keep the collective count equal across ranks
            batch = records[:1]
        texts = [format_prompt(tokenizer, prompt_of(r, data), data.apply_chat_template) for r in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, synced_gpus=synced,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for rec, ans in zip(batch[:real], answers[:real]):
            correct += _right(verify, prompt_text(rec, data), ans, rec.get(data.answer_key))
            total += 1
    model.train(was_training)
    return correct, total


def _right(verify, prompt: str, completion: str, answer) -> bool:
    try:
        return full_marks(float(verify(prompt, completion, answer)))
    except Exception:  # noqa: BLE001 - the verifier's failure on one answer: that answer does not count as right
        return False
