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
from elasticrl.weights.slices import Delta, element_index, index_bytes, put_units, unsliceable, view_box
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
        deltas = [n.removesuffix(index_key) for n in tensors if n.endswith(index_key)]
        plans = self.worker.erl_plans() if deltas else None
        if deltas and plans is None:
            raise RuntimeError(f"weight sync: a delta of {deltas[0]!r} came to a worker without copy plans")
        view = partial(part_of, self.worker.erl_params()) if deltas else None
        for name in deltas:
            replay_delta(plans[name], tensors[name + index_key], tensors[name + values_key],
                         tensors[name + shape_key], view)
        return self.worker.erl_land([(n, t) for n, t in tensors.items() if not n.endswith(DELTA_KEYS)], message)


def file_delta(delta: Delta, held: dict, name: str, t: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A full tensor as a file holds it for a delta sync: whole, or as the flat unit indices,
    values and full shape of its change (``slices.Delta``; ``replay_delta`` applies them)."""
    dt = shm.DTYPES[dtype]
    out = torch.empty(t.numel() * dt.itemsize, dtype=torch.uint8, device=t.device)
    count, nbytes = delta.pack(held, name, t, dt, out)
    if count < 0:
        return {name: out.view(dt).view(t.shape).cpu()}
    index, values, shape = (name + k for k in DELTA_KEYS)
    return {index: out[:4 * count].view(torch.int32).cpu(), values: out[index_bytes(count): nbytes].view(dt).cpu(),
            shape: torch.tensor(t.shape, dtype=torch.int64)}


def replay_delta(plans: list, index: torch.Tensor, values: torch.Tensor, full_shape, view) -> None:
    """Apply a change of a full tensor (flat unit ``index``, ``values``: ``slices.Delta``) to a
    worker's parameters through the tensor's copy plans, each a box of the full tensor
    (``slices.sliceable``): unit by unit where the box is one run of the full tensor (the whole
    tensor; rows of it, as a fused q/k/v part or a row-parallel slice takes), else element by
    element. ``view(param, byte offset, shape, strides)``: that part of a parameter."""
    if not index.numel():
        return  # nothing of this tensor changed
    full_shape = tuple(int(n) for n in full_shape)
    k = values.numel() // index.numel()  # elements per unit
    units = index.long()  # ascending (``slices.changed_units``)
    at = None
    for kind, param, dst_off, dst_shape, dst_strides, _, src_off, src_shape, src_strides in plans:
        if kind == "fill":
            continue  # constants (padding) no sync changes
        box = view_box(full_shape, int(src_off), src_shape, src_strides)
        dst = view(param, dst_off, dst_shape, dst_strides)
        run = _run(box, full_shape)
        if run is not None and dst.is_contiguous() and run[0] % k == 0 and run[1] % k == 0:
            a, b = torch.searchsorted(units, torch.tensor([run[0] // k, run[1] // k])).tolist()
            put_units(dst, units[a:b] - run[0] // k, values[a * k: b * k].to(dst.dtype), k)
            continue
        if at is None:
            at = torch.stack(torch.unravel_index(element_index(index, k), full_shape), 1)
        lo, hi = (torch.tensor([b[d] for b in box]) for d in (0, 1))
        inside = ((at >= lo) & (at < hi)).all(1)
        dst.index_put_(tuple((at[inside] - lo).T), values[inside].to(dst.dtype))


def _run(box, full_shape) -> tuple[int, int] | None:
    """(start, end) in the full tensor's flat elements where ``box`` is one contiguous run of it
    (its dimensions whole after the first partial one, and of extent 1 before it), else None."""
    partial = [d for d, ((lo, hi), n) in enumerate(zip(box, full_shape)) if (lo, hi) != (0, n)]
    if len(partial) > 1 or partial and any(hi - lo != 1 for lo, hi in box[:partial[0]]):
        return None
    start, size = 0, 1
    for (lo, hi), n in zip(reversed(box), reversed(full_shape)):
        start += lo * size
        size *= n
    extent = 1
    for lo, hi in box:
        extent *= hi - lo
    return start, start + extent
