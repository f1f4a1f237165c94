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
import dataclasses
import sys
import time
from pathlib import Path

import ray

from elasticrl import backend
from elasticrl import run_folder as rf
from elasticrl.cluster import RoleError, ray_session
from elasticrl.data.records import prompt_answer, read_records
from elasticrl.engine.checkpoint import Resume
from elasticrl.envs.pool import environments
from elasticrl.models import load_tokenizer
from elasticrl.plan.roles import cpus_needed
from elasticrl.rewards.sources import RewardSources
from elasticrl.rollout.sources import in_background, rollout_source
from elasticrl.spec import JobSpec
from elasticrl.spec.algorithms import advantage_of, reward_model_first
from elasticrl.spec.schema import RewardModelSpec
from elasticrl.trainers.evaluate import evaluate_answers
from elasticrl.trainers.experience import scored
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
    Step,
    driver_state,
    recover,
    resume_state,
    save,
    startup_line,
    timed,
    trained_groups,
)
from elasticrl.trainers.warm_start import initial_model, trained_reward_model
from elasticrl.world import world_paths


def resolve_rl_paths(spec: JobSpec) -> dict[str, str]:
    data = data_paths(spec, "rl_prompts", "eval")
    return {"model": initial_model(spec), "prompts": data["train"], "eval": data["eval"],
            "sft": str(world_paths(spec.world)["sft"]) if spec.rl.ptx_coef > 0 else ""}


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
        if reward_model_first(spec):
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
    run.source = rollout_source(spec, roles.pool, run.prompts, run.prompt_ids, run.tokenizer, run.envs,
                                run.cadence)
    start = resume_state(run, resume) if resume.folder else 0
    transport = roles.pool.attach(roles.actor, spec.rollout.weight_sync, spec.rollout.bucket_mb,
                                  str(run.output / rf.WEIGHTS))
    if resume.folder or (spec.model.lora.quantize != "none" and not roles.pool.lora_rank):
        roles.pool.sync(run.version)  # (the engines loaded the 16-bit base, not the trainer's 4-bit one)
    run.metrics = MetricsLog(run.output, run.asked, resume_step=start if resume.folder else None)
    run.checkpoints = Checkpoints(spec, run.output, run.asked)
    summary: dict = {"transport": transport}
    if start == 0 and run.cadence.evaluate_start():
        summary["initial"] = {"step": 0, **_evaluate(run, 0)}
        run.metrics.write(summary["initial"])
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
    """This step's samples, from the run's rollout source (``rollout.sources``)."""
    s = Step(step, [], [])
    run.roles.pool.step = step + 1  # as the console counts steps
    engines, run.scale_seen = asked_engines(run.output, run.scale_seen)  # `elasticrl scale`
    if engines is not None:
        run.roles.pool.scale_to(engines)
    with timed(s, "rollout"):
        s.indices, s.results, info = run.source.next(step, run.version)
        s.info.update(info)
        s.generated = sum(len(r.logprobs) for r in s.results)
    return s


@contextlib.contextmanager
def engines_asleep(run: Run, s: Step):
    """``placement.colocate: all``: the engines sleep through the block and their weights wake
    after it, for the sync; the KV cache wakes with the next rollout (on GPUs the memory goes
    to the trainers meanwhile; see rollout.engine for vLLM's CPU build)."""
    hybrid = run.spec.placement.colocate == "all"
    if hybrid:
        with timed(s, "train"):
            slept = run.roles.pool.call("sleep")
    try:
        yield
    finally:
        if hybrid:
            with timed(s, "train"):
                woke = run.roles.pool.call("wake", ["weights"])
            # what the hybrid engine costs a step (a CPU engine's restart with rollout.cpu_sleep: restart)
            s.info["rollout/sleep_wake_s"] = max(a["seconds"] + b["seconds"] for a, b in zip(slept, woke))


def train(run: Run, s: Step) -> None:
    """The critic's update, then the actor's (after ``rl.freeze_actor_steps``)."""
    rl, roles = run.spec.rl, run.roles
    trained = [g for g in (roles.critic, roles.actor) if g]
    with timed(s, "train"):
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
            for key in ("policy_loss", "kl_loss"):  # the ranks' global-denominator shares, a mean over mini-batches
                if f"{key}_sum" in a[0]:
                    s.stats[key] = sum(x[f"{key}_sum"] for x in a) / max(1, a[0]["minibatches"])
            tokens = sum(x["tokens"] for x in a)
            for key in ("clip_frac", "approx_kl", "entropy", "kl", "is/ratio_mean", "is/clipped_frac",
                        "is/masked_frac", "mismatch/kl"):  # token means over every rank's tokens
                if any(key in x for x in a):
                    s.stats[key] = sum(x.get(key, 0.0) * x["tokens"] for x in a) / max(1, tokens)
            s.stats.update({k: a[0][k] for k in ("grad_norm", "lr", "token_imbalance") if a[0][k] is not None})
        for group in trained:  # ... and leaves the device to the engines until the next update
            group.call("idle_states", True)


def sync(run: Run, s: Step) -> None:
    """The new weights into every engine, as the next version."""
    with timed(s, "rollout"):  # what rolled out in the background meanwhile (rl.async_rollout)
        run.source.weights_changing()
    with timed(s, "sync"):
        run.version += 1
        s.sync = run.roles.pool.sync(run.version)


def report(run: Run, s: Step) -> dict:
    """The step's metrics row (logged every log.every_steps), evaluation, checkpoint, progress."""
    done = s.step + 1
    for phase, seconds in s.seconds.items():
        run.totals[phase] += seconds
    row = {"step": done, **s.info, **s.stats, **s.sync, **run.roles.pool.stats(),
           "fault/trainer_restarts": run.restarts, "fault/seconds_lost": run.seconds_lost,
           **{f"time/{k}": s.seconds[k] for k in PHASES},
           "time/step": sum(s.seconds.values()), "rollout/tokens_per_s": s.generated / max(s.seconds["rollout"], 1e-9)}
    if run.pss_gb is None:  # the run's first step: the footprint with every role up and working
        run.pss_gb = row["memory/pss_gb"] = backend.tree_memory()["pss"] / 1e9
        row["time/launch_to_first_step"] = backend.process_age_s()
    if run.cadence.memory_copy(done):
        t0 = time.time()
        run.copies.take(trained_groups(run.roles), done, driver_state(run, done))
        row["fault/seconds_copying"] = time.time() - t0
    evaluated = run.cadence.evaluate(done)
    if evaluated:
        row.update(_evaluate(run, done))
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


def _evaluate(run: Run, done: int) -> dict:
    """Held-out evaluation (``trainers.evaluate``); with episodes, the first greedy ones written out."""
    samples = run.source.samples
    row = evaluate_answers(run.spec, run.roles.pool, run.eval_ids, run.evals, run.rewards.verify, samples.evaluation())
    if samples.shown:
        run.metrics.episodes(done, samples.shown)
    return row
