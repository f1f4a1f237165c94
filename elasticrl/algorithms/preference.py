"""Pairwise preference losses."""
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
