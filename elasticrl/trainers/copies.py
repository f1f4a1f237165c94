"""The in-memory copy of the trained roles' state (``fault.memory_copy_steps``), kept off the
ranks and off the driver. Each rank stages what its ``save`` writes (its own pieces, its RNG)
and hands it to a keeper: a small process on the node of its next rank in the ring that runs
on another node (on one node, a process of its own, which outlives a killed rank). The copy
of a lost rank is then held where the loss did not reach, each keeper holds about one rank's
share per rank it keeps (twice: the newest copy and the one the next replaces), and no
process holds the whole state. A recovery has the keepers write the newest complete copy into
a checkpoint folder; when a rank and its keeper are both gone the copy is incomplete and the
newest checkpoint is used instead.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import ray


class Held:
    """One node's keeper: per (role, rank), its two newest copies, {step: {relative path: data}}.
    A new copy goes into the memory of the older one (its pages are warm: a fresh 300 MB
    buffer costs ~20x the copy itself in page faults); the newer stays whole meanwhile."""

    def __init__(self):
        self.files: dict = {}

    def put(self, role: str, rank: int, step: int, files: dict) -> None:
        held = self.files.setdefault((role, rank), {})
        old = held.pop(min(held), {}) if len(held) > 1 else {}
        # an array arrives as a view of the object store, which lives only as long as its
        # owner (the rank): the keeper copies it into memory of its own
        for name, data in files.items():
            if isinstance(data, bytes):
                continue
            spare = old.get(name)
            if isinstance(spare, np.ndarray) and spare.shape == data.shape:
                np.copyto(spare, data)
                files[name] = spare
            else:
                files[name] = data.copy()
        held[step] = files

    def write(self, step: int, folder: str) -> list:
        """Write the copies of step ``step`` under ``folder``/ROLE; returns [role, rank] of each."""
        out = []
        for (role, rank), held in sorted(self.files.items()):
            for name, data in held.get(step, {}).items():
                path = Path(folder) / role / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            if step in held:
                out.append([role, rank])
        return out


Keeper = ray.remote(num_cpus=0)(Held)


def holders(nodes: list[str]) -> list[str]:
    """The node whose keeper holds each rank's copy: that of the next rank in the ring on
    another node, or (every rank on one node) the rank's own node."""
    n = len(nodes)
    return [next((nodes[(r + k) % n] for k in range(1, n) if nodes[(r + k) % n] != nodes[r]), nodes[r])
            for r in range(n)]


class PeerCopies:
    """The driver's side: which step the copy is of and the driver's own state at it; the
    keepers hold the ranks' files. A copy being taken goes into the memory of the older of
    the keepers' two, so the confirmed one stays whole and usable until the new one counts."""

    def __init__(self):
        self.keepers: dict[str, object] = {}
        self.step: int | None = None   # of the copy a recovery may use
        self.state: dict = {}
        self.ranks: dict[str, int] = {}
        self.taken: tuple | None = None  # (step, state, ranks) of a copy taken, not yet confirmed

    def _keeper(self, node: str):
        if node not in self.keepers:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self.keepers[node] = Keeper.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote()
        return self.keepers[node]

    def take(self, groups: dict, step: int, state: dict) -> None:
        """Every rank of ``groups`` (role -> RoleGroup) copies its state of step ``step`` to its
        keeper; ``state`` is the driver's at that step."""
        self.taken = None  # until every rank has handed its copy over
        for role, group in groups.items():
            keepers = [self._keeper(node) for node in holders(group.call("node_id"))]
            group.call("copy_to", keepers, role, step)
        self.taken = step, state, {role: g.num_ranks for role, g in groups.items()}

    def confirm(self) -> None:
        """The copy taken counts from now on (the driver has logged its step)."""
        if self.taken is not None:
            (self.step, self.state, self.ranks), self.taken = self.taken, None

    def write(self, folder: Path) -> bool:
        """Write the copy into ``folder``; whether it was whole (every rank's files found)."""
        found = set()
        for keeper in list(self.keepers.values()):
            try:
                found |= {tuple(x) for x in ray.get(keeper.write.remote(self.step, str(folder)), timeout=600)}
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # a lost node's keeper: its copies are gone
        return found == {(role, r) for role, n in self.ranks.items() for r in range(n)}

    def drop(self) -> None:
        """Forget the copy (a checkpoint as new was written, or it was used)."""
        self.step = self.taken = None

    def shutdown(self) -> None:
        for keeper in self.keepers.values():
            ray.kill(keeper, no_restart=True)
        self.keepers.clear()
