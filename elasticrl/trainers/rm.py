"""Reward model: Bradley-Terry on preference pairs, a scalar head on a causal LM.

Variant: the reward of a (prompt, response) is the head's value at the last real token
(the end-of-text token, as the paper's PPO reads it); the loss is
-log sigmoid(r_chosen - r_rejected), averaged over every pair of the global batch. The
export is a Hugging Face sequence-classification model, usable as ``rewards.models`` and as
the critic's initialisation.

Run it:
  CPU:          elasticrl run examples/tiny_rm.yaml --output runs/rm
  workstation:  elasticrl run my_rm.yaml --output runs/rm --set train.num_ranks=4
"""
from __future__ import annotations

from pathlib import Path

import torch

from elasticrl.algorithms.preference import bradley_terry_loss
from elasticrl.cluster import RoleGroup, ray_session
from elasticrl.cluster.placement import pool_for
from elasticrl.data.records import pad_batch, read_jsonl, sample_indices, tokenize_sft
from elasticrl.engine.rank import TrainRank
from elasticrl.models.load import token_values
from elasticrl.spec import JobSpec, load_spec, spec_to_dict
from elasticrl.trainers.init import initial_model
from elasticrl.trainers.loop import num_steps, offline_loop, prepare_output
from elasticrl.world import world_paths


class RMWorker:
    def __init__(self, spec: dict, paths: dict[str, str]):
        self.spec = load_spec(spec)
        self.paths = paths

    def setup(self, rank, world_size, addr, port, total_steps) -> dict:
        s = self.spec
        self.core = TrainRank(s, s.train, self.paths["model"], rank, world_size, addr, port, total_steps, kind="value")
        keys = (s.data.prompt_key, s.data.chosen_key, s.data.rejected_key)
        self.pairs = read_jsonl(self.paths["train"], keys)
        self.eval_pairs = read_jsonl(self.paths["eval"], keys)
        return {"dtype": self.core.dtype}

    def _rewards(self, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        s, tok = self.spec, self.core.tokenizer
        seqs = []
        for key in (s.data.chosen_key, s.data.rejected_key):
            for p in pairs:
                seqs.append(tokenize_sft(tok, p[s.data.prompt_key], p[key], s.data.apply_chat_template,
                                         s.data.max_length)[0])
        b = {k: v.to(self.core.device) for k, v in pad_batch(seqs, tok.pad_token_id).items()}
        values = token_values(self.core.engine.module if not self.core.engine.training else self.core.engine,
                              b["input_ids"], b["attention_mask"])
        last = b["attention_mask"].sum(1) - 1
        r = values[torch.arange(len(seqs)), last]
        return r[: len(pairs)], r[len(pairs):]

    def train_step(self, step: int) -> dict:
        s, core = self.spec, self.core
        B = s.train.global_batch_size
        idx = sample_indices(len(self.pairs), s.seed, step * B, B)
        mine = [self.pairs[i] for i in idx][core.my_rows(B)]
        mbs = s.train.micro_batch_size
        core.engine.train()
        loss_sum, correct, margin = 0.0, 0, 0.0
        lr = core.engine.get_lr()[0]
        for m in range(0, len(mine), mbs):
            chosen, rejected = self._rewards(mine[m:m + mbs])
            # mean over this micro-batch's pairs, rescaled to a share of the global mean
            loss = bradley_terry_loss(chosen, rejected) * len(chosen) / B
            core.engine.backward(loss * core.dp_size * core.grad_accum)
            core.engine.step()
            loss_sum += loss.item()
            correct += int((chosen > rejected).sum())
            margin += float((chosen - rejected).sum())
        return {"loss_sum": loss_sum, "correct": correct, "margin_sum": margin, "pairs": len(mine), "lr": lr,
                "leader": core.is_dp_leader}

    @torch.no_grad()
    def evaluate(self, num_pairs: int) -> dict:
        self.core.engine.eval()
        pairs = self.eval_pairs[:num_pairs] if num_pairs else self.eval_pairs
        mine = pairs[self.core.dp_rank::self.core.dp_size]
        correct, margin = 0, 0.0
        for m in range(0, len(mine), 64):
            chosen, rejected = self._rewards(mine[m:m + 64])
            correct += int((chosen > rejected).sum())
            margin += float((chosen - rejected).sum())
        return {"correct": correct, "margin_sum": margin, "total": len(mine), "leader": self.core.is_dp_leader}

    def save(self, folder): self.core.save(folder)
    def load(self, folder): self.core.load(folder)
    def export(self, folder): self.core.export(folder)


def run_rm(spec: JobSpec, output: Path) -> dict:
    output = prepare_output(spec, output)
    t = spec.train
    summary: dict = {}
    with ray_session(spec.ray, num_cpus_needed=t.num_ranks):
        world = world_paths(spec.world) if spec.data.train is None or spec.data.eval is None else {}
        paths = {"model": initial_model(spec), "train": spec.data.train or str(world["preference"]),
                 "eval": spec.data.eval or str(world["preference_eval"])}
        keys = (spec.data.prompt_key, spec.data.chosen_key, spec.data.rejected_key)
        total = num_steps(t.max_steps, t.num_epochs, len(read_jsonl(paths["train"], keys)), t.global_batch_size)
        read_jsonl(paths["eval"], keys)
        group = RoleGroup("reward_model", RMWorker, t.num_ranks, spec_to_dict(spec), paths,
                          pool=pool_for(spec.placement.pools, "actor"))
        try:
            group.setup(total)
            summary.update(_train(spec, group, output, total))
        finally:
            group.shutdown()
    return summary


def _evaluate(group, spec) -> dict:
    res = [r for r in group.call("evaluate", spec.eval.num_prompts) if r["leader"]]
    n = max(1, sum(r["total"] for r in res))
    return {"eval/pairwise_accuracy": sum(r["correct"] for r in res) / n,
            "eval/margin": sum(r["margin_sum"] for r in res) / n}


def _train(spec: JobSpec, group: RoleGroup, output: Path, total: int) -> dict:
    def step_row(res):
        pairs = sum(r["pairs"] for r in res)
        return {"loss": sum(r["loss_sum"] for r in res), "accuracy": sum(r["correct"] for r in res) / pairs,
                "margin": sum(r["margin_sum"] for r in res) / pairs, "lr": res[0]["lr"]}

    return offline_loop(spec, group, output, total, step_row, lambda: _evaluate(group, spec), "pairwise_accuracy")
