"""The trainer's weights as the engines name them (``sync.py`` sends them, ``engine/checkpoint.py``
exports them): each module's parameters once (a tied head under its first name, under the
model's Hugging Face names), a LoRA layer's base with its adapters merged in, a 4-bit base
dequantized. Gathered to rank 0 (``iter_full_params``) or each rank's AutoTP slice
(``iter_local_params``), the slices' layouts, and a LoRA model's adapters alone.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from elasticrl import parallel
from elasticrl.weights import slices


def _modules(ds_engine):
    """(module name, module, its own parameters) with each parameter once (a tied head is the
    embedding's tensor: it goes under its first name), under the model's Hugging Face names. A
    LoRA layer (``model.lora``) is one module with its base and adapter parameters, which
    ``_sent`` merges; a module peft trains whole (a value head) is its trained copy."""
    seen = set()
    for mod_name, module in ds_engine.module.named_modules():
        if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):  # peft's ModulesToSaveWrapper
            seen |= {id(p) for p in module.original_module.parameters()}
            module = module.modules_to_save[module.active_adapters[0]]
        params = [(n, p) for n, p in module.named_parameters(recurse=_is_lora(module)) if id(p) not in seen]
        seen |= {id(p) for _, p in params}
        if params:
            yield mod_name.removeprefix("base_model.model."), module, params


def _is_lora(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def _sent(module, params) -> list[tuple[str, torch.Tensor]]:
    """What a module sends (parameters gathered): its parameters, or a LoRA layer's base weights
    with the adapters merged in (W + alpha / r x B A, peft's delta)."""
    if not _is_lora(module):
        return [(name, p.detach()) for name, p in params]
    base = module.get_base_layer()
    weight = _dense(base.weight)
    merged = weight + sum(module.get_delta_weight(a).to(weight.dtype) for a in module.active_adapters)
    return [("weight", merged.detach())] + ([("bias", base.bias.detach())] if base.bias is not None else [])


def _dense(weight: torch.Tensor) -> torch.Tensor:
    """A base weight as its layer computes with it: a 4-bit one (``model.lora.quantize``) dequantized."""
    if getattr(weight, "quant_state", None) is None:
        return weight
    import bitsandbytes.functional as bnb

    return bnb.dequantize_4bit(weight.data, weight.quant_state)


def _sent_shapes(module, params) -> list[tuple[str, torch.Tensor]]:
    """``_sent``'s (name, parameter whose shape it has), without gathering."""
    if not _is_lora(module):
        return params
    base = module.get_base_layer()
    weight = base.weight
    if getattr(weight, "quant_state", None) is not None:  # a 4-bit weight's packed shape is not its own
        weight = torch.empty(weight.quant_state.shape, dtype=weight.quant_state.dtype, device="meta")
    return [("weight", weight)] + ([("bias", base.bias)] if base.bias is not None else [])


def _full_name(mod_name: str, name: str) -> str:
    return f"{mod_name}.{name}" if mod_name else name


def iter_full_params(ds_engine) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full tensor) on rank 0, (name, None) elsewhere; every rank must iterate.

    ZeRO-3 partitions and AutoTP slices are gathered one module at a time, so no rank ever
    holds more than one module's full weights beyond its own shard.
    """
    rank0 = dist.get_rank() == 0
    stage3 = ds_engine.zero_optimization_stage() == 3
    tp = ds_engine.autotp_size() > 1
    if not stage3 and not tp:
        if rank0:
            for mod_name, module, params in _modules(ds_engine):
                for name, t in _sent(module, params):
                    yield _full_name(mod_name, name), t
        return
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    for mod_name, module, params in _modules(ds_engine):
        tensors = [p for _, p in params]
        with deepspeed.zero.GatheredParameters(tensors, enabled=stage3), \
                GatherReplacedLayerParams(tensors, module, enabled=tp):
            for name, t in _sent(module, params):
                yield _full_name(mod_name, name), (t if rank0 else None)


def iter_local_params(ds_engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's AutoTP slice as a contiguous tensor) on every rank; ZeRO-3 partitions
    are gathered one module at a time (collective), AutoTP slices never are."""
    import deepspeed

    stage3 = ds_engine.zero_optimization_stage() == 3
    for mod_name, module, params in _modules(ds_engine):
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage3):
            for name, t in _sent(module, params):
                yield _full_name(mod_name, name), t.contiguous()


def trainer_layouts(ds_engine) -> dict[str, slices.Layout]:
    """Each parameter's full shape and AutoTP cut, in the order the iterators above yield them;
    None when AutoTP fused several projections into one parameter (no plain cut)."""
    cuts = parallel.autotp_cuts(ds_engine)
    layouts = {}
    for mod_name, module, params in _modules(ds_engine):
        for name, p in _sent_shapes(module, params):
            local = list(getattr(p, "ds_shape", p.shape))
            cut = cuts.get(id(p))
            if cut is None:
                layouts[_full_name(mod_name, name)] = slices.Layout(tuple(local))
                continue
            if cut[1] is None:
                return None
            sizes = tuple(int(n) for n in cut[0]._partition_sizes)
            local[cut[1]] = sum(sizes)
            layouts[_full_name(mod_name, name)] = slices.Layout(tuple(local), cut[1], sizes)
    return layouts


def adapter_tensors(engine) -> dict:
    """A LoRA-trained model's adapters under peft's names (without the adapter's name), fp32 on
    the CPU, on rank 0 ({} elsewhere): ZeRO-3 gathers one adapter at a time. Collective."""
    from deepspeed.runtime.zero import GatheredParameters
    from peft.utils import get_peft_model_state_dict

    rank, model = dist.get_rank(), engine.module
    whole = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # the frozen base
            continue
        with GatheredParameters([p]):  # a no-op where nothing is partitioned
            if rank == 0:
                whole[name] = p.detach().to(torch.float32).cpu().clone()
    return get_peft_model_state_dict(model, state_dict=whole) if rank == 0 else {}


def max_param_bytes(ds_engine) -> int:
    tp = max(1, ds_engine.autotp_size())

    def whole(p) -> int:  # a 4-bit weight goes dequantized
        q = getattr(p, "quant_state", None)
        return q.shape.numel() * q.dtype.itemsize if q is not None else \
            getattr(p, "ds_numel", p.numel()) * p.element_size()
    return max(whole(p) * tp for p in ds_engine.module.parameters())
