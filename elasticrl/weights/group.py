"""A torch.distributed group for moving weights, apart from every process's default world.

The trainer's DeepSpeed world and vLLM's tensor-parallel world already own the default
process group in their processes, so the weight group is a standalone ProcessGroup object
(gloo on CPU, NCCL on GPU, from the backend switch) built on its own TCPStore.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from elasticrl.backend import tcp_store


def new_group(addr: str, port: int, rank: int, world_size: int, backend_name: str, timeout_s: int):
    store = tcp_store(addr, port, world_size, rank, timeout_s)
    if backend_name == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()
