"""Which roles each algorithm runs, where they share devices and how many CPUs a local cluster
needs: counted by hand for each family."""
from __future__ import annotations

import pytest

from elasticrl.plan.roles import colocated, cpus_needed, job_roles
from elasticrl.spec import load_spec


def _spec(algorithm, *overrides):
    return load_spec({"algorithm": algorithm}, list(overrides), check_paths=False)


@pytest.mark.parametrize("algorithm, overrides, roles, groups, cpus", [
    # 2 trainer ranks + the driver
    ("sft", [], {"actor": 2}, [], 3),
    ("prm", ["train.num_ranks=4", "train.global_batch_size=64"], {"actor": 4}, [], 5),
    # the reference lives in the trainer's ranks: it shares their CPUs
    ("dpo", [], {"actor": 2, "reference": 2}, [["actor", "reference"]], 3),
    # 2 trainer ranks + 1 engine of 2 CPUs + the driver
    ("rejection_sampling", ["rollout.cpus_per_engine=2"], {"actor": 2, "rollout": 1}, [], 5),
    ("iterative_dpo", [], {"actor": 2, "reference": 2, "rollout": 1}, [["actor", "reference"]], 4),
    # GRPO without KL: actor + engines; with it a reference of its own (3 ranks)
    ("grpo", ["rollout.num_engines=2"], {"actor": 2, "rollout": 2}, [], 5),
    ("grpo", ["rl.kl_coef=0.1", "placement.reference_ranks=3"], {"actor": 2, "rollout": 1, "reference": 3}, [], 7),
    # PPO, two reward models of 2 ranks each beside a 1-rank critic: 2 + 1 + 2 + 1 + 2 x 2 + 1
    ("ppo", ["rl.kl_coef=0.1", "placement.reward_ranks=2", "rewards.models=[{path: a}, {path: b}]"],
     {"actor": 2, "rollout": 1, "reference": 2, "critic": 1, "reward": 2}, [], 11),
    # colocated pairs count their widest member once: max(2, 2) + 1 + max(1, 2) + 1
    ("ppo", ["rl.kl_coef=0.1", "placement.reward_ranks=2", "rewards.models=[{path: a}]",
             "placement.colocate=actor_ref+critic_reward"],
     {"actor": 2, "rollout": 1, "reference": 2, "critic": 1, "reward": 2},
     [["actor", "reference"], ["critic", "reward"]], 6),
    # the hybrid engine: everything on the actor's 2 bundles, + the driver
    ("grpo", ["placement.colocate=all", "rl.kl_coef=0.1"], {"actor": 2, "rollout": 1, "reference": 2},
     [["actor", "reference", "rollout"]], 3),
])
def test_roles_groups_and_cpus_of_each_family(algorithm, overrides, roles, groups, cpus):
    spec = _spec(algorithm, *overrides)
    assert {name: r.ranks for name, r in job_roles(spec).items()} == roles
    assert colocated(spec) == groups
    assert cpus_needed(spec) == cpus


def test_pools_and_resources_per_rank():
    spec = _spec("ppo", "placement.pools=split", "rollout.tp_size=2", "rollout.cpus_per_engine=3",
                 "rewards.models=[{path: a}, {path: b}]")
    roles = job_roles(spec)
    assert roles["rollout"].pool == "rollout" and (roles["rollout"].gpus, roles["rollout"].cpus) == (2, 3)
    assert {r.pool for name, r in roles.items() if name != "rollout"} == {"train"}
    assert roles["reward"].copies == 2 and roles["critic"].head == "value" and roles["actor"].head == "lm"
    assert job_roles(_spec("rm"))["actor"].head == "value"
