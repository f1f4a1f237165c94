"""Supervised fine-tuning: N data-parallel DeepSpeed ranks as Ray actors, driven step by step.

Variant: next-token cross-entropy on response tokens only (prompt tokens are masked), the
mean taken over every response token of the global batch (not a mean of per-micro-batch
means), as in the paper's SFT (Appendix A.1).

Run it:
  CPU:          elasticrl run examples/tiny_sft.yaml --output runs/sft
  workstation:  elasticrl run my_sft.yaml --output runs/sft --set train.num_ranks=4
  Slurm:        elasticrl launch my_sft.yaml --scheduler slurm
"""
from __future__ import annotations

import time
from pathlib import Path

from elasticrl import backend
from elasticrl.algorithms.logprobs import masked_sum, response_mask, token_logprobs
from elasticrl.cluster import Placement, RoleGroup, ray_session
from elasticrl.data.records import pad_batch, prompt_answer, read_records, sft_example, sft_fields
from elasticrl.engine import checkpoint as ckpt
from elasticrl.engine.rank import TrainRank
from elasticrl.models.evaluate import greedy_accuracy
from elasticrl.plan.roles import cpus_needed
from elasticrl.spec import JobSpec, load_spec, spec_to_dict
from elasticrl.trainers.loop import (MetricsLog, Progress, eval_due, find_resume, finish_run, num_steps,
                                     prepare_output, save_checkpoint)
from elasticrl.world import world_paths


class SFTWorker:
    """One rank: holds the DeepSpeed engine and reads its share of each global batch."""

    def __init__(self, spec: dict, paths: dict[str, str]):
        self.spec = load_spec(spec)
        self.paths = paths

    def setup(self, rank: int, world_size: int, addr: str, port: int, total_steps: int,
              resume: str | None = None) -> dict:
        s = self.spec
        self.core = TrainRank(s, s.train, self.paths["model"], rank, world_size, addr, port, total_steps, resume=resume)
        self.engine, self.tokenizer, self.rank = self.core.engine, self.core.tokenizer, rank
        self.records = read_records(self.paths["train"], sft_fields(s.data))
        self.eval_records = read_records(self.paths["eval"], prompt_answer(s.data))
        return {"dtype": self.core.dtype}

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
        for part in core.split(examples):
            ids, trained = zip(*part)
            padded = pad_batch(list(ids), self.tokenizer.pad_token_id, list(trained))
            batch = {k: v.to(core.device) for k, v in padded.items()}
            logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            nll = -masked_sum(token_logprobs(logits, batch["labels"]), response_mask(batch["labels"]))
            nll_total += core.backward(nll, max(global_tokens, 1))
            seq_tokens += int(batch["attention_mask"].sum())
        grad_norm = self.engine.get_global_grad_norm()
        return {"nll_sum": nll_total, "global_tokens": global_tokens, "seq_tokens": seq_tokens, "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None, "leader": core.is_dp_leader}

    def set_records(self, path: str) -> None:
        """Train on these examples from now on (rejection sampling: each round's)."""
        self.records = read_records(path, sft_fields(self.spec.data))

    def attach_rollout(self, *args) -> str:
        return self.core.attach_rollout(*args)

    def sync_weights(self, version: int) -> dict:
        return self.core.sync_weights(version)

    def detach_rollout(self) -> None:
        self.core.detach_rollout()

    def evaluate(self, num_prompts: int) -> dict:
        s = self.spec
        records = self.eval_records[:num_prompts] if num_prompts else self.eval_records
        synced = s.train.zero_stage == 3 or s.train.tp_size > 1
        correct, total = greedy_accuracy(
            self.engine.module, self.tokenizer, records, s, max_new_tokens=s.eval.max_new_tokens,
            dp_rank=self.core.dp_rank, dp_size=self.core.dp_size,
            synced=synced, device=backend.current_device())
        return {"correct": correct, "total": total, "leader": self.core.is_dp_leader}

    def save(self, folder: str) -> None:
        self.core.save(folder)

    def export(self, folder: str) -> None:
        self.core.export(folder)


def resolve_paths(spec: JobSpec) -> dict[str, str]:
    """Model and data locations: the spec's, or the embedded tiny world's."""
    needs_world = spec.model.path is None or spec.data.train is None or spec.data.eval is None
    world = world_paths(spec.world) if needs_world else {}
    return {"model": spec.model.path or str(world["model"]),
            "train": spec.data.train or str(world["sft"]),
            "eval": spec.data.eval or str(world["eval"])}


def run_sft(spec: JobSpec, output: Path) -> dict:
    resume_dir = find_resume(spec, output)
    output = prepare_output(spec, output)
    paths = resolve_paths(spec)
    num_records = len(read_records(paths["train"], sft_fields(spec.data), check=True))
    read_records(paths["eval"], prompt_answer(spec.data), check=True)  # fail before Ray starts
    t = spec.train
    total = num_steps(t.max_steps, t.num_epochs, num_records, t.global_batch_size)
    start = ckpt.read_trainer_state(resume_dir)["step"] if resume_dir else 0
    summary: dict = {"steps": total, "resumed_from": start if resume_dir else None}
    with ray_session(spec.ray, cpus_needed(spec)):
        group = Placement(spec).group("actor", SFTWorker, spec_to_dict(spec), paths, name="trainer")
        try:
            summary["dtype"] = group.setup(total, resume=str(resume_dir / "actor") if resume_dir else None)[0]["dtype"]
            summary.update(_train(spec, group, output, start, total))
        finally:
            group.shutdown()
    return summary


def _evaluate(group: RoleGroup, spec: JobSpec) -> float:
    results = [r for r in group.call("evaluate", spec.eval.num_prompts) if r["leader"]]
    return sum(r["correct"] for r in results) / max(1, sum(r["total"] for r in results))


def _train(spec: JobSpec, group: RoleGroup, output: Path, start: int, total: int) -> dict:
    metrics = MetricsLog(output, spec, resume_step=start if start else None)
    progress = Progress(total, start, spec.log.progress_bar, desc="sft")
    summary: dict = {}
    if start == 0 and spec.eval.every_steps and spec.eval.enabled:
        acc = _evaluate(group, spec)
        metrics.write({"step": 0, "eval/accuracy": acc})
        summary["initial_eval_accuracy"] = acc
    row: dict = {}
    for step in range(start, total):
        t0 = time.time()
        results = group.call("train_step", step)
        seconds = time.time() - t0
        leaders = [r for r in results if r["leader"]]
        done = step + 1
        row = {"step": done, "loss": sum(r["nll_sum"] for r in leaders) / max(1, results[0]["global_tokens"]),
               "lr": results[0]["lr"], "grad_norm": results[0]["grad_norm"],
               "tokens_per_s": sum(r["seq_tokens"] for r in leaders) / seconds,
               "samples": done * spec.train.global_batch_size, "step_seconds": seconds}
        if eval_due(spec, done, total):
            row["eval/accuracy"] = _evaluate(group, spec)
        if done % spec.log.every_steps == 0 or "eval/accuracy" in row or done == total or done == 1:
            metrics.write(row)
        if spec.checkpoint.every_steps and (done % spec.checkpoint.every_steps == 0 or done == total):
            save_checkpoint({"actor": group}, spec, output, done)
        progress.update(loss=row["loss"], **({"acc": row["eval/accuracy"]} if "eval/accuracy" in row else {}))
    return finish_run(group, spec, output, summary, row, progress, metrics)
