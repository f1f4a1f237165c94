"""DeepSpeed as the training engine: config, distributed start, optimizer and schedule.

One function builds the DeepSpeed config from the spec, one wraps a model into an engine.
ZeRO 0-3, CPU offload of optimizer states and parameters, AutoTP, bf16/fp32, a
``torch.optim.AdamW`` (DeepSpeed's own Adam JIT-compiles a C++ op on CPU), linear warm-up
then cosine decay, gradient accumulation and clipping.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta

import torch

from elasticrl import backend
from elasticrl.spec.schema import TrainSpec


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: int) -> None:
    """Join the trainer's process group (NCCL or gloo, from the backend switch)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A trainer rank compiles nothing, but every ZeRO engine imports DeepSpeed's Muon module,
    # whose torch.compile decorators import torch's inductor: ~1 s of each rank's start-up.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import deepspeed
    import torch.distributed as dist

    backend.set_local_device(int(os.environ["LOCAL_RANK"]))
    # the group on a store listening on the master's address only; DeepSpeed adopts it
    store = backend.tcp_store(master_addr, master_port, world_size, rank, timeout_s)
    dist.init_process_group(backend.dist_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    deepspeed.init_distributed(dist_backend=backend.dist_backend(), timeout=timedelta(seconds=timeout_s),
                               rank=rank, world_size=world_size, auto_mpi_discovery=False)


def ds_config(train: TrainSpec, dtype: str, grad_accum: int) -> dict:
    zero: dict = {"stage": train.zero_stage}
    if train.zero_stage == 3:
        # Partition every parameter, however small: tiny models would otherwise stay whole.
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    if train.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": backend.has_gpu()}
    if train.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": backend.has_gpu()}
    cfg = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train.tp_size > 1:
        cfg["tensor_parallel"] = {"autotp_size": train.tp_size}
    return cfg


def lr_lambda(warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_optimizer(model: torch.nn.Module, train: TrainSpec, lr: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": train.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]  # LoRA: 2-D adapters only
    if train.offload_optimizer and backend.has_gpu():
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # compiled once; fast on offloaded states

        return DeepSpeedCPUAdam(groups, lr=lr, betas=train.adam_betas, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=train.adam_betas)


def build_engine(model: torch.nn.Module, train: TrainSpec, dtype: str, grad_accum: int,
                 total_steps: int, lr: float | None = None, mpu=None):
    """Wrap ``model`` in a DeepSpeed engine with optimizer and warm-up/cosine schedule; ``mpu``:
    the sequence-parallel groups (``engine.sequence``)."""
    import deepspeed

    lr = train.lr if lr is None else lr
    optimizer = make_optimizer(model, train, lr)
    warmup = max(1, round(train.warmup_ratio * total_steps)) if train.warmup_ratio > 0 else 0
    # A factory, not a scheduler: ZeRO-3 wraps the optimizer and regroups its parameters,
    # so the schedule must attach to the optimizer DeepSpeed ends up stepping.
    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps, train.min_lr_ratio))

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=ds_config(train, dtype, grad_accum), mpu=mpu)
    return engine
