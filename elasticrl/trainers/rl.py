"""RL from rewards: PPO with a critic, and the critic-free GRPO / REINFORCE++ / RLOO.

The step, as in the paper's Appendix B, one named function per phase over one ``Step``:
rollout (vLLM) -> experience (rewards, reference log-probs, values, advantages) -> train
(DeepSpeed; critic then actor, several epochs of mini-batches) -> sync (the weights into the
engines) -> report (metrics, evaluation, checkpoint). Differences from the paper: advantages
are computed on the driver, which holds the whole batch, so whitening statistics are global
by construction; group estimators keep a prompt's n samples together; async mode overlaps
the rollout of the next steps with training under a staleness bound, correcting off-policy
batches with truncated importance sampling against the rollout engine's log-probs.

Run it:
  CPU:          elasticrl run examples/tiny_grpo.yaml --output runs/grpo
  workstation:  elasticrl run my_ppo.yaml --output runs/ppo --set train.num_ranks=4
  Slurm:        elasticrl launch my_ppo.yaml --scheduler slurm
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from elasticrl import backend
from elasticrl.algorithms.advantages import ADVANTAGES, last_token_rewards, overlong_penalty, varying_groups
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.normalize import masked_whiten
from elasticrl.cluster import RoleError, ray_session
from elasticrl.data.records import prompt_answer, prompt_text, read_records, sample_indices
from elasticrl.engine.checkpoint import Resume
from elasticrl.envs.pool import environments
from elasticrl.models import load_tokenizer
from elasticrl.plan.roles import cpus_needed
from elasticrl.rewards.sources import RewardSources
from elasticrl.rewards.verifiers import full_marks
from elasticrl.rollout.episodes import StreamTurns, run_episodes
from elasticrl.rollout.pool import sampling_params
from elasticrl.rollout.sample import Sample
from elasticrl.rollout.stream import Stream
from elasticrl.spec import JobSpec
from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, advantage_of
from elasticrl.spec.schema import RewardModelSpec
from elasticrl.trainers.batch import Experience, behaviour_logprobs, gather_rows, pack
from elasticrl.trainers.evaluate import evaluate_answers
from elasticrl.trainers.loop import (
    Checkpoints,
    MetricsLog,
    Progress,
    asked_engines,
    check_user_files,
    data_paths,
    find_resume,
    finish_run,
    prepare_output,
)
from elasticrl.trainers.rl_run import (
    PHASES,
    Encoded,
    Roles,
    Run,
    before_scoring,
    driver_state,
    in_background,
    join_segment,
    recover,
    resume_state,
    save,
    score_again_after_frozen_loss,
    startup_line,
    trained_groups,
)
from elasticrl.trainers.warm_start import initial_model, trained_reward_model
from elasticrl.world import world_paths


def resolve_rl_paths(spec: JobSpec) -> dict[str, str]:
    data = data_paths(spec, "rl_prompts", "eval")
    return {"model": initial_model(spec), "prompts": data["train"], "eval": data["eval"],
            "sft": str(world_paths(spec.world)["sft"]) if spec.rl.ptx_coef > 0 else ""}


@dataclass
class Step:
    """One step's data as it moves through the phases."""

    step: int
    indices: list[int]                    # the prompts' record indices
    results: list[Sample]                 # completions, n per prompt, in prompt order
    generated: int = 0                    # tokens the engines generated for them
    batch: Experience | None = None       # tensors for the trainers (None: nothing to train on)
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    sync: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


@contextlib.contextmanager
def _timed(s: Step, phase: str):
    t0 = time.time()
    yield
    s.seconds[phase] = s.seconds.get(phase, 0.0) + time.time() - t0


def run_rl(spec: JobSpec, output: Path) -> dict:
    started = time.time()  # an `elasticrl scale` asked while the job starts up applies too
    resume = find_resume(spec, output)
    output = prepare_output(spec, output)
    asked = spec
    summary: dict = {"algorithm": spec.algorithm, "advantage": advantage_of(spec.algorithm, spec.rl.advantage)}
    check_user_files(spec, lambda path: _check_prompts(spec, path), prompt_answer(spec.data))
    # the reward functions' process starts first: one that does not import fails before Ray
    with RewardSources(spec) as rewards, environments(spec) as envs, ray_session(spec.ray, cpus_needed(spec)):
        ray_up = backend.process_age_s()
        if spec.algorithm == "ppo" and spec.init.rm_steps and not spec.rewards.models:
            path = trained_reward_model(spec)
            spec = dataclasses.replace(spec, rewards=dataclasses.replace(
                spec.rewards, models=[RewardModelSpec(path=path, weight=1.0)]))
            summary["reward_model"] = path
        paths = resolve_rl_paths(spec)
        rl = spec.rl
        total_updates = rl.num_steps * rl.epochs * rl.prompts_per_step * rl.samples_per_prompt \
            // spec.train.global_batch_size
        # the roles start (engines first) while this thread reads the data and loads the tokenizer; should
        # that fail, Ray's teardown ends what they started
        starting = in_background(Roles, spec, paths, total_updates, resume)
        prompts = read_records(paths["prompts"], prompt_answer(spec.data))
        evals = read_records(paths["eval"], prompt_answer(spec.data))
        tok = load_tokenizer(paths["model"], spec.model.trust_remote_code, spec.data.chat_template)
        prompt_ids, eval_ids = (Encoded(records, spec.data, tok) for records in (prompts, evals))
        roles = starting.result()
        summary["placement"] = roles.layout()
        summary["startup"] = up = {"launch_to_ray_s": ray_up and round(ray_up, 1), **roles.startup,
                                   "launch_to_roles_s": round(backend.process_age_s() or 0.0, 1)}
        summary["threads"] = threads = roles.threads()
        print(startup_line(up, threads), file=sys.stderr, flush=True)
        try:
            evals_used = range(min(len(evals), spec.eval.num_prompts or len(evals)))
            run = Run(spec, roles, rewards, tok, prompts, prompt_ids, evals, [eval_ids[i] for i in evals_used], output,
                      asked, scale_seen=started, envs=envs)
            try:
                summary.update(_train_run(run, resume))
            finally:
                run.copies.shutdown()
        finally:
            roles.shutdown()
    return summary


def _check_prompts(spec: JobSpec, path: str) -> None:
    """A user's prompts file, and its first prompt in the chat template, before Ray starts
    (with the embedded model, its tokenizer is built, not the whole world)."""
    from elasticrl.world.tokenizer import build_tokenizer

    if spec.model.path is None:
        tok = build_tokenizer()
        tok.chat_template = spec.data.chat_template or tok.chat_template
    else:
        tok = load_tokenizer(spec.model.path, spec.model.trust_remote_code, spec.data.chat_template)
    Encoded(read_records(path, prompt_answer(spec.data), check=True, data=spec.data), spec.data, tok)[0]


def _train_run(run: Run, resume: Resume) -> dict:
    spec, roles = run.spec, run.roles
    if spec.rollout.environment and spec.rl.async_rollout:  # (a fast tokenizer is not for two threads at once)
        run.thread_tokenizer = copy.deepcopy(run.tokenizer)
    if spec.rl.fully_async:
        rl = spec.rl
        turns = StreamTurns(run.envs, run.thread_tokenizer, run.prompts, rl.samples_per_prompt, rl.max_turns,
                            rl.max_episode_tokens or spec.rollout.max_model_len, spec.rollout.max_model_len) \
            if spec.rollout.environment else None
        run.stream = Stream(spec, run.prompt_ids, lambda ids: run.tokenizer.decode(ids, skip_special_tokens=True),
                            turns)
    start = resume_state(run, resume) if resume.folder else 0
    transport = roles.pool.attach(roles.actor, spec.rollout.weight_sync, spec.rollout.bucket_mb,
                                  str(run.output / "weights"))
    if resume.folder or (spec.model.lora.quantize != "none" and not roles.pool.lora_rank):
        roles.pool.sync(run.version)  # (the engines loaded the 16-bit base, not the trainer's 4-bit one)
    run.metrics = MetricsLog(run.output, run.asked, resume_step=start if resume.folder else None)
    run.checkpoints = Checkpoints(spec, run.output, run.asked)
    summary: dict = {"transport": transport}
    if start == 0 and run.cadence.evaluate_start():
        summary["initial"] = {"step": 0, **evaluate_answers(spec, roles.pool, run.eval_ids, run.evals,
                                                            run.rewards.verify, _eval_episodes(run))}
        run.metrics.write(summary["initial"])
        if run.shown:
            run.metrics.episodes(0, run.shown)
    run.progress = Progress(spec.rl.num_steps, start, spec.log.progress_bar, desc=spec.algorithm)
    row: dict = {}
    step = start
    while step < spec.rl.num_steps:
        try:
            s = rollout(run, step)
            scored(run, s)
            with engines_asleep(run, s):  # the hybrid engine: vLLM sleeps while the trainers train
                train(run, s)
            sync(run, s)
            row = report(run, s)
            step += 1
        except RoleError as exc:
            step = recover(run, exc, step)
    roles.pool.detach()
    summary["memory/pss_gb"] = max(run.pss_gb or 0.0, backend.tree_memory()["pss"] / 1e9)  # the first step's, or now's
    summary = finish_run(roles.actor, spec, run.output, summary, row, run.progress, run.metrics, run.checkpoints)
    total = sum(run.totals.values()) or 1.0
    summary["time_share"] = {k: round(v / total, 3) for k, v in run.totals.items()}
    summary["final"] = {k: v for k, v in row.items() if not k.startswith("time/")}
    if run.recoveries:
        summary["recoveries"] = run.recoveries
    return summary


# --- the phases -------------------------------------------------------------------------
def rollout(run: Run, step: int) -> Step:
    """This step's completions: rolled out now, or ahead on older weights (async)."""
    rl = run.spec.rl
    s = Step(step, [], [])
    run.roles.pool.step = step + 1  # as the console counts steps
    engines, run.scale_seen = asked_engines(run.output, run.scale_seen)  # `elasticrl scale`
    if engines is not None:
        run.roles.pool.scale_to(engines)
    episodes = bool(run.spec.rollout.environment)
    with _timed(s, "rollout"):
        if rl.fully_async:
            s.indices, s.results, info = _from_stream(run, step)
            s.info.update(info)
        else:
            if not run.pending:
                _submit(run, step)
            _, s.indices, handle = run.pending.popleft()
            if episodes:
                join_segment(run)
                s.results, info = handle.result()
                s.info.update(info)
            else:
                s.results = run.roles.pool.collect(handle)
        s.generated = sum(len(r.logprobs) for r in s.results)
        # async: batches rolled out ahead on the current weights; episodes one batch (joined before the sync)
        depth = (min(1, rl.max_staleness) if episodes else rl.max_staleness) \
            if rl.async_rollout and not rl.fully_async else 0
        while len(run.pending) < depth and step + 1 + len(run.pending) < rl.num_steps:
            ahead = step + 1 + len(run.pending)
            if any(run.cadence.checkpoint(t + 1) for t in range(step, ahead)):
                break  # nothing is in flight at a checkpoint: a resumed run rolls out as this one does
            _submit(run, ahead)  # on the current weights
    return s


def _from_stream(run: Run, step: int) -> tuple[list[int], list[Sample], dict]:
    """rl.fully_async: the batch from the stream (rounds now only while none is ready), then the
    queue refilled and its rounds going on in the background until ``sync`` (rollout.stream)."""
    stream, pool = run.stream, run.roles.pool
    stream.fill(lambda: _draw(run))
    stream.expire(run.version)
    while not stream.ready(run.version):
        stream.round(pool)
    out = stream.take(run.version)
    stream.fill(lambda: _draw(run))
    if step + 1 < run.spec.rl.num_steps:
        stream.arm()
        run.segment = in_background(stream.segment, pool, run.version + 1)
    return out


def _submit(run: Run, step: int) -> None:
    """Step ``step``'s rollout on the current weights: its requests queued in the pool, or its
    episodes going on turn by turn in a driver thread (``run.segment``, joined before the next sync)."""
    idx, sampling = _draw(run), sampling_params(run.spec, step)
    if run.spec.rollout.environment:
        tok = run.thread_tokenizer or run.tokenizer
        handle = run.segment = in_background(_episodes, run, [run.prompts[i] for i in idx], sampling, tok)
    else:
        handle = run.roles.pool.submit([run.prompt_ids[i] for i in idx], sampling)
    run.pending.append((step, idx, handle))


def _episodes(run: Run, rows: list[dict], sampling: dict, tokenizer=None) -> tuple[list[Sample], dict]:
    """``rows``' multi-turn episodes with the job's environment (``rollout.environment``)."""
    spec = run.spec
    return run_episodes(run.roles.pool, run.envs, tokenizer or run.tokenizer, rows, sampling, spec.rl.max_turns,
                        spec.rl.max_episode_tokens or spec.rollout.max_model_len, spec.rollout.max_model_len)


EPISODES_SHOWN = 4  # evaluation episodes written out whole each evaluation


def _eval_episodes(run: Run):
    """Evaluation's episodes (``evaluate_answers``), with an environment (the greedy ones'
    first few kept in ``run.shown`` for the log); else None."""
    if not run.spec.rollout.environment:
        return None

    def generate(rows: list[dict], sampling: dict) -> list[Sample]:
        samples = _episodes(run, rows, sampling)[0]
        if sampling.get("temperature") == 0.0:
            run.shown = samples[:EPISODES_SHOWN]
        return samples
    return generate


def _draw(run: Run) -> list[int]:
    """The next rl.prompts_per_step prompts of the run's sample order (their record indices)."""
    rl = run.spec.rl
    idx = sample_indices(len(run.prompts), run.spec.seed, run.drawn, rl.prompts_per_step, run.spec.data.shuffle)
    run.drawn += rl.prompts_per_step
    return idx


def experience(run: Run, s: Step) -> None:
    """Rewards, then the batch the trainers learn from: the policy's and the reference's
    log-probs, the critic's values and the advantages. The model passes run side by side,
    and while the rewards are scored (dynamic sampling first picks the rows they see)."""
    with _timed(s, "experience"):
        _pack(run, s)
        batch_ref = ray.put(s.batch)
        passes = None if run.spec.rl.dynamic_sampling else _start_model_passes(run, batch_ref)
        rewards = _overlong(run, s, _score(run, s, batch_ref))
        if run.spec.rl.dynamic_sampling:
            rewards = _keep_varying_groups(run, s, rewards)
        if s.batch is not None:
            rewards = _shape_rewards(run, rewards)
            if passes is None:  # dynamic sampling: the passes see the rows kept
                passes = _start_model_passes(run, ray.put(s.batch))
            _advantages(run, s, rewards, _model_passes(run, s, rewards, passes))


def scored(run: Run, s: Step) -> None:
    """``experience``; when a rank of a frozen role (reference, reward model) is lost meanwhile,
    that role alone is rebuilt and the step scored again from the same samples."""
    before = before_scoring(run, s)
    while True:
        try:
            return experience(run, s)
        except RoleError as exc:
            score_again_after_frozen_loss(run, s, exc, before)


def _pack(run: Run, s: Step) -> None:
    """``s.batch``: the step's prompts and completions as the trainers' tensors."""
    drawn = [run.prompt_ids[i] for i in s.indices]
    p_ids = [drawn[r.prompt_index] if r.prompt_ids is None else r.prompt_ids for r in s.results]
    s.batch = pack(p_ids, [r.token_ids for r in s.results], run.tokenizer.pad_token_id, [r.mask for r in s.results])
    s.batch.behaviour_logprobs = behaviour_logprobs(s.results, s.batch)  # rl.is_correction's, and the acid test's


def _score(run: Run, s: Step, batch_ref) -> torch.Tensor:
    """The rewards of the batch ``s.batch`` (``batch_ref``: it in Ray's store); reward and
    accuracy figures."""
    spec, rl = run.spec, run.spec.rl
    texts = [r.text for r in s.results]
    recs = [run.prompts[s.indices[r.prompt_index]] for r in s.results]
    models = [(lambda g=g: gather_rows(g.call("score", batch_ref), "values"), w) for g, w in run.roles.rewards]
    scores = run.rewards([prompt_text(r, spec.data) for r in recs], texts, [r.get(spec.data.answer_key) for r in recs],
                         models, where=f"step {s.step + 1}")
    if spec.rollout.environment:  # the environment's own rewards of each episode
        scores.total += torch.tensor([r.episode["reward"] for r in s.results]) * scores.keep
    raw = _drop(run, s, scores)
    kept = raw[scores.keep]
    correct = torch.tensor([float(full_marks(v)) for v in scores.verified])
    s.info.update({"reward/mean": kept.mean().item() if len(kept) else 0.0,
              "reward/std": kept.std().item() if len(kept) > 1 else 0.0,
              "accuracy": correct.mean().item(), "response_length": s.batch.response_mask.sum(1).mean().item(),
              "rl/staleness": run.version - min(r.weight_version for r in s.results), **scores.info})
    if s.info["rl/staleness"] > (rl.max_staleness if rl.async_rollout else 0):
        raise RuntimeError(f"rollout staleness {s.info['rl/staleness']} exceeds the bound")  # an invariant
    return raw


def _drop(run: Run, s: Step, scores) -> torch.Tensor:
    """``rewards.on_error: drop_sample``: a dropped sample's tokens leave the loss (its
    response mask is cleared) and its reward is its group's mean over the kept samples, so
    that the others' advantages do not see it."""
    raw, keep = scores.total, scores.keep
    if keep.all():
        return raw
    s.batch.response_mask[~keep] = 0
    k = run.spec.rl.samples_per_prompt
    groups, kept = raw.view(-1, k), keep.view(-1, k)
    means = (groups * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp(min=1)
    return torch.where(kept, groups, means).reshape(-1)


def _overlong(run: Run, s: Step, rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong handling: the soft punishment added to the rewards (``rl.overlong_buffer``),
    and truncated responses (cut at rl.max_new_tokens) out of the loss (``rl.overlong_filter``)."""
    rl = run.spec.rl
    cut = torch.tensor([r.finish_reason == "length" for r in s.results])
    s.info["rl/truncated"] = cut.float().mean().item()
    if rl.overlong_buffer:
        lengths = torch.tensor([len(r.token_ids) for r in s.results])
        rewards = rewards + overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty)
    if rl.overlong_filter:
        s.batch.response_mask[cut] = 0
    return rewards


def _keep_varying_groups(run: Run, s: Step, rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling (DAPO): only prompt groups whose rewards vary. While fewer than
    rl.prompts_per_step groups are kept, more prompts are drawn (the run's next ones),
    rolled out and scored, up to rl.dynamic_sampling_max_draws draws in all; the batch is
    then the kept groups in whole mini-batches (``s.batch`` None when none is left).
    ``reward/mean`` and ``accuracy`` stay those of the step's first draw."""
    rl, B, n = run.spec.rl, run.spec.train.global_batch_size, run.spec.rl.samples_per_prompt
    want, draws, seen = rl.prompts_per_step * n, 1, len(s.results)
    out_of_loss = s.batch.response_mask.sum(1) == 0  # dropped or overlong rows stay out after re-packing
    keep = varying_groups(rewards, n)
    results, kept, off = [s.results[i] for i in keep.tolist()], [rewards[keep]], [out_of_loss[keep]]
    while len(results) < want and draws < rl.dynamic_sampling_max_draws:
        draws += 1
        more = Step(s.step, _draw(run), [])
        sampling = sampling_params(run.spec, s.step)
        more.results = _episodes(run, [run.prompts[i] for i in more.indices], sampling)[0] \
            if run.spec.rollout.environment else run.roles.pool.generate([run.prompt_ids[i] for i in more.indices],
                                                                          sampling)
        s.generated += sum(len(r.logprobs) for r in more.results)
        _pack(run, more)
        extra = _overlong(run, more, _score(run, more, ray.put(more.batch)))
        keep = varying_groups(extra, n)
        base = len(s.indices)
        s.indices = s.indices + more.indices
        results += [dataclasses.replace(more.results[i], prompt_index=more.results[i].prompt_index + base)
                    for i in keep.tolist()]
        kept.append(extra[keep])
        off.append((more.batch.response_mask.sum(1) == 0)[keep])
        seen += len(more.results)
    usable = min(len(results), want) // B * B
    usable -= usable % n
    s.info.update({"rl/kept_fraction": len(results) / seen, "rl/prompts_drawn": draws * rl.prompts_per_step})
    s.results = results[:usable]
    if not usable:
        s.batch = None
        return torch.zeros(0)
    _pack(run, s)
    s.batch.response_mask[torch.cat(off)[:usable]] = 0
    return torch.cat(kept)[:usable]


def _shape_rewards(run: Run, rewards: torch.Tensor) -> torch.Tensor:
    """Reward normalisation by running statistics and clipping (PPO tricks)."""
    rl = run.spec.rl
    if rl.normalize_reward:
        run.moments.update(rewards)
        return run.moments.normalize(rewards, rl.reward_clip)
    return rewards.clamp(-rl.reward_clip, rl.reward_clip) if rl.reward_clip else rewards


def _start_model_passes(run: Run, batch_ref) -> dict:
    """The forward passes the batch needs, started on their roles at once: key -> a function
    that waits for its per-rank answers (the policy's log-probs, the reference's, the
    critic's values). Roles on their own devices compute side by side."""
    roles, out = run.roles, {}
    if not reuses_update_logprobs(run.spec):
        out["old_logprobs"] = (roles.actor.call("logprobs", batch_ref, wait=False), "logprobs")
    if roles.reference is not None:
        out["ref_logprobs"] = (roles.reference.call("score", batch_ref, wait=False), "values")
    elif run.spec.rl.kl_coef > 0:  # in the actor's ranks: its frozen copy, or (LoRA) its model with adapters off
        out["ref_logprobs"] = (roles.actor.call("reference_logprobs", batch_ref, wait=False), "logprobs")
    if roles.critic is not None:
        out["old_values"] = (roles.critic.call("values", batch_ref, wait=False), "values")
    return out


def _model_passes(run: Run, s: Step, rewards: torch.Tensor, passes: dict) -> torch.Tensor:
    """The passes' answers into the batch, and the KL; returns the per-token rewards (the
    outcome on the last token, minus the KL penalty in reward mode)."""
    rl, batch = run.spec.rl, s.batch
    for key, (wait, field_name) in passes.items():
        setattr(batch, key, gather_rows(wait(), field_name))
    mask = batch.response_mask
    if batch.old_logprobs is not None:  # the acid test at every step: the engines' log-probs against the trainer's
        gap = (batch.behaviour_logprobs - batch.old_logprobs) * mask
        s.info["rollout/logprob_gap"] = gap.abs().max().item()
    token_rewards = last_token_rewards(rewards, mask)
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:  # else the update reports the KL
        kl = KL_ESTIMATORS[rl.kl_estimator](batch.old_logprobs, batch.ref_logprobs) * mask
        s.info["kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        if rl.kl_mode == "reward":
            token_rewards = token_rewards - rl.kl_coef * kl
    return token_rewards


def reuses_update_logprobs(spec: JobSpec) -> bool:
    """Whether the old log-probs are the update's own (``rl.old_logprobs: auto``): one pass of
    one mini-batch trains from the very weights it would score them with (with async rollouts
    too: decoupled PPO's proximal policy is those weights, and rl.is_correction weighs them
    against the engine's log-probs of the policy that sampled)."""
    rl = spec.rl
    return (rl.old_logprobs == "auto" and rl.epochs == 1
            and not (rl.kl_coef > 0 and rl.kl_mode == "reward")
            and rl.prompts_per_step * rl.samples_per_prompt == spec.train.global_batch_size)


def _advantages(run: Run, s: Step, rewards: torch.Tensor, token_rewards: torch.Tensor) -> None:
    spec, rl, batch = run.spec, run.spec.rl, s.batch
    name = advantage_of(spec.algorithm, rl.advantage)
    mask = batch.response_mask
    adv, returns = ADVANTAGES[name](rewards_b=rewards, token_rewards_bt=token_rewards,
                                    values_bt=batch.old_values, mask_bt=mask,
                                    group_size=rl.samples_per_prompt, gamma=rl.gamma, lam=rl.lam)
    if rl.whiten_advantages == "on" or (rl.whiten_advantages == "auto" and ADVANTAGE_ESTIMATORS[name].whiten):
        adv = masked_whiten(adv, mask)
    batch.advantages, batch.returns = adv.float(), returns.float()
    s.info["advantage/mean"] = (adv * mask).sum().item() / max(1.0, mask.sum().item())


@contextlib.contextmanager
def engines_asleep(run: Run, s: Step):
    """``placement.colocate: all``: the engines sleep through the block and their weights wake
    after it, for the sync; the KV cache wakes with the next rollout (on GPUs the memory goes
    to the trainers meanwhile; see rollout.engine for vLLM's CPU build)."""
    hybrid = run.spec.placement.colocate == "all"
    if hybrid:
        with _timed(s, "train"):
            slept = run.roles.pool.call("sleep")
    try:
        yield
    finally:
        if hybrid:
            with _timed(s, "train"):
                woke = run.roles.pool.call("wake", ["weights"])
            # what the hybrid engine costs a step (a CPU engine's restart with rollout.cpu_sleep: restart)
            s.info["rollout/sleep_wake_s"] = max(a["seconds"] + b["seconds"] for a, b in zip(slept, woke))


def train(run: Run, s: Step) -> None:
    """The critic's update, then the actor's (after ``rl.freeze_actor_steps``)."""
    rl, roles = run.spec.rl, run.roles
    trained = [g for g in (roles.critic, roles.actor) if g]
    with _timed(s, "train"):
        if s.batch is None:
            return
        for group in trained:  # placement.offload_idle on GPUs: the optimizer state comes back
            group.call("idle_states", False)
        ref = ray.put(s.batch)
        if roles.critic:
            c = roles.critic.call("train", ref, s.step)
            s.stats["value_loss"] = sum(x["value_loss_sum"] for x in c) / max(1, c[0]["minibatches"])
        if s.step >= rl.freeze_actor_steps:
            a = [r for r in roles.actor.call("train", ref, s.step) if r["leader"]]
            s.stats["policy_loss"] = sum(x["policy_loss_sum"] for x in a) / max(1, a[0]["minibatches"])
            for key in ("clip_frac", "approx_kl", "entropy", "kl_loss", "kl", "grad_norm", "lr", "is/ratio_mean",
                        "is/clipped_frac", "is/masked_frac", "mismatch/kl"):
                vals = [x[key] for x in a if x.get(key) is not None]
                if vals:
                    s.stats[key] = sum(vals) / len(vals)
        for group in trained:  # ... and leaves the device to the engines until the next update
            group.call("idle_states", True)


def sync(run: Run, s: Step) -> None:
    """The new weights into every engine, as the next version."""
    with _timed(s, "rollout"):  # rl.fully_async: the rounds that went on while the trainers trained
        join_segment(run)
    with _timed(s, "sync"):
        run.version += 1
        s.sync = run.roles.pool.sync(run.version)


def report(run: Run, s: Step) -> dict:
    """The step's metrics row (logged every log.every_steps), evaluation, checkpoint, progress."""
    spec, done = run.spec, s.step + 1
    for phase, seconds in s.seconds.items():
        run.totals[phase] += seconds
    row = {"step": done, **s.info, **s.stats, **s.sync, **run.roles.pool.stats(),
           "fault/trainer_restarts": run.restarts, "fault/seconds_lost": run.seconds_lost,
           **{f"time/{k}": s.seconds[k] for k in PHASES},
           "time/step": sum(s.seconds.values()), "rollout/tokens_per_s": s.generated / max(s.seconds["rollout"], 1e-9)}
    if run.pss_gb is None:  # the run's first step: the footprint with every role up and working
        run.pss_gb = row["memory/pss_gb"] = backend.tree_memory()["pss"] / 1e9
        row["time/launch_to_first_step"] = backend.process_age_s()
    copy = spec.fault.memory_copy_steps
    if copy and done % copy == 0 and not run.cadence.checkpoint(done):
        t0 = time.time()
        run.copies.take(trained_groups(run.roles), done, driver_state(run, done))
        row["fault/seconds_copying"] = time.time() - t0
    evaluated = run.cadence.evaluate(done)
    if evaluated:
        row.update(evaluate_answers(spec, run.roles.pool, run.eval_ids, run.evals, run.rewards.verify,
                                    _eval_episodes(run)))
        if run.shown:
            run.metrics.episodes(done, run.shown)
    run.checkpoints.poll()
    row.update(run.checkpoints.figures())
    if run.cadence.log(done, evaluated):
        run.metrics.write(row)
    run.copies.confirm()  # a recovery from the copy finds its step's row written
    if run.cadence.checkpoint(done):
        save(run, done)
    run.progress.update(reward=row.get("reward/mean", 0.0),
                        **({"acc": row["eval/accuracy"]} if "eval/accuracy" in row else {}))
    return row


