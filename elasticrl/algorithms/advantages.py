"""Advantage estimators, by name (``rl.advantage`` picks one).

Conventions: B responses, T response tokens, ``mask_bt`` is 1 on real tokens. Responses of
one prompt are contiguous, ``group_size`` of them (n samples per prompt). Outcome rewards
are per response (``rewards_b``); token rewards (``token_rewards_bt``) hold the per-token
KL penalty with the outcome reward added on the last real token (the paper's "reward on
the end-of-text token" and "token-level KL"). Every estimator returns
``(advantages_bt, returns_bt)``; returns are the critic's targets (GAE) or equal the
advantages. Global whitening (REINFORCE++) is applied by the caller with statistics over
every data-parallel rank (see ``normalize.masked_whiten``).

The group estimators (grpo, dr_grpo, rloo, reinforce++_baseline) take their statistics in
float64, give a group whose rewards are all equal (to 1e-6) exactly zero, and keep the KL
penalty of ``rl.kl_mode: reward``: each token's advantage is its response's group advantage
plus the penalty from that token to the end (OpenRLHF's order; docs/algorithms.md compares
them with the peers' code term by term).
"""
from __future__ import annotations

import torch

from elasticrl.algorithms.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def last_token_rewards(rewards_b: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Place each response's outcome reward on its last real token."""
    out = torch.zeros_like(mask_bt, dtype=torch.float32)
    last = (mask_bt.cumsum(1) == mask_bt.sum(1, keepdim=True)) & (mask_bt > 0)
    out[last] = rewards_b.float()[last.nonzero()[:, 0]]
    return out


def discounted_returns(token_rewards_bt: torch.Tensor, mask_bt: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, over real tokens only: G_{t+1} is the next real token's (an
    episode's observation tokens between two turns are skipped, not a new start)."""
    returns = torch.zeros_like(token_rewards_bt)
    running = torch.zeros(token_rewards_bt.shape[0], dtype=token_rewards_bt.dtype)
    for t in reversed(range(token_rewards_bt.shape[1])):
        m = mask_bt[:, t]
        running = (token_rewards_bt[:, t] + gamma * running) * m + running * (1 - m)
        returns[:, t] = running
    return returns * mask_bt


def _groups(x_b: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards as [prompts, group_size], in float64: the mean of eight fp32 0.7s is a ulp off
    in fp32, which a zero std would blow up."""
    if group_size < 2 or x_b.shape[0] % group_size:
        raise ValueError(f"rl.samples_per_prompt: group estimators need >= 2 samples per prompt and whole "
                         f"groups, got {x_b.shape[0]} responses in groups of {group_size}")
    return x_b.double().view(-1, group_size)


def tied(g: torch.Tensor) -> torch.Tensor:
    """Per group (a row of ``_groups``): its rewards are all equal to 1e-6, so no sample is
    better than another: its advantages are 0, and dynamic sampling drops it."""
    return (g.max(1).values - g.min(1).values) <= 1e-6


def _per_token(adv_g: torch.Tensor, g: torch.Tensor, rewards_b, token_rewards_bt, mask_bt, gamma=1.0):
    """Group advantages ``adv_g`` (0 for a tied group) on every token of their response, plus
    the KL penalty still to come: the token rewards less the outcome (``-rl.kl_coef * KL`` per
    token in ``rl.kl_mode: reward``, else 0), summed from each token to the end (discounted by
    ``gamma``, rl.gamma, 1 by default)."""
    adv_b = torch.where(tied(g)[:, None], torch.zeros_like(adv_g), adv_g).view(-1)
    adv = adv_b.to(mask_bt.dtype).view(-1, 1) * mask_bt
    if token_rewards_bt is not None:
        adv = adv + discounted_returns(token_rewards_bt - last_token_rewards(rewards_b, mask_bt), mask_bt, gamma)
    return adv, adv


@ADVANTAGES.register("gae")
def gae(*, token_rewards_bt, values_bt, mask_bt, gamma=1.0, lam=0.95, **_):
    """Generalised advantage estimation (PPO with a critic).

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, with V = 0
    after the last real token; returns R_t = A_t + V_t are the critic's targets. t + 1 is the
    next real token: tokens out of the mask (padding, an episode's observations) are skipped.
    """
    values = values_bt.float() * mask_bt
    adv = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0])
    next_adv = torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask_bt[:, t]
        delta = token_rewards_bt[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * next_adv
        adv[:, t] = here * m
        next_value = values[:, t] * m + next_value * (1 - m)
        next_adv = here * m + next_adv * (1 - m)
    return adv, (adv + values) * mask_bt


@ADVANTAGES.register("reinforce++")
def reinforce_pp(*, token_rewards_bt, mask_bt, gamma=1.0, **_):
    """REINFORCE++: discounted token returns as advantages (the caller whitens them globally)."""
    returns = discounted_returns(token_rewards_bt, mask_bt, gamma)
    return returns, returns


@ADVANTAGES.register("reinforce++_baseline")
def reinforce_pp_baseline(*, rewards_b, token_rewards_bt, mask_bt, group_size, gamma=1.0, **_):
    """REINFORCE++ with the group's mean reward subtracted from each outcome reward first."""
    g = _groups(rewards_b, group_size)
    centred = torch.where(tied(g)[:, None], torch.zeros_like(g), g - g.mean(1, keepdim=True))
    shaped = token_rewards_bt - last_token_rewards(rewards_b, mask_bt) + last_token_rewards(centred.view(-1), mask_bt)
    returns = discounted_returns(shaped, mask_bt, gamma)
    return returns, returns


def overlong_penalty(lengths_b: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then falling
    linearly to ``-penalty`` at ``max_len`` (and staying there beyond)."""
    over = (lengths_b.float() - (max_len - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1)


def varying_groups(rewards_b: torch.Tensor, group_size: int) -> torch.Tensor:
    """Indices of the responses whose prompt's group has rewards that vary (DAPO's dynamic
    sampling drops the others: their group-relative advantages are all 0)."""
    keep = ~tied(rewards_b.double().view(-1, group_size))
    return keep.repeat_interleave(group_size).nonzero().flatten()


@ADVANTAGES.register("grpo")
def grpo(*, rewards_b, mask_bt, group_size, token_rewards_bt=None, gamma=1.0, eps=1e-6, **_):
    """GRPO: (r - mean of the group) / (std of the group + eps), unbiased std, every token."""
    g = _groups(rewards_b, group_size)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)
    return _per_token(adv, g, rewards_b, token_rewards_bt, mask_bt, gamma)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(*, rewards_b, mask_bt, group_size, token_rewards_bt=None, gamma=1.0, **_):
    """Dr. GRPO: r - mean of the group, no division by the std (pair with the
    ``seq_sum_norm`` loss aggregation, which also drops the length normalisation)."""
    g = _groups(rewards_b, group_size)
    return _per_token(g - g.mean(1, keepdim=True), g, rewards_b, token_rewards_bt, mask_bt, gamma)


@ADVANTAGES.register("rloo")
def rloo(*, rewards_b, mask_bt, group_size, token_rewards_bt=None, gamma=1.0, **_):
    """RLOO: r minus the mean reward of the other n-1 samples of its prompt."""
    g = _groups(rewards_b, group_size)
    loo = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    return _per_token(g - loo, g, rewards_b, token_rewards_bt, mask_bt, gamma)
