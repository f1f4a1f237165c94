"""The receiving half of the staged transports, shared by every engine kind: turn what
arrived (a shared buffer, a broadcast, a folder) into (name, tensor) pairs to load."""
from __future__ import annotations

import torch

from elasticrl.weights import shm
from elasticrl.weights.group import broadcast

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def from_shm(cache: dict, path: str, nbytes: int, metas: list) -> list[tuple[str, torch.Tensor]]:
    """Views into a staging buffer (mapped once per path, kept in ``cache``)."""
    buf = cache.get(path)
    if buf is None:
        buf = cache[path] = shm.attach(path, nbytes)
    return [(name, shm.view(buf, off, _DTYPES[dt], tuple(shape))) for name, dt, shape, off in metas]


def from_broadcast(group, metas: list, nbytes: int, device) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast from rank 0 of the weight group."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    broadcast(group, buf)
    return [(name, shm.view(buf, off, _DTYPES[dt], tuple(shape))) for name, dt, shape, off in metas]


def nbytes_of(weights: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in weights)
