"""Correction for tokens the trained policy did not sample (``rl.is_correction``).

The engine samples token t with log-prob b_t (its own kernels, perhaps older weights); the
update treats the policy before it as the proximal one, with log-prob o_t. Their ratio
rho_t = exp(o_t - b_t) weighs the token's clipped surrogate (decoupled PPO: the clip is
around the proximal policy, the weight corrects for the behaviour one):
  tis       w_t = min(rho_t, high)                       (token-level truncated IS)
  mis       w_t = rho_t if low <= rho_t <= high, else 0  (masked IS; the token still counts in a
                                                         token mean's denominator)
  seq_mask  w_t = 1, or 0 on every token of a response whose geometric-mean ratio
            exp(mean_t log rho_t) lies outside [low, high] (a length-fair sequence test)
  none      w_t = 1
Reported whatever the mode, over the tokens in the loss: ``is/ratio_mean``, ``is/clipped_frac``
(rho_t > high), ``is/masked_frac`` (weight 0 by the mode) and ``mismatch/kl`` (k3 estimate of
KL(behaviour || proximal), the engine-trainer gap).
"""
from __future__ import annotations

import torch

from elasticrl.algorithms.kl import k3


def correction_mode(mode: str, off_policy: bool, gpu: bool) -> str:
    """``auto``: tis where the engine's log-probs may differ from the trainer's (async rollouts,
    or GPU kernels); none in a synchronous run on a CPU, whose acid test shows no gap."""
    if mode != "auto":
        return mode
    return "tis" if off_policy or gpu else "none"


def importance_weights(old_bt: torch.Tensor, behaviour_bt: torch.Tensor, mask_bt: torch.Tensor, mode: str,
                       low: float, high: float) -> tuple[torch.Tensor | None, dict]:
    """Per-token weights of the loss (None for ``none``) and the figures above."""
    mask = mask_bt.bool()
    log_rho = (old_bt.detach().float() - behaviour_bt.float()).clamp(-20, 20) * mask
    rho = torch.exp(log_rho)
    if mode == "tis":
        weights = rho.clamp(max=high)
    elif mode == "mis":
        weights = torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))
    elif mode == "seq_mask":
        geo = torch.exp(log_rho.sum(1) / mask.sum(1).clamp(min=1))
        weights = ((geo >= low) & (geo <= high)).float()[:, None].expand_as(rho)
    elif mode == "none":
        weights = None
    else:
        raise ValueError(f"rl.is_correction: unknown mode {mode!r}")  # (the spec's Literal lists them)
    n = mask.sum().clamp(min=1)
    stats = {"is/ratio_mean": (rho * mask).sum().item() / n.item(),
             "is/clipped_frac": ((rho > high) & mask).sum().item() / n.item(),
             "is/masked_frac": 0.0 if weights is None else ((weights == 0) & mask).sum().item() / n.item(),
             "mismatch/kl": (k3(behaviour_bt.float(), old_bt.detach().float()) * mask).sum().item() / n.item()}
    return (None if weights is None else weights * mask), stats
