"""Summed response log-probabilities of whole sequences, padded or packed; a right-padded batch's
forward, packed (``packed_forward``), in the padded layout.

Packed: the sequences of a batch are laid end to end in one row, with position ids that
restart at each sequence; transformers then builds a block-diagonal causal mask from the
position ids (with no attention mask and no KV cache), so no sequence attends to another
and no compute is spent on padding. The results equal the padded ones
(tests/models/test_scoring.py holds them to 1e-5).
"""
from __future__ import annotations

import torch

from elasticrl.algorithms.logprobs import IGNORE, token_logprobs
from elasticrl.data.records import pad_batch


def response_logps(model, examples: list[tuple[list[int], list[bool]]], pad_id: int, packed: bool = False,
                   device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (token ids, which are response tokens): the sum of log p over its response
    tokens, and how many there are. Gradients flow unless the caller disables them."""
    if packed:
        return _packed(model, examples, device)
    seqs, trained = [e[0] for e in examples], [e[1] for e in examples]
    b = {k: v.to(device) for k, v in pad_batch(seqs, pad_id, trained).items()}
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    lp = token_logprobs(logits, b["labels"])
    scored = (b["labels"][:, 1:] != IGNORE).float()
    return (lp * scored).sum(1), scored.sum(1)


def _packed(model, examples, device):
    ids, pos, labels, owner = [], [], [], []
    for i, (seq, trained) in enumerate(examples):
        ids += seq
        pos += range(len(seq))
        # each sequence's first token is never scored: nothing is predicted across a boundary
        # between two sequences
        labels += [IGNORE] + [t if keep else IGNORE for t, keep in zip(seq[1:], trained[1:])]
        owner += [i] * len(seq)
    to = dict(dtype=torch.long, device=device)
    ids_t, labels_t = torch.tensor([ids], **to), torch.tensor([labels], **to)
    # no cache: transformers reads packing from the position ids only without one
    logits = model(input_ids=ids_t, position_ids=torch.tensor([pos], **to), use_cache=False).logits
    lp = token_logprobs(logits, labels_t)[0]
    scored = (labels_t[0, 1:] != IGNORE).float()
    idx = torch.tensor(owner[1:], **to)
    sums = torch.zeros(len(examples), device=lp.device).index_add(0, idx, lp * scored)
    counts = torch.zeros(len(examples), device=lp.device).index_add(0, idx, scored)
    return sums, counts


def packed_forward(forward, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``forward(input_ids=, position_ids=)`` over a right-padded batch's real tokens laid end to
    end in one row (position ids restarting at each sequence, as the padded rows count them),
    its per-token output put back in the padded layout ``[B, T, ...]`` (zeros on padding).
    Gradients flow to the packed computation."""
    keep = attention_mask.bool()
    lengths = attention_mask.sum(1).tolist()
    ids = input_ids[keep][None]
    pos = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])[None]
    out = forward(input_ids=ids, position_ids=pos)[0]
    full = out.new_zeros(*input_ids.shape, *out.shape[1:])
    full[keep] = out
    return full
