"""Which roles each algorithm runs, where they share devices and how many CPUs a local cluster
needs: counted by hand for each family."""
from __future__ import annotations

import pytest

from elasticrl.plan.roles import app_role_cpus, app_roles, colocated, cpus_needed, job_roles
from elasticrl.spec import load_spec


def _spec(algorithm, *overrides):
    return load_spec({"algorithm": algorithm}, list(overrides), check_paths=False)


@pytest.mark.parametrize("algorithm, overrides, roles, groups, cpus", [
    # 2 trainer ranks + the driver
    ("sft", [], {"actor": 2}, [], 3),
    ("prm", ["train.num_ranks=4", "train.global_batch_size=64"], {"actor": 4}, [], 5),
    # the reference lives in the trainer's ranks: it shares their CPUs
    ("dpo", [], {"actor": 2, "reference": 2}, [["actor", "reference"]], 3),
    # with LoRA the trained model with its adapters off is the reference: no copy
    ("kto", ["model.lora.rank=8"], {"actor": 2}, [], 3),
    # 2 trainer ranks + 1 engine of 2 CPUs + the driver
    ("rejection_sampling", ["rollout.cpus_per_engine=2"], {"actor": 2, "rollout": 1}, [], 5),
    ("iterative_dpo", [], {"actor": 2, "reference": 2, "rollout": 1}, [["actor", "reference"]], 4),
    # GRPO without KL: actor + engines; with it a reference of its own (3 ranks)
    ("grpo", ["rollout.num_engines=2"], {"actor": 2, "rollout": 2}, [], 5),
    ("grpo", ["rl.kl_coef=0.1", "placement.reference_ranks=3"], {"actor": 2, "rollout": 1, "reference": 3}, [], 7),
    # with LoRA the reference is the base, the actor's own model with its adapters off: no role
    ("grpo", ["rl.kl_coef=0.1", "model.lora.rank=8", "placement.colocate=actor_ref"], {"actor": 2, "rollout": 1},
     [], 4),
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


def test_app_roles_pools_and_resources_per_rank():
    """placement.pools per_role: one app role per placement group of model roles, named after
    them; its ranks ask for its nodes."""
    spec = _spec("ppo", "placement.pools=per_role", "rl.kl_coef=0.1", "rollout.tp_size=2",
                 "rollout.cpus_per_engine=3", "rewards.models=[{path: a}, {path: b}]")
    roles = job_roles(spec)
    assert app_roles(spec) == {"actor": ["actor"], "critic": ["critic"], "reference": ["reference"],
                               "reward": ["reward"], "rollout": ["rollout"]}
    assert {name: r.pool for name, r in roles.items()} == {name: name for name in roles}
    assert (roles["rollout"].gpus, roles["rollout"].cpus) == (2, 3)
    # 2 actor ranks, 1 critic rank, 2 reference ranks, two 1-rank reward models, 1 engine of 3 CPUs
    assert app_role_cpus(spec) == {"actor": 2, "critic": 1, "reference": 2, "reward": 2, "rollout": 3}
    assert roles["reward"].copies == 2 and roles["critic"].head == "value" and roles["actor"].head == "lm"
    assert job_roles(_spec("rm"))["actor"].head == "value"

    pairs = _spec("ppo", "placement.pools=per_role", "rl.kl_coef=0.1", "placement.colocate=actor_ref+critic_reward",
                  "rewards.models=[{path: a}]", "placement.reward_ranks=2")
    assert app_roles(pairs) == {"actor-reference": ["actor", "reference"], "critic-reward": ["critic", "reward"],
                                "rollout": ["rollout"]}
    assert {r: p.pool for r, p in job_roles(pairs).items()} == {
        "actor": "actor-reference", "reference": "actor-reference", "critic": "critic-reward",
        "reward": "critic-reward", "rollout": "rollout"}
    assert app_role_cpus(pairs) == {"actor-reference": 2, "critic-reward": 2, "rollout": 1}  # the widest, once
    hybrid = _spec("grpo", "placement.pools=per_role", "rl.kl_coef=0.1", "placement.colocate=all")
    assert app_roles(hybrid) == {"all": ["actor", "reference", "rollout"]}
    dpo = _spec("dpo", "placement.pools=per_role")  # its reference lives in the actor's ranks
    assert app_roles(dpo) == {"actor": ["actor", "reference"]} and job_roles(dpo)["reference"].pool == "actor"
    inside = _spec("ppo", "placement.pools=per_role", "rl.kl_coef=0.1", "placement.reference=in_actor",
                   "placement.colocate=critic_reward", "rewards.models=[{path: a}]")  # no process of its own
    assert app_roles(inside) == {"actor": ["actor", "reference"], "critic-reward": ["critic", "reward"],
                                 "rollout": ["rollout"]} and job_roles(inside)["reference"].in_trainer
    assert app_role_cpus(inside) == {"actor": 2, "critic-reward": 1, "rollout": 1}  # the actor's 2 ranks
    assert {r.pool for r in job_roles(_spec("ppo", "rl.kl_coef=0.1")).values()} == {None}  # 'any': elasticrl run
