"""How the RL step uses a batch's scores when samples are dropped (rewards.on_error: drop_sample)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from elasticrl.rewards.sources import Scores
from elasticrl.spec import load_spec
from elasticrl.trainers.rl import Step, _drop


def test_a_dropped_sample_leaves_the_loss_and_takes_its_groups_mean():
    spec = load_spec({"algorithm": "grpo", "rl": {"samples_per_prompt": 4}})
    mask = torch.ones(8, 3, dtype=torch.long)
    s = Step(step=0, indices=[0, 1], results=[], batch={"response_mask": mask})
    keep = torch.tensor([True, True, False, True, False, False, False, False])
    total = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    out = _drop(SimpleNamespace(spec=spec), s, Scores(total, keep))
    # group 1: the kept (1, 0, 1) have mean 2/3, the dropped one takes it; group 2: all dropped, 0
    assert torch.allclose(out, torch.tensor([1.0, 0.0, 2 / 3, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert mask.sum(1).tolist() == [3, 3, 0, 3, 0, 0, 0, 0]
