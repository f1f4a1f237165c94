"""``files``: sharded safetensors in a folder both sides see (checkpoint-style; the slowest, and
the one that needs nothing but a shared file system). Rank 0 writes each sync into a new folder
(atomically) that every engine loads; with a delta, a tensor whose change is small goes as its
flat indices and values, which each worker applies through its copy plans."""
from __future__ import annotations

import logging
import shutil
from functools import partial
from pathlib import Path

import ray
import torch

from elasticrl.weights import shm
from elasticrl.weights.receive import part_of
from elasticrl.weights.slices import Delta, unsliceable, view_box
from elasticrl.weights.transports import Payload, ReceiverBase, Transport

log = logging.getLogger(__name__)
DELTA_KEYS = (":delta.index", ":delta.values", ":delta.shape")  # a delta's tensors in a file, after its name


class Sender(Transport):
    name = "files"

    def __init__(self, s):
        super().__init__(s)
        self.seq = 0
        self.held: dict = {}  # what the engines got last, per tensor (delta)
        self.dtypes: dict | None = None  # each tensor's dtype in the engines (delta)

    def delta_pays(self) -> bool:
        return True

    def send_gathered(self, params, size: int, payload: Payload) -> int:
        from elasticrl.files import atomic_folder
        from elasticrl.weights.shards import save_sharded

        self.seq += 1
        root = Path(self.s.files_dir or "/tmp/elasticrl-weights")
        final = root / f"v{self.seq:06d}"
        dtypes = self._delta_dtypes() if payload.kind == "delta" else {}
        written = 0
        with atomic_folder(final) as tmp:
            tensors = {}
            for name, t in params:
                part = file_delta(payload.delta, self.held, name, t, dtypes[name]) if name in dtypes else \
                    {name: t.to("cpu", copy=True)}
                tensors.update(part)
                written += sum(v.numel() * v.element_size() for v in part.values())
            save_sharded(tensors, tmp, size)
        ray.get(self.call_all("load", str(final), payload.message()))
        for old in root.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return written * len(self.s.engines)

    def _delta_dtypes(self) -> dict[str, str]:
        """Each tensor's dtype in the engines, where every engine worker can apply a delta of it
        through its copy plans ({} where they cannot: those syncs go whole)."""
        if self.dtypes is None:
            plans = [w for e in self.s.engines for w in ray.get(e.copy_plans.remote())]
            why = unsliceable(plans, self.s.layouts) if self.s.layouts else "the trainer's AutoTP fuses projections"
            if why:
                log.warning("weight sync: %s; files go whole (rollout.delta_sync)", why)
            self.dtypes = {} if why else {name: cs[0][5] for name, cs in plans[0]["plans"].items()}
        return self.dtypes

    def forget(self) -> None:
        self.held = {}

    def release(self) -> None:
        self.held, self.dtypes = {}, None


class Receiver(ReceiverBase):
    def load(self, folder: str, message: dict) -> int:
        """A synced folder: whole tensors to the worker's loaders, deltas through its copy plans."""
        from elasticrl.weights.shards import iter_tensors

        tensors = dict(iter_tensors(folder))
        index_key, values_key, shape_key = DELTA_KEYS
        for name in [n.removesuffix(index_key) for n in tensors if n.endswith(index_key)]:
            plans = self.worker.erl_plans()
            if plans is None:
                raise RuntimeError(f"weight sync: a delta of {name!r} came to a worker without copy plans")
            replay_delta(plans[name], tensors[name + index_key], tensors[name + values_key],
                         tensors[name + shape_key], partial(part_of, self.worker.erl_params()))
        return self.worker.erl_land([(n, t) for n, t in tensors.items() if not n.endswith(DELTA_KEYS)], message)


def file_delta(delta: Delta, held: dict, name: str, t: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A full tensor as a file holds it for a delta sync: whole, or as the flat indices, values
    and full shape of its change (``replay_delta`` applies them)."""
    dt = shm.DTYPES[dtype]
    out = torch.empty(t.numel() * dt.itemsize, dtype=torch.uint8, device=t.device)
    count, nbytes = delta.pack(held, name, t, dt, out)
    if count < 0:
        return {name: out.view(dt).view(t.shape).cpu()}
    index, values, shape = (name + k for k in DELTA_KEYS)
    return {index: out[:4 * count].view(torch.int32).cpu(), values: out[4 * count: nbytes].view(dt).cpu(),
            shape: torch.tensor(t.shape, dtype=torch.int64)}


def replay_delta(plans: list, index: torch.Tensor, values: torch.Tensor, full_shape, view) -> None:
    """Apply a change of a full tensor (flat ``index``, ``values``) to a worker's parameters
    through the tensor's copy plans, each a box of the full tensor (``slices.sliceable``).
    ``view(param, byte offset, shape, strides)``: that part of a parameter."""
    full_shape = tuple(int(n) for n in full_shape)
    at = None
    for kind, param, dst_off, dst_shape, dst_strides, _, src_off, src_shape, src_strides in plans:
        if kind == "fill":
            continue  # constants (padding) no sync changes
        box = view_box(full_shape, int(src_off), src_shape, src_strides)
        dst = view(param, dst_off, dst_shape, dst_strides)
        if all(lo == 0 and hi == n for (lo, hi), n in zip(box, full_shape)) and dst.is_contiguous():
            dst.view(-1).index_copy_(0, index.long(), values.to(dst.dtype))  # the whole tensor, as it lies
            continue
        if at is None:
            at = torch.stack(torch.unravel_index(index.long(), full_shape), 1)
        lo, hi = (torch.tensor([b[k] for b in box]) for k in (0, 1))
        inside = ((at >= lo) & (at < hi)).all(1)
        dst.index_put_(tuple((at[inside] - lo).T), values[inside].to(dst.dtype))
