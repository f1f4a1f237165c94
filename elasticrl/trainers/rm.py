"""Reward model: Bradley-Terry on preference pairs, a scalar head on a causal LM.

Variant: the reward of a (prompt, response) is the head's value at the last real token
(the end-of-text token, as the paper's PPO reads it); the loss is
-log sigmoid(r_chosen - r_rejected - margin), averaged over every pair of the global batch,
with a pair's margin read from ``data.margin_key`` (0 where a line has none, Llama 2). The
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
from elasticrl.cluster import Placement, ray_session
from elasticrl.data.records import pad_batch, read_records, tokenize_sft
from elasticrl.models.load import token_values
from elasticrl.plan.roles import cpus_needed
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.trainers.loop import check_user_files, data_paths, find_resume, num_steps, offline_loop, prepare_output
from elasticrl.trainers.warm_start import initial_model
from elasticrl.trainers.worker import RankWorker


class RMWorker(RankWorker):
    kind = "value"

    def __init__(self, spec: dict, paths: dict[str, str]):
        super().__init__(spec, paths["model"])
        self.paths = paths

    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        out = super().setup(rank, world_size, addr, port, total_steps, resume)
        self.pairs = read_records(self.paths["train"], pair_keys(self.spec))
        self.eval_pairs = read_records(self.paths["eval"], pair_keys(self.spec))
        return out

    def model(self):
        """The engine while training (gradients flow), its bare module in evaluation."""
        return self.core.engine if self.core.engine.training else self.core.engine.module

    def _ids(self, pair: dict, key: str) -> list[int]:
        d = self.spec.data
        return tokenize_sft(self.core.tokenizer, pair[d.prompt_key], pair[key], d.apply_chat_template,
                            d.max_length)[0]

    def _rewards(self, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        s, tok = self.spec, self.core.tokenizer
        seqs = [self._ids(p, key) for key in (s.data.chosen_key, s.data.rejected_key) for p in pairs]
        b = {k: v.to(self.core.device) for k, v in pad_batch(seqs, tok.pad_token_id).items()}
        values = token_values(self.model(), b["input_ids"], b["attention_mask"], s.data.packing)
        last = b["attention_mask"].sum(1) - 1
        r = values[torch.arange(len(seqs)), last]
        return r[: len(pairs)], r[len(pairs):]

    def train_step(self, step: int) -> dict:
        s, B = self.spec, self.spec.train.global_batch_size
        loss_sum, correct, margin, pairs = 0.0, 0, 0.0, 0
        lr = self.core.engine.get_lr()[0]
        d = s.data
        for keys in self.core.micro_batches(len(self.pairs), step, lambda i: sum(  # a pair: its two sequences
                len(self._ids(self.pairs[i], k)) for k in (d.chosen_key, d.rejected_key))):
            if keys is None:  # a token budget's empty micro-batch: the collectives' turn, with no weight
                self.core.backward(torch.cat(self._rewards(self.pairs[:1])).sum() * 0)
                continue
            part = [self.pairs[i] for i in keys]
            chosen, rejected = self._rewards(part)
            margin_b = torch.tensor([float(p.get(d.margin_key, 0.0)) for p in part], device=chosen.device)
            # mean over this micro-batch's pairs, rescaled to a share of the global mean
            loss_sum += self.core.backward(bradley_terry_loss(chosen, rejected, margin_b) * len(part) / B)
            pairs += len(part)
            correct += int((chosen > rejected).sum())
            margin += float((chosen - rejected).detach().sum())
        return {"loss_sum": loss_sum, "correct": correct, "margin_sum": margin, "pairs": pairs, "lr": lr,
                "leader": self.core.is_dp_leader}

    @torch.no_grad()
    def evaluate(self, num_pairs: int) -> dict:
        self.core.engine.eval()
        pairs = self.eval_pairs[:num_pairs] if num_pairs else self.eval_pairs
        mine = pairs[self.core.dp_rank::self.core.dp_size]
        correct, margin = 0, 0.0
        for m in range(0, len(mine), 64):
            chosen, rejected = self._rewards(mine[m:m + 64])
            correct += int((chosen > rejected).sum())
            margin += float((chosen - rejected).detach().sum())
        return {"correct": correct, "margin_sum": margin, "total": len(mine), "leader": self.core.is_dp_leader}



def pair_keys(spec: JobSpec) -> tuple[str, ...]:
    return spec.data.prompt_key, spec.data.chosen_key, spec.data.rejected_key


def run_head_trainer(spec: JobSpec, output: Path, worker, datasets: tuple[str, str], read, step_row, evaluate,
                     show: str) -> dict:
    """The driver of a model with a scalar head trained on a fixed dataset (rm, prm):
    ``datasets`` names the world's train and eval files used when data.train/eval are null,
    ``read(path)`` reads and checks one (here first, so bad data fails before any worker starts);
    ``evaluate(group, spec)`` makes the eval figures, ``show`` the one on the progress bar."""
    resume = find_resume(spec, output)
    output = prepare_output(spec, output)
    t = spec.train
    check_user_files(spec, read, read)
    with ray_session(spec.ray, cpus_needed(spec)):
        paths = {"model": initial_model(spec), **data_paths(spec, *datasets)}
        total = num_steps(t.max_steps, t.num_epochs, len(read(paths["train"])), t.global_batch_size)
        read(paths["eval"])
        group = Placement(spec).group("actor", worker, spec_to_dict(spec), paths, name="reward_model")
        try:
            group.setup(total, resume=resume.role("actor"))
            return offline_loop(spec, group, output, total, step_row, lambda: evaluate(group, spec), show,
                                resume.step)
        finally:
            group.shutdown()


def run_rm(spec: JobSpec, output: Path) -> dict:
    return run_head_trainer(spec, output, RMWorker, ("preference", "preference_eval"),
                            lambda path: read_records(path, pair_keys(spec), check=True, data=spec.data), _step_row,
                            _evaluate,
                            "pairwise_accuracy")


def _evaluate(group, spec) -> dict:
    res = [r for r in group.call("evaluate", spec.eval.num_prompts) if r["leader"]]
    n = max(1, sum(r["total"] for r in res))
    return {"eval/pairwise_accuracy": sum(r["correct"] for r in res) / n,
            "eval/margin": sum(r["margin_sum"] for r in res) / n}


def _step_row(res: list[dict], *_) -> dict:
    pairs = sum(r["pairs"] for r in res)
    return {"loss": sum(r["loss_sum"] for r in res), "accuracy": sum(r["correct"] for r in res) / pairs,
            "margin": sum(r["margin_sum"] for r in res) / pairs, "lr": res[0]["lr"]}
