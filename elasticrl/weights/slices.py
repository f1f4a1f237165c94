"""Slice-to-slice weight sync: which part of which trainer rank's tensor lands where in which
engine worker, without assembling a full tensor anywhere.

A trainer rank under AutoTP holds a *box* of each full tensor: rows ``[a, b)`` of a
column-parallel weight, columns of a row-parallel one, or all of a replicated one. Each copy
of an engine worker's copy plan (``plan.py``) reads a box of the full tensor too (vLLM's
loaders narrow, they never reshape). A piece is the intersection of the two: the sender copies
that sub-box of its own slice into that sub-box of the worker's parameter. With trainer TP
size T and engine TP size T', the pieces reshard any T into any T' (2 -> 2 is one piece per
tensor and worker, 2 -> 1 two, 1 -> 2 one half each); a tensor every sender holds whole is
sent by one of them, chosen to balance bytes.

The arithmetic is on shapes and strides alone: the senders (``sync.py``) and the receiving
workers (``receive.py``) derive the same pieces and buckets from the same inputs. Nothing
here needs Ray, DeepSpeed or vLLM (``scripts/sync_check.py`` runs it between plain processes).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from elasticrl.weights.plan import Copy

Box = tuple[tuple[int, int], ...]


class Layout(NamedTuple):
    """How the trainer's ranks hold one tensor: its full shape and, when AutoTP cut it, the
    dimension and each tensor-parallel rank's share along it."""
    full_shape: tuple[int, ...]
    dim: int | None = None
    sizes: tuple[int, ...] = ()

    def box(self, tp_rank: int) -> Box:
        full = [(0, n) for n in self.full_shape]
        if self.dim is not None:
            start = sum(self.sizes[:tp_rank])
            full[self.dim] = (start, start + self.sizes[tp_rank])
        return tuple(full)


class Piece(NamedTuple):
    """One strided copy: from the sender's local tensor of ``name`` (element offset and strides)
    into a worker's parameter ``param`` (byte offset and element strides), or a constant fill."""
    name: str
    shape: tuple[int, ...]
    src_off: int
    src_strides: tuple[int, ...]
    param: int
    dst_off: int
    dst_strides: tuple[int, ...]
    dtype: str
    fill: float | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return 0 if self.fill is not None else n * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    from elasticrl.weights.shm import DTYPES

    return DTYPES[dtype].itemsize


def copy_nbytes(copy: Copy) -> int:
    """The bytes a copy of a copy plan writes (a fill: none)."""
    n = 1
    for s in copy[3]:
        n *= s
    return 0 if copy[0] == "fill" else n * _itemsize(copy[5])


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def view_box(full_shape, offset: int, shape, strides) -> Box | None:
    """The box of a contiguous ``full_shape`` tensor that a view (element offset, shape,
    strides) covers; None when the view is not a box (a transpose, a reshape, a broadcast)."""
    base = contiguous_strides(full_shape)
    if len(shape) != len(full_shape) or any(n > 1 and s != b for n, s, b in zip(shape, strides, base)):
        return None
    starts = []
    for b in base:
        starts.append(offset // b)
        offset %= b
    box = tuple((s, s + n) for s, n in zip(starts, shape))
    return box if all(hi <= f for (_, hi), f in zip(box, full_shape)) else None


def sliceable(plans: dict[str, list[Copy]], layouts: dict[str, Layout]) -> str | None:
    """None when every copy of every planned tensor reads a box of the full tensor; else why not."""
    for name, layout in layouts.items():
        for kind, _, _, dst_shape, _, _, src_off, src_shape, src_strides in plans.get(name, []):
            if kind == "copy" and (list(src_shape) != list(dst_shape) or
                                   view_box(layout.full_shape, int(src_off), src_shape, src_strides) is None):
                return f"{name}: vLLM's loader reads it through a view that is not a slice"
    return None


def worker_pieces(plans: dict[str, list[Copy]], layouts: dict[str, Layout], tp_size: int,
                  load: list[int]) -> list[list[Piece]]:
    """For one engine worker: the pieces each of the sender group's ``tp_size`` ranks copies,
    in the trainer's tensor order. ``load`` (bytes per sender, updated) balances the tensors
    that every sender holds whole across the engine's workers and engines fed by the group."""
    out: list[list[Piece]] = [[] for _ in range(tp_size)]
    for name, layout in layouts.items():
        copies = plans.get(name)
        if copies is None:
            raise ValueError(f"weight sync: trainer parameter {name!r} is not in the rollout engine's "
                             "checkpoint; the engines must start from the trainer's model")
        senders = range(tp_size) if layout.dim is not None else [min(range(tp_size), key=lambda k: load[k])]
        for k in senders:
            mine = layout.box(k)
            local = contiguous_strides([hi - lo for lo, hi in mine])
            for kind, param, dst_off, dst_shape, dst_strides, dtype, src_off, src_shape, src_strides in copies:
                if kind == "fill":
                    if k == senders[0]:
                        out[k].append(Piece(name, tuple(dst_shape), 0, (), param, dst_off, tuple(dst_strides), dtype,
                                            float(src_off)))
                    continue
                wanted = view_box(layout.full_shape, int(src_off), src_shape, src_strides)
                cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(mine, wanted))
                if any(lo >= hi for lo, hi in cut):
                    continue
                piece = Piece(name, tuple(hi - lo for lo, hi in cut),
                              sum((lo - m) * s for (lo, _), (m, _), s in zip(cut, mine, local)), local, param,
                              dst_off + _itemsize(dtype) * sum((lo - w) * s for (lo, _), (w, _), s in
                                                               zip(cut, wanted, dst_strides)),
                              tuple(dst_strides), dtype)
                out[k].append(piece)
                load[k] += piece.nbytes
    return out


def buckets(pieces: list[Piece], bucket_bytes: int) -> list[list[tuple[Piece, int]]]:
    """Pack the pieces with bytes into buckets of at most ``bucket_bytes`` (a bigger piece
    gets one of its own), each piece at a 64-byte aligned offset."""
    out: list[list[tuple[Piece, int]]] = [[]]
    offset = 0
    for p in pieces:
        if p.fill is not None:
            continue
        if out[-1] and offset + p.nbytes > bucket_bytes:
            out.append([])
            offset = 0
        out[-1].append((p, offset))
        offset = _aligned(offset + p.nbytes)
    return [b for b in out if b]


def places(pieces: list[Piece], bucket_bytes: int) -> tuple[dict[int, tuple], int]:
    """{id(piece): (offset, its bucket when the piece ends it, else None)} and the biggest bucket."""
    where, size = {}, 0
    for bucket in buckets(pieces, bucket_bytes):
        size = max(size, bucket_nbytes(bucket))
        for i, (piece, offset) in enumerate(bucket):
            where[id(piece)] = (offset, bucket if i == len(bucket) - 1 else None)
    return where, size


def bucket_nbytes(bucket: list[tuple[Piece, int]]) -> int:
    last, offset = bucket[-1]
    return offset + last.nbytes


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def assign(engine_bytes: list[int], num_groups: int) -> list[int]:
    """The sender group of each engine: the biggest engines first, each to the group with the
    fewest bytes so far (ties to the lowest group), so the bytes per sender are balanced."""
    load = [0] * num_groups
    group = [0] * len(engine_bytes)
    for e in sorted(range(len(engine_bytes)), key=lambda i: (-engine_bytes[i], i)):
        g = min(range(num_groups), key=lambda j: (load[j], j))
        group[e] = g
        load[g] += engine_bytes[e]
    return group


def receive_order(pieces_by_sender: dict[int, list[Piece]], order: dict[str, int],
                  bucket_bytes: int) -> tuple[list, list[Piece]]:
    """One worker's schedule: [(sender, bucket, bytes)] in the order to receive, and its fills.
    A sender sends a bucket as soon as it holds the bucket's last tensor, so receiving by (that
    tensor's place in the trainer's ``order``, sender) never waits on a send that comes later."""
    queue, fills = [], []
    for sender, pieces in pieces_by_sender.items():
        fills += [p for p in pieces if p.fill is not None]
        queue += [(order[b[-1][0].name], sender, b, bucket_nbytes(b)) for b in buckets(pieces, bucket_bytes)]
    return [(sender, b, n) for _, sender, b, n in sorted(queue, key=lambda q: q[:2])], fills


def revive(schedule) -> tuple[list, list[Piece]]:
    """A schedule as it arrives in a worker process: vLLM's messages turn tuples into lists."""
    queue, fills = schedule
    return [(int(sender), revive_bucket(bucket), int(n)) for sender, bucket, n in queue], [Piece(*p) for p in fills]


def revive_bucket(bucket) -> list[tuple[Piece, int]]:
    return [(Piece(*p), int(off)) for p, off in bucket]


def source_view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A piece of the sender's local tensor."""
    return t.as_strided(piece.shape, piece.src_strides, t.storage_offset() + piece.src_off)


def write_piece(arena, piece: Piece, t: torch.Tensor, delta: "Delta | None" = None) -> int:
    """Copy a piece straight into a worker's parameters mapped here (``plan.Arena``); with a
    ``delta``, only its elements that changed."""
    dst = arena.view(piece.param, piece.dst_off, piece.shape, piece.dst_strides, piece.dtype)
    if piece.fill is not None:
        dst.fill_(piece.fill)
        return 0
    if delta is not None:
        return delta.write(dst, source_view(t, piece))
    dst.copy_(source_view(t, piece))
    return piece.nbytes


class Delta:
    """Delta weight sync where the sender reaches the engine's parameters (``shm``): an element
    is written only where the trainer's value, cast to the engine's dtype, differs from the one
    the engine holds, bit for bit; a tensor whose changed elements, as (int32 index, value)
    pairs, would take more bytes than the whole tensor is copied whole. Comparing with what the
    engine holds, not with a remembered copy, makes every sync exact: after a restart or a
    recovery as after any other. Counts the elements seen and changed."""

    BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self):
        self.changed = self.total = 0

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """``src`` into ``dst`` where they differ; the bytes a message of the change would hold."""
        new = src.to(dst.dtype)
        bits = self.BITS[dst.element_size()]
        changed = new.view(bits) != dst.view(bits)
        n, size = int(changed.sum()), dst.element_size()
        self.changed, self.total = self.changed + n, self.total + dst.numel()
        if n * (size + 4) >= dst.numel() * size:
            dst.copy_(new)
            return dst.numel() * size
        if n:
            dst[changed] = new[changed]
        return n * (size + 4)


class Outbox:
    """One sender's buckets for one worker, filled piece by piece as the tensors come and sent
    point to point when full: exactly the buckets the worker expects (``receive_order``)."""

    def __init__(self, group, dst: int, pieces: list[Piece], bucket_bytes: int, device):
        self.group, self.dst = group, dst
        self.pieces = pieces
        self.where, size = places(pieces, bucket_bytes)
        self.buf = torch.empty(size, dtype=torch.uint8, device=device)

    def put(self, piece: Piece, t: torch.Tensor) -> int:
        if piece.fill is not None:
            return 0  # the worker applies constants itself
        offset, bucket = self.where[id(piece)]
        src = source_view(t, piece)
        self.buf[offset: offset + piece.nbytes].view(src.dtype).view(piece.shape).copy_(src)
        if bucket is not None:
            self.group.send([self.buf[:bucket_nbytes(bucket)]], self.dst, 0).wait()
        return piece.nbytes


class SharedOutbox:
    """One sender's buckets for one worker, handed over through two shared buffers in turn (CUDA
    IPC on a GPU, /dev/shm on CPU): the sender fills one while the worker copies out of the
    other. ``load(worker, sender, slot, handle, bucket)`` returns a Ray ref that is ready once
    the worker copied that bucket out. The buffers are the sender's: vLLM's sleep-mode memory
    cannot be exported over CUDA IPC, so the copies land in vLLM's own parameters, and sleep
    and wake keep working."""

    def __init__(self, load, sender: int, worker: int, pieces: list[Piece], bucket_bytes: int, device, wait=None):
        """``wait(ref)``: block until the worker is done with a bucket (default ``ray.get``)."""
        from elasticrl.weights import shm

        self.load, self.sender, self.worker, self.pieces = load, sender, worker, pieces
        self.wait = wait or _ray_get
        self.where, size = places(pieces, bucket_bytes)
        self.buffers = [shm.share(max(size, 1), device) for _ in range(2)]
        self.turn, self.pending = 0, [None, None]

    def put(self, piece: Piece, t: torch.Tensor) -> int:
        from elasticrl import backend

        if piece.fill is not None:
            return 0  # constants: the padding the engine zeroed at load, which no sync writes
        offset, bucket = self.where[id(piece)]
        if self.pending[self.turn] is not None:  # the worker is done with this buffer's last bucket
            self.wait(self.pending[self.turn])
            self.pending[self.turn] = None
        handle, buf = self.buffers[self.turn]
        src = source_view(t, piece)
        buf[offset: offset + piece.nbytes].view(src.dtype).view(piece.shape).copy_(src)
        if bucket is not None:
            backend.synchronize()  # the bytes are in before the worker reads them
            self.pending[self.turn] = self.load(self.worker, self.sender, self.turn, handle, bucket)
            self.turn = 1 - self.turn
        return piece.nbytes

    def finish(self) -> None:
        for ref in self.pending:
            if ref is not None:
                self.wait(ref)
        self.pending = [None, None]

    def close(self) -> None:
        from elasticrl.weights import shm

        for handle, _ in self.buffers:
            shm.unshare(handle)


def _ray_get(ref):
    import ray

    return ray.get(ref)
