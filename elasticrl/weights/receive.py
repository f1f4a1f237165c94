"""The receiving half of the staged transports, shared by every engine kind: turn what
arrived (a shared buffer, a broadcast, a folder) into (name, tensor) pairs to load."""
from __future__ import annotations

import torch

from elasticrl.weights import shm
from elasticrl.weights.group import broadcast


def from_shm(cache: dict, path: str, nbytes: int, metas: list) -> list[tuple[str, torch.Tensor]]:
    """Views into a staging buffer (mapped once per path, kept in ``cache``)."""
    buf = cache.get(path)
    if buf is None:
        buf = cache[path] = shm.attach(path, nbytes)
    return [(name, shm.view(buf, off, shm.DTYPES[dt], tuple(shape))) for name, dt, shape, off in metas]


def from_broadcast(group, metas: list, nbytes: int, device) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast from rank 0 of the weight group."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    broadcast(group, buf)
    return [(name, shm.view(buf, off, shm.DTYPES[dt], tuple(shape))) for name, dt, shape, off in metas]


def nbytes_of(weights: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in weights)


def param_view(params: list[torch.Tensor], piece) -> torch.Tensor:
    """Where a piece (``slices.Piece``) lands in a worker's parameter."""
    p = params[piece.param].data  # not the Parameter: writing into a leaf that requires grad is refused
    assert shm.DTYPES[piece.dtype] == p.dtype, (piece.name, piece.dtype, p.dtype)
    return p.as_strided(piece.shape, piece.dst_strides, p.storage_offset() + piece.dst_off // p.element_size())


def piece_view(buf: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """A piece as packed in a received bucket (contiguous at ``offset``)."""
    return shm.view(buf, offset, shm.DTYPES[piece.dtype], piece.shape)


def receive_sliced(group, params: list[torch.Tensor], schedule, buf: torch.Tensor | None = None) -> int:
    """One sliced sync into a worker's parameters: its fills, then each bucket from its sender in
    the schedule's order (``slices.receive_order``), each piece copied where it belongs. One
    thread, as NCCL wants. ``buf``: a receive buffer kept between syncs (a fresh one per bucket
    costs its page faults every time), at least as big as the biggest bucket."""
    queue, fills = schedule
    for piece in fills:
        param_view(params, piece).fill_(piece.fill)
    if buf is None:
        buf = torch.empty(max((n for _, _, n in queue), default=0), dtype=torch.uint8, device=params[0].device)
    for sender, bucket, nbytes in queue:
        group.recv([buf[:nbytes]], sender, 0).wait()
        copy_pieces(params, buf, bucket)
    return sum(n for _, _, n in queue)


def copy_pieces(params: list[torch.Tensor], buf: torch.Tensor, bucket) -> int:
    """Each (piece, offset) of a bucket from ``buf`` into its parameter."""
    for piece, offset in bucket:
        param_view(params, piece).copy_(piece_view(buf, offset, piece))
    return sum(piece.nbytes for piece, _ in bucket)
