"""The Ray workers of the RL roles: actor, critic, and frozen models (reference, reward).

Each holds a ``TrainRank`` (trained roles) or a plain model (frozen roles) and exposes what
the driver calls per phase. Batches arrive whole (a Ray object shared by every rank); each
rank takes its rows (``data.records.row_share``), so tensor-parallel peers see the same data,
and answers with ``rows_reply``. The policy's log-probs, its entropy and the reference's
log-probs are those of softmax(logits / rl.temperature), the distribution rollouts sample.
"""
from __future__ import annotations

import math
import time

import torch

from elasticrl import backend
from elasticrl.algorithms.correction import correction_mode, importance_weights
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.logprobs import masked_sum, response_mask, token_logprobs
from elasticrl.algorithms.losses import aggregate, entropy_from_logits, policy_loss, value_loss
from elasticrl.data.records import pad_batch, read_records, row_share, sample_indices, tokenize_sft
from elasticrl.engine import sequence
from elasticrl.engine.budget import plan as budget_plan
from elasticrl.engine.strategy import ds_config, init_distributed
from elasticrl.models.load import load_causal_lm, load_tokenizer, load_value_model, token_values
from elasticrl.models.scoring import packed_forward
from elasticrl.spec import load_spec
from elasticrl.spec.algorithms import longest_sequence
from elasticrl.trainers.batch import Experience, rows_reply, widened
from elasticrl.trainers.worker import TRAINER_IMPORTS, RankWorker


def _minibatches(num_rows: int, global_batch: int, epochs: int, seed: int):
    """Row indices of each optimizer step: ``epochs`` shuffled passes in mini-batches."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(num_rows, generator=g)
        for start in range(0, num_rows - global_batch + 1, global_batch):
            yield perm[start:start + global_batch]


def _denominators(batch: Experience, index: torch.Tensor, spec) -> dict:
    """A mini-batch's global counts, which each micro-batch's loss divides by (``aggregate``):
    its tokens in the loss, its responses with any, its rows, and the most model tokens a
    response may have (seq_sum_norm's constant: rl.max_new_tokens a turn)."""
    mask, rl = batch.response_mask[index], spec.rl
    return {"num_tokens": mask.sum(), "num_seqs": (mask.sum(1) > 0).sum().clamp(min=1), "num_rows": len(index),
            "norm_length": rl.max_new_tokens * (rl.max_turns if spec.rollout.environment else 1)}


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits.float() / temperature


class _TrainedRole(RankWorker):
    """What the actor and the critic workers share: their batch's rows in micro-batches."""

    def _micro(self, batch: Experience, index: torch.Tensor):
        """This rank's share of a mini-batch in micro-batches on the device, each with its rows
        (None: an empty one of a token budget, computed on the mini-batch's first row)."""
        for part in self.core.split(index, batch.attention_mask[index].sum(1).tolist()):
            yield batch.rows(index[:1] if part is None else part).trimmed().to(self.core.device), part

    def _forward_all(self, batch: Experience, fn) -> tuple[list[int], torch.Tensor | None]:
        """``fn(micro-batch)`` over this rank's rows of the whole batch, concatenated (at the
        batch's width: each micro-batch is trimmed to its own), and those rows."""
        self.core.engine.eval()
        n, width = batch.num_rows, batch.input_ids.shape[1] - 1
        rows, out = [], []
        for mb, part in self._micro(batch, torch.arange(n)):
            result = fn(mb)
            if part is not None:
                rows += part.tolist()
                out.append(widened(result.cpu(), width))
        return rows, (torch.cat(out) if out else None)


class ActorWorker(_TrainedRole):
    """The policy: log-probs for experience, the PPO-family update, weights to the engines."""

    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        out = super().setup(rank, world_size, addr, port, total_steps, resume)
        s = self.spec
        if s.rl.ptx_coef > 0:
            self.ptx_records = read_records(self.ptx_path, ("prompt", "response"))
        self.ref = None  # placement.reference: in_actor: the frozen start model, whole in this process
        if s.placement.reference == "in_actor" and s.rl.kl_coef > 0:
            t0 = time.time()
            self.ref = self.core.frozen_copy()
            out["reference_load_s"] = time.time() - t0
        return out

    def set_ptx_data(self, path: str) -> None:
        self.ptx_path = path

    @torch.no_grad()
    def logprobs(self, batch: Experience, model=None) -> dict:
        """Log-probs of this rank's rows under the current policy, or ``model`` (shifted layout)."""
        T = self.spec.rl.temperature
        share, lp = self._forward_all(batch, lambda mb: token_logprobs(self._logits(mb, model), mb.labels, T))
        return rows_reply(share, "logprobs", lp, self.core.is_dp_leader)

    @torch.no_grad()
    def reference_logprobs(self, batch: Experience) -> dict:
        """The reference's log-probs in this process: its frozen copy's (placement.reference:
        in_actor), or under LoRA (``model.lora``) the base's, the model with its adapters switched
        off (no copy of the weights)."""
        if self.ref is not None:
            return self.logprobs(batch, self.ref)
        with self.core.engine.module.disable_adapter():
            return self.logprobs(batch)

    def _logits(self, mb: Experience, model=None, positions=None) -> torch.Tensor:
        """The logits of the policy, or of ``model``, padded or (data.packing) packed, or of a
        sequence-parallel slice at ``positions`` (no mask: right padding under causal attention)."""
        model = self.core.engine if model is None else model
        if positions is not None:
            with sequence.sliced():
                return model(input_ids=mb.input_ids, position_ids=positions, use_cache=False).logits
        if self.spec.data.packing:
            return packed_forward(lambda **kw: model(**kw, use_cache=False).logits, mb.input_ids, mb.attention_mask)
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits

    def train(self, batch: Experience, step: int) -> dict:
        """PPO epochs over the batch; returns mean stats over this rank's micro-batches."""
        s, rl = self.spec, self.spec.rl
        engine = self.core.engine
        engine.train()
        kl_fn = KL_ESTIMATORS[rl.kl_estimator]
        correction = correction_mode(rl.is_correction, rl.async_rollout, backend.has_gpu())
        stats: dict[str, float] = {}  # token-weighted sums of the micro-batches' means
        tokens = minibatches = 0
        loss_sum = kl_loss_sum = worst = 0.0
        num_rows = batch.num_rows
        for k, index in enumerate(_minibatches(num_rows, self.train.global_batch_size, rl.epochs, s.seed + step)):
            denom = _denominators(batch, index, self.spec)
            worst = max(worst, self.core.token_imbalance(batch.attention_mask[index].sum(1).tolist()))
            for whole, part in self._micro(batch, index):
                mb, positions = self.core.sequence_slice(whole)
                sliced = positions is not None  # a slice's last position predicts the next slice's first token
                logits = self._logits(mb, positions=positions)
                if part is None:  # the collectives' turn of an empty micro-batch, with no weight
                    with sequence.sliced(sliced):  # (checkpointed layers recompute sliced too)
                        self.core.backward(logits.sum() * 0)
                    continue
                logp = token_logprobs(logits, mb.labels, rl.temperature, aligned=sliced)
                mask = mb.response_mask
                # on-policy (rl.old_logprobs: auto): the policy before this update is this one
                old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
                weights, istats = (None, {}) if mb.behaviour_logprobs is None else importance_weights(
                    old, mb.behaviour_logprobs, mask, correction, rl.is_threshold_low, rl.is_threshold)
                loss, pstats = policy_loss(logp, old, mb.advantages, mask, clip_low=rl.clip_low,
                                           clip_high=rl.clip_high, dual_clip=rl.dual_clip, token_weights_bt=weights,
                                           ratio_level=rl.importance_ratio, aggregation=rl.loss_aggregation, **denom)
                total, pstats = loss, {**pstats, **istats}
                if rl.kl_coef > 0 and rl.kl_mode == "loss":
                    kl = aggregate(kl_fn(logp, mb.ref_logprobs), mask, rl.loss_aggregation, **denom)
                    total = total + rl.kl_coef * kl
                    kl_loss_sum += kl.item()  # a global-denominator share, as the loss
                if mb.old_logprobs is None and mb.ref_logprobs is not None:  # the experience phase had none
                    pstats["kl"] = aggregate(kl_fn(old, mb.ref_logprobs), mask, "token_mean").item()
                with torch.set_grad_enabled(rl.entropy_coef > 0):  # else only reported: no graph kept for it
                    entropy_bt = entropy_from_logits(_tempered(logits if sliced else logits[:, :-1], rl.temperature))
                if rl.entropy_coef > 0:
                    total = total - rl.entropy_coef * aggregate(entropy_bt, mask, rl.loss_aggregation, **denom)
                ent = aggregate(entropy_bt.detach(), mask, "token_mean")  # reported as a plain token mean
                pstats["entropy"] = ent.item()
                if rl.ptx_coef > 0:  # a mean over its own tokens, not a share of the global batch
                    total = total + rl.ptx_coef * self._ptx_loss(step * 1000 + k, len(index)) / \
                        (self.core.dp_size * self.core.micro_count)
                with sequence.sliced(sliced):
                    self.core.backward(total)
                loss_sum += loss.item()  # global-denominator share: summed over ranks = the loss
                n = int(mask.sum())  # the means are token means: weighted by tokens, any cut reports the same
                for key, v in pstats.items():
                    stats[key] = stats.get(key, 0.0) + v * n
                tokens += n
            minibatches += 1
        keys = sorted(stats)  # each sequence-parallel rank holds its slices' shares
        loss_sum, kl_loss_sum, tokens, *sums = self.core.sequence_sum([loss_sum, kl_loss_sum, tokens,
                                                                       *(stats[k] for k in keys)])
        out = {k: v / max(tokens, 1) for k, v in zip(keys, sums)}
        out.update(policy_loss_sum=loss_sum, minibatches=minibatches, leader=self.core.is_dp_leader, tokens=tokens,
                   token_imbalance=worst)
        if rl.kl_coef > 0 and rl.kl_mode == "loss":
            out["kl_loss_sum"] = kl_loss_sum
        norm = engine.get_global_grad_norm()
        out["grad_norm"] = float(norm) if norm is not None and math.isfinite(float(norm)) else None
        out["lr"] = engine.get_lr()[0]
        return out

    def _ptx_loss(self, position: int, batch_size: int) -> torch.Tensor:
        """Mean SFT NLL on the world's SFT data (the paper's pretraining-loss trick)."""
        s = self.spec
        per_rank = max(1, self.train.micro_batch_size)
        idx = sample_indices(len(self.ptx_records), s.seed + 7, position * per_rank * self.core.dp_size +
                             self.core.dp_rank * per_rank, per_rank)
        ex = [tokenize_sft(self.core.tokenizer, self.ptx_records[i]["prompt"], self.ptx_records[i]["response"],
                           s.data.apply_chat_template, s.data.max_length) for i in idx]
        ids, trained = zip(*ex)
        b = {k: v.to(self.core.device) for k, v in pad_batch(list(ids), self.core.tokenizer.pad_token_id,
                                                               list(trained)).items()}
        logits = self.core.engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        mask = response_mask(b["labels"])
        return -masked_sum(token_logprobs(logits, b["labels"]), mask) / mask.sum().clamp(min=1)


class CriticWorker(_TrainedRole):
    """The value model: values for GAE, the clipped value-loss update."""

    kind = "value"

    @torch.no_grad()
    def values(self, batch: Experience) -> dict:
        module = self.core.engine.module
        share, values = self._forward_all(
            batch, lambda mb: token_values(module, mb.input_ids, mb.attention_mask, self.spec.data.packing)[:, :-1])
        return rows_reply(share, "values", values, self.core.is_dp_leader)

    def train(self, batch: Experience, step: int) -> dict:
        rl, critic = self.spec.rl, self.spec.critic
        engine = self.core.engine
        engine.train()
        total, minibatches = 0.0, 0
        for index in _minibatches(batch.num_rows, self.train.global_batch_size, rl.epochs,
                                  self.spec.seed + step + 1):
            minibatches += 1
            denom = _denominators(batch, index, self.spec)
            for whole, part in self._micro(batch, index):
                mb, positions = self.core.sequence_slice(whole)
                with sequence.sliced(positions is not None):  # forward and backward (checkpointed recomputes)
                    values = token_values(engine.module, mb.input_ids, mb.attention_mask, self.spec.data.packing,
                                          positions)
                    values = values if positions is not None else values[:, :-1]  # a slice's are aligned
                    if part is None:  # an empty micro-batch: the collectives' turn, with no weight
                        self.core.backward(values.sum() * 0)
                        continue
                    loss = value_loss(values, mb.old_values, mb.returns, mb.response_mask,
                                      clip=critic.value_clip, aggregation=rl.loss_aggregation, **denom)
                    total += self.core.backward(loss)
        return {"value_loss_sum": total, "minibatches": minibatches, "critic_lr": engine.get_lr()[0]}


class FrozenWorker:
    """A model that only scores: the reference policy (log-probs) or a reward model (a
    scalar at the last real token). With ``train.zero_stage: 3`` and several ranks its
    weights are sharded over them (DeepSpeed ZeRO-3 inference, as OpenRLHF runs its
    reference); otherwise each rank holds them whole. Idle weights can leave the GPU
    between phases (``placement.offload_idle``)."""

    def __init__(self, spec: dict, model_path: str, kind: str, offload_idle: bool):
        self.spec = load_spec(spec)
        self.kind, self.model_path = kind, model_path
        self.offload_idle = offload_idle and backend.has_gpu()

    def setup(self, rank, world_size, addr, port, *_):
        imported, t0 = backend.import_heavy(*TRAINER_IMPORTS), time.time()
        self.rank, self.world_size = rank, world_size
        s = self.spec
        backend.set_threads(s.train.threads)
        backend.set_longest(longest_sequence(s))  # the attention kernel by length
        self.sharded = s.train.zero_stage == 3 and world_size > 1
        dtype = backend.resolve_dtype(s.model.dtype)
        load = load_value_model if self.kind == "reward" else load_causal_lm
        self.tokenizer = load_tokenizer(self.model_path, s.model.trust_remote_code)
        if self.sharded:
            import deepspeed

            init_distributed(rank, world_size, addr, port, s.train.comm_timeout_s)
            cfg = ds_config(s.train, dtype, 1)
            cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        **({"offload_param": {"device": "cpu", "pin_memory": True}}
                                           if self.offload_idle else {})}
            model = load(self.model_path, s.model.trust_remote_code, cfg).eval()
            model.requires_grad_(False)
            self.model = deepspeed.initialize(model=model, config=cfg)[0].module
            self.offload_idle = False  # ZeRO-3 keeps the shards in host memory itself
        else:
            self.model = load(self.model_path, s.model.trust_remote_code).to(
                torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
            self.model.requires_grad_(False)
            self._place(backend.current_device() if not self.offload_idle else torch.device("cpu"))
        return {"import_s": imported, "load_s": time.time() - t0}

    def threads(self) -> int:
        return torch.get_num_threads()

    def _place(self, device) -> None:
        self.model.to(device)
        if device.type == "cpu":
            backend.empty_cache()

    def _parts(self, batch: Experience) -> list:
        """This rank's rows of ``batch`` in micro-batches, as the trainers cut them (rows, or a
        token budget's plan); sharded ranks gather weights together, so each runs as many
        forwards (None: an empty one, on a stand-in row)."""
        n, t = batch.num_rows, self.spec.train
        if t.max_tokens_per_micro_batch:
            parts = [None if p is None else torch.tensor(p) for p in budget_plan(
                batch.attention_mask.sum(1).tolist(), self.world_size, t.max_tokens_per_micro_batch,
                self.spec.data.packing)[self.rank]]
        else:
            index, mbs = torch.arange(n)[row_share(n, self.world_size, self.rank)], t.micro_batch_size
            parts = [index[m:m + mbs] for m in range(0, len(index), mbs)]
            largest = -(-n // self.world_size)
            parts += [None] * (-(-largest // mbs) - len(parts))
        return parts if self.sharded else [p for p in parts if p is not None]

    @torch.no_grad()
    def score(self, batch: Experience) -> dict:
        """This rank's rows: log-probs (reference) or rewards at the last token (reward)."""
        device = backend.current_device()
        if self.offload_idle:
            self._place(device)
        rows, out, s = [], [], self.spec
        for part in self._parts(batch):
            mb = batch.rows(torch.arange(1) if part is None else part).trimmed().to(device)
            if self.kind == "reward":
                values = token_values(self.model, mb.input_ids, mb.attention_mask, s.data.packing)
                last = mb.attention_mask.sum(1) - 1
                result = values[torch.arange(len(last)), last].cpu()
            else:
                logits = packed_forward(lambda **kw: self.model(**kw, use_cache=False).logits, mb.input_ids,
                                        mb.attention_mask) if s.data.packing else \
                    self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                result = widened(token_logprobs(logits, mb.labels, s.rl.temperature).cpu(),
                                 batch.input_ids.shape[1] - 1)
            if part is not None:
                rows += part.tolist()
                out.append(result)
        if self.offload_idle:
            self._place(torch.device("cpu"))
        return rows_reply(rows, "values", torch.cat(out) if out else None, True)
