"""Reward-model and preference losses."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_b: torch.Tensor, rejected_b: torch.Tensor, margin_b=None) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected - margin), mean over pairs (InstructGPT's RM loss,
    with Llama 2's optional margin)."""
    diff = chosen_b.float() - rejected_b.float()
    if margin_b is not None:
        diff = diff - margin_b
    return -F.logsigmoid(diff).mean()


def process_reward_loss(values_bt: torch.Tensor, markers_bt: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the scalar head's logit at each step-marker token against the
    step's label (1 = still on track, 0 = wrong; soft labels in between, as Math-Shepherd's
    estimated ones), mean over the markers. ``markers_bt`` is True at marker positions;
    ``labels_bt`` holds the labels there (anything elsewhere)."""
    return F.binary_cross_entropy_with_logits(values_bt[markers_bt].float(), labels_bt[markers_bt].float())


def dpo_loss(policy_chosen_b: torch.Tensor, policy_rejected_b: torch.Tensor, ref_chosen_b: torch.Tensor,
             ref_rejected_b: torch.Tensor, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0,
             nll_coef: float = 0.0, chosen_tokens_b=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the implicit rewards ``beta * (log pi - log ref)`` of each side.

    Inputs are summed log-probabilities of each response. With h = (pi_c - ref_c) - (pi_r - ref_r):
      sigmoid (DPO, Rafailov et al.): -(1-e) log s(beta h) - e log s(-beta h); e > 0 is
        conservative DPO (labels flipped with probability e);
      ipo (Azar et al.): (h - 1/(2 beta))^2.
    ``nll_coef`` > 0 adds the chosen response's per-token negative log-likelihood,
    -pi_c / chosen_tokens, times the coefficient (iterative reasoning preference optimisation,
    Pang et al. 2024), which keeps DPO from lowering the chosen answers' probability.
    """
    h = (policy_chosen_b.float() - ref_chosen_b.float()) - (policy_rejected_b.float() - ref_rejected_b.float())
    if kind == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss: unknown kind {kind!r}; expected 'sigmoid' or 'ipo'")
    if nll_coef:
        loss = loss - nll_coef * policy_chosen_b.float() / chosen_tokens_b.float().clamp(min=1)
    chosen_reward = beta * (policy_chosen_b.float() - ref_chosen_b.float()).detach()
    rejected_reward = beta * (policy_rejected_b.float() - ref_rejected_b.float()).detach()
    return loss, chosen_reward, rejected_reward


def kto_loss(policy_b: torch.Tensor, ref_b: torch.Tensor, desirable_b: torch.Tensor, kl_ref: torch.Tensor,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-example KTO losses (Ethayarajh et al.) on unpaired responses.

    r = log pi - log ref of each response; ``kl_ref`` is the reference point z0, an estimate of
    KL(pi || ref) (the caller takes it from mismatched prompt/response pairs, clamps it at 0 and
    detaches it). Desirable: w_d (1 - s(beta (r - z0))); undesirable: w_u (1 - s(beta (z0 - r))).
    """
    r = policy_b.float() - ref_b.float()
    z0 = kl_ref.float().detach()
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable_b.bool(), good, bad)
