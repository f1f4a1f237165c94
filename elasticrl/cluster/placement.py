"""Placement of the RL roles, from ``placement.colocate``.

Roles that share devices share one placement group: each bundle is one device (a GPU, or
a slice of CPUs) and every role in the group puts one rank on each bundle with a fraction
of it, as OpenRLHF's colocation does. Roles alone get their own group. On a machine
without GPUs the same code places CPU bundles.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from elasticrl import backend
from elasticrl.cluster.group import pool_resource

COLOCATION = {
    "none": [],
    "actor_ref": [["actor", "reference"]],
    "critic_reward": [["critic", "reward"]],
    "actor_ref+critic_reward": [["actor", "reference"], ["critic", "reward"]],
    "all": [["actor", "reference", "critic", "reward", "rollout"]],
}


class SharedBundles:
    """One placement group shared by colocated roles; ``share`` is what each rank takes."""

    def __init__(self, roles: list[str], num_bundles: int, cpus_per_bundle: float, timeout_s: float = 300,
                 num_groups: int | None = None, pool: str | None = None):
        """``num_groups``: role groups sharing the bundles (several reward models are one role)."""
        self.roles = roles
        self.share = 1.0 / (num_groups or len(roles))
        bundle = {**backend.bundle(1.0, cpus_per_bundle), **pool_resource(pool)}
        self.pg = placement_group([bundle] * num_bundles, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(f"placement: cannot place {num_bundles} bundle(s) of {bundle} for colocated roles "
                               f"{roles}; the cluster offers {ray.available_resources()}")
        self.cpus = cpus_per_bundle

    def options(self) -> dict:
        """RoleGroup arguments for one role of this group."""
        return {"shared": self, "gpus_per_rank": self.share, "cpus_per_rank": self.cpus * self.share}

    def remove(self) -> None:
        remove_placement_group(self.pg)


def pool_for(pools: str, role: str) -> str | None:
    """``placement.pools``: 'split' puts rollout engines on the 'rollout' pool, the rest on 'train'."""
    return None if pools == "any" else "rollout" if role == "rollout" else "train"


def colocation_groups(colocate: str, active: dict[str, int], cpus_per_bundle: float,
                      copies: dict[str, int] | None = None, pools: str = "any") -> dict[str, SharedBundles]:
    """Role -> shared bundles for the roles that are active (role -> its rank count);
    ``copies``: role groups of one role (e.g. several reward models), 1 if absent."""
    out: dict[str, SharedBundles] = {}
    copies = copies or {}
    for group in COLOCATION[colocate]:
        members = [r for r in group if r in active]
        if len(members) < 2:
            continue
        shared = SharedBundles(members, max(active[r] for r in members), cpus_per_bundle,
                               num_groups=sum(copies.get(r, 1) for r in members), pool=pool_for(pools, members[0]))
        for r in members:
            out[r] = shared
    return out
