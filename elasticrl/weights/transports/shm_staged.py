"""``shm_staged``: engines on the trainer's node, through two /dev/shm staging buffers that rank 0
fills in turn while the engines load the other with their own loaders (whole tensors, which the
loaders may transform; adapters). Also how ``shm`` and ``ipc`` send what they cannot write
straight (adapters; loaders without copy plans; gathered ipc, as vLLM's parameters on a GPU
cannot be exported)."""
from __future__ import annotations

import ray
import torch

from elasticrl.weights import shm
from elasticrl.weights.transports import Payload, ReceiverBase, Transport


class Sender(Transport):
    name = "shm_staged"

    def __init__(self, s):
        super().__init__(s)
        self.buffers: list[tuple[str, torch.Tensor]] = []

    def send_gathered(self, params, size: int, payload: Payload) -> None:
        if not self.buffers or self.buffers[0][1].numel() < size:
            self._release_buffers()
            self.buffers = [shm.create(size, "stage") for _ in range(2)]
        pending: list[list] = [[], []]
        message = payload.message()
        for k, (metas, _) in enumerate(fill_buckets(params, [b for _, b in self.buffers], size)):
            path, _ = self.buffers[k % 2]
            # the staging transport's receivers, whichever transport stages through it
            pending[k % 2] = [e.weights.remote(Sender.name, "load", path, size, metas, message) for e in self.s.engines]
            # Before the trainer refills the other buffer, its previous load must be done.
            ray.get(pending[(k + 1) % 2])
            pending[(k + 1) % 2] = []
        ray.get(pending[0] + pending[1])

    def _release_buffers(self) -> None:
        for path, _ in self.buffers:
            on_live(e.weights.remote(Sender.name, "drop", path) for e in self.s.engines)
            shm.release(path)
        self.buffers = []

    def close(self) -> None:
        if self.s.rank == 0:
            self._release_buffers()


class Receiver(ReceiverBase):
    def __init__(self, worker):
        super().__init__(worker)
        self.buffers: dict[str, torch.Tensor] = {}  # mapped once per path

    def load(self, path: str, nbytes: int, metas: list, message: dict) -> int:
        """A staged bucket: (name, dtype, shape, offset) views into the buffer at ``path``."""
        buf = self.buffers.get(path)
        if buf is None:
            buf = self.buffers[path] = shm.attach(path, nbytes)
        return self.worker.erl_land(unpack_bucket(buf, metas), message)

    def drop(self, path: str) -> None:
        self.buffers.pop(path, None)

    def release(self) -> None:
        self.buffers = {}


def fill_buckets(params, buffers: list[torch.Tensor], size: int):
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


def unpack_bucket(buf: torch.Tensor, metas: list) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a bucket that ``fill_buckets`` packed."""
    return [(name, shm.view(buf, off, shm.DTYPES[dt], tuple(shape))) for name, dt, shape, off in metas]


def on_live(refs) -> None:
    """Wait for calls on engines, of which some may have died (the pool replaces those)."""
    for ref in list(refs):
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass
