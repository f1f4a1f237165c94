"""Supervised fine-tuning: N data-parallel DeepSpeed ranks as Ray actors, driven step by step.

Variant: next-token cross-entropy on response tokens only (prompt tokens are masked), the
mean taken over every response token of the global batch (not a mean of per-micro-batch
means), as in the paper's SFT (Appendix A.1). With ``data.packing`` a micro-batch's sequences are
laid end to end in one row (no padding; ``models.scoring``), with the same loss and gradients.

Run it:
  CPU:          elasticrl run examples/tiny_sft.yaml --output runs/sft
  workstation:  elasticrl run my_sft.yaml --output runs/sft --set train.num_ranks=4
  Slurm:        elasticrl launch my_sft.yaml --scheduler slurm
"""
from __future__ import annotations

from pathlib import Path

from elasticrl import backend
from elasticrl.algorithms.logprobs import masked_sum, response_mask, token_logprobs
from elasticrl.cluster import Placement, RoleGroup, ray_session
from elasticrl.data.records import pad_batch, prompt_answer, read_records, sft_example, sft_fields
from elasticrl.models.evaluate import greedy_accuracy
from elasticrl.models.scoring import response_logps
from elasticrl.plan.roles import cpus_needed
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.trainers.loop import check_user_files, data_paths, find_resume, num_steps, offline_loop, prepare_output
from elasticrl.trainers.warm_start import initial_model
from elasticrl.trainers.worker import RankWorker


class SFTWorker(RankWorker):
    """One rank: holds the DeepSpeed engine and reads its share of each global batch."""

    def __init__(self, spec: dict, paths: dict[str, str]):
        super().__init__(spec, paths["model"])
        self.paths = paths

    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        out = super().setup(rank, world_size, addr, port, total_steps, resume)
        self.engine, self.tokenizer = self.core.engine, self.core.tokenizer
        self.records = read_records(self.paths["train"], sft_fields(self.spec.data))
        self.eval_records = read_records(self.paths["eval"], prompt_answer(self.spec.data))
        return out

    def train_step(self, step: int) -> dict:
        s, core = self.spec, self.core
        examples = [sft_example(self.tokenizer, self.records[i], s.data)
                    for i in core.batch_records(len(self.records), step)]
        # Every rank sees the whole global batch's ids, so it knows the global token count
        # without a collective: the loss is a true mean over all trained tokens (the first
        # token of a sequence is never predicted).
        global_tokens = sum(sum(trained[1:]) for _, trained in examples)
        lr = self.engine.get_lr()[0]
        nll_total, seq_tokens = 0.0, 0
        self.engine.train()
        for part in core.split(examples, [len(ids) for ids, _ in examples]):
            weight = 0 if part is None else 1  # None: a token budget's empty micro-batch, computed with no weight
            part = part or examples[:1]
            ids, trained = zip(*part)
            if s.data.packing:  # laid end to end, no padding
                nll = -response_logps(self.engine, part, self.tokenizer.pad_token_id, True, core.device)[0].sum()
            else:
                b = {k: v.to(core.device) for k, v in pad_batch(list(ids), self.tokenizer.pad_token_id,
                                                                 list(trained)).items()}
                logits = self.engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                nll = -masked_sum(token_logprobs(logits, b["labels"]), response_mask(b["labels"]))
            nll_total += core.backward(nll * weight, max(global_tokens, 1))
            seq_tokens += sum(len(x) for x in ids) * weight
        grad_norm = self.engine.get_global_grad_norm()
        return {"nll_sum": nll_total, "global_tokens": global_tokens, "seq_tokens": seq_tokens, "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None, "leader": core.is_dp_leader}

    def set_records(self, path: str) -> None:
        """Train on these examples from now on (rejection sampling: each round's)."""
        self.records = read_records(path, sft_fields(self.spec.data))

    def evaluate(self, num_prompts: int) -> dict:
        s = self.spec
        records = self.eval_records[:num_prompts] if num_prompts else self.eval_records
        synced = s.train.zero_stage == 3 or s.train.tp_size > 1
        correct, total = greedy_accuracy(
            self.engine.module, self.tokenizer, records, s, max_new_tokens=s.eval.max_new_tokens,
            dp_rank=self.core.dp_rank, dp_size=self.core.dp_size,
            synced=synced, device=backend.current_device())
        return {"correct": correct, "total": total, "leader": self.core.is_dp_leader}


def resolve_paths(spec: JobSpec) -> dict[str, str]:
    """Model and data locations: the spec's, or the embedded tiny world's (its warm start with
    ``init.sft_steps``: conditional SFT from an SFT model, as SteerLM starts)."""
    return {"model": initial_model(spec), **data_paths(spec, "sft", "eval")}


def run_sft(spec: JobSpec, output: Path) -> dict:
    return train_sft(spec, output)


def train_sft(spec: JobSpec, output: Path, data: dict[str, str] | None = None) -> dict:
    """An SFT job; ``data``: train and eval files to read instead of the spec's (conditional
    SFT's attribute-marked copies of them, in the run's folder): the spec, and so each
    checkpoint, keeps naming the user's files, and a run resumes wherever its folder is."""
    resume = find_resume(spec, output)
    output = prepare_output(spec, output)
    check_user_files(spec, sft_fields(spec.data), prompt_answer(spec.data))
    paths = {**resolve_paths(spec), **(data or {})}
    t = spec.train
    total = num_steps(t.max_steps, t.num_epochs, len(read_records(paths["train"], sft_fields(spec.data))),
                      t.global_batch_size)
    summary: dict = {"steps": total, "resumed_from": resume.step if resume.folder else None}
    with ray_session(spec.ray, cpus_needed(spec)):
        group = Placement(spec).group("actor", SFTWorker, spec_to_dict(spec), paths, name="trainer")
        try:
            summary["dtype"] = group.setup(total, resume=resume.role("actor"))[0]["dtype"]
            summary.update(offline_loop(spec, group, output, total, lambda res, done, seconds: _step_row(
                spec, res, done, seconds), lambda: _evaluate(group, spec), "accuracy", resume.step))
        finally:
            group.shutdown()
    return summary


def _evaluate(group: RoleGroup, spec: JobSpec) -> dict:
    results = [r for r in group.call("evaluate", spec.eval.num_prompts) if r["leader"]]
    return {"eval/accuracy": sum(r["correct"] for r in results) / max(1, sum(r["total"] for r in results))}


def _step_row(spec: JobSpec, leaders: list[dict], done: int, seconds: float) -> dict:
    """Next-token loss over the global batch's trained tokens (every rank knows their count)."""
    return {"loss": sum(r["nll_sum"] for r in leaders) / max(1, leaders[0]["global_tokens"]),
            "lr": leaders[0]["lr"], "grad_norm": leaders[0]["grad_norm"],
            "tokens_per_s": sum(r["seq_tokens"] for r in leaders) / seconds,
            "samples": done * spec.train.global_batch_size}
