"""Token log-probabilities and masked reductions, shared by SFT and the RL losses."""
from __future__ import annotations

import torch

IGNORE = -100
BLOCK = 2**26  # logits (fp32 values) converted at a time by token_logprobs: 256 MB


def token_logprobs(logits_btv: torch.Tensor, labels_bt: torch.Tensor, temperature: float = 1.0,
                   aligned: bool = False) -> torch.Tensor:
    """log p(labels[t+1] | tokens[:t+1]) for every position, aligned to ``labels[:, 1:]``, under
    softmax(logits / temperature): the policy that sampled at that temperature. ``aligned``:
    ``labels[t]`` is already the token position t predicts (a sequence-parallel slice's), and
    every position is scored.

    The chosen token's logit minus the log-sum-exp over the vocabulary, taken a block of rows
    at a time: no full-vocabulary log-softmax of the whole batch is made (in fp32 it would be
    0.6 MB per token with a 150k vocabulary).

    Returns ``[B, T-1]`` fp32; positions whose label is ``IGNORE`` hold 0.
    """
    targets = labels_bt if aligned else labels_bt[:, 1:]
    safe = targets.clamp(min=0).unsqueeze(-1)
    rows = max(1, BLOCK // max(1, targets.shape[1] * logits_btv.shape[-1]))
    parts = []
    for start in range(0, logits_btv.shape[0], rows):
        z_btv = logits_btv[start:start + rows, :targets.shape[1]].float()
        if temperature != 1.0:
            z_btv = z_btv / temperature
        parts.append(z_btv.gather(-1, safe[start:start + rows]).squeeze(-1) - torch.logsumexp(z_btv, -1))
    return torch.cat(parts).masked_fill(targets == IGNORE, 0.0)


def response_mask(labels_bt: torch.Tensor) -> torch.Tensor:
    """1.0 where ``labels[:, 1:]`` is a scored token (aligned with ``token_logprobs``)."""
    return (labels_bt[:, 1:] != IGNORE).float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)
