"""Reward and advantage normalisation.

``masked_moments`` gives (sum, sum of squares, count) that a caller can all-reduce over
data-parallel ranks before ``masked_whiten``: the paper's "distributed advantage
normalisation with global statistics".
"""
from __future__ import annotations

import torch


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.double()
    m = mask.double()
    return torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()])


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | None = None,
                  eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries (population variance), from ``moments``
    if given. The epsilon is inside the root, as in verl and OpenRLHF: a batch whose values
    are all tied up to fp32 noise (var ~1e-15) stays ~0 instead of being blown up to +-1."""
    s, ss, n = (moments if moments is not None else masked_moments(x, mask)).tolist()
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    out = ((x.double() - mean) if shift_mean else x.double()) / (var + eps) ** 0.5
    return (out * mask).to(x.dtype)


class RunningMoments:
    """Running mean/std of rewards across steps (reward normalisation), merged per batch."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: torch.Tensor) -> None:
        x = x.double().flatten()
        n = x.numel()
        if n == 0:
            return
        b_mean, b_var = x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta ** 2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def normalize(self, x: torch.Tensor, clip: float | None = None, eps: float = 1e-8) -> torch.Tensor:
        out = (x - self.mean) / (self.var ** 0.5 + eps)
        return out.clamp(-clip, clip) if clip else out

    def state(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}
