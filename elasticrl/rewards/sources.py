"""The rewards of a batch: the spec's functions, remote endpoints and reward models, each
times its weight, summed."""
from __future__ import annotations

import torch

from elasticrl.cluster.group import gather_rows
from elasticrl.rewards.functions import load_function
from elasticrl.rewards.remote import RemoteReward
from elasticrl.spec import JobSpec


class RewardSources:
    def __init__(self, spec: JobSpec):
        self.functions = [(load_function(f.path, f"rewards.functions[{i}].path"), f.weight)
                          for i, f in enumerate(spec.rewards.functions)]
        self.remote = [(RemoteReward(r.url, r.timeout_s, r.retries), r.weight) for r in spec.rewards.remote]

    def __call__(self, prompts: list[str], completions: list[str], answers: list, batch_ref, models) -> torch.Tensor:
        total = torch.zeros(len(completions))
        for fn, w in self.functions:
            total += w * torch.tensor([float(fn(p, c, a)) for p, c, a in zip(prompts, completions, answers)])
        for fn, w in self.remote:
            total += w * torch.tensor(fn(prompts, completions, answers))
        for group, w in models:
            total += w * gather_rows(group.call("score", batch_ref), "values").float()
        return total
