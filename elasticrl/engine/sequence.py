"""Sequence parallelism (``train.sp_size``): DeepSpeed's Ulysses attention for Hugging Face models.

The ranks of a sequence-parallel group (``sp_size`` consecutive ranks: one data-parallel rank
between them) train on the same micro-batch, each on a contiguous slice of its positions. Every
layer runs on the slice; attention trades the slices for heads (an all-to-all), attends over the
whole length with its share of the heads, and trades back. Each rank's loss is its slice's share
of the global loss (the same global denominators as without), and DeepSpeed sums the gradients
over the group (and averages them over the data-parallel ranks), so the whole sequence's
gradients come out. A rank keeps the activations of its slice: about 1/sp_size of them.

Only the training forwards are sliced (``sliced``); scoring, generation and packed forwards in
the same processes run whole, with their masks. Rows are right-padded and attention is causal,
so the padding at a row's end changes no real token (the slices themselves carry no mask).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from elasticrl.algorithms.logprobs import IGNORE

_SLICED = [False]  # set while a training forward runs on slices


def enable(model, sp_size: int, micro_batch: int):
    """Ulysses attention for ``model``'s kernel, used inside ``sliced`` only; returns the
    process groups DeepSpeed takes (``deepspeed.initialize(mpu=...)``). A second model in the
    process (of the same architecture) takes the groups and the attention already set up."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation == "eager":  # Ulysses needs a kernel that masks causally by itself
        model.set_attn_implementation("sdpa")
    if groups._SEQUENCE_PARALLEL_GROUP is not None:
        return groups
    kernel = model.config._attn_implementation
    whole = ALL_ATTENTION_FUNCTIONS[kernel]
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, kernel, sp_size, micro_batch,
                                                          seq_length_is_variable=True)
    ulysses = ALL_ATTENTION_FUNCTIONS[kernel]

    def attention(*args, **kwargs):
        return (ulysses if _SLICED[0] else whole)(*args, **kwargs)
    ALL_ATTENTION_FUNCTIONS[kernel] = attention
    return mpu


@contextlib.contextmanager
def sliced(on: bool = True):
    """Forwards inside run on sequence-parallel slices (``on``) or whole."""
    before, _SLICED[0] = _SLICED[0], on
    try:
        yield
    finally:
        _SLICED[0] = before


def slice_rows(mb, rank: int, size: int):
    """This rank's slice of a micro-batch's positions (an ``Experience``) and their position ids:
    the rows padded to a multiple of ``size`` and cut into ``size`` runs; the shifted per-token
    tensors at the same positions, and ``labels`` aligned to them (position t holds the token
    t + 1 it predicts, the next slice's first at a slice's end: ``token_logprobs(aligned=True)``)."""
    import dataclasses

    length = mb.input_ids.shape[1]
    width = -(-length // size) * size
    n = width // size
    start = rank * n

    def cut(t: torch.Tensor, fill) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=fill)[:, start:start + n]

    out = {k: cut(v, 0) for k, v in mb.tensors().items() if k not in ("input_ids", "attention_mask", "labels")}
    out.update(input_ids=cut(mb.input_ids, 0), attention_mask=cut(mb.attention_mask, 0),
               labels=cut(mb.labels[:, 1:], IGNORE))
    positions = torch.arange(start, start + n, device=mb.input_ids.device).expand(mb.input_ids.shape[0], n)
    return dataclasses.replace(mb, **out), positions
