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
