"""Same-node shared memory for weights: a file in /dev/shm mapped as a torch tensor by the
trainer and by every engine process on that node. Nothing is serialised: the trainer
copies raw tensor bytes in, the engine reads them as views."""
from __future__ import annotations

from pathlib import Path

import torch

from elasticrl.files import remove_stale, shm_path

ALIGN = 64  # bytes; keeps every view aligned for vector loads
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # names in messages


def create(nbytes: int, tag: str = "weights") -> tuple[str, torch.Tensor]:
    """A new shared buffer; returns its path (for the other side) and a uint8 view."""
    remove_stale()
    path = shm_path(tag)
    with open(path, "wb") as fh:
        fh.truncate(nbytes)
    return str(path), torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def attach(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def release(path: str) -> None:
    Path(path).unlink(missing_ok=True)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    return buf[offset: offset + nbytes].view(dtype).view(shape)


def share(nbytes: int, device) -> tuple[tuple, torch.Tensor]:
    """A buffer another process on this node can map, and its handle (``open_shared``): a
    /dev/shm file on CPU, a CUDA IPC handle of ordinary device memory on a GPU."""
    from elasticrl import backend

    if device.type == "cpu":
        path, buf = create(nbytes, "pieces")
        return ("shm", path, nbytes), buf
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return ("ipc", backend.export_device_buffer(buf)), buf


def open_shared(handle: tuple) -> torch.Tensor:
    from elasticrl import backend

    return attach(handle[1], handle[2]) if handle[0] == "shm" else backend.open_device_buffer(handle[1])


def unshare(handle: tuple) -> None:
    if handle[0] == "shm":
        release(handle[1])
