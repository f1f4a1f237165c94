"""Methods mixed into every vLLM worker (``worker_extension_cls``) to receive weights.

All transports end in the model's own ``load_weights`` with Hugging Face names, so vLLM's
loaders do the fusing (q/k/v, gate/up) and the tensor-parallel slicing: each worker keeps
only its rank's slice, exactly as when it loaded the checkpoint.

vLLM's CPU backend packs every linear weight into a oneDNN buffer after loading and drops
the dense copy, so ``load_weights`` has nowhere to write. ``erl_prepare`` gives linear
layers dense weights again and then either computes with them directly (``dense``: on
CPUs without AMX/AVX512-BF16 the packed GEMM is within ~10 % of MKL's, and a sync becomes
a plain copy) or repacks the changed layers after every sync (``packed``).

Engines serving a LoRA-trained policy (``rollout.lora_sync: adapter``) keep their base weights
and receive only the adapters, which replace adapter ``ADAPTER_ID`` in vLLM's LoRA manager.
"""
from __future__ import annotations

import torch

from elasticrl import backend
from elasticrl.weights import receive, transports

backend.quiet_vllm()  # in an engine's worker processes too (TP > 1), which import this module

ADAPTER_ID = 1  # the trained adapter's id in vLLM: each sync replaces it in place


class WeightReceiver:
    # --- set-up -------------------------------------------------------------------------
    def _erl_model(self):
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def erl_prepare(self, model_path: str, cpu_mode: str) -> dict:
        """Make every weight writable by ``load_weights``; returns what was done. ``cpu_mode``
        "lora": the engine serves adapters, its weights stay as they are."""
        from vllm.platforms import current_platform

        if cpu_mode == "lora" or not current_platform.is_cpu():
            return {"mode": "lora" if cpu_mode == "lora" else "gpu", "recreated": 0}
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        from elasticrl.weights.shards import iter_tensors

        model = self._erl_model()
        recreated = 0
        for mod in model.modules():
            if isinstance(getattr(mod, "quant_method", None), UnquantizedLinearMethod) and mod.weight.numel() == 0:
                mod.quant_method.create_weights(
                    mod, mod.input_size_per_partition, mod.output_partition_sizes, mod.input_size,
                    mod.output_size, mod.params_dtype, weight_loader=_loader_of(mod))
                recreated += 1
        model.load_weights(iter_tensors(model_path))  # dense values again, through vLLM's loaders
        self._erl_cpu_mode = cpu_mode
        self._erl_repack(model)
        return {"mode": cpu_mode, "recreated": recreated}

    def _erl_repack(self, model) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for mod in model.modules():
            if hasattr(mod, "cpu_linear") and getattr(mod, "weight", None) is not None and mod.weight.numel():
                if self._erl_cpu_mode == "dense":
                    mod.cpu_linear = torch.nn.functional.linear
                else:  # keep the dense copy: the next sync writes into it again
                    dispatch_cpu_unquantized_gemm(mod, remove_weight=False)

    def erl_finish(self) -> None:
        """After the last bucket of a sync: packed CPU engines repack their linears once."""
        if getattr(self, "_erl_cpu_mode", None) == "packed":
            self._erl_repack(self._erl_model())

    # --- the transports' receivers (``weights.transports``) ----------------------------------
    def erl_weights(self, transport: str, method: str, args: tuple):
        """``method`` of this worker's receiver of ``transport``."""
        return transports.receiver(self, transport, method, args)

    def erl_params(self) -> list[torch.Tensor]:
        return [p for _, p in self._erl_model().named_parameters()]

    def erl_plans(self) -> dict | None:
        plans = getattr(self, "_erl_plans", None)
        return plans and plans["plans"]

    def erl_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def erl_device(self) -> torch.device:
        return next(self._erl_model().parameters()).device

    def erl_land(self, weights: list[tuple[str, torch.Tensor]], message: dict) -> int:
        """(name, tensor) pairs a receiver got: into the model through its loaders, or (an
        adapter payload) as the served adapter."""
        if message["kind"] == "adapter":
            self._erl_set_adapter(weights, message["adapter"])
        else:
            self._erl_model().load_weights(weights)
        return receive.nbytes_of(weights)

    def _erl_set_adapter(self, weights: list[tuple[str, torch.Tensor]], config: dict) -> None:
        """Replace adapter ``ADAPTER_ID`` with these tensors (peft names) in vLLM's LoRA manager,
        as vLLM's in-place reload does from a folder."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager
        manager, model = workers._adapter_manager, workers._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": workers.max_position_embeddings})
        helper.validate_legal(workers.lora_config)
        lora = LoRAModel.from_lora_tensors(
            ADAPTER_ID, {n: t.clone() for n, t in weights}, helper, device="cpu",  # the buffers are reused
            dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(lora)
        manager.activate_adapter(ADAPTER_ID)

    def erl_copy_plans(self, model_path: str) -> dict:
        """For each checkpoint tensor, the copies vLLM's ``load_weights`` makes from it into this
        worker's parameters (found by intercepting ``copy_`` without copying; ``plan.py``), so
        a sender can write straight into the parameters: one copy per sync, slices included."""
        from elasticrl.weights.plan import record_copy_plans

        if getattr(self, "_erl_plans", None) is None:
            plans, unplanned = record_copy_plans(self._erl_model(), model_path)
            self._erl_plans = {"plans": plans, "unplanned": unplanned}
        return self._erl_plans

    def erl_release_all(self) -> None:
        transports.release_receivers(self)

    def erl_state_dict(self, digest: bool = False) -> dict[str, list | str]:
        """This worker's weights, small models only (tests compare slices with the trainer's), or
        (``digest``) a SHA-256 of each one's bytes (tests compare them bit for bit)."""
        import hashlib

        params = self._erl_model().named_parameters()
        if digest:
            return {n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                    for n, p in params}
        return {n: p.detach().cpu().float().tolist() for n, p in params}


def _loader_of(mod):
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    if type(mod.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(mod, "weight_loader_v2"):
        return mod.weight_loader_v2
    return mod.weight_loader
