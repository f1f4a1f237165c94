"""What rollouts sample with: every sampling setting of the spec, one seed rule."""
from __future__ import annotations

from elasticrl.rollout.pool import rollout_seed, sampling_params
from elasticrl.spec import load_spec


def test_sampling_params_carry_every_rollout_setting_and_the_step_seed():
    spec = load_spec({"algorithm": "rejection_sampling", "seed": 7, "rl": {
        "samples_per_prompt": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 12}})
    # step 4's seed: 7 + (4 + 1) x 1_000_003
    assert sampling_params(spec, 4) == {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 12,
                                        "seed": 5_000_022}
    assert rollout_seed(7, 4) == 5_000_022
    # evaluation: the run's own seed, its own length
    assert sampling_params(spec, None, 6) == {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 6,
                                              "seed": 7}
    assert "top_k" not in sampling_params(load_spec({}), 0)  # 0 disables it: vLLM's default then


def test_stop_strings_reach_rollouts():
    spec = load_spec({}, ['rl.stop=["\\n", "="]'])
    assert sampling_params(spec, 0)["stop"] == ["\n", "="]
    assert "stop" not in sampling_params(load_spec({}), 0)
