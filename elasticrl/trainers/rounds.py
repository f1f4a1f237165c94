"""Rounds of generate -> score -> fine-tune: rejection sampling and iterative DPO.

Each round, vLLM samples ``rl.samples_per_prompt`` completions for ``rounds.prompts_per_round``
prompts with the current weights, the reward functions (or remote endpoints) score them, and:
  rejection_sampling: the best completion of each prompt whose reward reaches
    ``rounds.min_reward`` becomes an SFT example (Llama 2's rejection-sampling fine-tuning);
  iterative_dpo: the best and the worst completion of each prompt whose rewards differ
    become a chosen/rejected pair for DPO against the frozen starting model (online
    iterative DPO, the reference stays the round-0 model).
The trainer then takes ``rounds.steps_per_round`` optimizer steps on that round's data, and
its weights are synced into vLLM before the next round. Each round's data is written to
OUTPUT/rounds/N.jsonl (atomically) and metrics to metrics.jsonl, one row per round. A
checkpoint is written after each round that completes a multiple of checkpoint.every_steps
optimizer steps (and after the last); a resumed job redoes the rounds after it with the same
seeds on the same weights.

Run it:
  CPU:          elasticrl run examples/tiny_rejection_sampling.yaml --output runs/rs
                elasticrl run examples/tiny_rejection_sampling.yaml --set algorithm=iterative_dpo
  workstation:  the same with --set train.num_ranks=4 --set rollout.num_engines=2
"""
from __future__ import annotations

import time
from pathlib import Path

from elasticrl import run_folder as rf
from elasticrl.cluster import Placement, RoleGroup, ray_session
from elasticrl.data.records import format_prompt, read_records, sample_indices, write_jsonl
from elasticrl.models import load_tokenizer
from elasticrl.plan.roles import cpus_needed
from elasticrl.rewards.sources import RewardSources
from elasticrl.rollout.pool import RolloutPool, sampling_params
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.trainers.evaluate import evaluate_answers
from elasticrl.trainers.loop import (
    Cadence,
    Checkpoints,
    MetricsLog,
    Progress,
    check_user_files,
    data_paths,
    find_resume,
    finish_run,
    prepare_output,
)
from elasticrl.trainers.preference import PreferenceWorker
from elasticrl.trainers.sft import SFTWorker
from elasticrl.trainers.warm_start import initial_model
from elasticrl.world import world_paths


def select(spec: JobSpec, prompts: list[dict], completions: list[list[str]],
           rewards: list[list[float | None]]) -> list[dict]:
    """One round's training records from each prompt's scored completions (None: dropped)."""
    d, out = spec.data, []
    for prompt, texts, scores in zip(prompts, completions, rewards):
        scored = [i for i in range(len(texts)) if scores[i] is not None]
        if not scored:
            continue
        best = max(scored, key=lambda i: scores[i])
        if not ALGORITHMS[spec.algorithm].pairs:  # the best sample, as an SFT row
            if scores[best] >= spec.rounds.min_reward:
                out.append({d.prompt_key: prompt[d.prompt_key], d.response_key: texts[best]})
        else:
            worst = min(scored, key=lambda i: scores[i])
            if scores[best] > scores[worst]:
                out.append({d.prompt_key: prompt[d.prompt_key], d.chosen_key: texts[best],
                            d.rejected_key: texts[worst]})
    return out


def run_rounds(spec: JobSpec, output: Path) -> dict:
    resume = find_resume(spec, output)
    state = resume.state or {"round": 0, "version": 0}
    output = prepare_output(spec, output)
    r = spec.rounds
    total = r.num_rounds * r.steps_per_round
    keys = (spec.data.prompt_key, spec.data.answer_key)
    check_user_files(spec, keys, keys)
    with RewardSources(spec) as rewards, ray_session(spec.ray, cpus_needed(spec)):
        world = world_paths(spec.world)
        model = initial_model(spec)
        # the workers' own data is replaced each round (set_records); evaluation runs on vLLM here
        pairs = ALGORITHMS[spec.algorithm].pairs
        paths = {"model": model, "train": str(world["preference" if pairs else "sft"]),
                 "eval": str(world["preference_eval" if pairs else "eval"]), "eval_prompts": "", "train_kind": "pairs"}
        data = data_paths(spec, "rl_prompts", "eval")
        prompts, evals = (read_records(data[split], keys) for split in ("train", "eval"))
        worker = PreferenceWorker if pairs else SFTWorker
        placement = Placement(spec)
        group = placement.group("actor", worker, spec_to_dict(spec), paths, name="trainer")
        pool = None
        try:
            group.setup(total, resume=resume.role("actor"))
            pool = RolloutPool(model, spec.rollout, spec.model.dtype, spec.seed, spec.model.trust_remote_code,
                               where=placement.options("rollout"))
            pool.attach(group, spec.rollout.weight_sync, spec.rollout.bucket_mb, str(output / rf.WEIGHTS))
            if state["version"]:  # resumed: the engines start from the checkpoint's weights
                pool.sync(state["version"])
            summary = _loop(spec, group, pool, rewards, prompts, evals, model, output, state)
        finally:
            if pool is not None:
                pool.shutdown()
            group.shutdown()
    return summary


def _loop(spec, group, pool, rewards, prompts, evals, model, output, state: dict) -> dict:
    """Rounds from ``state['round']`` (0, or where a checkpoint left off) to the last."""
    r, rl, d = spec.rounds, spec.rl, spec.data
    tok = load_tokenizer(model, spec.model.trust_remote_code, spec.data.chat_template)

    def encode(text):
        return tok(format_prompt(tok, text, d.apply_chat_template), add_special_tokens=False)["input_ids"]

    eval_ids = [encode(e[d.prompt_key]) for e in evals[: spec.eval.num_prompts or None]]
    start, version = state["round"], state["version"]
    metrics = MetricsLog(output, spec, resume_step=start * r.steps_per_round if start else None)
    checkpoints = Checkpoints(spec, output)
    steps = r.steps_per_round
    cadence = Cadence(spec, r.num_rounds * steps)
    summary: dict = {}
    if not start and cadence.evaluate_start():
        summary["initial"] = {"step": 0, "round": 0, **evaluate_answers(spec, pool, eval_ids, evals, rewards.verify)}
        metrics.write(summary["initial"])
    progress = Progress(r.num_rounds, start, spec.log.progress_bar, desc=spec.algorithm)
    row: dict = {}
    for rnd in range(start, r.num_rounds):
        t0 = time.time()
        idx = sample_indices(len(prompts), spec.seed, rnd * r.prompts_per_round, r.prompts_per_round, d.shuffle)
        batch = [prompts[i] for i in idx]
        results = pool.generate([encode(p[d.prompt_key]) for p in batch], sampling_params(spec, rnd))
        texts = [[] for _ in batch]
        for res in results:
            texts[res.prompt_index].append(res.text)
        flat = [t for ts in texts for t in ts]
        owners = [batch[i] for i, ts in enumerate(texts) for _ in ts]
        scored = rewards([p[d.prompt_key] for p in owners], flat, [p.get(d.answer_key) for p in owners],
                         where=f"round {rnd + 1}")
        # a dropped sample (rewards.on_error: drop_sample) is no candidate for the records
        scores = [v if keep else None for v, keep in zip(scored.total.tolist(), scored.keep.tolist())]
        k = rl.samples_per_prompt
        per_prompt = [scores[i * k:(i + 1) * k] for i in range(len(batch))]
        records = select(spec, batch, texts, per_prompt)
        data = output / rf.ROUNDS / f"{rnd + 1}.jsonl"
        write_jsonl(data, records)
        t_gen = time.time() - t0
        valid = [v for v in scores if v is not None]
        row = {"step": (rnd + 1) * r.steps_per_round, "round": rnd + 1, "round/records": len(records),
               "round/reward_mean": sum(valid) / max(1, len(valid)), "time/generate": t_gen, **scored.info}
        if records:
            group.call("set_records", str(data))
            t1 = time.time()
            losses = []
            for s in range(r.steps_per_round):
                losses.append(_train_step(group, rnd * r.steps_per_round + s))
            row.update({"loss": sum(losses) / len(losses), "time/train": time.time() - t1})
            version = rnd + 1
            row.update(pool.sync(version))
        done, since = (rnd + 1) * steps, rnd * steps
        evaluated = cadence.evaluate(done, since)
        if evaluated:
            row.update(evaluate_answers(spec, pool, eval_ids, evals, rewards.verify))
        checkpoints.poll()
        if cadence.log(done, evaluated, since):
            metrics.write({**row, **checkpoints.figures()})
        if cadence.checkpoint(done, since):
            checkpoints.save({"actor": group}, done, {
                "prompts_seen": (rnd + 1) * r.prompts_per_round, "round": rnd + 1, "version": version})
        progress.update(records=len(records), **({"acc": row["eval/accuracy"]} if "eval/accuracy" in row else {}))
    return finish_run(group, spec, output, summary, row, progress, metrics, checkpoints)


def _train_step(group: RoleGroup, step: int) -> float:
    res = [x for x in group.call("train_step", step) if x["leader"]]
    if "nll_sum" in res[0]:  # SFT: mean over the global batch's response tokens
        return sum(x["nll_sum"] for x in res) / max(1, res[0]["global_tokens"])
    return sum(x["loss_sum"] for x in res)
