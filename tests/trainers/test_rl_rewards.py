"""How the RL step uses a batch's scores when samples are dropped (rewards.on_error: drop_sample) or run
long, and the long tail of its response lengths."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from elasticrl.rewards.sources import Scores
from elasticrl.rollout.sample import Sample
from elasticrl.spec import load_spec
from elasticrl.trainers.experience import Step, _drop


def test_a_dropped_sample_leaves_the_loss_and_takes_its_groups_mean():
    spec = load_spec({"algorithm": "grpo", "rl": {"samples_per_prompt": 4}})
    mask = torch.ones(8, 3, dtype=torch.long)
    s = Step(step=0, indices=[0, 1], results=[], batch=SimpleNamespace(response_mask=mask))
    keep = torch.tensor([True, True, False, True, False, False, False, False])
    total = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    out = _drop(SimpleNamespace(spec=spec), s, Scores(total, keep))
    # group 1: the kept (1, 0, 1) have mean 2/3, the dropped one takes it; group 2: all dropped, 0
    assert torch.allclose(out, torch.tensor([1.0, 0.0, 2 / 3, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert mask.sum(1).tolist() == [3, 3, 0, 3, 0, 0, 0, 0]


def test_overlong_responses_are_punished_softly_and_filtered_from_the_loss():
    from elasticrl.trainers.experience import _overlong

    spec = load_spec({"algorithm": "grpo", "rl": {"samples_per_prompt": 2, "max_new_tokens": 8,
                                                  "overlong_buffer": 4, "overlong_filter": True}})
    results = [Sample(0, [1] * n, [0.0] * n, "", why, 0) for n, why in ((3, "stop"), (6, "stop"), (8, "length"),
                                                                         (8, "stop"))]
    mask = torch.ones(4, 8, dtype=torch.long)
    s = Step(step=0, indices=[0, 1], results=results, batch=SimpleNamespace(response_mask=mask))
    out = _overlong(SimpleNamespace(spec=spec), s, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    # free up to 4 tokens: 3 -> 0, 6 -> -0.5, 8 -> -1 (cut or not)
    assert out.tolist() == [1.0, 0.5, 0.0, -1.0]
    # only the response cut at the limit (finish_reason 'length') leaves the loss
    assert mask.sum(1).tolist() == [8, 8, 0, 8] and s.info["rl/truncated"] == 0.25


def test_the_long_tail_of_response_lengths_is_reported():
    """Lengths 1, 2, 3, 4, 100: mean 22, median 3, 90th percentile at rank 0.9 x 4 = 3.6 between 4
    and 100 (4 + 0.6 x 96 = 61.6), longest 100; one sample is all four."""
    from elasticrl.trainers.experience import length_stats

    stats = length_stats([1, 2, 3, 4, 100])
    assert {k.rsplit("/", 1)[1]: round(v, 6) for k, v in stats.items()} == {"mean": 22.0, "p50": 3.0, "p90": 61.6,
                                                                            "max": 100.0}
    assert set(length_stats([7]).values()) == {7.0}
