"""Hugging Face-style sharded safetensors: size-bounded shards plus an index (write them into
an ``elasticrl.files.atomic_folder`` to publish them whole).

Layout matches ``save_pretrained``: one ``model.safetensors`` when everything fits in one
shard, else ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``.
Nothing here unpickles anything.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names into shards in order, each at most ``max_shard_bytes`` (a lone bigger tensor
    gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]


def shard_names(count: int) -> list[str]:
    """The files of a model in ``count`` shards, named as Hugging Face names them."""
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(folder: str | Path, total_bytes: int, weight_map: dict[str, str]) -> None:
    """The index of a sharded model folder: each tensor's file."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (Path(folder) / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def save_sharded(state_dict: dict[str, torch.Tensor], folder: str | Path, max_shard_bytes: int) -> list[str]:
    """Write tensors into ``folder`` (which must exist); return the file names written."""
    folder = Path(folder)
    sizes = [(k, v.numel() * v.element_size()) for k, v in state_dict.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map = {}
    for fname, keys in zip(names, shards):
        tensors = {k: state_dict[k].detach().to("cpu").contiguous() for k in keys}
        _dedupe_storage(tensors)
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if len(names) > 1:
        write_index(folder, sum(n for _, n in sizes), weight_map)
        names.append(INDEX)
    return names


def _dedupe_storage(tensors: dict[str, torch.Tensor]) -> None:
    # safetensors refuses tensors that share storage (tied weights): give each its own copy.
    seen = set()
    for k, v in tensors.items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
        if ptr in seen:
            tensors[k] = v.clone()
        seen.add(ptr)


def shard_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        return [folder / f for f in sorted(set(index["weight_map"].values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise FileNotFoundError(f"{folder}: no {SINGLE} or {INDEX}; is this a Hugging Face model folder "
                            "saved with safetensors?")


def iter_tensors(folder: str | Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from every shard, one file open at a time."""
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_sharded(folder: str | Path) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(folder))


def _prefix(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """A safetensors file's length and header, and the bytes of data after them."""
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, offset = {"__metadata__": metadata}, 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return len(head).to_bytes(8, "little") + head, offset


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8).view(-1)


def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """A safetensors file of ``tensors`` written straight from their memory (no serialised copy;
    views of one buffer allowed; a device tensor comes to the host one at a time), under a temp
    name renamed when complete; returns the bytes written."""
    prefix, size = _prefix(tensors, metadata)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")  # the file appears whole or not at all
    with open(tmp, "wb") as fh:
        fh.write(prefix)
        for _, t in tensors:
            fh.write(memoryview(_raw(t).numpy()))
    os.replace(tmp, path)
    return len(prefix) + size


def safetensors_buffer(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str],
                       reuse: torch.Tensor | None = None) -> torch.Tensor:
    """What ``write_safetensors`` writes, as one uint8 tensor in memory (``reuse`` when it has
    the size: its pages are warm), each tensor copied once."""
    prefix, size = _prefix(tensors, metadata)
    total = len(prefix) + size
    buf = reuse if reuse is not None and reuse.numel() == total else torch.empty(total, dtype=torch.uint8)
    buf[:len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    at = len(prefix)
    for _, t in tensors:
        raw = _raw(t)
        buf[at:at + raw.numel()].copy_(raw)
        at += raw.numel()
    return buf
