"""Methods mixed into every vLLM worker (``worker_extension_cls``) to receive weights.

All transports end in the model's own ``load_weights`` with Hugging Face names, so vLLM's
loaders do the fusing (q/k/v, gate/up) and the tensor-parallel slicing: each worker keeps
only its rank's slice, exactly as when it loaded the checkpoint.

vLLM's CPU backend packs every linear weight into a oneDNN buffer after loading and drops
the dense copy, so ``load_weights`` has nowhere to write. ``erl_prepare`` gives linear
layers dense weights again and then either computes with them directly (``dense``: on
CPUs without AMX/AVX512-BF16 the packed GEMM is within ~10 % of MKL's, and a sync becomes
a plain copy) or repacks the changed layers after every sync (``packed``).
"""
from __future__ import annotations

import torch

from elasticrl.weights import receive, shm


class WeightReceiver:
    # --- set-up -------------------------------------------------------------------------
    def _erl_model(self):
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def erl_prepare(self, model_path: str, cpu_mode: str) -> dict:
        """Make every weight writable by ``load_weights``; returns what was done."""
        from vllm.platforms import current_platform

        self._erl_buffers: dict[str, torch.Tensor] = {}
        self._erl_group = None
        if not current_platform.is_cpu():
            return {"mode": "gpu", "recreated": 0}
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

    # --- transports ---------------------------------------------------------------------
    def erl_load_shm(self, path: str, nbytes: int, metas: list[tuple[str, str, list[int], int]]) -> int:
        """Load tensors laid out in a same-node staging buffer: (name, dtype, shape, offset)."""
        weights = receive.from_shm(self._erl_buffers, path, nbytes, metas)
        self._erl_model().load_weights(weights)
        return receive.nbytes_of(weights)

    def erl_share_weights(self, model_path: str) -> dict:
        """Move every parameter into a /dev/shm arena and record, for each checkpoint tensor,
        the copies vLLM's ``load_weights`` makes from it (destination and source as strided
        views, found by intercepting ``copy_`` without copying). The trainer then writes
        straight into this worker's live parameters: one memcpy per sync, slices included."""
        from elasticrl.weights.plan import record_copy_plans

        if getattr(self, "_erl_arena", None) is None:
            model = self._erl_model()
            params = [p for _, p in model.named_parameters()]
            sizes = [shm.aligned(p.numel() * p.element_size()) for p in params]
            path, arena = shm.create(sum(sizes), "engine")
            offset = 0
            for p, size in zip(params, sizes):
                view = shm.view(arena, offset, p.dtype, tuple(p.shape))
                view.copy_(p.data)
                p.data = view
                offset += size
            plans, unplanned = record_copy_plans(model, model_path, arena)
            self._erl_arena = {"path": path, "nbytes": arena.numel(), "plans": plans, "unplanned": unplanned,
                               "arena": arena}
        a = self._erl_arena
        return {k: a[k] for k in ("path", "nbytes", "plans", "unplanned")}

    def erl_release_shm(self, path: str) -> None:
        self._erl_buffers.pop(path, None)

    def erl_release_all(self) -> None:
        self._erl_buffers = {}
        arena = getattr(self, "_erl_arena", None)
        if arena is not None:
            shm.release(arena["path"])  # our mapping (the live weights) stays valid

    def erl_join_group(self, addr: str, port: int, rank_offset: int, world_size: int, backend: str,
                       timeout_s: int) -> None:
        """Join the weight group: trainer rank 0 is rank 0, engine workers follow."""
        from elasticrl.weights.group import new_group

        rank = rank_offset + self._erl_tp_rank()
        self._erl_group = new_group(addr, port, rank, world_size, backend, timeout_s)

    def _erl_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def erl_load_broadcast(self, metas: list[tuple[str, str, list[int], int]], nbytes: int) -> int:
        """Receive one bucket broadcast from rank 0 of the weight group, then load it."""
        weights = receive.from_broadcast(self._erl_group, metas, nbytes, next(self._erl_model().parameters()).device)
        self._erl_model().load_weights(weights)
        return nbytes

    def erl_leave_group(self) -> None:
        self._erl_group = None

    def erl_load_files(self, folder: str) -> int:
        from elasticrl.weights.shards import iter_tensors

        weights = list(iter_tensors(folder))
        self._erl_model().load_weights(weights)
        return receive.nbytes_of(weights)

    def erl_state_dict(self) -> dict[str, list]:
        """This worker's weights, small models only (tests compare slices with the trainer's)."""
        return {n: p.detach().cpu().float().tolist() for n, p in self._erl_model().named_parameters()}


def _loader_of(mod):
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    if type(mod.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(mod, "weight_loader_v2"):
        return mod.weight_loader_v2
    return mod.weight_loader
