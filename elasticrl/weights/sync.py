"""Trainer -> rollout engines: the weights, versioned, slice to slice where the engines allow.

Every trainer rank calls ``sync_weights`` (ZeRO-3 gathers are collectives). Two layouts:

- **sliced** (the default for vLLM engines): every trainer rank sends only its own AutoTP slice
  (``slices.py``), and each engine worker receives only the part of its own slice that it lacks;
  no full tensor is assembled anywhere. Engines are shared out among the data-parallel
  replicas (each fed by one replica's tensor-parallel ranks, bytes balanced), so different
  ranks feed different engines at once.
- **gathered**: each module gathered to rank 0 (ZeRO-3 partitions and AutoTP slices, one module
  at a time), and rank 0 alone sends. For engines without copy plans (the transformers
  fallback, loaders that transform weights) and the staged transports.

Transports, chosen by ``transport_for`` from where the two sides live:

- ``shm``: engines on the trainer's node (CPU). Each engine worker keeps its parameters in a
  /dev/shm arena and publishes copy plans (``plan.py``); senders write straight into the live
  parameters, slices and fusions included: one memcpy per sync.
- ``ipc``: engines on the trainer's node with GPUs (colocated on the trainer's own devices, where
  NCCL refuses two ranks on one device): buckets of pieces in the senders' own buffers, mapped
  by the workers over CUDA IPC and copied into vLLM's parameters (``slices.SharedOutbox``).
- ``shm_staged``: the same node, through two staging buffers that rank 0 fills in turn while
  the engines load the other with vLLM's loaders (gathered; for loaders that transform).
- ``broadcast``: a process group of the senders and every engine worker (gloo on CPU, NCCL on
  GPU): point-to-point buckets of pieces when sliced, one broadcast per bucket when gathered.
- ``files``: sharded safetensors in a folder both sides see (checkpoint-style, slowest).

A LoRA-trained policy (``model.lora``) goes either merged (its adapters merged into the base
weights, under the base's names, by any of the above) or, to engines that serve adapters
(``rollout.lora_sync: adapter``), as the adapters alone: gathered to rank 0, one bucket staged
in shared memory (``shm``, ``ipc``, ``shm_staged``), broadcast, or written as files.

With ``rollout.delta_sync`` a sync sends only the elements that changed (``slices.Delta``), where
bytes cost more than finding them: over sliced ``broadcast`` (and ``ipc`` between GPUs) compared
with what the sender sent that worker last (packed as indices and values, counts first), over
``files`` as index/value tensors that each worker applies through its copy plans. ``shm`` and a
CPU's ``ipc`` are memory copies on one node, which finding the changed elements costs more than
(reading both copies: 29 ms against a 9 ms copy for the 50m model's 88 MB, one thread): they
send whole.

A sync is atomic for the engines: they refuse to generate between ``begin_sync`` and
``finish_sync(version)``.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from elasticrl import backend, parallel
from elasticrl.weights import shm, slices
from elasticrl.weights.group import broadcast, new_group
from elasticrl.weights.params import (
    adapter_tensors,
    iter_full_params,
    iter_local_params,
    max_param_bytes,
    trainer_layouts,
)
from elasticrl.weights.plan import Arena, replay

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "ipc", "shm_staged", "broadcast", "files")
SLICED = ("shm", "ipc", "broadcast")


def transport_for(requested: str, one_node: bool) -> str:
    """``one_node``: every trainer rank and every engine on one node."""
    if requested == "shm" and backend.has_gpu():
        raise ValueError("rollout.weight_sync: shm writes into CPU engines' memory; on GPUs use ipc (one node) "
                         "or broadcast")
    if requested != "auto":
        return requested
    if one_node:
        return "ipc" if backend.has_gpu() else "shm"
    return "broadcast"


class WeightSender:
    """Held by every trainer rank, with every engine; built collectively (``attach_rollout``)."""

    def __init__(self, ds_engine, engines: list, engine_infos: list[dict], transport: str, bucket_bytes: int,
                 timeout_s: int, files_dir: str | None = None, layout: str = "auto", adapters: bool = False,
                 delta: bool = False):
        """``delta``: send only the elements that changed (``slices.Delta``) where the transport
        pays for it: sliced broadcast, sliced ipc between GPUs, files into engines with copy plans."""
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
        self.transport = transport_for(transport, bool(here.item()))
        if self.transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_sync: unknown transport {self.transport!r}; "
                             f"choose auto or one of {TRANSPORTS}")
        self.layouts = trainer_layouts(ds_engine)
        self.layout = layout
        self.delta = delta and not self.adapters
        self._delta: slices.Delta | None = None  # this sync's counts
        self._held: dict = {}  # files: what the engines got last, per tensor (delta)
        self._file_dtypes: dict | None = None  # files: each tensor's dtype in the engines (delta)
        self.tp = max(1, ds_engine.autotp_size())
        # decided at the first sync: it asks the engines, and failures there are the pool's to handle
        self.sliced = self.plans = None
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._group = None
        self._arenas = None  # shm: per engine, per worker, an Arena over its live parameters
        self._outboxes = None  # broadcast, ipc: what this rank sends each worker
        self._incarnations = None
        self.shm_mode = None

    # --- who sends what -------------------------------------------------------------------
    def _prepare(self) -> None:
        """Slice or gather, and who sends what: the same answer on every rank from the same
        inputs. Collective; a rank that cannot reach the engines makes every rank raise."""
        error = None
        try:
            wanted = self.layout != "gathered" and self.transport in SLICED and self.layouts is not None
            self.plans = [ray.get(e.copy_plans.remote()) for e in self.engines] if wanted else None
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
            error = exc
        _agree(error)
        self.sliced = self.plans is not None and self._can_slice()
        if self.sliced:
            self._plan_senders()

    def _can_slice(self) -> bool:
        why = _unsliceable([w for workers in self.plans for w in workers], self.layouts)
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
            self._release_targets()
            if self.adapters is None:
                self._prepare()
            else:
                self.sliced = False
        if self.rank == 0:
            self._incarnations = incarnations
        sent, self._delta = 0, slices.Delta() if self.delta and self._delta_here() else None
        try:
            sent = self._sync_adapters(ds_engine) if self.adapters else \
                self._sync_sliced(ds_engine) if self.sliced else self._sync_gathered(ds_engine)
        except Exception as exc:  # noqa: BLE001 - raised by _agree, on every rank
            error = exc
        counts = (self._delta.changed, self._delta.total) if self._delta else (0, 0)
        by_rank = [_ints([0, 0, 0]) for _ in range(self.world)]
        dist.all_gather(by_rank, _ints([sent if error is None else -1, *counts]))  # every write is in before finish
        if error is not None or any(int(b[0]) < 0 for b in by_rank):
            self._forget()  # the engines may hold part of this sync: the next one sends whole
        _raise_if_failed(error, [int(b[0]) for b in by_rank])
        if self.rank != 0:
            return {}
        ray.get([e.finish_sync.remote(version) for e in self.engines])
        seconds = time.time() - t0
        total = sum(int(b[0]) for b in by_rank)
        stats = {"sync/seconds": seconds, "sync/gbytes": total / 1e9, "sync/transport": self.transport,
                 "sync/gbps": total / 1e9 / seconds if seconds else 0.0, "sync/version": version,
                 "sync/layout": "adapters" if self.adapters else "sliced" if self.sliced else "gathered",
                 "sync/sent_gbytes_by_rank": [int(b[0]) / 1e9 for b in by_rank]}
        seen = sum(int(b[2]) for b in by_rank)
        if seen:  # delta: the share of the elements written that changed
            stats["sync/delta_fraction"] = sum(int(b[1]) for b in by_rank) / seen
        if self.transport == "shm":
            stats["sync/shm_mode"] = self.shm_mode  # "direct", or "staged" when plans were missing
        return stats

    def _sync_sliced(self, ds_engine) -> int:
        """Every rank copies its pieces of each tensor as the tensor comes (one module at a time)."""
        mine = self._mine()
        by_name: dict[str, list] = {}
        if self.transport in ("broadcast", "ipc"):
            device = backend.current_device()
            if self._outboxes is None and self.transport == "broadcast":
                self._ensure_group(self.world)
                self._outboxes = [slices.Outbox(self._group, self._worker_rank(e, w), pieces, self.bucket_bytes,
                                                device) for e, w, pieces in mine]
            elif self._outboxes is None:
                self._outboxes = [slices.SharedOutbox(self.engines[e].load_pieces.remote, self.rank, w, pieces,
                                                      self.bucket_bytes, device) for e, w, pieces in mine]
            refs = [e.receive.remote(self._delta is not None) for e in self.engines] \
                if self.rank == 0 and self._group else []
            for box in self._outboxes:
                for piece in box.pieces:
                    by_name.setdefault(piece.name, []).append((box, piece))
            sent = _each_piece(iter_local_params(ds_engine), by_name,
                               lambda box, piece, t: box.put(piece, t, self._delta))
            for box in self._outboxes:
                if isinstance(box, slices.SharedOutbox):
                    box.finish()
            ray.get(refs)
            return sent
        arenas = self._open_arenas({e for e, _, _ in mine})  # rank 0 stopped the engines before its broadcast
        for e, w, pieces in mine:
            for piece in pieces:
                by_name.setdefault(piece.name, []).append((arenas[e][w], piece))
        self.shm_mode = "direct"
        sent = _each_piece(iter_local_params(ds_engine), by_name, slices.write_piece)
        backend.synchronize()
        return sent

    def _delta_here(self) -> bool:
        """Whether this sync goes as a delta (decided on every rank alike): where bytes cost."""
        sliced = bool(self.sliced) and (self.transport == "broadcast" or self.transport == "ipc" and backend.has_gpu())
        return self.transport == "files" or sliced

    def _forget(self) -> None:
        for box in self._outboxes or ():
            box.forget()
        self._held = {}

    def _sync_gathered(self, ds_engine) -> int:
        params = _Counted(iter_full_params(ds_engine))
        if self.rank != 0:
            for _ in params:
                pass
            return 0
        size = max(self.bucket_bytes, shm.aligned(max_param_bytes(ds_engine)))
        # gathered ipc stages through host memory: vLLM's own parameters cannot be exported on a GPU
        send = {"shm": self._send_shm, "ipc": self._send_staged, "shm_staged": self._send_staged,
                "broadcast": self._send_broadcast, "files": self._send_files}[self.transport]
        try:
            written = send(params, size)
        finally:
            for _ in params:  # the other ranks' gathers still need this one (ZeRO-3, AutoTP)
                pass
        # what reached the engines, as the sliced path counts (written straight into them: those bytes)
        return params.nbytes * len(self.engines) if written is None else written

    def _sync_adapters(self, ds_engine) -> int:
        """The adapters only, in one bucket from rank 0, which each engine loads as its adapter."""
        params = _Counted(sorted(adapter_tensors(ds_engine).items()))
        if self.rank != 0:
            return 0
        size = sum(shm.aligned(t.numel() * t.element_size()) for _, t in params.items)
        send = {"broadcast": self._send_broadcast, "files": self._send_files}.get(self.transport, self._send_staged)
        send(params, size, self.adapters)
        return params.nbytes * len(self.engines)

    def _open_arenas(self, wanted) -> dict[int, list[Arena]]:
        """Map the parameters of every worker of the ``wanted`` engines (once per incarnation)."""
        if self._arenas is None:
            self._arenas = {}
            for e in sorted(wanted):
                workers = ray.get(self.engines[e].share_weights.remote())  # in tensor-parallel rank order
                self._arenas[e] = [Arena(shm.attach(w["path"], w["nbytes"]), w["offsets"]) for w in workers]
        return self._arenas

    # --- gathered: direct into the engines' parameters, else staged ----------------------
    def _send_shm(self, params, size: int) -> int | None:
        """Straight into the engines' parameters (the bytes written), else staged (None)."""
        if self.plans is None:
            self.plans = [ray.get(e.copy_plans.remote()) for e in self.engines]
        if any(n for workers in self.plans for w in workers for n in w["unplanned"]):
            self.shm_mode = "staged"
            return self._send_staged(params, size)
        self.shm_mode = "direct"
        arenas = self._open_arenas(range(len(self.engines)))
        targets = [(arena, w["plans"]) for e, workers in enumerate(self.plans) for arena, w in zip(arenas[e], workers)]
        written = 0
        for name, t in params:
            t = t.contiguous()
            for arena, plans in targets:
                plan = plans.get(name)
                if plan is None:
                    raise ValueError(f"weight sync: trainer parameter {name!r} is not in the rollout engine's "
                                     "checkpoint; the engines must start from the trainer's model")
                written += replay(plan, t, arena)
        return written

    def _send_staged(self, params, size: int, adapter: dict | None = None) -> None:
        if not self._buffers or self._buffers[0][1].numel() < size:
            self._release_buffers()
            self._buffers = [shm.create(size, "stage") for _ in range(2)]
        pending: list[list] = [[], []]
        for k, (metas, _) in enumerate(_fill_buckets(params, [b for _, b in self._buffers], size)):
            path, _ = self._buffers[k % 2]
            pending[k % 2] = [e.load_shm.remote(path, size, metas, adapter) for e in self.engines]
            # Before the trainer refills the other buffer, its previous load must be done.
            ray.get(pending[(k + 1) % 2])
            pending[(k + 1) % 2] = []
        ray.get(pending[0] + pending[1])

    # --- broadcast ----------------------------------------------------------------------
    def _worker_rank(self, engine: int, worker: int) -> int:
        return self._group_senders + sum(i.get("tp_size", 1) for i in self.infos[:engine]) + worker

    def _ensure_group(self, senders: int) -> None:
        """The weight group: trainer ranks 0..senders-1 (all of them when sliced, rank 0 when
        gathered), then every engine's workers; rank 0 hosts its store on MASTER_ADDR."""
        if self._group is not None:
            return
        self._group_senders = senders
        addr = os.environ.get("MASTER_ADDR") or ray.util.get_node_ip_address()
        port = _ints([0])
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port[0] = s.getsockname()[1]
        if senders > 1:
            dist.broadcast(port, 0)
        world = senders + sum(i.get("tp_size", 1) for i in self.infos)
        refs = []
        if self.rank == 0:
            refs = [e.join_group.remote(addr, int(port), self._worker_rank(k, 0), world, backend.dist_backend(),
                                        self.timeout_s) for k, e in enumerate(self.engines)]
        self._group = new_group(addr, int(port), self.rank, world, backend.dist_backend(), self.timeout_s)
        ray.get(refs)
        if self.sliced and self.rank == 0:  # what each worker receives from whom, at every sync
            ray.get([e.expect.remote(self._schedules(k)) for k, e in enumerate(self.engines)])

    def _schedules(self, engine: int) -> dict:
        """{worker: its receive schedule} for one engine (``slices.receive_order``)."""
        order = {name: i for i, name in enumerate(self.layouts)}
        d = self.replica_of[engine]
        return {w: slices.receive_order({self.rank_of[(d, k)]: mine for k, mine in enumerate(pieces) if mine},
                                        order, self.bucket_bytes)
                for w, pieces in enumerate(self.pieces[engine])}

    def _send_broadcast(self, params, size: int, adapter: dict | None = None) -> None:
        self._ensure_group(1)
        buf = torch.empty(size, dtype=torch.uint8, device=backend.current_device())
        for metas, nbytes in _fill_buckets(params, [buf], size):
            refs = [e.load_broadcast.remote(metas, nbytes, adapter) for e in self.engines]
            broadcast(self._group, buf[:nbytes])
            # one bucket in flight: an engine serves calls in threads, and each call takes the
            # next broadcast, so a second one could take this bucket's bytes under its metas
            ray.get(refs)

    # --- files --------------------------------------------------------------------------
    def _send_files(self, params, size: int, adapter: dict | None = None) -> int:
        from elasticrl.files import atomic_folder
        from elasticrl.weights.shards import save_sharded

        self._files_seq = getattr(self, "_files_seq", 0) + 1
        root = Path(self.files_dir or "/tmp/elasticrl-weights")
        final = root / f"v{self._files_seq:06d}"
        dtypes = self._delta_dtypes() if self._delta is not None and adapter is None else {}
        written = 0
        with atomic_folder(final) as tmp:
            tensors = {}
            for name, t in params:
                part = slices.file_delta(self._delta, self._held, name, t, dtypes[name]) if name in dtypes else \
                    {name: t.to("cpu", copy=True)}
                tensors.update(part)
                written += sum(v.numel() * v.element_size() for v in part.values())
            save_sharded(tensors, tmp, size)
        ray.get([e.load_files.remote(str(final), adapter) for e in self.engines])
        for old in root.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return written * len(self.engines)

    def _delta_dtypes(self) -> dict[str, str]:
        """files: each tensor's dtype in the engines, where every engine worker can apply a delta
        of it through its copy plans ({} where they cannot: those syncs go whole)."""
        if self._file_dtypes is None:
            plans = [w for e in self.engines for w in ray.get(e.copy_plans.remote())]
            why = _unsliceable(plans, self.layouts) if self.layouts else "the trainer's AutoTP fuses projections"
            if why:
                log.warning("weight sync: %s; files go whole (rollout.delta_sync)", why)
            self._file_dtypes = {} if why else {name: cs[0][5] for name, cs in plans[0]["plans"].items()}
        return self._file_dtypes

    # --- teardown -----------------------------------------------------------------------
    def _release_targets(self) -> None:
        """Forget the engines' buffers and group (their processes restarted)."""
        for box in self._outboxes or ():
            if isinstance(box, slices.SharedOutbox):
                box.close()
        self._arenas = self._outboxes = self._group = self._file_dtypes = None
        self._held = {}

    def _release_buffers(self) -> None:
        for path, _ in self._buffers:
            _on_live(e.release_shm.remote(path) for e in self.engines)
            shm.release(path)
        self._buffers = []

    def close(self) -> None:
        """Release what the engines hold of this sender; an engine that died has nothing left."""
        if self._group is not None and self.rank == 0:
            _on_live(e.leave_group.remote() for e in self.engines)
        self._release_targets()
        if self.rank == 0:
            self._release_buffers()


def _peft_config(ds_engine) -> dict:
    """The trained adapter's peft config as plain JSON values (vLLM's PEFTHelper reads it)."""
    import json

    return json.loads(json.dumps(ds_engine.module.peft_config["default"].to_dict(), default=sorted))


def _unsliceable(plans: list[dict], layouts: dict) -> str | None:
    """Why the engine workers' copy ``plans`` do not all read boxes of the full tensors (None: they do)."""
    unplanned = sorted({n for w in plans for n in w["unplanned"]})
    if unplanned:
        return f"vLLM transforms {unplanned[:5]} while loading"
    return next((why for w in plans if (why := slices.sliceable(w["plans"], layouts))), None)


def _each_piece(tensors, by_name: dict, copy) -> int:
    """``copy(target, piece, tensor)`` for every piece of every tensor as it comes; after a failure
    the tensors are still walked (ZeRO-3 gathers them collectively), then it is raised."""
    sent, error = 0, None
    for name, t in tensors:
        for target, piece in by_name.get(name, ()) if error is None else ():
            try:
                sent += copy(target, piece, t)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = exc
                break
    if error is not None:
        raise error
    return sent


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
        metas.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset = shm.aligned(offset + n)
    if metas:
        yield metas, offset


