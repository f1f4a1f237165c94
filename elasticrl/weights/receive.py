"""The receiving half of the staged transports, shared by every engine kind: turn what
arrived (a shared buffer, a broadcast, a folder) into (name, tensor) pairs to load."""
from __future__ import annotations

import torch

from elasticrl.weights import shm
from elasticrl.weights.group import broadcast
from elasticrl.weights.slices import DELTA_KEYS, packed_bucket_nbytes, replay_delta, unpack


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
    assert shm.DTYPES[piece.dtype] == params[piece.param].dtype, (piece.name, piece.dtype)
    return part_of(params, piece.param, piece.dst_off, piece.shape, piece.dst_strides)


def part_of(params: list[torch.Tensor], param: int, offset: int, shape, strides) -> torch.Tensor:
    """A view of parameter ``param`` at a byte offset."""
    p = params[param].data  # not the Parameter: writing into a leaf that requires grad is refused
    return p.as_strided(shape, strides, p.storage_offset() + offset // p.element_size())


def from_files(folder: str, params: list[torch.Tensor], plans: dict | None) -> list[tuple[str, torch.Tensor]]:
    """A synced folder's whole tensors to load; its deltas (``slices.file_delta``) applied here,
    through the worker's copy ``plans``."""
    from functools import partial

    from elasticrl.weights.shards import iter_tensors

    tensors = dict(iter_tensors(folder))
    index_key, values_key, shape_key = DELTA_KEYS
    for name in [n.removesuffix(index_key) for n in tensors if n.endswith(index_key)]:
        if plans is None:
            raise RuntimeError(f"weight sync: a delta of {name!r} came to a worker without copy plans")
        replay_delta(plans[name], tensors[name + index_key], tensors[name + values_key], tensors[name + shape_key],
                     partial(part_of, params))
    return [(n, t) for n, t in tensors.items() if not n.endswith(DELTA_KEYS)]


def piece_view(buf: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """A piece as packed in a received bucket (contiguous at ``offset``)."""
    return shm.view(buf, offset, shm.DTYPES[piece.dtype], piece.shape)


def receive_sliced(group, params: list[torch.Tensor], schedule, buf: torch.Tensor | None = None,
                   delta: bool = False) -> int:
    """One sliced sync into a worker's parameters: its fills, then each bucket from its sender in
    the schedule's order (``slices.receive_order``), each piece copied where it belongs; with
    ``delta``, each bucket's counts come first, then its packed bytes (``slices.Delta``). One
    thread, as NCCL wants. ``buf``: a receive buffer kept between syncs (a fresh one per bucket
    costs its page faults every time), at least as big as the biggest bucket."""
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


def copy_pieces(params: list[torch.Tensor], buf: torch.Tensor, bucket, counts: list[int] | None = None) -> int:
    """Each (piece, offset) of a bucket from ``buf`` into its parameter; with ``counts``, the
    pieces are packed one after another, each whole or a delta (``slices.unpack``)."""
    if counts is None:
        for piece, offset in bucket:
            param_view(params, piece).copy_(piece_view(buf, offset, piece))
        return sum(piece.nbytes for piece, _ in bucket)
    offset = 0
    for (piece, _), count in zip(bucket, counts):
        offset = shm.aligned(offset + unpack(param_view(params, piece), buf[offset:], int(count)))
    return offset
