"""Where pieces land in an engine worker's parameters, shared by the transports' receivers:
views of a parameter at a byte offset, and a bucket's pieces copied (or unpacked, as deltas)
into them."""
from __future__ import annotations

import torch

from elasticrl.weights import shm
from elasticrl.weights.slices import unpack


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


def piece_view(buf: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """A piece as packed in a received bucket (contiguous at ``offset``)."""
    return shm.view(buf, offset, shm.DTYPES[piece.dtype], piece.shape)


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
