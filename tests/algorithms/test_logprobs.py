"""Token log-probabilities and masks against hand computations."""
from __future__ import annotations

import math

import pytest
import torch

from elasticrl.algorithms.logprobs import masked_mean, response_mask, token_logprobs


def test_token_logprobs_against_a_hand_computation():
    # Vocabulary of 3; logits chosen so softmax is easy: [0, ln 2, ln 3] -> probs [1/6, 2/6, 3/6].
    row = torch.tensor([0.0, math.log(2), math.log(3)])
    logits = row.repeat(1, 4, 1)  # [B=1, T=4, V=3]
    labels = torch.tensor([[-100, 2, 1, -100]])
    lp = token_logprobs(logits, labels)
    assert lp.shape == (1, 3)
    torch.testing.assert_close(lp, torch.tensor([[math.log(3 / 6), math.log(2 / 6), 0.0]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(response_mask(labels), torch.tensor([[1.0, 1.0, 0.0]]))
    # mean over the two scored tokens: (ln .5 + ln 1/3) / 2
    assert masked_mean(lp, response_mask(labels)).item() == pytest.approx((math.log(0.5) + math.log(1 / 3)) / 2)


def test_token_logprobs_at_a_temperature():
    # logits [0, ln 2, ln 4] at T = 0.5 are [0, 2 ln 2, 4 ln 2] = ln [1, 4, 16]: probs [1, 4, 16] / 21
    row = torch.tensor([0.0, math.log(2), math.log(4)])
    logits = row.repeat(1, 3, 1)
    labels = torch.tensor([[-100, 2, 0]])
    lp = token_logprobs(logits, labels, temperature=0.5)
    torch.testing.assert_close(lp, torch.tensor([[math.log(16 / 21), math.log(1 / 21)]]), atol=1e-6, rtol=0)
    # T = 1 is the plain log-softmax: [1, 2, 4] / 7
    torch.testing.assert_close(token_logprobs(logits, labels), torch.tensor([[math.log(4 / 7), math.log(1 / 7)]]),
                               atol=1e-6, rtol=0)


def test_token_logprobs_block_by_block_equal_the_log_softmax(monkeypatch):
    from elasticrl.algorithms import logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 2] = -100
    whole = token_logprobs(logits, labels, temperature=0.7)
    # an independent formula: the log-softmax of the tempered logits at the labels
    ref = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref = ref.masked_fill(labels[:, 1:] == -100, 0.0)
    torch.testing.assert_close(whole, ref, atol=1e-6, rtol=0)
    monkeypatch.setattr(logprobs, "BLOCK", 4 * 7)  # one row (4 positions x 7 logits) per block: 3 blocks
    blocked = token_logprobs(logits, labels, temperature=0.7)
    torch.testing.assert_close(blocked, ref, atol=1e-6, rtol=0)
    # gradients flow through the blocks as through the whole
    (g_blocked,) = torch.autograd.grad(blocked.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_blocked, g_ref, atol=1e-6, rtol=0)
