"""The estimators, KL terms, losses and aggregations against the peers' definitions (OpenRLHF's
experience maker and loss code, verl's ``core_algos``), rewritten here from their formulas in
float64, on random ragged batches with tied groups (all right, all wrong, all at 0.7) and
extreme log-ratios. Where a peer defines a thing differently, the test states the relation
(docs/algorithms.md says why)."""
from __future__ import annotations

import math

import pytest
import torch

from elasticrl.algorithms.advantages import ADVANTAGES, last_token_rewards
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.losses import AGGREGATIONS, policy_loss
from elasticrl.algorithms.normalize import masked_whiten

N, GROUPS, T = 4, 6, 7  # samples per prompt, prompts, response width


def _batch(seed: int):
    """Ragged right-padded masks (1..T tokens), rewards with tied groups, per-token KL terms."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N * GROUPS,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    rewards = torch.rand(N * GROUPS, generator=g, dtype=torch.float64)
    rewards[:N] = 1.0             # all right
    rewards[N:2 * N] = 0.0        # all wrong
    rewards[2 * N:3 * N] = 0.7    # all equal, not exactly representable
    rewards[3 * N:4 * N] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    kl = torch.randn(N * GROUPS, T, generator=g, dtype=torch.float64) * 0.3 * mask
    return rewards, mask, kl


# --- the peers, from their formulas -------------------------------------------------------------

def openrlhf_group(rewards, mask, kl, beta, estimator):
    """OpenRLHF: shape the outcome in its group, put it on the last token, add -beta * KL per token,
    and take the undiscounted return from each token as the advantage."""
    r = rewards.view(-1, N)
    if estimator == "rloo":
        r = r - (r.sum(-1, keepdim=True) - r) / (N - 1)
    elif estimator in ("reinforce++_baseline", "dr_grpo"):
        r = r - r.mean(-1, keepdim=True)
    else:  # group_norm
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)
    last = mask.size(1) - 1 - mask.long().fliplr().argmax(1, keepdim=True)
    reward = torch.zeros_like(kl).scatter_(1, last, r.reshape(-1, 1)) - beta * kl
    returns = torch.zeros_like(reward)
    running = torch.zeros(reward.size(0), dtype=reward.dtype)
    for t in reversed(range(reward.size(1))):
        running = (mask * reward)[:, t] + running
        returns[:, t] = running
    return returns * mask


def openrlhf_whiten(adv, mask):
    mean = (adv * mask).sum() / mask.sum()
    var = ((adv - mean) ** 2 * mask).sum() / mask.sum()
    return (adv - mean) * var.clamp(min=1e-8).rsqrt() * mask


def verl_group(rewards, mask, estimator):
    """verl (no KL in the reward): the outcome score shaped in its group, the same on every token."""
    r = rewards.view(-1, N)
    if estimator == "grpo":
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    elif estimator == "rloo":
        r = r * N / (N - 1) - r.mean(-1, keepdim=True) * N / (N - 1)
    else:
        r = r - r.mean(-1, keepdim=True)
    return r.reshape(-1, 1) * mask


def verl_whiten(x, mask):  # Bessel-corrected variance, epsilon in the root
    mean = (x * mask).sum() / mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def ours(name, rewards, mask, kl, beta):
    token_rewards = last_token_rewards(rewards, mask).double() - beta * kl
    adv, _ = ADVANTAGES[name](rewards_b=rewards, token_rewards_bt=token_rewards, mask_bt=mask, group_size=N)
    return adv


# --- the comparisons ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce++_baseline"])
def test_group_estimators_match_openrlhf_with_the_kl_penalty_and_verl_without(name, seed):
    rewards, mask, kl = _batch(seed)
    for beta in (0.0, 0.05):
        want = openrlhf_group(rewards, mask, kl, beta, name)
        got = ours(name, rewards, mask, kl, beta)
        if name == "reinforce++_baseline":  # both whiten over the batch's tokens
            want, got = openrlhf_whiten(want, mask), masked_whiten(got, mask)
        # our eps 1e-6 against OpenRLHF's 1e-9 in the std's denominator (std ~0.5): relative 2e-6
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # verl, without a KL in the reward: the same advantages (reinforce++_baseline: but for the
    # Bessel factor of verl's variance, over the batch's n tokens)
    got = ours(name, rewards, mask, kl, 0.0)
    want = verl_group(rewards, mask, name)
    if name == "reinforce++_baseline":
        n = mask.sum()
        got, want = masked_whiten(got, mask) * torch.sqrt((n - 1) / n), verl_whiten(want, mask)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    # the tied groups (the first three) score exactly 0 before any whitening: no sample is better
    assert ours(name, rewards, mask, kl, 0.0)[: 3 * N].abs().max() == 0


def test_gae_matches_openrlhf_on_ragged_batches():
    rewards, mask, kl = _batch(3)
    g = torch.Generator().manual_seed(3)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    token_rewards = last_token_rewards(rewards, mask).double() - 0.05 * kl
    gamma, lam = 0.99, 0.9
    v, r = values * mask, token_rewards * mask  # OpenRLHF's loop, right-padded responses
    last, advs = torch.zeros(mask.shape[0], dtype=torch.float64), []
    for t in reversed(range(T)):
        nxt = v[:, t + 1] if t < T - 1 else 0.0
        last = r[:, t] + gamma * nxt - v[:, t] + gamma * lam * last
        advs.append(last)
    want = torch.stack(advs[::-1], 1) * mask
    adv, ret = ADVANTAGES["gae"](token_rewards_bt=token_rewards, values_bt=values, mask_bt=mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret.double(), (want + v) * mask, atol=1e-6, rtol=0)


def test_kl_estimators_match_the_peers_at_extreme_log_ratios():
    """k1 and k2 as both peers; k3 as both: exp(r) - 1 - r with r = log(ref / pi) clamped to
    +-20 (verl) and the value capped at 10 (both)."""
    logp = torch.zeros(81, dtype=torch.float64)
    ref = torch.linspace(-30, 30, 81, dtype=torch.float64)
    r = (ref - logp).clamp(-20, 20)
    torch.testing.assert_close(KL_ESTIMATORS["k1"](logp, ref), logp - ref)
    torch.testing.assert_close(KL_ESTIMATORS["k2"](logp, ref), 0.5 * (logp - ref) ** 2)
    torch.testing.assert_close(KL_ESTIMATORS["k3"](logp, ref), (r.exp() - 1 - r).clamp(-10, 10))


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_openrlhf_token_by_token(dual_clip):
    """OpenRLHF's PolicyLoss ('ppo'), token-mean over a global token count, clip-higher on."""
    _, mask, kl = _batch(4)
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.5
    old = logp + kl  # ratios from e^-1 to e^1 and beyond
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ratio = (logp - old).clamp(-20, 20).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv
    clip1 = torch.min(surr1, surr2)
    loss_bt = -clip1 if dual_clip is None else -torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
    want = (loss_bt * mask).sum() / 40.0
    got, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, num_tokens=40.0)
    assert got.item() == pytest.approx(want.item(), abs=1e-12)


def test_aggregations_match_verl_and_dr_grpo():
    """token_mean and seq_mean_token_mean as verl's agg_loss (a fully masked response counts in
    neither sum, as in verl and OpenRLHF); seq_sum_norm as Dr. GRPO's code, token sum / (rows x
    the generation budget), where verl's seq-mean-token-sum-norm divides by the budget alone."""
    _, mask, kl = _batch(5)
    mask[2] = 0  # a response out of the loss (overlong-filtered)
    loss = kl.abs()
    tokens = mask.sum(-1)
    assert AGGREGATIONS["token_mean"](loss, mask).item() == pytest.approx(((loss * mask).sum() / mask.sum()).item())
    per_seq = (loss * mask).sum(-1) / (tokens + 1e-8)
    want = (per_seq * (tokens > 0)).sum() / (tokens > 0).sum()
    assert AGGREGATIONS["seq_mean_token_mean"](loss, mask).item() == pytest.approx(want.item(), abs=1e-7)
    budget = 16
    assert AGGREGATIONS["seq_sum_norm"](loss, mask, norm_length=budget).item() == pytest.approx(
        ((loss * mask).sum() / (mask.shape[0] * budget)).item(), abs=1e-12)
    verl = (loss * mask).sum() / budget
    assert AGGREGATIONS["seq_sum_norm"](loss, mask, norm_length=budget).item() == pytest.approx(
        verl.item() / mask.shape[0], abs=1e-12)


def test_whitening_a_batch_of_tied_fp32_rewards_stays_near_zero():
    """REINFORCE++-baseline where every group is tied (all right, all wrong, all at 0.7, fp32):
    the centred returns are 0 or fp32 noise, and whitening must not blow the noise up (the
    epsilon inside the root, as in both peers: under 4e-4 there; it was +-1.1 here with the
    epsilon outside)."""
    rewards = torch.tensor([1.0] * 8 + [0.0] * 8 + [0.7] * 8 + [0.7] * 8, dtype=torch.float32)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4] * 8)[:, None]).float()
    adv, _ = ADVANTAGES["reinforce++_baseline"](rewards_b=rewards, token_rewards_bt=last_token_rewards(rewards, mask),
                                                mask_bt=mask, group_size=8)
    assert masked_whiten(adv, mask).abs().max() < 4e-4
    # fp32 noise alone (1e-8 per token, mean 0): the old (x - mean) / (std + 1e-8) gave +-1
    noise = torch.tensor([1e-8, -1e-8] * 16, dtype=torch.float32)[:, None] * mask
    assert masked_whiten(noise, mask).abs().max() < 1e-3
    # a real spread is whitened as before: population std of [0, 1] is 1/2 -> +-1 (to 1e-8 / var)
    close = masked_whiten(torch.tensor([0.0, 1.0]), torch.ones(2))
    assert close.tolist() == pytest.approx([-1.0, 1.0], abs=1e-7)


def test_a_tied_group_of_inexact_rewards_gets_exactly_zero_advantage():
    """Eight fp32 rewards of 0.7: their fp32 mean is a ulp off (|r - mean| ~6e-8) and their std
    about as small, so (r - mean) / (std + 1e-6) was ~0.06; the group is tied: 0, in every
    group estimator, while a neighbour group that varies is unchanged."""
    rewards = torch.tensor([0.7] * 8 + [1.0, 0.0] * 4, dtype=torch.float32)
    mask = torch.ones(16, 3)
    for name in ("grpo", "dr_grpo", "rloo"):
        adv, _ = ADVANTAGES[name](rewards_b=rewards, mask_bt=mask, group_size=8)
        assert adv[:8].abs().max().item() == 0.0, name
    adv, _ = ADVANTAGES["grpo"](rewards_b=rewards, mask_bt=mask, group_size=8)
    # the varying group: mean .5, unbiased std sqrt(8 * .25 / 7); A = +-.5 / that
    assert adv[8:, 0].tolist() == pytest.approx([0.5 / (math.sqrt(2 / 7) + 1e-6) * s for s in [1, -1] * 4], abs=1e-6)
