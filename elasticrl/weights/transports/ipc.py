"""``ipc``: engines on the trainer's node with GPUs (colocated on the trainer's own devices, where
NCCL refuses two ranks on one device; on CPU the same protocol runs over /dev/shm). Each sender
fills buckets of its pieces in two buffers of its own in turn, which the workers map (CUDA IPC)
and copy into vLLM's parameters while it fills the other: vLLM's sleep-mode memory cannot be
exported, so the copies land in vLLM's own parameters and sleep and wake keep working. Whole
tensors (adapters, the gathered layout) go staged (``shm_staged``)."""
from __future__ import annotations

import functools

import ray
import torch

from elasticrl import backend
from elasticrl.weights import shm
from elasticrl.weights.receive import copy_pieces
from elasticrl.weights.slices import Buckets, Piece, revive_bucket
from elasticrl.weights.transports import Payload, ReceiverBase, Transport, each_piece, shm_staged


class Sender(Transport):
    name = "ipc"
    sliced = True

    def __init__(self, s):
        super().__init__(s)
        self.outboxes: list[SharedOutbox] | None = None
        self.staged = shm_staged.Sender(s)

    def delta_pays(self) -> bool:
        return bool(self.s.sliced) and backend.has_gpu()  # between GPUs; a CPU's copy is cheaper than the comparison

    def send_sliced(self, tensors, mine, payload: Payload) -> int:
        if self.outboxes is None:
            device = backend.current_device()
            self.outboxes = [SharedOutbox(functools.partial(self.call, e, "load_pieces"), self.s.rank, w, pieces,
                                          self.s.bucket_bytes, device) for e, w, pieces in mine]
        sent = each_piece(tensors, [(box, box.pieces) for box in self.outboxes],
                          lambda box, piece, t: box.put(piece, t, payload.delta))
        for box in self.outboxes:
            box.finish()
        return sent

    def send_gathered(self, params, size: int, payload: Payload) -> None:
        return self.staged.send_gathered(params, size, payload)

    def forget(self) -> None:
        for box in self.outboxes or ():
            box.forget()

    def release(self) -> None:
        for box in self.outboxes or ():
            box.close()
        self.outboxes = None

    def close(self) -> None:
        self.release()
        self.staged.close()


class SharedOutbox(Buckets):
    """One sender's buckets for one worker, handed over through two shared buffers in turn (CUDA
    IPC on a GPU, /dev/shm on CPU): the sender fills one while the worker copies out of the
    other. ``load(worker, sender, slot, handle, bucket, counts)`` returns a Ray ref that is
    ready once the worker copied that bucket out."""

    def __init__(self, load, sender: int, worker: int, pieces: list[Piece], bucket_bytes: int, device, wait=None):
        """``wait(ref)``: block until the worker is done with a bucket (default ``ray.get``)."""
        super().__init__(pieces, bucket_bytes)
        self.load, self.sender, self.worker = load, sender, worker
        self.wait = wait or ray.get
        self.buffers = [shm.share(max(self.size, 1), device) for _ in range(2)]
        self.turn, self.pending = 0, [None, None]

    def put(self, piece: Piece, t: torch.Tensor, delta=None) -> int:
        if piece.fill is not None:
            return 0  # constants: the padding the engine zeroed at load, which no sync writes
        if self.pending[self.turn] is not None:  # the worker is done with this buffer's last bucket
            self.wait(self.pending[self.turn])
            self.pending[self.turn] = None
        handle, buf = self.buffers[self.turn]
        done = self.pack(buf, piece, t, delta)
        if done is None:
            return piece.nbytes if delta is None else 0
        nbytes, counts = done
        backend.synchronize()  # the bytes are in before the worker reads them
        bucket = self.where[id(piece)][1]
        self.pending[self.turn] = self.load(self.worker, self.sender, self.turn, handle, bucket, counts)
        self.turn = 1 - self.turn
        return piece.nbytes if counts is None else nbytes

    def finish(self) -> None:
        for ref in self.pending:
            if ref is not None:
                self.wait(ref)
        self.pending = [None, None]

    def close(self) -> None:
        for handle, _ in self.buffers:
            shm.unshare(handle)


class Receiver(ReceiverBase):
    def __init__(self, worker):
        super().__init__(worker)
        self.mapped: dict = {}  # (sender, slot): (handle, its buffer mapped here)

    def load_pieces(self, worker: int, sender: int, slot: int, handle: list, bucket: list,
                    counts: list | None = None) -> int:
        """One bucket for worker ``worker`` (the others return): copy its pieces (``counts``:
        packed as deltas) out of the sender's shared buffer into the parameters, and finish
        before returning (the sender refills the buffer after)."""
        if self.worker.erl_rank() != worker:
            return 0
        key, plain = (int(sender), int(slot)), _plain(handle)
        if key not in self.mapped or self.mapped[key][0] != plain:
            self.mapped[key] = (plain, shm.open_shared(plain))
        n = copy_pieces(self.worker.erl_params(), self.mapped[key][1], revive_bucket(bucket), counts)
        backend.synchronize()
        return n

    def release(self) -> None:
        self.mapped = {}


def _plain(handle):
    """A handle as sent: vLLM's messages turn its tuples into lists."""
    return [_plain(h) for h in handle] if isinstance(handle, (list, tuple)) else handle
