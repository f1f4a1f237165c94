"""``shm``: CPU engines on the trainer's node. Each engine worker moves its parameters into one
/dev/shm arena, which the trainer's ranks map; senders write straight into the live parameters
through the workers' copy plans (``plan.py``), slices and fusions included: one memory copy per
sync. Adapters, and loaders that transform weights (no copy plans), go staged (``shm_staged``)."""
from __future__ import annotations

import ray
import torch

from elasticrl import backend
from elasticrl.weights import shm
from elasticrl.weights.plan import Arena, replay
from elasticrl.weights.slices import Piece, source_view
from elasticrl.weights.transports import Payload, ReceiverBase, Transport, each_piece, shm_staged


class Sender(Transport):
    name = "shm"
    sliced = True

    def __init__(self, s):
        super().__init__(s)
        self.arenas: dict[int, list[Arena]] | None = None  # per engine, per worker
        self.plans = None  # gathered: the engines' copy plans, asked once per incarnation
        self.staged = shm_staged.Sender(s)
        self.mode = None  # "direct", or "staged" when the engines' loaders transform weights

    def send_sliced(self, tensors, mine, payload: Payload) -> int:
        arenas = self._open({e for e, _, _ in mine})
        self.mode = "direct"
        sent = each_piece(tensors, [(arenas[e][w], pieces) for e, w, pieces in mine], write_piece)
        backend.synchronize()
        return sent

    def send_gathered(self, params, size: int, payload: Payload) -> int | None:
        """Straight into the engines' parameters (the bytes written), else staged."""
        if payload.kind == "adapter":  # served by the engines, not loaded into their weights
            return self.staged.send_gathered(params, size, payload)
        if self.plans is None:
            self.plans = self.s.plans or [ray.get(e.copy_plans.remote()) for e in self.s.engines]
        plans = self.plans
        if any(n for workers in plans for w in workers for n in w["unplanned"]):
            self.mode = "staged"
            return self.staged.send_gathered(params, size, payload)
        self.mode = "direct"
        arenas = self._open(range(len(self.s.engines)))
        targets = [(arena, w["plans"]) for e, workers in enumerate(plans) for arena, w in zip(arenas[e], workers)]
        written = 0
        for name, t in params:
            t = t.contiguous()
            for arena, plans_of in targets:
                plan = plans_of.get(name)
                if plan is None:
                    raise ValueError(f"weight sync: trainer parameter {name!r} is not in the rollout engine's "
                                     "checkpoint; the engines must start from the trainer's model")
                written += replay(plan, t, arena)
        return written

    def _open(self, wanted) -> dict[int, list[Arena]]:
        """Map the parameters of every worker of the ``wanted`` engines (once per incarnation)."""
        if self.arenas is None:
            self.arenas = {}
            for e in sorted(wanted):
                workers = ray.get(self.call(e, "share"))  # in tensor-parallel rank order
                self.arenas[e] = [Arena(shm.attach(w["path"], w["nbytes"]), w["offsets"]) for w in workers]
        return self.arenas

    def stats(self) -> dict:
        return {"sync/shm_mode": self.mode}

    def release(self) -> None:
        self.arenas = self.plans = None

    def close(self) -> None:
        self.release()
        self.staged.close()


def write_piece(arena: Arena, piece: Piece, t: torch.Tensor) -> int:
    """Copy a piece straight into a worker's parameters mapped here."""
    dst = arena.view(piece.param, piece.dst_off, piece.shape, piece.dst_strides, piece.dtype)
    if piece.fill is not None:
        dst.fill_(piece.fill)
        return 0
    dst.copy_(source_view(t, piece))
    return piece.nbytes


class Receiver(ReceiverBase):
    def __init__(self, worker):
        super().__init__(worker)
        self.arena = None

    def share(self) -> dict:
        """Move every parameter into one /dev/shm arena that the trainer's ranks on this node map;
        its path and each parameter's byte offset (the copy plans' destinations)."""
        if self.arena is None:
            params = self.worker.erl_params()
            assert params[0].device.type == "cpu", "the shm arena is for CPU engines"
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += shm.aligned(p.numel() * p.element_size())
            path, arena = shm.create(total, "engine")
            for p, offset in zip(params, offsets):
                view = shm.view(arena, offset, p.dtype, tuple(p.shape))
                view.copy_(p.data)
                p.data = view
            self.arena = {"path": path, "nbytes": total, "offsets": offsets}
        return self.arena

    def release(self) -> None:
        if self.arena is not None:
            shm.release(self.arena["path"])  # our mapping (the live weights) stays valid
