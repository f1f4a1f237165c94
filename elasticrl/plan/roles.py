"""Which model roles a job runs, how many ranks each, which share devices, on which node pool
and how many CPUs they need: one answer for the planner, the launcher and the trainers
(``cluster.placement`` turns it into Ray placement groups)."""
from __future__ import annotations

from typing import NamedTuple

from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.schema import JobSpec

POOL_PREFIX = "elasticrl_pool_"  # the custom resource a pool's Ray nodes carry (launch/node.py)

# placement.colocate -> groups of roles that share devices (absent roles are skipped).
COLOCATION = {
    "none": [],
    "actor_ref": [["actor", "reference"]],
    "critic_reward": [["critic", "reward"]],
    "actor_ref+critic_reward": [["actor", "reference"], ["critic", "reward"]],
    "all": [["actor", "reference", "critic", "reward", "rollout"]],
}


class Role(NamedTuple):
    head: str                 # 'lm' (causal LM) or 'value' (scalar head)
    ranks: int                # Ray actors (rollout: engines) the job starts for it
    pool: str | None = None   # the node pool its ranks must run on (placement.pools: split)
    cpus: int = 1             # CPUs per rank on a machine without GPUs
    gpus: int = 1             # GPUs per rank (rollout: its tensor-parallel size)
    copies: int = 1           # role groups of this role (one per reward model)
    in_trainer: bool = False  # lives inside the trainer's ranks (dpo's reference), not a group of its own


def is_rl(spec: JobSpec) -> bool:
    return ALGORITHMS[spec.algorithm].family == "rl"


def reward_models(spec: JobSpec) -> int:
    """Reward-model roles of the job (one trained first when ppo has none and init.rm_steps)."""
    if not is_rl(spec):
        return 0
    return len(spec.rewards.models) or int(spec.algorithm == "ppo" and spec.init.rm_steps > 0)


def pool_for(spec: JobSpec, role: str) -> str | None:
    """``placement.pools``: 'split' puts rollout engines on the 'rollout' pool, the rest on 'train'."""
    return None if spec.placement.pools == "any" else "rollout" if role == "rollout" else "train"


def job_roles(spec: JobSpec) -> dict[str, Role]:
    alg = ALGORITHMS[spec.algorithm]
    n, p = spec.train.num_ranks, spec.placement

    def role(name, head, ranks, **kw):
        return Role(head, ranks, pool_for(spec, name), **kw)

    roles = {"actor": role("actor", alg.head, n)}
    if alg.reference:  # dpo, kto, iterative_dpo: a frozen copy in each trainer rank's process
        roles["reference"] = role("reference", "lm", n, in_trainer=True)
    if alg.rollout:
        r = spec.rollout
        roles["rollout"] = role("rollout", "lm", r.num_engines, cpus=r.cpus_per_engine, gpus=r.tp_size)
    if alg.family == "rl":
        if spec.rl.kl_coef > 0:
            roles["reference"] = role("reference", "lm", p.reference_ranks or n)
        if alg.critic:
            roles["critic"] = role("critic", "value", spec.critic.num_ranks)
        if reward_models(spec):
            roles["reward"] = role("reward", "value", p.reward_ranks, copies=reward_models(spec))
    return roles


def colocated(spec: JobSpec) -> list[list[str]]:
    """The groups of this job's roles that share devices (each of two roles at least)."""
    roles = job_roles(spec)
    if not is_rl(spec):  # only the trainer-internal reference shares, with its trainer
        groups = [["actor", "reference"]]
    else:
        groups = COLOCATION[spec.placement.colocate]
    return [m for m in ([r for r in g if r in roles] for g in groups) if len(m) > 1]


def cpus_needed(spec: JobSpec) -> int:
    """Logical CPUs of a local cluster: each rank's, roles that share devices counted once, and
    one for the driver."""
    roles = job_roles(spec)
    cpus = {name: r.ranks * r.cpus * r.copies for name, r in roles.items()}
    for group in colocated(spec):
        shared = max(roles[r].ranks for r in group)
        for r in group:
            cpus[r] = 0
        cpus[group[0]] = shared
    return sum(cpus.values()) + 1
