"""Preference losses against hand-derived values (each derivation in a comment), float-tight."""
from __future__ import annotations

import math

import pytest
import torch

from elasticrl.algorithms.preference import bradley_terry_loss, dpo_loss, kto_loss, process_reward_loss

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_bradley_terry_with_and_without_margin():
    # diff 1 -> log(1 + e^-1) = 0.313261687518; with margin 1, diff 0 -> log 2
    close(bradley_terry_loss(T([2.0]), T([1.0])), math.log1p(math.exp(-1)))
    close(bradley_terry_loss(T([2.0]), T([1.0]), T([1.0])), math.log(2))


def test_process_reward_loss_reads_only_the_markers():
    # markers at (0,1) logit 0 label 1: log 2; (0,3) logit ln 3 label 1: -log(3/4) = log(4/3);
    # (1,2) logit ln 3 label 0: -log(1/4) = log 4; (1,0) logit 0 soft label 0.25: log 2 again.
    # Mean: (2 log 2 + log(4/3) + log 4) / 4 = (6 log 2 - log 3) / 4 = 0.765068... The 99s are
    # not markers and must not count.
    ln3 = math.log(3)
    values = T([[99.0, 0.0, 99.0, ln3], [0.0, 99.0, ln3, 99.0]], requires_grad=True)
    markers = T([[False, True, False, True], [True, False, True, False]])
    labels = T([[9.0, 1.0, 9.0, 1.0], [0.25, 9.0, 0.0, 9.0]])
    loss = process_reward_loss(values, markers, labels)
    close(loss, (6 * math.log(2) - ln3) / 4)
    loss.backward()
    # d/dx BCE = (sigmoid(x) - y) / 4 at markers, 0 elsewhere
    close(values.grad, T([[0.0, -0.5 / 4, 0.0, -0.25 / 4], [0.25 / 4, 0.0, 0.75 / 4, 0.0]]))


def test_dpo_sigmoid_conservative_and_ipo():
    # pi_c=-1, ref_c=-2, pi_r=-3, ref_r=-2: h = (1) - (-1) = 2; beta 0.5 -> beta*h = 1
    pc, rc, pr, rr = T([-1.0]), T([-2.0]), T([-3.0]), T([-2.0])
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.5)
    close(loss, [math.log1p(math.exp(-1))])  # -log s(1) = 0.313261687518
    close(cr, [0.5])  # beta (pi_c - ref_c)
    close(rj, [-0.5])
    # cDPO, e = 0.1: 0.9 log(1+e^-1) + 0.1 log(1+e) = log(1+e^-1) + 0.1 (since log(1+e) - log(1+e^-1) = 1)
    close(dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)[0], [math.log1p(math.exp(-1)) + 0.1])
    # IPO: (h - 1/(2 beta))^2 = (2 - 1)^2 = 1 at beta 0.5, (2 - 2)^2 = 0 at beta 0.25
    close(dpo_loss(pc, pr, rc, rr, beta=0.5, kind="ipo")[0], [1.0])
    close(dpo_loss(pc, pr, rc, rr, beta=0.25, kind="ipo")[0], [0.0])
    # + NLL of the chosen per token: -(-1) / 2 tokens = 0.5, times coefficient 2 -> + 1.0
    close(dpo_loss(pc, pr, rc, rr, beta=0.5, nll_coef=2.0, chosen_tokens_b=T([2.0]))[0],
          [math.log1p(math.exp(-1)) + 1.0])
    with pytest.raises(ValueError, match="unknown kind 'hinge'"):
        dpo_loss(pc, pr, rc, rr, beta=0.5, kind="hinge")


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = T([-1.0], requires_grad=True), T([-3.0], requires_grad=True)
    dpo_loss(pc, pr, T([-2.0]), T([-2.0]), beta=0.5)[0].sum().backward()
    # d/dpc [-log s(beta h)] = -beta (1 - s(beta h)) = -0.5 (1 - s(1)) = -0.134470710
    close(pc.grad, [-0.5 * (1 - 1 / (1 + math.exp(-1)))])
    close(pr.grad, [0.5 * (1 - 1 / (1 + math.exp(-1)))])


def test_kto_desirable_and_undesirable_around_the_reference_point():
    # r = pi - ref = -1 - (-2) = 1, z0 = 0.5, beta = 2:
    #   desirable 1 - s(2 (1 - 0.5)) = 1 - s(1) = 0.268941421
    #   undesirable, weight 1.5: 1.5 (1 - s(2 (0.5 - 1))) = 1.5 (1 - s(-1)) = 1.5 * 0.731058579
    out = kto_loss(T([-1.0, -1.0]), T([-2.0, -2.0]), T([True, False]), T(0.5), beta=2.0, undesirable_weight=1.5)
    s1 = 1 / (1 + math.exp(-1))
    close(out, [1 - s1, 1.5 * s1])
    # z0 is a constant of the loss: no gradient reaches it
    z0 = T(0.5, requires_grad=True)
    policy = T([-1.0], requires_grad=True)
    kto_loss(policy, T([-2.0]), T([True]), z0, beta=2.0).sum().backward()
    assert policy.grad is not None
    assert z0.grad is None
