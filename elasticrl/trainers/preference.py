"""Preference optimisation against a frozen reference: DPO (with its IPO and conservative
variants) on chosen/rejected pairs, and KTO on unpaired desirable/undesirable examples.

Variant: log-probabilities are sums over response tokens. The reference is a frozen copy
of the starting model in each rank's process, or (``preference.reference: precomputed``,
dpo only) its log-probs are computed once before training, spread over the ranks, and the
copy is freed; under LoRA (``model.lora``) it is the trained model with its adapters
off. KTO's reference point z0 is the mean of log pi - log ref over mismatched
pairs (prompt i with response i+1 of the micro-batch), averaged over every rank, clamped at
0 and detached, as in the KTO paper. Losses are means over the global batch. With
``data.packing`` a micro-batch's sequences are laid end to end (no padding).

Run it:
  CPU:          elasticrl run examples/tiny_dpo.yaml --output runs/dpo
  workstation:  elasticrl run my_dpo.yaml --output runs/dpo --set train.num_ranks=4
"""
from __future__ import annotations

from pathlib import Path

import ray
import torch

from elasticrl import backend
from elasticrl.algorithms.preference import dpo_loss, kto_loss
from elasticrl.cluster import Placement, RoleGroup, ray_session
from elasticrl.data.records import prompt_answer, read_records, sample_indices, tokenize_sft
from elasticrl.models.evaluate import greedy_accuracy
from elasticrl.models.scoring import response_logps
from elasticrl.plan.roles import cpus_needed
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.trainers.loop import check_user_files, data_paths, find_resume, num_steps, offline_loop, prepare_output
from elasticrl.trainers.warm_start import initial_model
from elasticrl.trainers.worker import RankWorker
from elasticrl.world import world_paths


def unpaired(pairs: list[dict], spec: JobSpec) -> list[dict]:
    """KTO examples from preference pairs: each chosen response desirable, each rejected not."""
    d = spec.data
    return [{d.prompt_key: p[d.prompt_key], d.response_key: p[key], d.label_key: key == d.chosen_key}
            for p in pairs for key in (d.chosen_key, d.rejected_key)]


class PreferenceWorker(RankWorker):
    def __init__(self, spec: dict, paths: dict[str, str]):
        super().__init__(spec, paths["model"])
        self.paths = paths
        self.unpaired = ALGORITHMS[self.spec.algorithm].unpaired  # KTO: single answers labelled good or bad

    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        """``resume``: the trained copy continues from a checkpoint; the reference stays the start."""
        super().setup(rank, world_size, addr, port, total_steps, resume)
        s, d = self.spec, self.spec.data
        self.tok = self.core.tokenizer
        pair_keys = (d.prompt_key, d.chosen_key, d.rejected_key)
        if self.unpaired and self.paths["train_kind"] == "unpaired":
            self.records = read_records(self.paths["train"], (d.prompt_key, d.response_key, d.label_key))
        else:
            self.records = read_records(self.paths["train"], pair_keys)
            if self.unpaired:
                self.records = unpaired(self.records, s)
        self.eval_pairs = read_records(self.paths["eval"], pair_keys)
        self.eval_prompts = read_records(self.paths["eval_prompts"], prompt_answer(d)) \
            if self.paths.get("eval_prompts") else []
        self.ref = self.core.frozen_copy()
        self.table: dict | None = None  # precomputed reference log-probs
        return {"dtype": self.core.dtype, "records": len(self.records)}

    # --- log-probs -----------------------------------------------------------------------
    def _encode(self, prompt: str, response: str) -> tuple[list[int], int]:
        d = self.spec.data
        return tokenize_sft(self.tok, prompt, response, d.apply_chat_template, d.max_length)

    def _logps(self, model, examples, with_counts: bool = False):
        sums, counts = response_logps(model, examples, self.tok.pad_token_id, self.spec.data.packing,
                                      self.core.device)
        return (sums, counts) if with_counts else sums

    def _pair_examples(self, pairs: list[dict]) -> list:
        d = self.spec.data
        return [self._encode(p[d.prompt_key], p[k]) for k in (d.chosen_key, d.rejected_key) for p in pairs]

    @torch.no_grad()
    def _ref_pairs(self, pairs: list[dict], keys: list, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            got = torch.tensor([self.table[split][k] for k in keys], device=self.core.device)
            return got[:, 0], got[:, 1]
        lp = self._ref_logps(self._pair_examples(pairs))
        return lp[: len(pairs)], lp[len(pairs):]

    @torch.no_grad()
    def _ref_logps(self, examples) -> torch.Tensor:
        """The reference's log-probs: the frozen copy's, or under LoRA (``model.lora``) the base's,
        the trained model with its adapters off (no copy)."""
        if self.ref is not None:
            return self._logps(self.ref, examples).float()
        module = self.core.engine.module
        training = module.training
        with module.disable_adapter():
            lp = self._logps(module.eval(), examples).float()
        module.train(training)
        return lp

    @torch.no_grad()
    def reference_share(self, train_keys: list[int], num_eval: int) -> dict:
        """Reference log-probs of this rank's share of the train pairs the run will draw and of
        the eval pairs (precomputed mode)."""
        out = {}
        eval_keys = list(range(min(num_eval, len(self.eval_pairs)) if num_eval else len(self.eval_pairs)))
        for split, pairs, keys in (("train", self.records, train_keys), ("eval", self.eval_pairs, eval_keys)):
            mine = keys[self.core.dp_rank::self.core.dp_size]
            vals = []
            for m in range(0, len(mine), 64):
                c, r = self._ref_pairs([pairs[i] for i in mine[m:m + 64]], [], split)
                vals += torch.stack([c, r], 1).tolist()
            out[split] = dict(zip(mine, vals))
        return out

    def set_records(self, path: str) -> None:
        """Train on these pairs from now on (iterative DPO: each round's)."""
        d = self.spec.data
        self.records = read_records(path, (d.prompt_key, d.chosen_key, d.rejected_key))

    def use_reference_table(self, table: dict) -> None:
        self.table = table
        self.ref = None  # the frozen copy is no longer needed
        backend.empty_cache()

    # --- training ------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        s, core = self.spec, self.core
        B = s.train.global_batch_size
        parts = core.micro_batches(len(self.records), step)
        stats = {"loss_sum": 0.0, "chosen_sum": 0.0, "rejected_sum": 0.0, "correct": 0,
                 "rows": sum(map(len, parts)), "kl_ref": 0.0, "lr": core.engine.get_lr()[0],
                 "leader": core.is_dp_leader}
        for keys in parts:
            rows = [self.records[i] for i in keys]
            loss = self._kto(rows, stats) if self.unpaired else self._dpo(rows, keys, stats)
            stats["loss_sum"] += core.backward(loss / B)
        return stats

    def _dpo(self, pairs, keys, stats) -> torch.Tensor:
        p = self.spec.preference
        lp, counts = self._logps(self.core.engine, self._pair_examples(pairs), with_counts=True)
        ref_c, ref_r = self._ref_pairs(pairs, keys, "train")
        n = len(pairs)
        loss, cr, rr = dpo_loss(lp[:n], lp[n:], ref_c, ref_r, p.beta, p.loss, p.label_smoothing, p.nll_coef, counts[:n])
        stats["chosen_sum"] += float(cr.sum())
        stats["rejected_sum"] += float(rr.sum())
        stats["correct"] += int((cr > rr).sum())
        return loss.sum()

    def _kto(self, rows, stats) -> torch.Tensor:
        d, p = self.spec.data, self.spec.preference
        examples = [self._encode(r[d.prompt_key], r[d.response_key]) for r in rows]
        n = len(rows)
        mismatched = [self._encode(rows[i][d.prompt_key], rows[(i + 1) % n][d.response_key]) for i in range(n)]
        with torch.no_grad():
            ref = self._ref_logps(examples + mismatched)
            kl = (self._logps(self.core.engine, mismatched).float() - ref[n:]).mean()
            if torch.distributed.is_initialized():  # one reference point for the whole batch
                torch.distributed.all_reduce(kl)
                kl /= torch.distributed.get_world_size()
            z0 = kl.clamp(min=0)
        lp = self._logps(self.core.engine, examples)
        good = torch.tensor([bool(r[d.label_key]) for r in rows], device=lp.device)
        loss = kto_loss(lp, ref[:n], good, z0, p.beta, p.desirable_weight, p.undesirable_weight)
        reward = p.beta * (lp.detach().float() - ref[:n])
        stats["chosen_sum"] += float(reward[good].sum())
        stats["rejected_sum"] += float(reward[~good].sum())
        stats["correct"] += int(good.sum())  # counts desirable rows (KTO has no pairs)
        stats["kl_ref"] = float(z0)
        return loss.sum()

    # --- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, num_pairs: int, num_prompts: int) -> dict:
        s, core = self.spec, self.core
        core.engine.eval()
        pairs = self.eval_pairs[:num_pairs] if num_pairs else self.eval_pairs
        mine = list(range(core.dp_rank, len(pairs), core.dp_size))
        out = {"correct": 0, "margin_sum": 0.0, "logp_margin_sum": 0.0, "total": len(mine), "leader": core.is_dp_leader}
        for m in range(0, len(mine), 64):
            keys = mine[m:m + 64]
            chunk = [pairs[i] for i in keys]
            lp = self._logps(core.engine, self._pair_examples(chunk)).float()
            pc, pr = lp[: len(chunk)], lp[len(chunk):]
            rc, rr = self._ref_pairs(chunk, keys, "eval")
            margin = s.preference.beta * ((pc - rc) - (pr - rr))
            out["correct"] += int((margin > 0).sum())
            out["margin_sum"] += float(margin.sum())
            out["logp_margin_sum"] += float((pc - pr).sum())
        if self.eval_prompts:
            prompts = self.eval_prompts[:num_prompts] if num_prompts else self.eval_prompts
            out["answers_correct"], out["answers"] = greedy_accuracy(
                core.engine.module, self.tok, prompts, s, max_new_tokens=s.eval.max_new_tokens,
                dp_rank=core.dp_rank, dp_size=core.dp_size, synced=s.train.zero_stage == 3 or s.train.tp_size > 1,
                device=core.device)
        return out



def resolve_preference_paths(spec: JobSpec) -> dict[str, str]:
    paths = {"model": initial_model(spec), **data_paths(spec, "preference", "preference_eval"),
             "eval_prompts": str(world_paths(spec.world)["eval"]) if None in (spec.data.train, spec.data.eval) else ""}
    paths["train_kind"] = _train_kind(spec, paths["train"])
    return paths


def _train_kind(spec: JobSpec, path: str) -> str:
    first = read_records(path, (spec.data.prompt_key,), check=True)[0]
    return "unpaired" if spec.data.label_key in first and spec.data.chosen_key not in first else "pairs"


def _train_fields(spec: JobSpec, kind: str) -> tuple:
    d = spec.data
    return (d.prompt_key, d.response_key, d.label_key) if kind == "unpaired" else \
        (d.prompt_key, d.chosen_key, d.rejected_key)


def run_preference(spec: JobSpec, output: Path) -> dict:
    resume = find_resume(spec, output)
    output = prepare_output(spec, output)
    t = spec.train
    check_user_files(spec, lambda path: read_records(path, _train_fields(spec, _train_kind(spec, path)), check=True,
                                                     data=spec.data),
                     _train_fields(spec, "pairs"))
    with ray_session(spec.ray, cpus_needed(spec)):
        paths = resolve_preference_paths(spec)
        group = Placement(spec).group("actor", PreferenceWorker, spec_to_dict(spec), paths, name="trainer")
        try:
            records = _count_records(spec, paths)
            total = num_steps(t.max_steps, t.num_epochs, records, t.global_batch_size)
            group.setup(total, resume=resume.role("actor"))
            if spec.preference.reference == "precomputed":
                drawn = total * t.global_batch_size  # only the pairs the run will draw
                keys = list(range(records)) if drawn >= records else \
                    sorted(set(sample_indices(records, spec.seed, 0, drawn, spec.data.shuffle)))
                shares = group.call("reference_share", keys, spec.eval.num_prompts)
                table = {split: {k: v for share in shares for k, v in share[split].items()}
                         for split in ("train", "eval")}
                group.call("use_reference_table", ray.put(table))
            return _train(spec, group, output, total, resume.step)
        finally:
            group.shutdown()


def _count_records(spec: JobSpec, paths: dict) -> int:
    records = len(read_records(paths["train"], _train_fields(spec, paths["train_kind"])))
    return 2 * records if ALGORITHMS[spec.algorithm].unpaired and paths["train_kind"] == "pairs" else records


def _evaluate(group, spec) -> dict:
    res = [r for r in group.call("evaluate", spec.eval.num_prompts, spec.eval.num_prompts) if r["leader"]]
    n = max(1, sum(r["total"] for r in res))
    row = {"eval/pairwise_accuracy": sum(r["correct"] for r in res) / n,
           "eval/margin": sum(r["margin_sum"] for r in res) / n,
           "eval/logp_margin": sum(r["logp_margin_sum"] for r in res) / n}
    if "answers" in res[0]:
        row["eval/accuracy"] = sum(r["answers_correct"] for r in res) / max(1, sum(r["answers"] for r in res))
    return row


def _train(spec: JobSpec, group: RoleGroup, output: Path, total: int, start: int) -> dict:
    def step_row(res, *_):
        rows = sum(r["rows"] for r in res)
        row = {"loss": sum(r["loss_sum"] for r in res), "lr": res[0]["lr"]}
        if ALGORITHMS[spec.algorithm].unpaired:  # "correct" counts the desirable rows
            good = sum(r["correct"] for r in res)
            return {**row, "reward/desirable": sum(r["chosen_sum"] for r in res) / max(1, good),
                    "reward/undesirable": sum(r["rejected_sum"] for r in res) / max(1, rows - good),
                    "kl_ref": res[0]["kl_ref"]}
        chosen, rejected = sum(r["chosen_sum"] for r in res) / rows, sum(r["rejected_sum"] for r in res) / rows
        return {**row, "reward/chosen": chosen, "reward/rejected": rejected, "reward/margin": chosen - rejected,
                "reward/accuracy": sum(r["correct"] for r in res) / rows}

    return offline_loop(spec, group, output, total, step_row, lambda: _evaluate(group, spec), "margin", start)
