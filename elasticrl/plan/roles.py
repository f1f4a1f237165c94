"""Which model roles a job runs: one answer for the planner, the launcher and the trainers."""
from __future__ import annotations

from typing import NamedTuple

from elasticrl.spec.schema import JobSpec

RL_ALGORITHMS = ("grpo", "ppo", "reinforce++", "rloo")
PREFERENCE_ALGORITHMS = ("dpo", "kto")  # a frozen reference in each trainer rank's process
ROUND_ALGORITHMS = ("rejection_sampling", "iterative_dpo")  # rounds of vLLM sampling, then training


class Role(NamedTuple):
    head: str   # 'lm' (causal LM) or 'value' (scalar head)
    ranks: int  # Ray actors (rollout: engines) the job starts for it


def is_rl(spec: JobSpec) -> bool:
    return spec.algorithm in RL_ALGORITHMS


def reward_models(spec: JobSpec) -> int:
    """Reward-model roles of the job (one trained first when ppo has none and init.rm_steps)."""
    return len(spec.rewards.models) or int(spec.algorithm == "ppo" and spec.init.rm_steps > 0)


def job_roles(spec: JobSpec) -> dict[str, Role]:
    n = spec.train.num_ranks
    if spec.algorithm in ("sft", "conditional_sft"):
        return {"actor": Role("lm", n)}
    if spec.algorithm in ("rm", "prm"):
        return {"actor": Role("value", n)}
    if spec.algorithm in PREFERENCE_ALGORITHMS:
        return {"actor": Role("lm", n), "reference": Role("lm", n)}
    if spec.algorithm == "rejection_sampling":
        return {"actor": Role("lm", n), "rollout": Role("lm", spec.rollout.num_engines)}
    if spec.algorithm == "iterative_dpo":
        return {"actor": Role("lm", n), "reference": Role("lm", n), "rollout": Role("lm", spec.rollout.num_engines)}
    roles = {"actor": Role("lm", n), "rollout": Role("lm", spec.rollout.num_engines)}
    if spec.rl.kl_coef > 0:
        roles["reference"] = Role("lm", spec.placement.reference_ranks or n)
    if spec.algorithm == "ppo":
        roles["critic"] = Role("value", spec.critic.num_ranks)
    if reward_models(spec):
        roles["reward"] = Role("value", spec.placement.reward_ranks)
    return roles
