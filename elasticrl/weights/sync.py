"""Trainer -> rollout engines: the weights, versioned, slice to slice where the engines allow.

Every trainer rank calls ``sync_weights`` (ZeRO-3 gathers are collectives). Two layouts:

- **sliced** (the default for vLLM engines): every trainer rank sends only its own AutoTP slice
  (``slices.py``), and each engine worker receives only the part of its own slice that it lacks;
  no full tensor is assembled anywhere. Engines are shared out among the data-parallel
  replicas (each fed by one replica's tensor-parallel ranks, bytes balanced), so different
  ranks feed different engines at once.
- **gathered**: each module gathered to rank 0 (ZeRO-3 partitions and AutoTP slices, one module
  at a time), and rank 0 alone sends. For engines without copy plans (the transformers
  fallback, loaders that transform weights) and the transports that cannot write slices.

How the bytes travel is the transport's (``transports/``, one module each, sender and receiver
side by side: shm, ipc, shm_staged, broadcast, files); ``transports.choose`` picks one from where
the two sides live. What a sync carries is a ``transports.Payload``:

- the weights whole;
- a delta (``rollout.delta_sync``): only the words of elements that changed (``slices.Delta``),
  where the transport says bytes cost more than finding them (``Transport.delta_pays``: sliced
  broadcast, ipc between GPUs, files). ``shm`` and a CPU's ``ipc`` are memory copies on one
  node, which finding the changes costs more than (reading both copies: about 25 ms against a
  9 ms copy for the 50m model's 88 MB, one thread): they send whole;
- an adapter: a LoRA-trained policy's adapters alone, gathered to rank 0, to engines that serve
  them (``rollout.lora_sync: adapter``); otherwise the adapters go merged into the base
  weights, under the base's names, as any weights.

A sync is atomic for the engines: they refuse to generate between ``begin_sync`` and
``finish_sync(version)``.
"""
from __future__ import annotations

import logging
import time

import ray
import torch
import torch.distributed as dist

from elasticrl import backend, parallel
from elasticrl.weights import shm, slices, transports
from elasticrl.weights.params import (
    adapter_tensors,
    iter_full_params,
    iter_local_params,
    max_param_bytes,
    trainer_layouts,
)
from elasticrl.weights.transports import Payload

log = logging.getLogger(__name__)


class WeightSender:
    """Held by every trainer rank, with every engine; built collectively (``attach_rollout``)."""

    def __init__(self, ds_engine, engines: list, engine_infos: list[dict], transport: str, bucket_bytes: int,
                 timeout_s: int, files_dir: str | None = None, layout: str = "auto", adapters: bool = False,
                 delta: bool = False):
        """``delta``: send only what changed where the transport says it pays."""
        self.engines = engines
        self.adapters = _peft_config(ds_engine) if adapters else None
        self.infos = engine_infos
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.files_dir = files_dir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        node = ray.get_runtime_context().get_node_id()
        here = _ints([all(i["node_id"] == node for i in engine_infos)])
        dist.all_reduce(here, op=dist.ReduceOp.MIN)
        self.transport = transports.choose(transport, bool(here.item()), backend.has_gpu())
        self.via = transports.module(self.transport).Sender(self)
        self.layouts = trainer_layouts(ds_engine)
        self.layout = layout
        self.delta = delta and not self.adapters
        self.tp = max(1, ds_engine.autotp_size())
        # decided at the first sync: it asks the engines, and failures there are the pool's to handle
        self.sliced = self.plans = None
        self._incarnations = None

    # --- who sends what -------------------------------------------------------------------
    def _prepare(self) -> None:
        """Slice or gather, and who sends what: the same answer on every rank from the same
        inputs. Collective; a rank that cannot reach the engines makes every rank raise."""
        error = None
        try:
            wanted = self.layout != "gathered" and self.via.sliced and self.layouts is not None
            self.plans = [ray.get(e.copy_plans.remote()) for e in self.engines] if wanted else None
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
            error = exc
        _agree(error)
        self.sliced = self.plans is not None and self._can_slice()
        if self.sliced:
            self._plan_senders()

    def _can_slice(self) -> bool:
        why = slices.unsliceable([w for workers in self.plans for w in workers], self.layouts)
        if why and self.rank == 0:
            log.warning("weight sync: %s; rank 0 gathers and sends every tensor whole", why)
        return why is None

    def _plan_senders(self) -> None:
        """Engines to data-parallel replicas, then each worker's pieces from each sender."""
        dp_rank, dp_size = parallel.data_parallel_info(self.tp)
        coords = _ints([dp_rank, parallel.tensor_parallel_rank(self.tp)])
        everyone = [torch.zeros_like(coords) for _ in range(self.world)]
        dist.all_gather(everyone, coords)
        self.rank_of = {(int(c[0]), int(c[1])): r for r, c in enumerate(everyone)}
        self.me = (dp_rank, int(coords[1]))
        engine_bytes = [sum(slices.copy_nbytes(c) for w in workers for cs in w["plans"].values() for c in cs)
                        for workers in self.plans]
        self.replica_of = slices.assign(engine_bytes, dp_size)
        load = {d: [0] * self.tp for d in range(dp_size)}
        # pieces[e][w][k]: what tensor-parallel rank k of engine e's replica copies into worker w
        self.pieces = [[slices.worker_pieces(w["plans"], self.layouts, self.tp, load[self.replica_of[e]])
                        for w in workers] for e, workers in enumerate(self.plans)]

    def _mine(self) -> list[tuple[int, int, list]]:
        """(engine, worker, my pieces for it) for the engines my replica feeds."""
        d, k = self.me
        return [(e, w, pieces[k]) for e, workers in enumerate(self.pieces) if self.replica_of[e] == d
                for w, pieces in enumerate(workers) if pieces[k]]

    def _payload(self) -> Payload:
        """What this sync carries (decided on every rank alike)."""
        if self.adapters is not None:
            return Payload("adapter", adapter=self.adapters)
        if self.delta and self.via.delta_pays():
            return Payload("delta", delta=slices.Delta())
        return Payload()

    # --- a sync -------------------------------------------------------------------------
    def sync(self, ds_engine, version: int) -> dict:
        """Push the trainer's current weights; collective over the trainer's ranks. A failure on
        one rank (an engine that died, a send that broke) is raised on every rank, after the
        collectives of the sync, so the group stays usable for the retry without that engine."""
        t0 = time.time()
        incarnations, error = None, None
        if self.rank == 0:
            try:
                incarnations = ray.get([e.begin_sync.remote() for e in self.engines])
            except Exception as exc:  # noqa: BLE001 - raised by _agree, on every rank
                error = exc
        _agree(error)
        changed = _ints([self.rank == 0 and incarnations != self._incarnations])
        dist.broadcast(changed, 0)
        if changed.item() or self.sliced is None:  # an engine restarted: its buffers and processes are new
            self.via.release()
            if self.adapters is None:
                self._prepare()
            else:
                self.sliced = False
        if self.rank == 0:
            self._incarnations = incarnations
        sent, payload = 0, self._payload()
        try:
            sent = self.via.send_sliced(iter_local_params(ds_engine), self._mine(), payload) if self.sliced \
                else self._sync_gathered(ds_engine, payload)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            # one line (the exception itself is raised below): the ranks that did not fail name this one
            log.warning("weight sync (%s) failed on trainer rank %d: %s", self.transport, self.rank, exc)
            error = exc
        counts = (payload.delta.changed, payload.delta.total) if payload.delta else (0, 0)
        by_rank = [_ints([0, 0, 0]) for _ in range(self.world)]
        dist.all_gather(by_rank, _ints([sent if error is None else -1, *counts]))  # every write is in before finish
        if error is not None or any(int(b[0]) < 0 for b in by_rank):
            self.via.forget()  # the engines may hold part of this sync: the next one sends whole
        _raise_if_failed(error, [int(b[0]) for b in by_rank])
        if self.rank != 0:
            return {}
        ray.get([e.finish_sync.remote(version) for e in self.engines])
        seconds = time.time() - t0
        total = sum(int(b[0]) for b in by_rank)
        stats = {"sync/seconds": seconds, "sync/gbytes": total / 1e9, "sync/transport": self.transport,
                 "sync/gbps": total / 1e9 / seconds if seconds else 0.0, "sync/version": version,
                 "sync/layout": "adapters" if self.adapters else "sliced" if self.sliced else "gathered",
                 "sync/sent_gbytes_by_rank": [int(b[0]) / 1e9 for b in by_rank], **self.via.stats()}
        seen = sum(int(b[2]) for b in by_rank)
        if seen:  # delta: the share of the elements written that changed
            stats["sync/delta_fraction"] = sum(int(b[1]) for b in by_rank) / seen
        return stats

    def _sync_gathered(self, ds_engine, payload: Payload) -> int:
        """Rank 0 sends whole tensors (gathered on every rank, collectively), or the adapters."""
        if payload.kind == "adapter":
            tensors = sorted(adapter_tensors(ds_engine).items())
            size = sum(shm.aligned(t.numel() * t.element_size()) for _, t in tensors)
            params = _Counted(iter(tensors))
        else:
            params = _Counted(iter_full_params(ds_engine))
            size = max(self.bucket_bytes, shm.aligned(max_param_bytes(ds_engine)))
        if self.rank != 0:
            for _ in params:  # rank 0's gathers need this one's (ZeRO-3, AutoTP)
                pass
            return 0
        try:
            written = self.via.send_gathered(params, size, payload)
        finally:
            for _ in params:  # the other ranks' gathers still need this one (ZeRO-3, AutoTP)
                pass
        # what reached the engines, as the sliced path counts (written straight into them: those bytes)
        return params.nbytes * len(self.engines) if written is None else written

    def close(self) -> None:
        """Release what the engines hold of this sender; an engine that died has nothing left."""
        self.via.close()


def _peft_config(ds_engine) -> dict:
    """The trained adapter's peft config as plain JSON values (vLLM's PEFTHelper reads it)."""
    import json

    return json.loads(json.dumps(ds_engine.module.peft_config["default"].to_dict(), default=sorted))


def _agree(error: BaseException | None) -> None:
    """Collective: raise on every rank when any rank had an error (its own where it had one)."""
    ok = _ints([error is None])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError("weight sync: another trainer rank failed (its error is in its log)")


def _raise_if_failed(error: BaseException | None, sent_by_rank: list[int]) -> None:
    if error is not None:
        raise error
    failed = [r for r, n in enumerate(sent_by_rank) if n < 0]
    if failed:
        raise RuntimeError(f"weight sync: trainer rank(s) {failed} failed (their errors are in their logs)")


def _ints(values) -> torch.Tensor:
    """Integers for the trainer's own collectives (NCCL wants them on the device)."""
    return torch.tensor([int(v) for v in values], dtype=torch.int64, device=backend.current_device())


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
