"""A role group: N Ray actors of one role, placed together on one placement group.

The group forms the role's torch.distributed world (rank 0's node address, a free port)
and calls methods on every rank, failing fast with the role and rank of the first error:
a dead rank otherwise leaves its peers blocked in a collective until the timeout.
"""
from __future__ import annotations

import os
import re
import socket
import time
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
    """A rank of a role failed; the message names the role, the rank and the cause.
    ``role`` and ``ranks`` say which (None when the failure is not one rank's), ``lost``
    whether its process is gone or hung (the driver may re-form the role) rather than a
    Python error in it (which would repeat)."""

    def __init__(self, message: str, role: str | None = None, ranks: list[int] | None = None, lost: bool = False,
                 what: str | None = None):
        super().__init__(message)
        self.role, self.ranks, self.lost = role, ranks, lost
        self.what = what or message.splitlines()[0]  # in a few words, for a console line


class Unplaceable(RoleError):
    """A role's ranks cannot be placed: the live nodes can never hold them (``room``: how
    many ranks of that size they could hold), or they did not get placed in time (None)."""

    def __init__(self, message: str, role: str, room: int | None):
        super().__init__(message, role)
        self.room = room


_ERROR_LINE = re.compile(r"^\s*([\w.]*(?:Error|Exception)): (.+)$", re.M)


def root_cause(exc: BaseException) -> str:
    """The error behind a Ray failure as 'Type: message'. An actor that died in its
    constructor carries the constructor's traceback only as text: its last error line."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    if isinstance(cause, ray.exceptions.RayActorError):
        found = _ERROR_LINE.findall(text)
        if found and found[-1][0].rsplit(".", 1)[-1] not in ("ActorDiedError", "RayActorError"):
            return f"{found[-1][0].rsplit('.', 1)[-1]}: {found[-1][1].strip()}"
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def where(_self=None) -> str:
    """The node a Ray actor runs on, as its operator knows it: the Slurm node's name (or the
    host's) and the Ray node's id. Called on the actor (``__ray_call__``)."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return f"{host} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"


def _free_address(_self) -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


# what a collective raises on a rank whose peer's process (or node) is gone: gloo, NCCL
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted")


def _dead_among(refs: list, wait_s: float = 5.0):
    """(ref, error) of a call in ``refs`` whose actor died, within ``wait_s``; else None."""
    pending, deadline = list(refs), time.time() + wait_s
    while pending and time.time() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return ref, exc
            except Exception:  # noqa: BLE001 - another failure of that call is not a lost actor
                continue
    return None


def room(bundle: dict) -> int:
    """How many ``bundle``s the live nodes can hold at most (each bundle on one node; what
    other roles hold is not subtracted)."""
    return sum(int(min(n["Resources"].get(k, 0.0) / v for k, v in bundle.items() if v > 0) + 1e-9)
               for n in ray.nodes() if n["Alive"])


def _place(role: str, bundles: list[dict], timeout_s: float, await_nodes: bool = False):
    """A ready placement group of ``bundles``. Raises ``Unplaceable`` as soon as the live nodes
    can never hold them (checked each second: a node that died leaves the count; with
    ``await_nodes``, only once ``timeout_s`` passed without a node joining that holds them),
    or when it is not placed within ``timeout_s``."""
    n, one = len(bundles), bundles[0]
    pg, deadline = None, time.time() + timeout_s
    try:
        while True:
            fits = room(one)
            if fits < n:
                if not await_nodes or time.time() >= deadline:
                    raise Unplaceable(f"{role}: {n} rank(s) of {one} do not fit: the live nodes hold {fits}. "
                                      "Lower the rank count or add nodes.", role, fits)
                time.sleep(1.0)
                continue
            pg = pg or placement_group(bundles, strategy="PACK", name=f"elasticrl-{role}-{uuid.uuid4().hex[:8]}")
            if ray.wait([pg.ready()], timeout=min(1.0, max(0.0, deadline - time.time())))[0]:
                return pg
            if time.time() >= deadline:
                raise Unplaceable(f"{role}: could not place {n} rank(s) of {one} within {timeout_s:.0f}s; the "
                                  f"cluster offers {ray.available_resources()}. Lower the rank count or add nodes.",
                                  role, None)
    except BaseException:
        if pg is not None:
            remove_placement_group(pg)
        raise


class RoleGroup:
    def __init__(self, role: str, actor_cls, num_ranks: int, *args, gpus_per_rank: float = 1.0,
                 cpus_per_rank: float = 1.0, place_timeout_s: float = 300, actor_options: dict | None = None,
                 shared=None, pool: str | None = None, watchdog: tuple[float, float] | None = None,
                 await_nodes: bool = False, **kwargs):
        """``shared``: a ``placement.SharedBundles`` when this role is colocated with others;
        ``pool``: the node pool (``elasticrl launch``) whose nodes must host the ranks;
        ``await_nodes``: when the live nodes cannot hold the ranks, wait ``place_timeout_s``
        for nodes to join (a frozen role re-formed after its node was lost);
        ``watchdog``: (factor, seconds): a call that takes longer than factor x the longest
        call of its method so far + seconds is a hang (``fault.hang_factor``, ``min_deadline_s``)."""
        self.role = role
        self.num_ranks = num_ranks
        self.watchdog = watchdog
        self._longest: dict[str, float] = {}  # method -> the longest call of it so far, seconds
        self.owns_pg = shared is None
        if shared is not None:
            self.pg = shared.pg
        else:
            bundles = [{**backend.bundle(gpus_per_rank, cpus_per_rank), **pool_resource(pool)}
                       for _ in range(num_ranks)]
            self.pg = _place(role, bundles, place_timeout_s, await_nodes)
        remote_cls = ray.remote(actor_cls)
        self._extra: list = []  # placement groups of ranks added while the job runs (``add``)

        def start(i: int, pg=None):  # rank i's actor on bundle i (``replace`` starts it again there)
            return remote_cls.options(
                **backend.worker_resources(gpus_per_rank, cpus_per_rank),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg or self.pg, placement_group_bundle_index=0 if pg else i),
                **(actor_options or {}),
            ).remote(*args, **kwargs)

        self._start = start
        # what one rank of its own takes (None when colocated: the ranks share bundles)
        self.bundle = None if shared is not None else {**backend.bundle(gpus_per_rank, cpus_per_rank),
                                                         **pool_resource(pool)}
        self.actors = [start(i) for i in range(num_ranks)]

    def setup(self, *args, wait: bool = True, **kwargs):
        """Form the role's process group: each rank's ``setup(rank, world, addr, port, ...)``.
        ``wait=False`` returns at once a function that waits for it (roles set up side by side)."""
        addr, port = self._get([self.actors[0].__ray_call__.remote(_free_address)])[0]
        refs = [a.setup.remote(rank, self.num_ranks, addr, port, *args, **kwargs) for rank, a in enumerate(self.actors)]
        return self._answers(refs, None, wait)

    def call(self, method: str, *args, wait: bool = True, **kwargs):
        """Run ``method`` on every rank with the same arguments; results in rank order.
        ``wait=False`` returns at once a function that waits for them (roles working side by side)."""
        return self._answers([getattr(a, method).remote(*args, **kwargs) for a in self.actors], method, wait)

    def _answers(self, refs: list, method: str | None, wait: bool):
        """The ranks' answers to ``refs``, or (``wait=False``) a function that waits for them."""
        return self._get(refs, method=method) if wait else (lambda: self._get(refs, method=method))

    def call_rank(self, rank: int, method: str, *args, **kwargs) -> Any:
        return self._get([getattr(self.actors[rank], method).remote(*args, **kwargs)], ranks=[rank],
                         method=method)[0]

    def _get(self, refs: list, ranks: list[int] | None = None, method: str | None = None) -> list:
        ranks = ranks or list(range(len(refs)))
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        pending, t0 = list(refs), time.time()
        limit = None
        if self.watchdog and method in self._longest:
            limit = self.watchdog[0] * self._longest[method] + self.watchdog[1]
        while pending:
            left = None if limit is None else max(0.0, t0 + limit - time.time())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:  # past the deadline: a rank is stopped, or waits on one that is
                hung = sorted(rank_of[r] for r in pending)
                raise RoleError(f"{self.role} rank(s) {', '.join(map(str, hung))} stopped answering: no reply to "
                                f"{method} in {limit:.0f} s (its longest call so far took "
                                f"{self._longest[method]:.1f} s)", self.role, hung, lost=True,
                                what=f"{self.role} rank(s) {', '.join(map(str, hung))} stopped answering "
                                     f"({method}: no reply in {limit:.0f} s)")
            try:
                ray.get(done[0])
            except Exception as exc:  # the first failure ends the call; peers would hang
                peer_gone = bool(_PEER_GONE.search(str(exc)))
                if not isinstance(exc, ray.exceptions.RayActorError) and pending:
                    # a collective fails on the peers of a rank that died: blame the dead rank (Ray
                    # tells a whole node's loss only once its health checks failed: wait longer)
                    dead = _dead_among(pending, 60.0 if peer_gone else 5.0)
                    if dead is not None:
                        done, exc = [dead[0]], dead[1]
                cause = getattr(exc, "cause", None) or exc
                lost = isinstance(exc, ray.exceptions.RayActorError) or peer_gone
                raise RoleError(f"{self.role} rank {rank_of[done[0]]} failed: {root_cause(exc)}",
                                self.role, [rank_of[done[0]]], lost=lost,
                                what=f"{self.role} rank {rank_of[done[0]]} died ({type(cause).__name__})" if lost
                                else None) from exc
        if method is not None:
            self._longest[method] = max(self._longest.get(method, 0.0), time.time() - t0)
        return ray.get(refs)

    def replace(self, rank: int):
        """Kill rank ``rank``'s actor (if it still runs) and start a new one on its bundle, with
        the same arguments; returns it at once (it is ready when a call on it answers)."""
        ray.kill(self.actors[rank], no_restart=True)
        pg = next((g for r, g in self._extra if r == rank), None)
        self.actors[rank] = self._start(rank, pg)
        return self.actors[rank]

    def add(self) -> int:
        """One more rank, on a placement group of its own (it starts when the cluster has
        room for it); returns its rank. Not for colocated roles, whose bundles are shared."""
        if self.bundle is None:
            raise RoleError(f"{self.role}: a colocated role cannot grow (its ranks share the other roles' devices)")
        rank = len(self.actors)
        pg = placement_group([self.bundle], name=f"elasticrl-{self.role}-{uuid.uuid4().hex[:8]}")
        self._extra.append((rank, pg))
        self.actors.append(self._start(rank, pg))
        return rank

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
        for _, pg in self._extra:
            remove_placement_group(pg)

