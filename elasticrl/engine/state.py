"""A trained model's whole state, rank-unaware and pickle-free: what a checkpoint holds.

Full fp32 master parameters and full optimizer moments by parameter name (safetensors), and
the optimizer's step count, the LR schedule and the engine's counters (JSON). Any world size,
ZeRO stage and data-parallel layout saves the same files and loads them, because the
tensors are whole: DeepSpeed's partitions are gathered on save (``safe_get_full_*``) and cut
again on load (``safe_set_full_*``); nothing goes through ``torch.load``.

Both functions are collective: every rank of the model's process group calls them, in the
same parameter order (ZeRO-1/2 all-reduce and ZeRO-3 all-gather each tensor).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from elasticrl import parallel
from elasticrl.weights.shards import save_sharded, shard_files

MOMENTS = "optimizer"           # the shard files' stem for optimizer moments
ENGINE_STATE = "engine_state.json"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _inner_optimizer(engine):
    """The torch optimizer that holds the states (ZeRO and bf16 wrap it)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _wrapped(param) -> bool:
    """Whether DeepSpeed keeps the fp32 master apart (ZeRO-1/2/3, bf16): its full value is then a
    collective (a rank whose partition holds none of it still takes part)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _full(param, key: str | None, inner) -> torch.Tensor | None:
    """The whole fp32 parameter (key None) or optimizer state ``key`` of ``param``."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _wrapped(param):
        return safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    if key is None:  # no wrapper (ZeRO-0, fp32): the module's parameter is the master
        return param.detach().float()
    state = inner.state.get(param, {})
    return state.get(key)


def full_state(engine) -> tuple[dict, dict]:
    """(weights, moments) by parameter name, whole: gathered over ZeRO's partitions and
    AutoTP's slices, on rank 0 (empty elsewhere). Collective."""
    inner = _inner_optimizer(engine)
    stepped = any(len(s) for s in inner.state.values())
    if stepped:
        _link_states(engine)
    sliced = _tp_slices(engine)
    weights, moments = {}, {}
    for name, p in engine.module.named_parameters():
        for key in (None, *(_ADAM_KEYS if stepped else ())):
            t = _full(p, key, inner)
            if t is None:
                continue
            if id(p) in sliced:
                layer, dim = sliced[id(p)]
                t = layer._all_gather_shards(t.to(p.device).contiguous(), layer._partition_sizes, dim)
            if dist.get_rank() == 0:
                (weights if key is None else moments)[name if key is None else f"{key}.{name}"] = \
                    t.detach().cpu().clone()
    return weights, moments


def save_engine(engine, folder: str | Path, max_shard_bytes: int) -> None:
    """Write the engine's weights, moments and counters into ``folder`` (rank 0 writes)."""
    weights, moments = full_state(engine)
    if dist.get_rank() != 0:
        return
    folder = Path(folder)
    save_sharded(weights, folder, max_shard_bytes)
    if moments:
        (folder / MOMENTS).mkdir()
        save_sharded(moments, folder / MOMENTS, max_shard_bytes)
    inner = _inner_optimizer(engine)
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    sched = engine.lr_scheduler
    state = {"world_size": dist.get_world_size(), "tp_size": engine.autotp_size(),
             "optimizer_step": steps[0] if steps else 0.0,
             "scheduler": {"last_epoch": sched.last_epoch, "step_count": sched._step_count,
                           "last_lr": sched.get_last_lr()},
             "global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "skipped_steps": engine.skipped_steps}
    (folder / ENGINE_STATE).write_text(json.dumps(state, indent=2))


def load_engine(engine, folder: str | Path) -> None:
    """Restore what ``save_engine`` wrote into a freshly built engine (of any world size)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    folder = Path(folder)
    state = json.loads((folder / ENGINE_STATE).read_text())
    weights = _reader(folder)
    moments = _reader(folder / MOMENTS) if (folder / MOMENTS).is_dir() else None
    inner = _inner_optimizer(engine)
    if moments is not None:
        _init_adam_states(engine, inner, state["optimizer_step"])
    sliced = _tp_slices(engine)

    def mine(p, full: torch.Tensor) -> torch.Tensor:  # this rank's AutoTP slice of a whole tensor
        if id(p) in sliced:
            layer, dim = sliced[id(p)]
            full = full.split(layer._partition_sizes, dim=dim)[layer.tp_index]
        return full.to(p.device).contiguous()

    for name, p in engine.module.named_parameters():
        full = mine(p, weights(name))
        if _wrapped(p):
            safe_set_full_fp32_param(p, full)
        else:
            p.data.copy_(full)
        if moments is None:
            continue
        for key in _ADAM_KEYS:
            value = mine(p, moments(f"{key}.{name}"))
            if _wrapped(p):
                safe_set_full_optimizer_state(p, value, key)
            else:
                inner.state[p][key].copy_(value)
    sched = engine.lr_scheduler
    sched.last_epoch = state["scheduler"]["last_epoch"]
    sched._step_count = state["scheduler"]["step_count"]
    sched._last_lr = list(state["scheduler"]["last_lr"])
    for group, lr in zip(inner.param_groups, sched._last_lr):
        group["lr"] = lr
    engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]


def _tp_slices(engine) -> dict[int, tuple]:
    """id(parameter) -> (its AutoTP layer, the dimension AutoTP cut it along), for the
    parameters each tensor-parallel rank holds a slice of (none without AutoTP)."""
    cuts = parallel.autotp_cuts(engine)
    for module, dim in cuts.values():
        if dim is None:  # fused projections (q, k and v in one weight) slice each part
            raise NotImplementedError(f"checkpoints of AutoTP-sliced fused parameters ({type(module).__name__}) "
                                      "are not supported yet; checkpoint at train.tp_size: 1")
    return cuts


def saved_world_size(folder: str | Path) -> int:
    return json.loads((Path(folder) / ENGINE_STATE).read_text())["world_size"]


def _init_adam_states(engine, inner, step: float) -> None:
    """Create AdamW's per-parameter state as its first step would (zeros, then overwritten
    by the saved moments), so the partitions the moments load into exist."""
    # ZeRO-3 hands its flat fp32 partitions to the torch optimizer only for the length of a step
    flat = [p for g in inner.param_groups for p in g["params"]] + list(
        getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))
    for p in flat:
        if not inner.state.get(p):
            inner.state[p] = {"step": torch.tensor(step, dtype=torch.float32),
                              "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                              "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        else:
            inner.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
    _link_states(engine)


def _link_states(engine) -> None:
    """Point ZeRO-1/2's and bf16's per-parameter fragments at the optimizer states. DeepSpeed
    links them once, right after the first step of the first parameter group, when the other
    groups' states do not exist yet (their fragments stay empty): link them again."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _reader(folder: Path):
    """name -> tensor from a folder's safetensors shards."""
    index = {}
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                index[name] = path

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise ValueError(f"{folder}: the checkpoint has no {name!r}; it was written for another model")
        with safe_open(str(index[name]), framework="pt") as f:
            return f.get_tensor(name)
    return get
