"""RL math against hand-derived values (each derivation in a comment), float-tight."""
from __future__ import annotations

import math

import pytest
import torch

from elasticrl.algorithms.advantages import ADVANTAGES, discounted_returns, last_token_rewards
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.losses import AGGREGATIONS, entropy_from_logits, policy_loss, value_loss
from elasticrl.algorithms.normalize import RunningMoments, masked_moments, masked_whiten

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_gae_by_hand():
    # r = [0, 0, 1], V = [.5, .6, .7], gamma 1, lambda .5, V after the end = 0:
    # delta2 = 1 - .7 = .3            A2 = .3
    # delta1 = .7 - .6 = .1           A1 = .1 + .5 * .3 = .25
    # delta0 = .6 - .5 = .1           A0 = .1 + .5 * .25 = .225
    # returns = A + V = [.725, .85, 1.0]; a padded 4th token gets 0 and its value is ignored.
    adv, ret = ADVANTAGES["gae"](token_rewards_bt=T([[0.0, 0, 1, 0]]), values_bt=T([[0.5, 0.6, 0.7, 9.9]]),
                                 mask_bt=T([[1.0, 1, 1, 0]]), gamma=1.0, lam=0.5)
    close(adv, [[0.225, 0.25, 0.3, 0]])
    close(ret, [[0.725, 0.85, 1.0, 0]])


def test_gae_with_discount():
    # gamma .5, lambda 1: A_t = sum_l gamma^l delta_{t+l} = G_t - V_t (Monte Carlo), r = [1, 2]:
    # G1 = 2, G0 = 1 + .5 * 2 = 2; V = [1, 1] -> A = [1, 1]
    adv, _ = ADVANTAGES["gae"](token_rewards_bt=T([[1.0, 2]]), values_bt=T([[1.0, 1]]), mask_bt=T([[1.0, 1]]),
                               gamma=0.5, lam=1.0)
    close(adv, [[1.0, 1.0]])


def test_gae_and_returns_skip_an_episodes_observation_tokens():
    # model tokens at 0, 1 and 4; 2, 3 are an observation (out of the mask), 5 padding.
    # r = [0, 0, x, x, 1, 0] (x: ignored), V = [.5, .6, 9, 9, .8, 9], gamma 1, lambda .5:
    # delta4 = 1 - .8 = .2                      A4 = .2
    # delta1 = V4 - V1 = .8 - .6 = .2           A1 = .2 + .5 * .2 = .3
    # delta0 = .6 - .5 = .1                     A0 = .1 + .5 * .3 = .25
    # returns = A + V = [.75, .9, 0, 0, 1.0, 0]; a reset at the observation would give A1 = delta1'
    # = 0 - .6 (the value after the turn taken as 0): the turns would not see each other
    mask = T([[1.0, 1, 0, 0, 1, 0]])
    adv, ret = ADVANTAGES["gae"](token_rewards_bt=T([[0.0, 0, 7, 7, 1, 0]]),
                                 values_bt=T([[0.5, 0.6, 9, 9, 0.8, 9]]), mask_bt=mask, gamma=1.0, lam=0.5)
    close(adv, [[0.25, 0.3, 0, 0, 0.2, 0]])
    close(ret, [[0.75, 0.9, 0, 0, 1.0, 0]])
    # G over model tokens, gamma .5, r = [1, 0, x, x, 2]: G4 = 2, G1 = 0 + .5 * 2 = 1, G0 = 1 + .5 = 1.5
    close(discounted_returns(T([[1.0, 0, 7, 7, 2, 0]]), mask, 0.5), [[1.5, 1.0, 0, 0, 2.0, 0]])


def test_discounted_returns_and_last_token_rewards():
    # G2 = 2, G1 = 0 + .5 * 2 = 1, G0 = 1 + .5 * 1 = 1.5
    close(discounted_returns(T([[1.0, 0, 2]]), T([[1.0, 1, 1]]), 0.5), [[1.5, 1.0, 2.0]])
    close(last_token_rewards(T([3.0, 5.0]), T([[1.0, 1, 0], [1.0, 0, 0]])), [[0, 3, 0], [5, 0, 0]])


def test_reinforce_pp_is_the_return():
    token_rewards = T([[-0.1, 0.9]])
    adv, ret = ADVANTAGES["reinforce++"](token_rewards_bt=token_rewards, mask_bt=T([[1.0, 1]]), gamma=1.0)
    close(adv, [[0.8, 0.9]])  # G1 = .9, G0 = -.1 + .9
    close(ret, adv)


def test_reinforce_pp_baseline_centres_the_outcome_in_its_group():
    # outcomes [1, 0] (one group of 2): centred [.5, -.5]; KL penalty -.1 per token;
    # shaped rewards [[-.1, .4], [-.1, -.6]] -> returns [[.3, .4], [-.7, -.6]]
    mask = T([[1.0, 1], [1.0, 1]])
    token_rewards = T([[-0.1, -0.1], [-0.1, -0.1]]) + last_token_rewards(T([1.0, 0.0]), mask)
    adv, _ = ADVANTAGES["reinforce++_baseline"](rewards_b=T([1.0, 0.0]), token_rewards_bt=token_rewards,
                                                mask_bt=mask, group_size=2, gamma=1.0)
    close(adv, [[0.3, 0.4], [-0.7, -0.6]])


def test_group_estimators():
    rewards = T([1.0, 0, 0, 1])
    mask = T([[1.0, 1]] * 4)
    # GRPO: mean .5, unbiased std sqrt(4 * .25 / 3) = 1/sqrt(3); A = +-.5 sqrt(3) = +-.866025
    adv, _ = ADVANTAGES["grpo"](rewards_b=rewards, mask_bt=mask, group_size=4)
    close(adv[:, 0], [0.5 / (1 / math.sqrt(3) + 1e-6) * s for s in (1, -1, -1, 1)])
    close(adv[:, 1], adv[:, 0])
    # Dr. GRPO: r - mean = +-.5
    close(ADVANTAGES["dr_grpo"](rewards_b=rewards, mask_bt=mask, group_size=4)[0][:, 0], [0.5, -0.5, -0.5, 0.5])
    # RLOO: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - (1+0+1)/3 = -2/3
    close(ADVANTAGES["rloo"](rewards_b=rewards, mask_bt=mask, group_size=4)[0][:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # padding stays 0
    adv, _ = ADVANTAGES["dr_grpo"](rewards_b=T([1.0, 0]), mask_bt=T([[1.0, 0], [1.0, 1]]), group_size=2)
    close(adv, [[0.5, 0], [-0.5, -0.5]])


def test_group_estimators_keep_the_kl_penalty_of_the_reward():
    """rl.kl_mode: reward: each token's advantage is its response's group advantage plus the
    penalty -beta * KL from that token to the end. One group of 2, outcomes [1, 0], 3 tokens,
    the second response 2 long; KL per token [.2, .4, .6] and [.5, 1, x], beta .1:
      penalty-to-go  row 0: -.1 * [1.2, 1.0, .6] = [-.12, -.10, -.06]
                     row 1: -.1 * [1.5, 1.0]     = [-.15, -.10, 0]
      Dr. GRPO (r - mean = +-.5):  [.38, .40, .44], [-.65, -.60, 0]
      RLOO (r - the other's r = +-1):  [.88, .90, .94], [-1.15, -1.10, 0]
      GRPO (+-.5 / (std sqrt(.5) + 1e-6)): +-.707106 plus the same penalties
    With beta 0 they are the group advantages alone (they were so whatever beta was)."""
    mask = T([[1.0, 1, 1], [1.0, 1, 0]])
    kl = T([[0.2, 0.4, 0.6], [0.5, 1.0, 0.0]])
    rewards = T([1.0, 0.0])
    token_rewards = last_token_rewards(rewards, mask) - 0.1 * kl
    kw = {"rewards_b": rewards, "token_rewards_bt": token_rewards, "mask_bt": mask, "group_size": 2}
    close(ADVANTAGES["dr_grpo"](**kw)[0], [[0.38, 0.40, 0.44], [-0.65, -0.60, 0]])
    close(ADVANTAGES["rloo"](**kw)[0], [[0.88, 0.90, 0.94], [-1.15, -1.10, 0]])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(ADVANTAGES["grpo"](**kw)[0], [[a - 0.12, a - 0.10, a - 0.06], [-a - 0.15, -a - 0.10, 0]])
    plain = dict(kw, token_rewards_bt=last_token_rewards(rewards, mask))
    close(ADVANTAGES["rloo"](**plain)[0], [[1.0, 1, 1], [-1.0, -1, 0]])


def test_k3_is_capped_at_10_and_gives_no_gradient_beyond():
    # r = log(ref/pi) = 5: exp(5) - 1 - 5 = 142.4, capped at 10 (both peers); as a loss term its
    # gradient in log pi would be exp(5) - 1 = 147.4 per token uncapped: 0 once capped. At r = 1,
    # under the cap: e - 2, gradient d/dlogpi (e^r - 1 - r) = -(e^r - 1) = -(e - 1).
    logp = T([0.0, 0.0], requires_grad=True)
    k3 = KL_ESTIMATORS["k3"](logp, T([5.0, 1.0]))
    close(k3, [10.0, math.e - 2])
    k3.sum().backward()
    close(logp.grad, [0.0, -(math.e - 1)])


def test_a_response_out_of_the_loss_counts_in_no_sequence_mean():
    # rows: token losses [1, 2, 3] (mean 2), [4, x, x] (4), a row with no token in the loss:
    # (2 + 4) / 2 = 3, not / 3 (verl and OpenRLHF exclude it)
    loss = T([[1.0, 2, 3], [4.0, 9, 9], [7.0, 7, 7]])
    mask = T([[1.0, 1, 1], [1.0, 0, 0], [0.0, 0, 0]])
    close(AGGREGATIONS["seq_mean_token_mean"](loss, mask), 3.0)


def test_group_estimators_refuse_bad_groups():
    with pytest.raises(ValueError, match="rl.samples_per_prompt"):
        ADVANTAGES["grpo"](rewards_b=T([1.0, 0, 1]), mask_bt=T([[1.0]] * 3), group_size=2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        ADVANTAGES.get_or_raise("ppo2", "rl.advantage")


def test_kl_estimators():
    # p = .5, p_ref = .25: r = log(p_ref/p) = -ln 2
    # k1 = ln 2; k2 = (ln 2)^2 / 2; k3 = e^-ln2 - 1 + ln 2 = .5 - 1 + ln 2
    lp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    close(KL_ESTIMATORS["k1"](lp, ref), [math.log(2)])
    close(KL_ESTIMATORS["k2"](lp, ref), [0.5 * math.log(2) ** 2])
    close(KL_ESTIMATORS["k3"](lp, ref), [0.5 - 1 + math.log(2)])
    close(KL_ESTIMATORS["k3"](lp, lp), [0.0])


def test_policy_loss_clipping_dual_clip_and_clip_higher():
    # token 0: ratio 1.5, A = +1 -> min(1.5, clip 1.2) = 1.2 -> loss -1.2 (clipped)
    # token 1: ratio 4,   A = -1 -> min(-4, -1.2) = -4   -> loss 4; dual clip c = 3 caps it at 3
    lp = T([[math.log(1.5), math.log(4.0)]])
    old = T([[0.0, 0.0]])
    adv = T([[1.0, -1.0]])
    mask = T([[1.0, 1.0]])
    loss, stats = policy_loss(lp, old, adv, mask)
    close(loss, (-1.2 + 4.0) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)  # token 0 only
    loss, _ = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    close(loss, (-1.2 + 3.0) / 2)
    loss, _ = policy_loss(lp, old, adv, mask, clip_high=0.28)  # clip-higher: 1.28 for A > 0
    close(loss, (-1.28 + 4.0) / 2)
    # at ratio 1 the gradient is -A (the policy-gradient estimator)
    lp1 = T([[0.0, 0.0]], requires_grad=True)
    policy_loss(lp1, old, adv, mask)[0].backward()
    close(lp1.grad, [[-0.5, 0.5]])


def test_value_loss_clipping():
    # V 1.5, V_old 1.0, R 2.0, clip .2: (1.5-2)^2 = .25, clipped V 1.2 -> (1.2-2)^2 = .64
    # -> .5 * max = .32; unclipped .5 * .25 = .125
    v, old, ret, mask = T([[1.5]]), T([[1.0]]), T([[2.0]]), T([[1.0]])
    close(value_loss(v, old, ret, mask, clip=0.2), 0.32)
    close(value_loss(v, old, ret, mask, clip=None), 0.125)


def test_entropy():
    # logits [0, 0]: uniform over 2 -> ln 2; logits [0, ln 3]: p = [.25, .75]
    close(entropy_from_logits(T([[[0.0, 0.0], [0.0, math.log(3)]]])),
          [[math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])


def test_aggregations():
    loss = T([[1.0, 2, 3], [4.0, 9, 9]])
    mask = T([[1.0, 1, 1], [1.0, 0, 0]])
    close(AGGREGATIONS["token_mean"](loss, mask), 10 / 4)
    close(AGGREGATIONS["token_mean"](loss, mask, num_tokens=T(8.0)), 10 / 8)  # global count over ranks
    close(AGGREGATIONS["seq_mean_token_mean"](loss, mask), (2 + 4) / 2)
    close(AGGREGATIONS["seq_sum_norm"](loss, mask), 10 / (2 * 3))
    close(AGGREGATIONS["seq_sum_norm"](loss, mask, norm_length=5), 10 / (2 * 5))
    # global denominators: two "ranks" each holding one response sum to the global mean
    for name, kw in (("token_mean", {"num_tokens": 4}), ("seq_mean_token_mean", {"num_seqs": 2}),
                     ("seq_sum_norm", {"num_rows": 2})):
        split = AGGREGATIONS[name](loss[:1], mask[:1], **kw) + AGGREGATIONS[name](loss[1:], mask[1:], **kw)
        close(split, AGGREGATIONS[name](loss, mask))


def test_token_weights_scale_the_policy_loss():
    # weights [.5, 2] on per-token losses [-1.2, 4] (see above): (-.6 + 8) / 2 = 3.7
    lp = T([[math.log(1.5), math.log(4.0)]])
    loss, _ = policy_loss(lp, T([[0.0, 0.0]]), T([[1.0, -1.0]]), T([[1.0, 1.0]]), token_weights_bt=T([[0.5, 2.0]]))
    close(loss, 3.7)


def test_whitening_and_global_moments():
    # [1, 2, 3] (+ a masked 100): mean 2, population var 2/3
    x, mask = T([1.0, 2, 3, 100]), T([1.0, 1, 1, 0])
    s = math.sqrt(2 / 3)
    close(masked_whiten(x, mask), [-1 / s, 0, 1 / s, 0])
    # the same from two "ranks" whose moments are summed (an all-reduce)
    moments = masked_moments(T([1.0, 2]), T([1.0, 1])) + masked_moments(T([3.0]), T([1.0]))
    close(masked_whiten(T([3.0]), T([1.0]), moments), [1 / s])


def test_running_moments_merge_batches():
    rm = RunningMoments()
    rm.update(T([1.0, 2, 3]))
    rm.update(T([4.0, 5]))
    assert rm.mean == pytest.approx(3.0, abs=1e-12) and rm.var == pytest.approx(2.0, abs=1e-12)
    close(rm.normalize(T([3.0 + math.sqrt(2)])), [1.0])
    close(rm.normalize(T([100.0]), clip=5.0), [5.0])


def test_dynamic_sampling_keeps_only_groups_whose_rewards_vary():
    from elasticrl.algorithms.advantages import varying_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5 + 1e-3])
    assert varying_groups(rewards, 2).tolist() == [2, 3, 6, 7]
    assert varying_groups(torch.zeros(6), 3).tolist() == []


def test_gspo_sequence_ratio_is_the_geometric_mean_of_the_token_ratios_clipped_as_one():
    # response 0: token log-ratios 0.2, -0.1, (pad) -> mean 0.05; response 1: 0.3 on one token
    logp = torch.tensor([[0.2, -0.1, 5.0], [0.3, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, ratio_level="sequence",
                              aggregation="seq_mean_token_mean")
    # s0 = e^0.05 (inside the clip): loss -e^0.05 A; s1 = e^0.3 > 1.2, A < 0: max(-s A, -1.2 A) = e^0.3
    assert loss.item() == pytest.approx((-math.exp(0.05) + math.exp(0.3)) / 2, abs=1e-6)
    loss.backward()
    # d/dlogp_t of -e^{mean} over response 0's two tokens: -e^0.05 / 2 each, / 2 responses; the pad: 0
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.05) / 4, -math.exp(0.05) / 4, 0.0], abs=1e-6)
    assert logp.grad[1].tolist() == pytest.approx([math.exp(0.3) / 2, 0.0, 0.0], abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.0)  # the unclipped term was the larger loss
    token, _ = policy_loss(logp.detach(), old, adv, mask, ratio_level="token", aggregation="seq_mean_token_mean")
    # per token, response 0: e^0.2 > 1.2 is clipped (A > 0), e^-0.1 is not: (-1.2 - e^-0.1) / 2; response 1 as
    # before: e^0.3. The same log-probs clip differently per token than per sequence.
    assert token.item() == pytest.approx(((-1.2 - math.exp(-0.1)) / 2 + math.exp(0.3)) / 2, abs=1e-6)


def test_overlong_penalty_falls_linearly_over_the_buffer():
    from elasticrl.algorithms.advantages import overlong_penalty

    # max 10 tokens, buffer 4: free up to 6, then -0.25 per token to -1 at 10
    got = overlong_penalty(torch.tensor([3, 6, 7, 9, 10]), max_len=10, buffer=4, penalty=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0])
    assert overlong_penalty(torch.tensor([8]), 10, 4, penalty=0.5).tolist() == pytest.approx([-0.25])


def test_importance_corrections_by_hand():
    """rl.is_correction: the engine's log-probs are the trainer's minus a known perturbation d,
    so rho = exp(d) per token. Three responses (the last token of the 2nd and 3rd is padding,
    given a huge gap that must count nowhere), thresholds [0.5, 2]:
      rho   row 0: 1, 3, 1/4     row 1: 3/2, 3/2, (pad)     row 2: 3, 3, (pad)
      tis       1, 2, 1/4               3/2, 3/2                   2, 2        (min(rho, 2))
      mis       1, 0, 0                 3/2, 3/2                   0, 0        (rho outside [.5, 2]: 0)
      seq_mask  geometric means (3/4)^(1/3) = .909, 3/2, 3: rows 0 and 1 weigh 1, row 2 leaves
    Over the 7 tokens: ratio mean 13.25 / 7; 3 above 2 (clipped); masked 0 / 4 / 2 (tis, mis,
    seq_mask); k3 per token rho - 1 - log rho."""
    from elasticrl.algorithms.correction import correction_mode, importance_weights

    old = torch.log(T([[0.5, 0.2, 0.4], [0.3, 0.6, 0.9], [0.1, 0.25, 0.9]]))  # the trainer's
    d = torch.log(T([[1.0, 3.0, 0.25], [1.5, 1.5, 1e6], [3.0, 3.0, 1e-6]]))
    behaviour = old - d  # the engine's, perturbed
    mask = T([[1.0, 1, 1], [1, 1, 0], [1, 1, 0]])
    expect = {"tis": [[1, 2, 0.25], [1.5, 1.5, 0], [2, 2, 0]],
              "mis": [[1, 0, 0], [1.5, 1.5, 0], [0, 0, 0]],
              "seq_mask": [[1, 1, 1], [1, 1, 0], [0, 0, 0]]}
    masked = {"tis": 0, "mis": 4 / 7, "seq_mask": 2 / 7, "none": 0}
    k3 = 3 * (2 - math.log(3)) + (math.log(4) - 0.75) + 2 * (0.5 - math.log(1.5))
    for mode in ("none", "tis", "mis", "seq_mask"):
        weights, stats = importance_weights(old, behaviour, mask, mode, 0.5, 2.0)
        if mode == "none":
            assert weights is None
        else:
            close(weights, expect[mode], 1e-5)
        close(stats["is/ratio_mean"], 13.25 / 7, 1e-5)
        close(stats["is/clipped_frac"], 3 / 7)
        close(stats["is/masked_frac"], masked[mode])
        close(stats["mismatch/kl"], k3 / 7, 1e-5)
    # no perturbation: every weight 1, nothing clipped or masked, no gap
    weights, stats = importance_weights(old, old.clone(), mask, "mis", 0.5, 2.0)
    close(weights, mask)
    assert stats == {"is/ratio_mean": 1.0, "is/clipped_frac": 0.0, "is/masked_frac": 0.0, "mismatch/kl": 0.0}
    # auto: truncated IS where the engine's log-probs may differ (async, GPU kernels)
    assert [correction_mode("auto", a, g) for a, g in ((False, False), (True, False), (False, True))] == \
        ["none", "tis", "tis"]
    assert correction_mode("mis", False, False) == "mis"
    with pytest.raises(ValueError, match="rl.is_correction"):
        importance_weights(old, behaviour, mask, "bogus", 0.5, 2.0)
