"""A role group: N Ray actors of one role, placed together on one placement group.

The group forms the role's torch.distributed world (rank 0's node address, a free port)
and calls methods on every rank, failing fast with the role and rank of the first error:
a dead rank otherwise leaves its peers blocked in a collective until the timeout.
"""
from __future__ import annotations

import socket
import uuid
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elasticrl import backend
from elasticrl.plan.roles import POOL_PREFIX


def pool_resource(pool: str | None) -> dict:
    return {POOL_PREFIX + pool: 1.0} if pool else {}


class RoleError(RuntimeError):
    """A rank of a role failed; the message names the role, the rank and the cause."""


def _free_address(_self) -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class RoleGroup:
    def __init__(self, role: str, actor_cls, num_ranks: int, *args, gpus_per_rank: float = 1.0,
                 cpus_per_rank: float = 1.0, place_timeout_s: float = 300, actor_options: dict | None = None,
                 shared=None, pool: str | None = None, **kwargs):
        """``shared``: a ``placement.SharedBundles`` when this role is colocated with others;
        ``pool``: the node pool (``elasticrl launch``) whose nodes must host the ranks."""
        self.role = role
        self.num_ranks = num_ranks
        self.owns_pg = shared is None
        if shared is not None:
            self.pg = shared.pg
        else:
            bundles = [{**backend.bundle(gpus_per_rank, cpus_per_rank), **pool_resource(pool)}
                       for _ in range(num_ranks)]
            total = ray.cluster_resources()
            for key in bundles[0]:
                if bundles[0][key] * num_ranks > total.get(key, 0):  # can never fit: say so now
                    raise RoleError(f"{role}: {num_ranks} rank(s) need {bundles[0][key] * num_ranks:g} {key} but "
                                    f"the whole cluster has {total.get(key, 0):g}. Lower the rank count or add nodes.")
            self.pg = placement_group(bundles, strategy="PACK", name=f"elasticrl-{role}-{uuid.uuid4().hex[:8]}")
            ready, _ = ray.wait([self.pg.ready()], timeout=place_timeout_s)
            if not ready:
                remove_placement_group(self.pg)
                raise RoleError(f"{role}: could not place {num_ranks} rank(s) of {bundles[0]} within "
                                f"{place_timeout_s:.0f}s; the cluster offers {ray.available_resources()}. "
                                "Lower the rank count or add nodes.")
        remote_cls = ray.remote(actor_cls)
        self.actors = [
            remote_cls.options(
                **backend.worker_resources(gpus_per_rank, cpus_per_rank),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                **(actor_options or {}),
            ).remote(*args, **kwargs)
            for i in range(num_ranks)
        ]

    def setup(self, *args, **kwargs) -> list:
        """Form the role's process group: each rank's ``setup(rank, world, addr, port, ...)``."""
        addr, port = self._get([self.actors[0].__ray_call__.remote(_free_address)])[0]
        return self._get([a.setup.remote(rank, self.num_ranks, addr, port, *args, **kwargs)
                          for rank, a in enumerate(self.actors)])

    def call(self, method: str, *args, **kwargs) -> list:
        """Run ``method`` on every rank with the same arguments; results in rank order."""
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_rank(self, rank: int, method: str, *args, **kwargs) -> Any:
        return self._get([getattr(self.actors[rank], method).remote(*args, **kwargs)], ranks=[rank])[0]

    def _get(self, refs: list, ranks: list[int] | None = None) -> list:
        ranks = ranks or list(range(len(refs)))
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # the first failure ends the call; peers would hang
                cause = getattr(exc, "cause", None) or exc
                raise RoleError(f"{self.role} rank {rank_of[done[0]]} failed: "
                                f"{type(cause).__name__}: {cause}") from exc
        return ray.get(refs)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)

