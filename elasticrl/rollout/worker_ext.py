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
from elasticrl.weights import receive, shm

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

        self._erl_buffers: dict[str, torch.Tensor] = {}
        self._erl_group = None
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

    # --- transports ---------------------------------------------------------------------
    def erl_load_shm(self, path: str, nbytes: int, metas: list[tuple[str, str, list[int], int]],
                     adapter: dict | None = None) -> int:
        """Load tensors laid out in a same-node staging buffer: (name, dtype, shape, offset);
        with ``adapter`` (a peft config) they are a LoRA adapter's, all of them."""
        return self._erl_load(receive.from_shm(self._erl_buffers, path, nbytes, metas), adapter)

    def _erl_load(self, weights: list[tuple[str, torch.Tensor]], adapter: dict | None) -> int:
        if adapter is None:
            self._erl_model().load_weights(weights)
        else:
            self._erl_set_adapter(weights, adapter)
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

    def erl_share_weights(self) -> dict:
        """Move every parameter into one /dev/shm arena that the trainer's ranks on this node map
        (CPU engines; on GPUs the ``ipc`` transport maps the senders' buffers instead). Returns
        its path and each parameter's byte offset (the copy plans' destinations)."""
        if getattr(self, "_erl_arena", None) is None:
            params = [p for _, p in self._erl_model().named_parameters()]
            assert params[0].device.type == "cpu", "the shm arena is for CPU engines"
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += shm.aligned(p.numel() * p.element_size())
            path, arena = shm.create(total, "engine")
            for p, offset in zip(params, offsets):
                view = shm.view(arena, offset, p.dtype, tuple(p.shape))
                view.copy_(p.data)
                p.data = view
            self._erl_arena = {"path": path, "nbytes": total, "offsets": offsets, "arena": arena}
        a = self._erl_arena
        return {k: a[k] for k in ("path", "nbytes", "offsets")}

    def erl_expect(self, schedules: dict) -> None:
        """What this worker receives at every sliced sync: (sender's group rank, bucket of
        (piece, offset), bytes) in the order to receive them, and constant fills
        (``WeightSender._schedules``)."""
        from elasticrl.weights.slices import revive

        rank = self._erl_tp_rank()
        self._erl_schedule = revive(schedules[rank] if rank in schedules else schedules[str(rank)])

    def erl_receive(self, delta: bool = False) -> int:
        """Receive one sliced sync from the senders (``receive.receive_sliced``)."""
        params = [p for _, p in self._erl_model().named_parameters()]
        need = max((n for _, _, n in self._erl_schedule[0]), default=0)
        if getattr(self, "_erl_inbox", None) is None or self._erl_inbox.numel() < need:
            self._erl_inbox = torch.empty(need, dtype=torch.uint8, device=params[0].device)
        try:
            return receive.receive_sliced(self._erl_group, params, self._erl_schedule, self._erl_inbox, delta)
        except BaseException:
            # close this worker's side: a sender blocked on it gets "connection closed" at once
            # instead of waiting out the group's timeout
            import gc

            self._erl_group = None
            gc.collect()
            raise

    def erl_load_pieces(self, worker: int, sender: int, slot: int, handle: list, bucket: list,
                        counts: list | None = None) -> int:
        """One bucket of a sliced ``ipc`` sync for worker ``worker`` (the others return): copy its
        pieces (``counts``: packed as deltas) out of the sender's shared buffer (mapped once per
        sender and slot) into the parameters, and finish before returning (the sender refills
        the buffer after)."""
        from elasticrl import backend
        from elasticrl.weights.slices import revive_bucket

        if self._erl_tp_rank() != worker:
            return 0
        mapped = getattr(self, "_erl_mapped", {})
        self._erl_mapped = mapped
        key = (int(sender), int(slot))
        plain = _plain(handle)
        if key not in mapped or mapped[key][0] != plain:
            mapped[key] = (plain, shm.open_shared(plain))
        params = [p for _, p in self._erl_model().named_parameters()]
        n = receive.copy_pieces(params, mapped[key][1], revive_bucket(bucket), counts)
        backend.synchronize()
        return n

    def erl_release_shm(self, path: str) -> None:
        self._erl_buffers.pop(path, None)

    def erl_release_all(self) -> None:
        self._erl_buffers = {}
        arena = getattr(self, "_erl_arena", None)
        if arena is not None:
            shm.release(arena["path"])  # our mapping (the live weights) stays valid

    def erl_join_group(self, addr: str, port: int, rank_offset: int, world_size: int, backend: str,
                       timeout_s: int) -> None:
        """Join the weight group: the sending trainer ranks come first, engine workers follow."""
        from elasticrl.weights.group import new_group

        rank = rank_offset + self._erl_tp_rank()
        self._erl_group = new_group(addr, port, rank, world_size, backend, timeout_s)

    def _erl_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def erl_load_broadcast(self, metas: list[tuple[str, str, list[int], int]], nbytes: int,
                           adapter: dict | None = None) -> int:
        """Receive one bucket broadcast from rank 0 of the weight group, then load it (the
        gathered path: a full tensor each, sliced by vLLM's loaders; or an adapter's tensors)."""
        weights = receive.from_broadcast(self._erl_group, metas, nbytes, next(self._erl_model().parameters()).device)
        self._erl_load(weights, adapter)
        return nbytes

    def erl_leave_group(self) -> None:
        self._erl_group = None

    def erl_load_files(self, folder: str, adapter: dict | None = None) -> int:
        """A synced folder: whole tensors go through ``load_weights``, deltas through the copy plans."""
        params = [p for _, p in self._erl_model().named_parameters()]
        plans = getattr(self, "_erl_plans", None)
        return self._erl_load(receive.from_files(folder, params, plans and plans["plans"]), adapter)

    def erl_state_dict(self, digest: bool = False) -> dict[str, list | str]:
        """This worker's weights, small models only (tests compare slices with the trainer's), or
        (``digest``) a SHA-256 of each one's bytes (tests compare them bit for bit)."""
        import hashlib

        params = self._erl_model().named_parameters()
        if digest:
            return {n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                    for n, p in params}
        return {n: p.detach().cpu().float().tolist() for n, p in params}


def _plain(handle):
    """A handle as sent: vLLM's messages turn its tuples into lists."""
    return [_plain(h) for h in handle] if isinstance(handle, (list, tuple)) else handle


def _loader_of(mod):
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    if type(mod.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(mod, "weight_loader_v2"):
        return mod.weight_loader_v2
    return mod.weight_loader
