"""Token log-probabilities and masked reductions, shared by SFT and the RL losses."""
from __future__ import annotations

import torch

IGNORE = -100


def token_logprobs(logits_btv: torch.Tensor, labels_bt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t+1] | tokens[:t+1]) for every position, aligned to ``labels[:, 1:]``, under
    softmax(logits / temperature): the policy that sampled at that temperature.

    Returns ``[B, T-1]`` fp32; positions whose label is ``IGNORE`` hold 0.
    """
    logits = logits_btv[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = labels_bt[:, 1:]
    safe = targets.clamp(min=0)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(targets == IGNORE, 0.0)


def response_mask(labels_bt: torch.Tensor) -> torch.Tensor:
    """1.0 where ``labels[:, 1:]`` is a scored token (aligned with ``token_logprobs``)."""
    return (labels_bt[:, 1:] != IGNORE).float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)
