"""The memory model: bytes per GPU of each role, by phase. Pure arithmetic, documented in
docs/planner.md, checked in tests against published figures (the ZeRO paper's
7.5B example, published parameter counts and KV-cache sizes).

Notation: P parameters, b bytes per 16-bit value (2), n ranks sharing the model, K = 12
bytes of Adam state per parameter in mixed precision (fp32 master copy, momentum, variance).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from elasticrl.plan.arch import Arch

GB = 1e9
ADAM_BYTES = 12            # K of the ZeRO paper
HALF = 2                   # bf16 / fp16
NF4 = 0.516                # a 4-bit base (QLoRA): 4 bits and a double-quantized scale per 64 weights
CONTEXT_BYTES = 1.0 * GB   # CUDA context, NCCL buffers and allocator slack of one process
REDUCE_BUCKET = 5e8        # DeepSpeed's default reduce/allgather bucket, in elements
LIVE_PARAMS = 1e9          # DeepSpeed's stage3_max_live_parameters


@dataclass(frozen=True)
class TrainConfig:
    """How DeepSpeed holds a trained model (actor or critic)."""

    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    micro_batch: int
    checkpointing: bool
    tp: int = 1
    adapters: int = 0  # LoRA: the parameters that train (adapters, a critic's head; the base frozen); 0: all
    quantized: bool = False  # QLoRA: the frozen base in 4 bits (ZeRO 0-2)
    sp: int = 1  # sequence-parallel size: a rank keeps the activations of 1/sp of each sequence


def model_states(params: float, n: int, zero_stage: int, offload_optimizer: bool = False,
                 offload_params: bool = False) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer states (ZeRO paper, Section 5):
    stage 0: (2 + 2 + K) P; stage 1: 2P + 2P + KP/n; stage 2: 2P + (2 + K) P/n; stage 3:
    (2 + 2 + K) P/n. Optimizer offload (ZeRO-Offload) moves the optimizer states and the
    gradient partitions to host memory, leaving a reduce bucket; parameter offload (stage 3)
    leaves no resident parameters."""
    p_share = n if zero_stage == 3 else 1
    g_share = n if zero_stage >= 2 else 1
    o_share = n if zero_stage >= 1 else 1
    gpu = {"params": 0.0 if offload_params else HALF * params / p_share,
           "grads": min(HALF * params / g_share, HALF * REDUCE_BUCKET) if offload_optimizer
           else HALF * params / g_share,
           "optimizer": 0.0 if offload_optimizer else ADAM_BYTES * params / o_share}
    host = (ADAM_BYTES + HALF) * params / o_share if offload_optimizer else 0.0
    host += HALF * params / p_share if offload_params else 0.0
    return {**gpu, "host": host}


def state_copies(checkpoint_background: bool, memory_copy: bool) -> int:
    """Copies of a trained role's fp32 state (ADAM_BYTES a parameter: masters and moments) held in
    host memory besides training: a background checkpoint's staging buffers (each rank's
    pieces until written); the in-memory copy's three (each rank's buffer it builds its copy
    in, and on a peer the keeper's newest copy and the older one whose memory the next reuses)."""
    return int(checkpoint_background) + 3 * int(memory_copy)


def zero3_working_set(arch: Arch) -> float:
    """Stage 3 gathers a layer's full parameters before using it and prefetches the next."""
    return HALF * min(LIVE_PARAMS, 2 * arch.layer_params())


def layer_activation_bytes(arch: Arch, micro_batch: int, seq: int, tp: int = 1) -> float:
    """One transformer layer's stored activations for backward, 16-bit, with a fused
    (flash / SDPA) attention: 34 s b h / t bytes (Korthikanti et al. 2022, eq. 1 without
    the 5 a s^2 b attention-score term that fused attention does not store)."""
    return 34 * seq * micro_batch * arch.hidden / tp


def logits_bytes(arch: Arch, micro_batch: int, seq: int, head: str = "lm") -> float:
    """fp32 logits and their log-softmax (or gradient): 2 x 4 s b V (a value head: ~0)."""
    return 0.0 if head == "value" else 2 * 4 * seq * micro_batch * arch.vocab


def train_activations(arch: Arch, micro_batch: int, seq: int, checkpointing: bool, head: str = "lm",
                      tp: int = 1) -> float:
    """Backward's peak: with full checkpointing each layer keeps its 16-bit input (2 s b h)
    and one layer is recomputed at a time; without, every layer keeps all of its own."""
    layer = layer_activation_bytes(arch, micro_batch, seq, tp)
    kept = arch.layers * HALF * seq * micro_batch * arch.hidden + layer if checkpointing else arch.layers * layer
    return kept + logits_bytes(arch, micro_batch, seq, head)


def forward_activations(arch: Arch, micro_batch: int, seq: int, head: str = "lm") -> float:
    """A no-grad forward (log-probs, values, rewards): one layer's working set and the logits."""
    return layer_activation_bytes(arch, micro_batch, seq) + logits_bytes(arch, micro_batch, seq, head)


@lru_cache(maxsize=None)
def trained_role(arch: Arch, head: str, n: int, cfg: TrainConfig, seq: int,
                 offload_idle: bool = False) -> dict[str, float]:
    """GPU bytes by phase of a DeepSpeed-trained role (actor: head 'lm', critic: 'value'); with
    LoRA (``cfg.adapters``) the base's weights are 16-bit (``cfg.quantized``: 4-bit) and frozen
    (no gradients or Adam states), the adapters have all three, and activations are the full model's. With
    ``offload_idle`` the gradients and optimizer states (moments and master weights) wait in
    host memory through rollout and experience (DeepSpeed's ``offload_states``)."""
    params = arch.params(head) / cfg.tp
    if cfg.adapters:  # LoRA: the frozen base's 16-bit weights (sharded by ZeRO-3), the adapters' full states
        states = model_states(cfg.adapters, n, cfg.zero_stage, cfg.offload_optimizer)
        base = model_states(params, n, cfg.zero_stage, offload_params=cfg.offload_params)
        states["params"] += NF4 * params if cfg.quantized else base["params"]
        states["host"] += base["host"]
    else:
        states = model_states(params, n // cfg.tp, cfg.zero_stage, cfg.offload_optimizer, cfg.offload_params)
    resident = states["params"] + states["grads"] + states["optimizer"] + CONTEXT_BYTES
    idle = states["grads"] + states["optimizer"] if offload_idle else 0.0
    working = zero3_working_set(arch) / cfg.tp if cfg.zero_stage == 3 else 0.0
    return {"rollout": resident - idle,
            "experience": resident - idle + working + forward_activations(arch, cfg.micro_batch, seq, head),
            "train": resident + working + train_activations(arch, cfg.micro_batch, -(-seq // cfg.sp),
                                                            cfg.checkpointing, head, cfg.tp),
            "host": states["host"] + idle}


@lru_cache(maxsize=None)
def frozen_role(arch: Arch, head: str, n: int, sharded: bool, offload_idle: bool, micro_batch: int,
                seq: int) -> dict[str, float]:
    """A reference or reward model: weights (ZeRO-3-sharded over n ranks, or whole), used only
    in the experience phase; with offload_idle its weights wait in host memory otherwise."""
    weights = HALF * arch.params(head) / (n if sharded else 1)
    working = zero3_working_set(arch) if sharded and n > 1 else 0.0
    idle = CONTEXT_BYTES + (0.0 if offload_idle else weights)
    busy = CONTEXT_BYTES + weights + working + forward_activations(arch, micro_batch, seq, head)
    return {"rollout": idle, "experience": busy, "train": idle, "host": weights if offload_idle else 0.0}


@lru_cache(maxsize=None)
def engine_need(arch: Arch, tp: int, seq: int, concurrent: int) -> float:
    """The least GPU memory a vLLM engine rank can run with: its weight slice, KV cache for
    ``concurrent`` full-length sequences, and ~1 GB of activations and CUDA graphs."""
    return HALF * arch.params() / tp + concurrent * seq * arch.kv_bytes_per_token() / tp + CONTEXT_BYTES


def engine_role(arch: Arch, tp: int, seq: int, concurrent: int, utilization: float, gpu_bytes: float,
                sleeps: bool) -> dict[str, float]:
    """vLLM takes ``utilization`` of the GPU while awake; asleep (level 1, the hybrid engine)
    its weights move to host memory and its KV cache is freed."""
    awake = utilization * gpu_bytes
    asleep = CONTEXT_BYTES if sleeps else awake
    return {"rollout": awake, "experience": asleep, "train": asleep,
            "host": HALF * arch.params() / tp if sleeps else 0.0}
