"""Placement of a job's roles on Ray, from ``plan.roles`` (which follows ``placement.colocate``).

Roles that share devices share one placement group: each bundle is one device (a GPU, or
a slice of CPUs) and every role in the group puts one rank on each bundle with a fraction
of it, as OpenRLHF's colocation does. Roles alone get their own group. On a machine
without GPUs the same code places CPU bundles.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from elasticrl import backend
from elasticrl.cluster.group import RoleGroup, pool_resource
from elasticrl.plan.roles import colocated, job_roles


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


class Placement:
    """The job's roles on Ray (from ``plan.roles``): roles that share devices share one
    placement group, the others get their own from their ``RoleGroup``. ``options(role)`` is
    what a ``RoleGroup`` (or the rollout pool) of that role takes."""

    def __init__(self, spec):
        self.roles = job_roles(spec)
        self.watchdog = (spec.fault.hang_factor, spec.fault.min_deadline_s)
        self.shared: dict[str, SharedBundles] = {}
        self._bundles: list[SharedBundles] = []
        for group in colocated(spec):
            members = [r for r in group if not self.roles[r].in_trainer]
            if len(members) < 2:
                continue
            bundles = SharedBundles(members, max(self.roles[r].ranks for r in members), cpus_per_bundle=1.0,
                                    num_groups=sum(self.roles[r].copies for r in members),
                                    pool=self.roles[members[0]].pool)
            self._bundles.append(bundles)
            self.shared.update(dict.fromkeys(members, bundles))

    def options(self, role: str) -> dict:
        if role in self.shared:
            return self.shared[role].options()
        r = self.roles[role]
        return {"gpus_per_rank": r.gpus, "cpus_per_rank": r.cpus, "pool": r.pool}

    def group(self, role: str, actor_cls, *args, name: str | None = None, ranks: int | None = None,
              **kwargs) -> RoleGroup:
        """The ``RoleGroup`` of ``role``'s ranks (``name``: what errors call it, default the role;
        ``ranks``: fewer than the job's, for a re-forming), its calls watched for hangs (``fault``)."""
        return RoleGroup(name or role, actor_cls, ranks or self.roles[role].ranks, *args, **self.options(role),
                         watchdog=self.watchdog, **kwargs)

    def remove(self) -> None:
        for bundles in self._bundles:
            bundles.remove()
