"""The rewards of a batch: the spec's functions, remote endpoints and reward models, each
times its weight, summed. Reward models are whatever scores the batch for the caller (the RL
driver passes callables that ask its reward-model roles)."""
from __future__ import annotations

from typing import Callable

import torch

from elasticrl.rewards.functions import load_function
from elasticrl.rewards.remote import RemoteReward
from elasticrl.spec import JobSpec

ModelScores = Callable[[], torch.Tensor]  # one reward model's scores of the batch, in batch order


class RewardSources:
    def __init__(self, spec: JobSpec):
        self.functions = [(load_function(f.path, f"rewards.functions[{i}].path"), f.weight)
                          for i, f in enumerate(spec.rewards.functions)]
        self.remote = [(RemoteReward(r.url, r.timeout_s, r.retries), r.weight) for r in spec.rewards.remote]

    def __call__(self, prompts: list[str], completions: list[str], answers: list,
                 models: list[tuple[ModelScores, float]] = ()) -> torch.Tensor:
        total = torch.zeros(len(completions))
        for fn, w in self.functions:
            total += w * torch.tensor([float(fn(p, c, a)) for p, c, a in zip(prompts, completions, answers)])
        for fn, w in self.remote:
            total += w * torch.tensor(fn(prompts, completions, answers))
        for score, w in models:
            total += w * score().float()
        return total
