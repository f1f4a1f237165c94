"""``broadcast``: a process group of the senders and every engine worker (gloo on CPU, NCCL on
GPUs), for engines anywhere. Sliced: each sender sends each worker its pieces point to point,
in buckets in the order the worker expects them (``slices.receive_order``; with a delta, each
bucket's counts first); gathered: rank 0 broadcasts buckets of whole tensors, which the workers
load with their loaders."""
from __future__ import annotations

import os
import socket

import ray
import torch

from elasticrl import backend
from elasticrl.weights import slices
from elasticrl.weights.group import broadcast, new_group
from elasticrl.weights.receive import copy_pieces, param_view
from elasticrl.weights.slices import Buckets, Piece, packed_bucket_nbytes
from elasticrl.weights.transports import Payload, ReceiverBase, Transport, each_piece, shm_staged


class Sender(Transport):
    name = "broadcast"
    sliced = True

    def __init__(self, s):
        super().__init__(s)
        self.group = self.outboxes = None

    def delta_pays(self) -> bool:
        return bool(self.s.sliced)

    def send_sliced(self, tensors, mine, payload: Payload) -> int:
        if self.outboxes is None:
            self._join(self.s.world)
            device = backend.current_device()
            self.outboxes = [Outbox(self.group, self._worker_rank(e, w), pieces, self.s.bucket_bytes, device)
                             for e, w, pieces in mine]
        refs = self.call_all("receive", payload.message()) if self.s.rank == 0 else []
        sent = each_piece(tensors, [(box, box.pieces) for box in self.outboxes],
                          lambda box, piece, t: box.put(piece, t, payload.delta))
        ray.get(refs)
        return sent

    def send_gathered(self, params, size: int, payload: Payload) -> None:
        self._join(1)
        buf = torch.empty(size, dtype=torch.uint8, device=backend.current_device())
        message = payload.message()
        for metas, nbytes in shm_staged.fill_buckets(params, [buf], size):
            refs = self.call_all("load", metas, nbytes, message)
            broadcast(self.group, buf[:nbytes])
            # one bucket in flight: an engine serves calls in threads, and each call takes the
            # next broadcast, so a second one could take this bucket's bytes under its metas
            ray.get(refs)

    def _worker_rank(self, engine: int, worker: int) -> int:
        return self.senders + sum(i.get("tp_size", 1) for i in self.s.infos[:engine]) + worker

    def _join(self, senders: int) -> None:
        """The weight group: trainer ranks 0..senders-1 (all of them when sliced, rank 0 when
        gathered), then every engine's workers; rank 0 hosts its store on MASTER_ADDR."""
        if self.group is not None:
            return
        s = self.s
        self.senders = senders
        addr = os.environ.get("MASTER_ADDR") or ray.util.get_node_ip_address()
        port = torch.zeros(1, dtype=torch.int64, device=backend.current_device())
        if s.rank == 0:
            with socket.socket() as sock:
                sock.bind(("", 0))
                port[0] = sock.getsockname()[1]
        if senders > 1:
            torch.distributed.broadcast(port, 0)
        world = senders + sum(i.get("tp_size", 1) for i in s.infos)
        refs = [self.call(k, "join", addr, int(port), self._worker_rank(k, 0), world, backend.dist_backend(),
                          s.timeout_s) for k in range(len(s.engines))] if s.rank == 0 else []
        self.group = new_group(addr, int(port), s.rank, world, backend.dist_backend(), s.timeout_s)
        ray.get(refs)
        if s.sliced and s.rank == 0:  # what each worker receives from whom, at every sync
            ray.get([self.call(k, "expect", self._schedules(k)) for k in range(len(s.engines))])

    def _schedules(self, engine: int) -> dict:
        """{worker: its receive schedule} for one engine (``slices.receive_order``)."""
        s = self.s
        order = {name: i for i, name in enumerate(s.layouts)}
        d = s.replica_of[engine]
        return {w: slices.receive_order({s.rank_of[(d, k)]: mine for k, mine in enumerate(pieces) if mine},
                                        order, s.bucket_bytes)
                for w, pieces in enumerate(s.pieces[engine])}

    def forget(self) -> None:
        for box in self.outboxes or ():
            box.forget()

    def release(self) -> None:
        self.group = self.outboxes = None

    def close(self) -> None:
        if self.group is not None and self.s.rank == 0:
            shm_staged.on_live(self.call_all("leave"))
        self.release()


class Outbox(Buckets):
    """One sender's buckets for one worker, sent point to point when full (with a ``Delta``:
    the counts first, then the packed bytes)."""

    def __init__(self, group, dst: int, pieces: list[Piece], bucket_bytes: int, device):
        super().__init__(pieces, bucket_bytes)
        self.group, self.dst = group, dst
        self.buf = torch.empty(self.size, dtype=torch.uint8, device=device)

    def put(self, piece: Piece, t: torch.Tensor, delta=None) -> int:
        """The bytes sent (a delta's counts included)."""
        if piece.fill is not None:
            return 0  # the worker applies constants itself
        done = self.pack(self.buf, piece, t, delta)
        if done is None:
            return piece.nbytes if delta is None else 0
        nbytes, counts = done
        if counts is not None:
            self.group.send([torch.tensor(counts, dtype=torch.int64, device=self.buf.device)], self.dst, 0).wait()
        if nbytes:
            self.group.send([self.buf[:nbytes]], self.dst, 0).wait()
        return piece.nbytes if counts is None else nbytes + 8 * len(counts)


class Receiver(ReceiverBase):
    def __init__(self, worker):
        super().__init__(worker)
        self.group = self.schedule = self.inbox = None

    def join(self, addr: str, port: int, rank_offset: int, world_size: int, backend_name: str, timeout_s: int) -> None:
        """Join the weight group: the sending trainer ranks come first, engine workers follow."""
        self.group = new_group(addr, port, rank_offset + self.worker.erl_rank(), world_size, backend_name, timeout_s)

    def expect(self, schedules: dict) -> None:
        """What this worker receives at every sliced sync: (sender's group rank, bucket of (piece,
        offset), bytes) in the order to receive them, and constant fills (``Sender._schedules``)."""
        rank = self.worker.erl_rank()
        self.schedule = slices.revive(schedules[rank] if rank in schedules else schedules[str(rank)])

    def receive(self, message: dict) -> int:
        """One sliced sync from the senders (``receive_sliced``)."""
        params = self.worker.erl_params()
        need = max((n for _, _, n in self.schedule[0]), default=0)
        if self.inbox is None or self.inbox.numel() < need:
            self.inbox = torch.empty(need, dtype=torch.uint8, device=params[0].device)
        try:
            return receive_sliced(self.group, params, self.schedule, self.inbox, message["kind"] == "delta")
        except BaseException:
            # close this worker's side: a sender blocked on it gets "connection closed" at once
            # instead of waiting out the group's timeout
            import gc

            self.group = None
            gc.collect()
            raise

    def load(self, metas: list, nbytes: int, message: dict) -> int:
        """One bucket broadcast from rank 0 (the gathered path: whole tensors, sliced by the
        worker's loaders; or an adapter's tensors)."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.worker.erl_device())
        broadcast(self.group, buf)
        self.worker.erl_land(shm_staged.unpack_bucket(buf, metas), message)
        return nbytes

    def leave(self) -> None:
        self.group = None

    def release(self) -> None:
        self.group = self.inbox = None


def receive_sliced(group, params: list[torch.Tensor], schedule, buf: torch.Tensor | None = None,
                   delta: bool = False) -> int:
    """One sliced sync into a worker's parameters: its fills, then each bucket from its sender in
    the schedule's order, each piece copied where it belongs; with ``delta``, each bucket's
    counts come first, then its packed bytes (``slices.Delta``). One thread, as NCCL wants.
    ``buf``: a receive buffer kept between syncs (a fresh one per bucket costs its page faults
    every time), at least as big as the biggest bucket."""
    queue, fills = schedule
    for piece in fills:
        param_view(params, piece).fill_(piece.fill)
    if buf is None:
        buf = torch.empty(max((n for _, _, n in queue), default=0), dtype=torch.uint8, device=params[0].device)
    received = 0
    for sender, bucket, nbytes in queue:
        counts = None
        if delta:
            head = torch.empty(len(bucket), dtype=torch.int64, device=buf.device)
            group.recv([head], sender, 0).wait()
            counts = head.tolist()
            nbytes = packed_bucket_nbytes(bucket, counts)
        if nbytes:
            group.recv([buf[:nbytes]], sender, 0).wait()
        copy_pieces(params, buf, bucket, counts)
        received += nbytes
    return received
