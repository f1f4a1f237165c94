"""Which model roles a job runs, how many ranks each, which share devices, on which app role's
nodes and how many CPUs they need: one answer for the planner, the launcher and the trainers
(``cluster.placement`` turns it into Ray placement groups).

An app role of ``elasticrl launch`` (``placement.pools: per_role``) is a placement group of
model roles: a role alone (``actor``, ``critic``, ``reference``, ``reward``, ``rollout``), or
the roles that share devices, joined (``actor-reference``, ``critic-reward``; ``all`` for the
hybrid engine). Its nodes join Ray carrying the custom resource ``elasticrl_pool_NAME``, which
every rank of its model roles asks for."""
from __future__ import annotations

from typing import NamedTuple

from elasticrl.spec.algorithms import ALGORITHMS, reward_model_first
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
    pool: str | None = None   # the app role whose nodes its ranks must run on (placement.pools: per_role)
    cpus: int = 1             # CPUs per rank on a machine without GPUs
    gpus: int = 1             # GPUs per rank (rollout: its tensor-parallel size)
    copies: int = 1           # role groups of this role (one per reward model)
    in_trainer: bool = False  # lives inside the trainer's ranks (dpo's reference, placement.reference:
    #                           in_actor), not a group of its own


def is_rl(spec: JobSpec) -> bool:
    return ALGORITHMS[spec.algorithm].family == "rl"


def reward_models(spec: JobSpec) -> int:
    """Reward-model roles of the job (one trained first when ppo has none and init.rm_steps)."""
    if not is_rl(spec):
        return 0
    return len(spec.rewards.models) or int(reward_model_first(spec))


ORDER = ("actor", "critic", "reference", "reward", "rollout")


def _model_roles(spec: JobSpec) -> dict[str, Role]:
    alg = ALGORITHMS[spec.algorithm]
    n, p = spec.train.num_ranks, spec.placement
    roles = {"actor": Role(alg.head, n)}
    if alg.reference and not spec.model.lora.rank:  # dpo, kto, iterative_dpo: a frozen copy in each rank's
        roles["reference"] = Role("lm", n, in_trainer=True)
    if alg.rollout:
        r = spec.rollout
        roles["rollout"] = Role("lm", r.num_engines, cpus=r.cpus_per_engine, gpus=r.tp_size)
    if alg.family == "rl":
        if spec.rl.kl_coef > 0 and not spec.model.lora.rank:  # under LoRA the base is the reference: the actor's
            roles["reference"] = Role("lm", n, in_trainer=True) if p.reference == "in_actor" else \
                Role("lm", p.reference_ranks or n)
        if alg.critic:
            roles["critic"] = Role("value", spec.critic.num_ranks)
        if reward_models(spec):
            roles["reward"] = Role("value", p.reward_ranks, copies=reward_models(spec))
    return roles


def _colocated(spec: JobSpec, roles: dict[str, Role]) -> list[list[str]]:
    groups = COLOCATION[spec.placement.colocate] if is_rl(spec) else [["actor", "reference"]]
    if "reference" in roles and roles["reference"].in_trainer and not any("reference" in g for g in groups):
        groups = [["actor", "reference"], *groups]  # placement.reference: in_actor
    return [m for m in ([r for r in g if r in roles] for g in groups) if len(m) > 1]


def app_roles(spec: JobSpec) -> dict[str, list[str]]:
    """The job's app roles: name -> the model roles placed on its nodes, in the order of ORDER
    (a reference inside the trainer's ranks is the actor's)."""
    roles = _model_roles(spec)
    groups = _colocated(spec, roles)
    out = {}
    for role in sorted(roles, key=ORDER.index):
        group = next((g for g in groups if role in g), [role])
        if role == group[0]:
            named = [r for r in group if not roles[r].in_trainer]
            out["all" if spec.placement.colocate == "all" and is_rl(spec) else "-".join(named)] = group
    return out


def job_roles(spec: JobSpec) -> dict[str, Role]:
    roles = _model_roles(spec)
    if spec.placement.pools == "per_role":
        pools = {role: name for name, members in app_roles(spec).items() for role in members}
        roles = {role: r._replace(pool=pools[role]) for role, r in roles.items()}
    return roles


def colocated(spec: JobSpec) -> list[list[str]]:
    """The groups of this job's roles that share devices (each of two roles at least)."""
    return _colocated(spec, _model_roles(spec))


def app_role_cpus(spec: JobSpec) -> dict[str, int]:
    """CPUs each app role's ranks take on a machine without GPUs: each rank's, roles that
    share devices counted once (one CPU a bundle, as many bundles as their widest role)."""
    roles = _model_roles(spec)
    out = {}
    for name, members in app_roles(spec).items():
        own = [roles[r] for r in members if not roles[r].in_trainer]
        out[name] = max(r.ranks for r in own) if len(own) > 1 else own[0].ranks * own[0].cpus * own[0].copies
    return out


def cpus_needed(spec: JobSpec) -> int:
    """Logical CPUs of a local cluster: every app role's, and one for the driver."""
    return sum(app_role_cpus(spec).values()) + 1
