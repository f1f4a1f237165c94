"""Trainer -> rollout engines: full weights, bucket by bucket, versioned.

Every trainer rank calls ``sync_weights`` (ZeRO-3 and AutoTP gathers are collectives);
rank 0 sends. Transports, chosen by ``transport_for`` from where the two sides live:

- ``shm``: engines on rank 0's node (CPU). Each engine worker keeps its parameters in a
  /dev/shm arena and publishes copy plans (``plan.py``); the trainer writes every tensor
  straight into the live parameters, slices and fusions included: one memcpy per sync.
- ``shm_staged``: the same node, through two staging buffers that the trainer fills in
  turn while the engines load the other with vLLM's loaders (two copies; the fallback for
  models whose loaders transform weights).
- ``broadcast``: one collective per bucket over a group of trainer rank 0 and every engine
  worker (gloo on CPU, NCCL on GPU); each worker loads its tensor-parallel slice.
- ``files``: sharded safetensors in a folder both sides see (checkpoint-style, slowest).

A sync is atomic for the engines: they refuse to generate between ``begin_sync`` and
``finish_sync(version)``.
"""
from __future__ import annotations

import logging
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

import ray
import torch
import torch.distributed as dist

from elasticrl import backend
from elasticrl.weights import shm
from elasticrl.weights.group import broadcast, new_group
from elasticrl.weights.plan import replay

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "shm_staged", "broadcast", "files")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPE_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


def transport_for(requested: str, my_node: str, engine_nodes: list[str]) -> str:
    if requested != "auto":
        return requested
    if not backend.has_gpu() and all(n == my_node for n in engine_nodes):
        return "shm"
    return "broadcast"


def iter_full_params(ds_engine) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full tensor) on rank 0, (name, None) elsewhere; every rank must iterate.

    ZeRO-3 partitions and AutoTP slices are gathered one module at a time, so no rank ever
    holds more than one module's full weights beyond its own shard.
    """
    rank0 = dist.get_rank() == 0
    stage3 = ds_engine.zero_optimization_stage() == 3
    tp = ds_engine.autotp_size() > 1
    if not stage3 and not tp:
        if rank0:
            for name, p in ds_engine.module.named_parameters():
                yield name, p.detach()
        return
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    for mod_name, module in ds_engine.module.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        tensors = [p for _, p in params]
        with deepspeed.zero.GatheredParameters(tensors, enabled=stage3), \
                GatherReplacedLayerParams(tensors, module, enabled=tp):
            for name, p in params:
                yield (f"{mod_name}.{name}" if mod_name else name), (p.detach() if rank0 else None)


def max_param_bytes(ds_engine) -> int:
    tp = max(1, ds_engine.autotp_size())
    return max(getattr(p, "ds_numel", p.numel()) * p.element_size() * tp for p in ds_engine.module.parameters())


class WeightSender:
    """Held by every trainer rank; only rank 0 keeps engines and buffers."""

    def __init__(self, engines: list, engine_infos: list[dict], transport: str, bucket_bytes: int,
                 timeout_s: int, files_dir: str | None = None):
        self.engines = engines
        self.infos = engine_infos
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.files_dir = files_dir
        self.transport = transport_for(transport, ray.get_runtime_context().get_node_id(),
                                       [i["node_id"] for i in engine_infos])
        if self.transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_sync: unknown transport {self.transport!r}; "
                             f"choose auto or one of {TRANSPORTS}")
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._group = None
        self._targets = None  # direct shm: per engine worker (typed arena views, copy plans)
        self._incarnations = None
        self.shm_mode = None

    def sync(self, ds_engine, version: int) -> dict:
        """Push the trainer's current weights; collective over the trainer's ranks."""
        rank0 = dist.get_rank() == 0
        t0 = time.time()
        params = _Counted(iter_full_params(ds_engine))
        if not rank0:
            for _ in params:
                pass
            return {}
        incarnations = ray.get([e.begin_sync.remote() for e in self.engines])
        if incarnations != self._incarnations:  # an engine restarted: its buffers are new
            self._release_targets()
            self._incarnations = incarnations
        size = max(self.bucket_bytes, shm.aligned(max_param_bytes(ds_engine)))
        send = {"shm": self._send_shm, "shm_staged": self._send_staged, "broadcast": self._send_broadcast,
                "files": self._send_files}[self.transport]
        send(params, size)
        ray.get([e.finish_sync.remote(version) for e in self.engines])
        seconds = time.time() - t0
        stats = {"sync/seconds": seconds, "sync/gbytes": params.nbytes / 1e9, "sync/transport": self.transport,
                 "sync/gbps": params.nbytes / 1e9 / seconds if seconds else 0.0, "sync/version": version}
        if self.transport == "shm":
            stats["sync/shm_mode"] = self.shm_mode  # "direct", or "staged" when plans were missing
        return stats

    # --- shm: direct into the engines' parameters, else staged ---------------------------
    def _send_shm(self, params, size: int) -> None:
        if self._targets is None:
            workers = [w for e in self.engines for w in ray.get(e.share_weights.remote())]
            unplanned = sorted({n for w in workers for n in w["unplanned"]})
            if unplanned:
                log.warning("weight sync: vLLM transforms %s while loading; using staged shared memory",
                            unplanned[:5])
                self._targets = []
            else:
                self._targets = []
                for w in workers:
                    arena = shm.attach(w["path"], w["nbytes"])
                    typed = {name: arena.view(dt) for name, dt in _DTYPE_BY_NAME.items()}
                    self._targets.append((typed, w["plans"]))
        if not self._targets:
            self.shm_mode = "staged"
            return self._send_staged(params, size)
        self.shm_mode = "direct"
        for name, t in params:
            t = t.contiguous()
            for typed, plans in self._targets:
                plan = plans.get(name)
                if plan is None:
                    raise ValueError(f"weight sync: trainer parameter {name!r} is not in the rollout engine's "
                                     "checkpoint; the engines must start from the trainer's model")
                replay(plan, t, typed)

    def _send_staged(self, params, size: int) -> None:
        if not self._buffers or self._buffers[0][1].numel() < size:
            self._release_buffers()
            self._buffers = [shm.create(size, "stage") for _ in range(2)]
        pending: list[list] = [[], []]
        for k, (metas, _) in enumerate(_fill_buckets(params, [b for _, b in self._buffers], size)):
            path, _ = self._buffers[k % 2]
            pending[k % 2] = [e.load_shm.remote(path, size, metas) for e in self.engines]
            # Before the trainer refills the other buffer, its previous load must be done.
            ray.get(pending[(k + 1) % 2])
            pending[(k + 1) % 2] = []
        ray.get(pending[0] + pending[1])

    # --- broadcast ----------------------------------------------------------------------
    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        world = 1 + sum(i.get("tp_size", 1) for i in self.infos)
        refs, offset = [], 1
        for e, info in zip(self.engines, self.infos):
            refs.append(e.join_group.remote(addr, port, offset, world, backend.dist_backend(), self.timeout_s))
            offset += info.get("tp_size", 1)
        self._group = new_group(addr, port, 0, world, backend.dist_backend(), self.timeout_s)
        ray.get(refs)

    def _send_broadcast(self, params, size: int) -> None:
        self._ensure_group()
        buf = torch.empty(size, dtype=torch.uint8, device=backend.current_device())
        refs = []
        for metas, nbytes in _fill_buckets(params, [buf], size):
            refs += [e.load_broadcast.remote(metas, nbytes) for e in self.engines]
            broadcast(self._group, buf[:nbytes])
        ray.get(refs)

    # --- files --------------------------------------------------------------------------
    def _send_files(self, params, size: int) -> None:
        from elasticrl.files import atomic_folder
        from elasticrl.weights.shards import save_sharded

        self._files_seq = getattr(self, "_files_seq", 0) + 1
        root = Path(self.files_dir or "/tmp/elasticrl-weights")
        final = root / f"v{self._files_seq:06d}"
        with atomic_folder(final) as tmp:
            save_sharded({name: t.to("cpu", copy=True) for name, t in params}, tmp, size)
        ray.get([e.load_files.remote(str(final)) for e in self.engines])
        for old in root.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    # --- teardown -----------------------------------------------------------------------
    def _release_targets(self) -> None:
        self._targets = None

    def _release_buffers(self) -> None:
        for path, _ in self._buffers:
            _on_live(e.release_shm.remote(path) for e in self.engines)
            shm.release(path)
        self._buffers = []

    def close(self) -> None:
        """Release what the engines hold of this sender; an engine that died has nothing left."""
        self._release_targets()
        self._release_buffers()
        if self._group is not None:
            _on_live(e.leave_group.remote() for e in self.engines)
            self._group = None


def _on_live(refs) -> None:
    """Wait for calls on engines, of which some may have died (the pool replaces those)."""
    for ref in list(refs):
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass


class _Counted:
    """Iterates (name, tensor) and counts the bytes of what it hands out."""

    def __init__(self, items):
        self.items = items
        self.nbytes = 0

    def __iter__(self):
        for name, t in self.items:
            if t is not None:
                self.nbytes += t.numel() * t.element_size()
            yield name, t


def _fill_buckets(params, buffers: list[torch.Tensor], size: int):
    """Pack tensors into ``buffers`` in turn; yield (metas, nbytes) each time one is full."""
    k, offset, metas = 0, 0, []
    for name, t in params:
        n = t.numel() * t.element_size()
        if offset + n > size and metas:
            yield metas, offset
            k, offset, metas = k + 1, 0, []
        buf = buffers[k % len(buffers)]
        shm.view(buf, offset, t.dtype, tuple(t.shape)).copy_(t)
        metas.append((name, _DTYPE_NAMES[t.dtype], list(t.shape), offset))
        offset = shm.aligned(offset + n)
    if metas:
        yield metas, offset


