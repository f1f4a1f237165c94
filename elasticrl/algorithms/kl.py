"""KL estimators between the policy and the reference, per token (Schulman's k1/k2/k3).

With r = log pi_ref(a) - log pi(a) for a sampled from pi:
  k1 = -r                  (unbiased, can be negative)
  k2 = r^2 / 2             (biased, low variance)
  k3 = exp(r) - 1 - r      (unbiased, never negative; capped at 10)
Used as a penalty in the reward (``rl.kl_mode: reward``) or as a loss term (``loss``).
"""
from __future__ import annotations

import torch

from elasticrl.algorithms.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
K3_CAP = 10.0


@KL_ESTIMATORS.register("k1")
def k1(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor) -> torch.Tensor:
    return logprobs_bt - ref_logprobs_bt


@KL_ESTIMATORS.register("k2")
def k2(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs_bt - ref_logprobs_bt) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor) -> torch.Tensor:
    """Its value capped at 10 (as verl and OpenRLHF cap it): past log(ref/pi) = 2.6 a token's
    exp(r) would dominate the penalty and, as a loss, its gradient (-147 at r = 5); capped,
    such a token adds 10 and no gradient."""
    log_ratio = (ref_logprobs_bt - logprobs_bt).clamp(-20, 20)  # exp overflows beyond
    return (torch.exp(log_ratio) - 1 - log_ratio).clamp(max=K3_CAP)
