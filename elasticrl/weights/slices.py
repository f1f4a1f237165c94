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

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
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
    return _dtype(dtype).itemsize


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


class Delta:
    """Delta weight sync: send only the *units* of a tensor whose bits, cast to the engine's
    dtype, differ from what this sender last sent that target (``held``: one copy of what it
    sends, in the engine's dtype, where the sender's tensor lives), which the target ``unpack``s.
    A unit is an 8-byte word of elements (4 bf16, 2 fp32) where the tensor's size allows
    (``unit``), else one element: comparing, finding and moving words costs a third less than
    elements, for at most a unit's extra bytes per change. A tensor whose changed units, as
    (int32 index, value) pairs, would take as many bytes as the whole goes whole. Counts the
    elements seen and changed (in units) over one sync."""

    def __init__(self):
        self.changed = self.total = 0

    def pack(self, held: dict, key, src: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> tuple[int, int]:
        """``src`` cast to ``dtype`` against ``held[key]`` (then updated), into the bytes ``out``:
        the whole tensor (count -1, at the first sync of this target) or the changed units'
        flat int32 indices followed by their values (count n). Returns (count, bytes)."""
        new = src.to(dtype).contiguous()
        k = unit(new.numel(), new.element_size())
        if new.storage_offset() % k:
            new = new.clone()  # a word's elements must start on a word
        old = held.get(key)
        self.total += new.numel()
        count = -1
        if old is None:
            held[key] = new.clone() if new.data_ptr() == src.data_ptr() else new
        else:
            size = new.element_size()  # whole once the pairs (and the padding) would take more bytes
            found = changed_units(new, old, (new.numel() * size - 4) // (4 + k * size))
            if found is not None:
                count = found[0].numel()
                out[:4 * count].view(torch.int32).copy_(found[0])
                out[index_bytes(count): packed_nbytes(new, count)].view(dtype).copy_(found[1])
        self.changed += new.numel() if count < 0 else count * k
        if count < 0:
            out[:packed_nbytes(new, -1)].view(dtype).view(new.shape).copy_(new)
        return count, packed_nbytes(new, count)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
HEAD = 1 << 14  # units sampled first
CHUNK_BYTES = 1 << 20  # compared at a time on a CPU: both sides' bytes stay in its caches (measured best)


def unit(numel: int, itemsize: int) -> int:
    """Elements per unit of a delta: an 8-byte word where the tensor is whole words, else one."""
    k = max(1, 8 // itemsize)
    return k if numel % k == 0 else 1


def changed_units(new: torch.Tensor, old: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat int32 indices of the units (``unit``) of ``new`` whose bits differ from ``old``'s
    (both contiguous, one dtype, starting on a unit), and those units' elements, each written
    into ``old``; None when more than ``limit`` differ, or the first ``HEAD`` units' share says
    they will (``old`` then takes ``new`` whole: a dense change costs its comparison more than a
    copy). A GPU compares the whole tensor at once; a CPU in numpy (whose nonzero is 2x torch's)
    a cache-sized chunk at a time, the chunks shared out among the rank's threads (numpy lets go
    of the GIL)."""
    k = unit(new.numel(), new.element_size())
    words = BITS[new.element_size() * k]
    if new.device.type != "cpu":
        x, y = new.view(-1).view(words), old.view(-1).view(words)
        index = (x != y).nonzero().view(-1)
        if index.numel() > limit:
            old.copy_(new)
            return None
        y[index] = x[index]
        return index.int(), x[index].view(new.dtype)
    x, y = (t.view(-1).view(words).numpy() for t in (new, old))
    head = min(x.size, HEAD)  # a dense change (as after a large step) is seen in its first units
    if np.count_nonzero(x[:head] != y[:head]) * x.size > limit * head:
        y[:] = x
        return None
    chunk = max(1, CHUNK_BYTES // x.itemsize)
    starts = list(range(0, x.size, chunk))
    threads = min(torch.get_num_threads(), len(starts))
    compare = functools.partial(_changed_chunks, x, y, chunk)
    parts = list(_pool().map(compare, [starts[i::threads] for i in range(threads)])) if threads > 1 \
        else [compare(starts)]
    found = sorted((part for p in parts for part in p), key=lambda part: part[0])
    if sum(len(i) for _, i, _ in found) > limit:
        y[:] = x
        return None
    if not found:
        return torch.zeros(0, dtype=torch.int32), new.new_empty(0)
    return (torch.from_numpy(np.concatenate([i for _, i, _ in found])),
            torch.from_numpy(np.concatenate([v for _, _, v in found])).view(new.dtype))


def _changed_chunks(x: np.ndarray, y: np.ndarray, chunk: int, starts: list[int]) -> list:
    """``changed_units``' work on the chunks at ``starts``: (start, indices, values) of each."""
    out = []
    for start in starts:
        xs, ys = x[start:start + chunk], y[start:start + chunk]
        index = np.flatnonzero(xs != ys)
        if index.size:
            values = np.take(xs, index)
            np.put(ys, index, values)
            out.append((start, (index + start).astype(np.int32), values))
    return out


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(2, torch.get_num_threads()), thread_name_prefix="delta")


def packed_nbytes(t: torch.Tensor, count: int) -> int:
    """The bytes ``Delta.pack`` writes for ``t`` with this count."""
    return _packed(t.numel(), t.element_size(), count)


def _packed(numel: int, itemsize: int, count: int) -> int:
    return numel * itemsize if count < 0 else index_bytes(count) + count * unit(numel, itemsize) * itemsize


def index_bytes(count: int) -> int:
    """A delta's int32 indices, padded so that its values start on 8 bytes."""
    return (4 * count + 7) // 8 * 8


def packed_bucket_nbytes(bucket: list[tuple[Piece, int]], counts: list[int]) -> int:
    """The bytes of a bucket packed with these counts (``Buckets``)."""
    offset = 0
    for (piece, _), count in zip(bucket, counts):
        offset = _aligned(offset + _packed(piece.nbytes // _itemsize(piece.dtype), _itemsize(piece.dtype), count))
    return offset


def unpack(dst: torch.Tensor, buf: torch.Tensor, count: int) -> int:
    """Apply what ``Delta.pack`` wrote at the start of ``buf`` to ``dst`` (any strided view);
    the bytes read."""
    nbytes = packed_nbytes(dst, count)
    if count < 0:
        dst.copy_(buf[:nbytes].view(dst.dtype).view(dst.shape))
    elif count:
        k = unit(dst.numel(), dst.element_size())
        units, values = buf[:4 * count].view(torch.int32).long(), buf[index_bytes(count): nbytes].view(dst.dtype)
        if dst.is_contiguous():
            put_units(dst, units, values, k)
        else:
            dst.index_put_(torch.unravel_index(element_index(units, k), dst.shape), values)
    return nbytes


def put_units(dst: torch.Tensor, units: torch.Tensor, values: torch.Tensor, k: int) -> None:
    """Units of ``k`` elements of a contiguous ``dst`` take ``values`` (their elements in order):
    as 8-byte words where both sides start on one, else as rows of ``k`` elements."""
    words = BITS.get(k * dst.element_size()) if k > 1 else None
    if words is not None and dst.storage_offset() % k == 0 and values.storage_offset() % k == 0:
        dst.view(-1).view(words).index_copy_(0, units, values.view(words))
    else:
        dst.view(-1, k).index_copy_(0, units, values.view(-1, k))


def element_index(units: torch.Tensor, k: int) -> torch.Tensor:
    """The flat element indices of units of ``k`` elements, in order (int64)."""
    units = units.long()
    return units if k == 1 else (units[:, None] * k + torch.arange(k, device=units.device)).view(-1)


class Buckets:
    """A sender's buckets for one worker, filled piece by piece as the tensors come, in the order
    the worker expects them (``receive_order``): each piece at its fixed place, or, with a
    ``Delta``, packed one after another with a count each (``Delta.pack``)."""

    def __init__(self, pieces: list[Piece], bucket_bytes: int):
        self.pieces = pieces
        self.where, self.size = places(pieces, bucket_bytes)
        self.held: dict = {}  # delta: what this worker got from here last, per piece
        self.cursor, self.counts = 0, []

    def pack(self, buf: torch.Tensor, piece: Piece, t: torch.Tensor, delta: "Delta | None"):
        """Put a piece in ``buf``; its bucket (bytes and counts) when the piece ends one, else None."""
        offset, bucket = self.where[id(piece)]
        src = source_view(t, piece)
        if delta is None:
            buf[offset: offset + piece.nbytes].view(src.dtype).view(piece.shape).copy_(src)
            return (bucket_nbytes(bucket), None) if bucket is not None else None
        count, n = delta.pack(self.held, id(piece), src, _dtype(piece.dtype), buf[self.cursor:])
        self.counts.append(count)
        self.cursor = _aligned(self.cursor + n)
        if bucket is None:
            return None
        done = (self.cursor, self.counts)
        self.cursor, self.counts = 0, []
        return done

    def forget(self) -> None:
        """The worker may hold other weights than the last ones sent (a sync failed): send whole,
        from a bucket's start."""
        self.held, self.cursor, self.counts = {}, 0, []


def unsliceable(plans: list[dict], layouts: dict) -> str | None:
    """Why engine workers' copy ``plans`` do not all read boxes of the full tensors (None: they do)."""
    unplanned = sorted({n for w in plans for n in w["unplanned"]})
    if unplanned:
        return f"vLLM transforms {unplanned[:5]} while loading"
    return next((why for w in plans if (why := sliceable(w["plans"], layouts))), None)


def _dtype(name: str) -> torch.dtype:
    from elasticrl.weights.shm import DTYPES

    return DTYPES[name]
