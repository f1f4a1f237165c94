"""One rank of a DeepSpeed-trained model, as every trainer's workers hold it.

It owns the engine, the tokenizer and the rank's data-parallel position, and does what
every trainer needs the same way: save, load, export, and push weights to rollout engines.
The Ray worker classes of each trainer hold one and add their own step functions.
"""
from __future__ import annotations

import json
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from elasticrl import backend
from elasticrl.data.records import row_share, sample_indices
from elasticrl.engine import checkpoint as ckpt
from elasticrl.engine import sequence, state
from elasticrl.engine.budget import imbalance
from elasticrl.engine.budget import plan as budget_plan
from elasticrl.engine.strategy import build_engine, ds_config, init_distributed
from elasticrl.files import write_text
from elasticrl.models import load_tokenizer, torch_dtype
from elasticrl.models.load import load_causal_lm, load_value_model, with_lora
from elasticrl.parallel import data_parallel_info, tensor_parallel_rank
from elasticrl.spec import JobSpec
from elasticrl.spec.algorithms import longest_sequence
from elasticrl.spec.schema import TrainSpec


class TrainRank:
    def __init__(self, spec: JobSpec, train: TrainSpec, model_path: str, rank: int, world_size: int, addr: str,
                 port: int, total_steps: int, *, lr: float | None = None, kind: str = "causal",
                 init_dist: bool = True, resume: str | None = None):
        """``resume``: a checkpoint folder of this role (``save``'s): the model starts from its
        weights and the optimizer, schedule and counters continue from its state."""
        self.spec, self.train, self.rank = spec, train, rank
        if init_dist:
            init_distributed(rank, world_size, addr, port, train.comm_timeout_s)
        backend.set_threads(train.threads)
        backend.set_longest(longest_sequence(spec))  # the attention kernel by length
        torch.manual_seed(spec.seed + rank)
        self.dtype = backend.resolve_dtype(spec.model.dtype)  # the worker's own hardware decides
        if self.dtype == "bf16" and not backend.fast_bf16() and rank == 0:
            warnings.warn("model.dtype: bf16 on a CPU without AVX512-BF16/AMX runs ~50x slower than fp32; "
                          "use model.dtype: auto", stacklevel=1)
        self.tokenizer = load_tokenizer(model_path, spec.model.trust_remote_code, spec.data.chat_template)
        dp_size = world_size // train.tp_size // train.sp_size
        self.grad_accum = train.global_batch_size // (train.micro_batch_size * dp_size)
        cfg = ds_config(train, self.dtype, self.grad_accum)
        load = load_value_model if kind == "value" else load_causal_lm
        # a checkpoint's pieces replace its weights
        model = load(model_path, spec.model.trust_remote_code, cfg, spec.model.lora.quantize, torch_dtype(self.dtype))
        self.lora = spec.model.lora.rank > 0
        if self.lora:
            model = with_lora(model, spec.model.lora, value_head=kind == "value")
        if spec.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.lora:  # the frozen embeddings' output must carry gradients into the checkpointed layers
                model.enable_input_require_grads()
        # sequence parallelism: DeepSpeed sums gradients over each group of sp_size ranks
        mpu = sequence.enable(model, train.sp_size, train.micro_batch_size) if train.sp_size > 1 else None
        self.engine = build_engine(model, train, self.dtype, self.grad_accum, total_steps, lr=lr, mpu=mpu)
        self.model_path = model_path
        if resume and self.lora:
            ckpt.check_base(resume, model_path)
        if resume:
            state.load_engine(self.engine, resume)
            rng = Path(resume) / f"rng_rank{rank}.safetensors"
            if rng.is_file() and state.saved_world_size(resume) == world_size:  # else the seeded start stays
                backend.set_rng_state(load_file(str(rng)))
        # the data ranks: ZeRO's partitions (data_parallel_info) less the sequence-parallel peers
        zero_rank, zero_size = data_parallel_info(train.tp_size)
        self.sp_rank, self.sp_size = zero_rank % train.sp_size, train.sp_size
        self.dp_rank, self.dp_size = zero_rank // train.sp_size, zero_size // train.sp_size
        self.is_dp_leader = tensor_parallel_rank(train.tp_size) == 0 and self.sp_rank == 0
        self.sender = None
        self._writer: _Writer | None = None            # the last save's writes (``saved``)
        self._staging: torch.Tensor | None = None      # its host buffer, which the next save reuses
        self._copy_buffer: torch.Tensor | None = None  # the last snapshot's, which the next reuses
        self._micro_count = self._micro_left = 0       # a token budget's micro-batches: planned, to go

    @property
    def device(self):
        return backend.current_device()

    def frozen_copy(self):
        """The start model, frozen, in this rank's dtype and device: a reference beside the trained
        copy. None under LoRA, where the trained model with its adapters off is the base."""
        if self.lora:
            return None
        return load_causal_lm(self.model_path, self.spec.model.trust_remote_code).to(
            self.device, torch_dtype(self.dtype)).eval().requires_grad_(False)

    def my_rows(self, num_rows: int) -> slice:
        """This rank's share of a batch of ``num_rows`` (tensor-parallel peers share one)."""
        return row_share(num_rows, self.dp_size, self.dp_rank)

    def split(self, index, lengths: list[int] | None = None) -> list:
        """This rank's share of a global (mini-)batch's row or record indices, in micro-batches:
        of ``train.micro_batch_size`` rows, or with ``train.max_tokens_per_micro_batch`` planned
        by the rows' token ``lengths`` (``engine.budget``: balanced over the ranks, cut by the
        budget, as many on every rank; None is an empty one). ``backward`` counts them."""
        budget = self.train.max_tokens_per_micro_batch
        if not budget:
            mine, mbs = index[self.my_rows(len(index))], self.train.micro_batch_size
            return [mine[m:m + mbs] for m in range(0, len(mine), mbs)]
        if lengths is None:
            raise ValueError("train.max_tokens_per_micro_batch needs the rows' lengths to plan micro-batches")
        mine = budget_plan(list(lengths), self.dp_size, budget, self.spec.data.packing)[self.dp_rank]
        self._micro_count = self._micro_left = len(mine)
        take = (lambda m: index[torch.tensor(m)]) if torch.is_tensor(index) else (lambda m: [index[j] for j in m])
        return [None if m is None else take(m) for m in mine]

    def sequence_slice(self, mb):
        """A micro-batch (``Experience``) as this rank trains on it: whole, and no position ids,
        or under sequence parallelism its slice of the positions (``sequence.slice_rows``)."""
        return (mb, None) if self.sp_size == 1 else sequence.slice_rows(mb, self.sp_rank, self.sp_size)

    def sequence_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over this rank's sequence-parallel group (each holds its slices' shares)."""
        if self.sp_size == 1:
            return values
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=groups.get_sequence_parallel_group())
        return t.tolist()

    def token_imbalance(self, lengths: list[int]) -> float:
        """How many more tokens the busiest data-parallel rank gets of a mini-batch of these
        lengths than the ranks' mean (``budget.imbalance``), as ``split`` shares it out."""
        if self.train.max_tokens_per_micro_batch:
            shares = [[i for m in micro if m for i in m] for micro in budget_plan(
                lengths, self.dp_size, self.train.max_tokens_per_micro_batch, self.spec.data.packing)]
        else:
            n = len(lengths)
            shares = [range(n)[row_share(n, self.dp_size, r)] for r in range(self.dp_size)]
        return imbalance(lengths, shares)

    def batch_records(self, num_records: int, step: int) -> list[int]:
        """Record indices of step ``step``'s global batch (the seeded order of
        data.records.sample_indices: any world size reads the same records)."""
        B = self.train.global_batch_size
        return sample_indices(num_records, self.spec.seed, step * B, B, self.spec.data.shuffle)

    def micro_batches(self, num_records: int, step: int, length=None) -> list:
        """This rank's record indices of step ``step``'s global batch, in micro-batches (``split``;
        ``length(i)``: record i's tokens, for token budgets); the engine goes into training mode."""
        self.engine.train()
        records = self.batch_records(num_records, step)
        return self.split(records, [length(i) for i in records] if self.train.max_tokens_per_micro_batch else None)

    @property
    def micro_count(self) -> int:
        """Micro-batches of the mini-batch being trained: the split's under a token budget."""
        return self._micro_count if self.train.max_tokens_per_micro_batch else self.grad_accum

    def backward(self, loss: torch.Tensor, denominator: float = 1.0) -> float:
        """Backward of a micro-batch's share of the global mean loss, ``loss / denominator``
        (DeepSpeed averages over data-parallel ranks, and by rows over the accumulation steps,
        so it is scaled back up); the engine steps at the accumulation boundary: the last of
        the split's micro-batches under a token budget. Returns ``loss``."""
        if self.train.max_tokens_per_micro_batch:
            self._micro_left -= 1
            self.engine.set_gradient_accumulation_boundary(self._micro_left == 0)
            self.engine.backward(loss * (self.dp_size / denominator), scale_wrt_gas=False)
        else:
            self.engine.backward(loss * (self.dp_size * self.grad_accum / denominator))
        self.engine.step()
        return loss.item()

    # --- persistence --------------------------------------------------------------------
    def save(self, folder: str, background: bool = False) -> int | None:
        """This rank's share of the role's state into ``folder`` (which exists): its pieces of
        the fp32 master weights and optimizer moments (``engine.state``) and its RNG; rank 0
        adds the counters, the model's config and the tokenizer. Returns once the pieces are
        copied to host memory; ``background`` writes them in a thread (``saved`` waits for it),
        else they are written from the live tensors now, returning the bytes. Not collective."""
        if self._writer is not None:
            self._writer.join()  # the previous save's writes first (their error went to its commit)
        staged = state.stage_engine(self.engine, copy=background, reuse=self._staging)
        self._staging, rng = staged.buffer, backend.rng_state()
        if self.rank == 0:
            self._save_model_files(folder)

        def write() -> int:  # the pieces last: with them the rank's part is complete
            save_file(rng, str(Path(folder) / f"rng_rank{self.rank}.safetensors"))
            return state.write_staged(staged, folder)
        self._writer = _Writer(write)
        if not background:
            return self.saved(wait=True)
        return None

    def saved(self, wait: bool = True) -> int | None:
        """Bytes the last save wrote once its writes are done (0 without one); None while they
        go on and ``wait`` is false. Raises what the writing raised (a full disk)."""
        return 0 if self._writer is None else self._writer.result(wait)

    def snapshot(self) -> dict:
        """What ``save`` writes, built in memory from the live tensors (the in-memory copy of
        ``fault.memory_copy_steps``, which a keeper holds): {relative path: bytes, or the pieces
        file as a uint8 array}. This rank's pieces (one copy, into a buffer the next snapshot
        reuses) and RNG; rank 0's also the counters, the model's config and the tokenizer."""
        pieces = state.PIECES.format(self.rank)
        files = state.staged_files(state.stage_engine(self.engine, copy=False), self._copy_buffer)
        self._copy_buffer = files[pieces]
        files[pieces] = files[pieces].numpy()  # Ray hands an array's memory over without pickling it
        files[f"rng_rank{self.rank}.safetensors"] = save(backend.rng_state())
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:  # a few small files
                self._save_model_files(tmp)
                files.update({str(f.relative_to(tmp)): f.read_bytes() for f in Path(tmp).rglob("*") if f.is_file()})
        return files

    def _save_model_files(self, folder: str) -> None:
        self.engine.module.config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if self.lora:
            write_text(Path(folder) / ckpt.LORA_BASE, json.dumps(ckpt.base_identity(self.model_path)))

    def export(self, folder: str) -> None:
        if self.lora:
            ckpt.export_adapters(self.engine, self.tokenizer, folder)
            if self.spec.export.merge:
                ckpt.export_merged(self.engine, self.tokenizer, Path(folder) / "merged",
                                   self.spec.export.max_shard_size_mb * 2**20, torch_dtype(self.dtype))
            return
        ckpt.export_hf(self.engine, self.tokenizer, folder, self.spec.export.max_shard_size_mb * 2**20,
                       torch_dtype(self.dtype))

    # --- weights into rollout engines ---------------------------------------------------
    def attach_rollout(self, engines: list, infos: list[dict], transport: str, bucket_mb: int,
                       files_dir: str | None = None, layout: str = "auto", adapters: bool = False) -> str:
        """A weight sender into ``engines`` (collective); ``layout`` "gathered" makes rank 0 send
        every tensor whole even where slices could go (benchmarks compare the two); ``adapters``:
        the engines serve LoRA adapters, and each sync sends only those."""
        from elasticrl.weights.sync import WeightSender

        self.sender = WeightSender(self.engine, engines, infos, transport, bucket_mb * 2**20,
                                   self.train.comm_timeout_s, files_dir, layout, adapters, self.spec.rollout.delta_sync)
        return self.sender.transport

    def sync_weights(self, version: int) -> dict:
        return self.sender.sync(self.engine, version)

    def detach_rollout(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class _Writer(threading.Thread):
    """A save's writes, in the background (``TrainRank.save``)."""

    def __init__(self, write):
        super().__init__(daemon=True, name="elasticrl-checkpoint-writer")
        self.write, self.written, self.error = write, None, None
        self.start()

    def run(self) -> None:
        try:
            self.written = self.write()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
            self.error = exc
        self.write = None  # the staged copy goes with it

    def result(self, wait: bool) -> int | None:
        if self.is_alive() and not wait:
            return None
        self.join()
        if self.error is not None:
            raise self.error
        return self.written
