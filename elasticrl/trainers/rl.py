"""RL from rewards: PPO with a critic, and the critic-free GRPO / REINFORCE++ / RLOO.

The step, as in the paper's Appendix B: rollout (vLLM) -> experience (rewards, reference
log-probs, values, advantages) -> update (DeepSpeed; critic then actor, several epochs of
mini-batches) -> weight sync into the engines. Differences from the paper: advantages are
computed on the driver, which holds the whole batch, so whitening statistics are global by
construction; group estimators keep a prompt's n samples together; async mode overlaps the
rollout of the next steps with training under a staleness bound, correcting off-policy
batches with truncated importance sampling against the rollout engine's log-probs.

Run it:
  CPU:          elasticrl run examples/tiny_grpo.yaml --output runs/grpo
  workstation:  elasticrl run my_ppo.yaml --output runs/ppo --set train.num_ranks=4
  Slurm:        elasticrl launch --scheduler slurm my_ppo.yaml   (issue 5)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from pathlib import Path

import ray
import torch

from elasticrl.algorithms.advantages import ADVANTAGES, last_token_rewards
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.normalize import RunningMoments, masked_whiten
from elasticrl.cluster import RoleGroup, ray_session
from elasticrl.cluster.group import gather_rows
from elasticrl.cluster.placement import colocation_groups, pool_for
from elasticrl.data.records import format_prompt, read_jsonl, sample_indices
from elasticrl.engine import checkpoint as ckpt
from elasticrl.models import load_tokenizer
from elasticrl.plan.roles import job_roles, reward_models
from elasticrl.rewards.sources import RewardSources
from elasticrl.rollout.pool import RolloutPool, evaluate_answers
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.spec.schema import RewardModelSpec
from elasticrl.trainers.batch import behaviour_logprobs, pack
from elasticrl.trainers.init import initial_model, trained_reward_model
from elasticrl.trainers.loop import MetricsLog, Progress, find_resume, prepare_output
from elasticrl.trainers.rl_workers import ActorWorker, CriticWorker, FrozenWorker
from elasticrl.world import world_paths
from elasticrl.world.task import is_correct

log = logging.getLogger(__name__)
DEFAULT_ADVANTAGE = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce++": "reinforce++_baseline"}


def advantage_name(spec: JobSpec) -> str:
    return DEFAULT_ADVANTAGE[spec.algorithm] if spec.rl.advantage == "auto" else spec.rl.advantage


# --- set-up -----------------------------------------------------------------------------
def resolve_rl_paths(spec: JobSpec) -> dict[str, str]:
    world = world_paths(spec.world) if (spec.data.train is None or spec.data.eval is None or
                                        spec.rl.ptx_coef > 0) else {}
    return {"model": initial_model(spec), "prompts": spec.data.train or str(world["rl_prompts"]),
            "eval": spec.data.eval or str(world["eval"]), "sft": str(world.get("sft", ""))}


def active_roles(spec: JobSpec) -> dict[str, int]:
    """Role -> rank count of what this job starts."""
    return {role: r.ranks for role, r in job_roles(spec).items()}


def cpus_needed(spec: JobSpec) -> int:
    """Logical CPUs of a local cluster: one per rank, colocated roles sharing theirs."""
    from elasticrl.cluster.placement import COLOCATION

    active = active_roles(spec)
    per_rank = {"rollout": spec.rollout.cpus_per_engine, "reward": reward_models(spec)}
    cpus = {r: n * per_rank.get(r, 1) for r, n in active.items()}
    for group in COLOCATION[spec.placement.colocate]:
        members = [r for r in group if r in active]
        if len(members) > 1:
            shared = max(active[r] for r in members)
            for r in members:
                cpus[r] = 0
            cpus[members[0]] = shared
    return sum(cpus.values()) + 1


class Roles:
    """Every role of the job, placed per ``placement.colocate``."""

    def __init__(self, spec: JobSpec, paths: dict[str, str], total_updates: int):
        d = spec_to_dict(spec)
        t = spec.train
        active = active_roles(spec)
        pools = spec.placement.pools
        shared = colocation_groups(spec.placement.colocate, active, cpus_per_bundle=1.0,
                                   copies={"reward": reward_models(spec)}, pools=pools)
        self.shared = list({id(v): v for v in shared.values()}.values())
        opts = lambda role: shared[role].options() if role in shared else {"pool": pool_for(pools, role)}  # noqa: E731
        self.groups: list[RoleGroup] = []
        self.actor = self._add(RoleGroup("actor", ActorWorker, t.num_ranks, d, paths["model"], **opts("actor")))
        if spec.rl.ptx_coef > 0:
            self.actor.call("set_ptx_data", paths["sft"])
        self.actor.setup(total_updates)
        self.reference = None
        if "reference" in active:
            self.reference = self._add(RoleGroup("reference", FrozenWorker, active["reference"], d, paths["model"],
                                                 "reference", spec.placement.offload_idle, **opts("reference")))
            self.reference.setup()
        self.critic = None
        if "critic" in active:
            init = spec.critic.path or (spec.rewards.models[0].path if spec.rewards.models else paths["model"])
            self.critic = self._add(RoleGroup(
                "critic", CriticWorker, spec.critic.num_ranks, d, init,
                {"num_ranks": spec.critic.num_ranks, "tp_size": 1,
                 "global_batch_size": t.global_batch_size,
                 "micro_batch_size": t.global_batch_size // spec.critic.num_ranks
                 if t.global_batch_size % (t.micro_batch_size * spec.critic.num_ranks) else t.micro_batch_size},
                spec.critic.lr, **opts("critic")))
            self.critic.setup(total_updates)
        self.rewards = []
        for i, m in enumerate(spec.rewards.models):
            g = self._add(RoleGroup(f"reward{i}", FrozenWorker, active["reward"], d, m.path, "reward",
                                    spec.placement.offload_idle,
                                    **opts("reward")))
            g.setup()
            self.rewards.append((g, m.weight))
        self.pool = RolloutPool(paths["model"], spec.rollout, spec.model.dtype, spec.seed,
                                spec.model.trust_remote_code, shared=shared.get("rollout"),
                                pool=pool_for(pools, "rollout"))
        self.groups.append(self.pool.group)

    def layout(self) -> dict[str, str]:
        """Role -> id of the placement group it runs on (colocated roles share one)."""
        return {g.role: g.pg.id.hex()[:12] for g in self.groups}

    def _add(self, group: RoleGroup) -> RoleGroup:
        self.groups.append(group)
        return group

    def shutdown(self) -> None:
        for g in reversed(self.groups):
            try:
                if g is self.pool.group:
                    self.pool.shutdown()
                else:
                    g.shutdown()
            except Exception as exc:  # keep tearing down the others
                log.warning("shutting down %s: %s", g.role, exc)
        for s in self.shared:
            s.remove()


# --- experience -------------------------------------------------------------------------
def _filter_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Indices of responses whose prompt group has varying rewards (dynamic sampling)."""
    g = rewards.view(-1, group_size)
    keep = (g.max(1).values - g.min(1).values) > 1e-6
    return (keep.repeat_interleave(group_size)).nonzero().flatten()


# --- the loop ---------------------------------------------------------------------------
def run_rl(spec: JobSpec, output: Path) -> dict:
    output = prepare_output(spec, output)
    rl, t = spec.rl, spec.train
    responses = rl.prompts_per_step * rl.samples_per_prompt
    if responses % t.global_batch_size:
        raise ValueError(f"train.global_batch_size: must divide rl.prompts_per_step x rl.samples_per_prompt = "
                         f"{responses}, got {t.global_batch_size}")
    name = advantage_name(spec)
    ADVANTAGES.get_or_raise(name, "rl.advantage")
    if name == "gae" and spec.algorithm != "ppo":
        raise ValueError("rl.advantage: gae needs a critic; use algorithm: ppo")
    rewards = RewardSources(spec)
    resume_dir = find_resume(spec, output)
    summary: dict = {"algorithm": spec.algorithm, "advantage": name}
    with ray_session(spec.ray, num_cpus_needed=cpus_needed(spec)):
        if spec.algorithm == "ppo" and spec.init.rm_steps and not spec.rewards.models:
            path = trained_reward_model(spec)
            spec = dataclasses.replace(spec, rewards=dataclasses.replace(
                spec.rewards, models=[RewardModelSpec(path=path, weight=1.0)]))
            summary["reward_model"] = path
        paths = resolve_rl_paths(spec)
        prompts = read_jsonl(paths["prompts"], (spec.data.prompt_key, spec.data.answer_key))
        evals = read_jsonl(paths["eval"], (spec.data.prompt_key, spec.data.answer_key))
        total_updates = rl.num_steps * rl.epochs * responses // t.global_batch_size
        roles = Roles(spec, paths, total_updates)
        summary["placement"] = roles.layout()
        try:
            summary.update(_loop(spec, roles, rewards, prompts, evals, paths, output, resume_dir))
        finally:
            roles.shutdown()
    return summary


def _loop(spec, roles, rewards, prompts, evals, paths, output, resume_dir) -> dict:
    rl = spec.rl
    tok = load_tokenizer(paths["model"], spec.model.trust_remote_code)
    pk = spec.data.prompt_key

    def encode(text):
        return tok(format_prompt(tok, text, spec.data.apply_chat_template), add_special_tokens=False)["input_ids"]

    prompt_ids = [encode(r[pk]) for r in prompts]
    eval_ids = [encode(r[pk]) for r in evals[: spec.eval.num_prompts or None]]
    sampling = {"n": rl.samples_per_prompt, "temperature": rl.temperature, "top_p": rl.top_p,
                "max_tokens": rl.max_new_tokens, **({"top_k": rl.top_k} if rl.top_k else {})}
    moments = RunningMoments()
    start, version = 0, 0
    if resume_dir:
        state = ckpt.read_trainer_state(resume_dir)
        start, version = state["step"], state["version"]
        moments.mean, moments.var, moments.count = state["reward_moments"]
        roles.actor.call("load", str(resume_dir / "actor"))
        if roles.critic:
            roles.critic.call("load", str(resume_dir / "critic"))
    roles.actor.call("attach_rollout", roles.pool.engines, roles.pool.infos, spec.rollout.weight_sync,
                     spec.rollout.bucket_mb, str(output / "weights"))
    if resume_dir:
        roles.actor.call("sync_weights", version)
    metrics = MetricsLog(output / "metrics.jsonl", resume_step=start if resume_dir else None)
    summary: dict = {"transport": roles.actor.call_rank(0, "__ray_call__", lambda w: w.core.sender.transport)}
    if start == 0 and spec.eval.every_steps:
        row = {"step": 0, **evaluate_answers(spec, roles.pool, eval_ids, evals)}
        metrics.write(row)
        summary["initial"] = row
    progress = Progress(rl.num_steps, start, spec.log.progress_bar, desc=spec.algorithm)

    def batch_prompts(step):
        idx = sample_indices(len(prompts), spec.seed, step * rl.prompts_per_step, rl.prompts_per_step)
        return idx, [prompt_ids[i] for i in idx]

    def step_sampling(step):  # seeded per step (and per prompt, in the engine): runs repeat
        return {**sampling, "seed": spec.seed + (step + 1) * 1_000_003}

    pending: deque = deque()  # (step, indices, handle) submitted ahead in async mode
    depth = rl.max_staleness if rl.async_rollout else 0
    phase_totals = {"rollout": 0.0, "experience": 0.0, "train": 0.0, "sync": 0.0}
    row: dict = {}
    for step in range(start, rl.num_steps):
        t0 = time.time()
        if not pending:
            idx, p = batch_prompts(step)
            pending.append((step, idx, roles.pool.submit(p, step_sampling(step))))
        _, idx, handle = pending.popleft()
        results = roles.pool.collect(handle)
        while len(pending) < depth and step + 1 + len(pending) < rl.num_steps:  # roll out ahead, on current weights
            nxt = step + 1 + len(pending)
            nidx, p = batch_prompts(nxt)
            pending.append((nxt, nidx, roles.pool.submit(p, step_sampling(nxt))))
        t_rollout = time.time() - t0

        t1 = time.time()
        batch, info = _experience(spec, roles, rewards, results, idx, prompts, prompt_ids, tok, moments, version)
        t_exp = time.time() - t1
        t2 = time.time()
        stats: dict = {}
        if batch is not None:
            ref = ray.put(batch)
            if roles.critic:
                c = [r for r in roles.critic.call("train", ref, step)]
                stats["value_loss"] = sum(x["value_loss_sum"] for x in c) / max(1, c[0]["minibatches"])
            if step >= rl.freeze_actor_steps:
                a = [r for r in roles.actor.call("train", ref, step) if r["leader"]]
                stats["policy_loss"] = sum(x["policy_loss_sum"] for x in a) / max(1, a[0]["minibatches"])
                for key in ("clip_frac", "approx_kl", "entropy", "kl_loss", "grad_norm", "lr"):
                    vals = [x[key] for x in a if x.get(key) is not None]
                    if vals:
                        stats[key] = sum(vals) / len(vals)
        t_train = time.time() - t2
        t3 = time.time()
        if spec.placement.colocate == "all":
            roles.pool.call("wake")
        version += 1
        sync = roles.actor.call("sync_weights", version)[0]
        t_sync = time.time() - t3
        done = step + 1
        seconds = time.time() - t0
        for k, v in zip(phase_totals, (t_rollout, t_exp, t_train, t_sync)):
            phase_totals[k] += v
        gen_tokens = sum(len(r["token_ids"]) for r in results)
        row = {"step": done, **info, **stats, **sync, "time/rollout": t_rollout, "time/experience": t_exp,
               "time/train": t_train, "time/sync": t_sync, "time/step": seconds,
               "rollout/tokens_per_s": gen_tokens / max(t_rollout, 1e-9)}
        if (spec.eval.every_steps and done % spec.eval.every_steps == 0) or done == rl.num_steps:
            row.update(evaluate_answers(spec, roles.pool, eval_ids, evals))
        if done % spec.log.every_steps == 0 or "eval/accuracy" in row or done == rl.num_steps or done == 1:
            metrics.write(row)
        if spec.checkpoint.every_steps and (done % spec.checkpoint.every_steps == 0 or done == rl.num_steps):
            _save(spec, roles, output, done, version, moments)
        progress.update(reward=row.get("reward/mean", 0.0),
                        **({"acc": row["eval/accuracy"]} if "eval/accuracy" in row else {}))
    progress.close()
    metrics.close()
    roles.actor.call("detach_rollout")
    if spec.export.enabled:
        roles.actor.call("export", str(output / "final"))
        summary["export"] = str(output / "final")
    total = sum(phase_totals.values()) or 1.0
    summary["time_share"] = {k: round(v / total, 3) for k, v in phase_totals.items()}
    summary["final"] = {k: v for k, v in row.items() if not k.startswith("time/")}
    return summary


def _experience(spec, roles, rewards, results, idx, prompts, prompt_ids, tok, moments, version):
    rl = spec.rl
    pk, ak = spec.data.prompt_key, spec.data.answer_key
    texts = [r["text"] for r in results]
    recs = [prompts[idx[r["prompt_index"]]] for r in results]
    p_ids = [prompt_ids[idx[r["prompt_index"]]] for r in results]
    batch = pack(p_ids, [r["token_ids"] for r in results], tok.pad_token_id)
    batch_ref = ray.put(batch)
    raw = rewards([r[pk] for r in recs], texts, [r.get(ak) for r in recs], batch_ref, roles.rewards)
    correct = torch.tensor([float(is_correct(c, r[ak])) if r.get(ak) is not None else 0.0
                            for c, r in zip(texts, recs)])
    info = {"reward/mean": raw.mean().item(), "reward/std": raw.std().item() if len(raw) > 1 else 0.0,
            "accuracy": correct.mean().item(), "response_length": batch["response_mask"].sum(1).mean().item(),
            "rl/staleness": version - min(r["weight_version"] for r in results)}
    if info["rl/staleness"] > (rl.max_staleness if rl.async_rollout else 0):
        raise RuntimeError(f"rollout staleness {info['rl/staleness']} exceeds the bound")  # an invariant
    keep = torch.arange(len(results))
    if rl.dynamic_sampling:
        keep = _filter_groups(raw, rl.samples_per_prompt)
        info["rl/kept_fraction"] = len(keep) / len(results)
        usable = len(keep) // spec.train.global_batch_size * spec.train.global_batch_size
        # whole groups and whole mini-batches only
        usable -= usable % rl.samples_per_prompt
        keep = keep[:usable]
        if len(keep) == 0:
            return None, info
        batch = {k: v[keep] for k, v in batch.items()}
        results = [results[i] for i in keep.tolist()]
    r = raw[keep]
    if rl.normalize_reward:
        moments.update(r)
        r = moments.normalize(r, rl.reward_clip)
    elif rl.reward_clip:
        r = r.clamp(-rl.reward_clip, rl.reward_clip)
    ref = ray.put(batch)
    mask = batch["response_mask"]
    old = gather_rows(roles.actor.call("logprobs", ref), "logprobs")
    batch["old_logprobs"] = old
    token_rewards = last_token_rewards(r, mask)
    if roles.reference is not None:
        ref_lp = gather_rows(roles.reference.call("score", ref), "values")
        batch["ref_logprobs"] = ref_lp
        kl = KL_ESTIMATORS[rl.kl_estimator](old, ref_lp) * mask
        info["kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        if rl.kl_mode == "reward":
            token_rewards = token_rewards - rl.kl_coef * kl
    values = None
    if roles.critic is not None:
        values = gather_rows(roles.critic.call("values", ref), "values")
        batch["old_values"] = values
    name = advantage_name(spec)
    adv, returns = ADVANTAGES[name](rewards_b=r, token_rewards_bt=token_rewards, values_bt=values, mask_bt=mask,
                                    group_size=rl.samples_per_prompt, gamma=rl.gamma, lam=rl.lam)
    whiten = rl.whiten_advantages == "on" or (rl.whiten_advantages == "auto" and name in ("gae", "reinforce++",
                                                                                         "reinforce++_baseline"))
    if whiten:
        adv = masked_whiten(adv, mask)
    batch["advantages"], batch["returns"] = adv.float(), returns.float()
    if rl.async_rollout:
        batch["behaviour_logprobs"] = behaviour_logprobs(results, batch)
    info["advantage/mean"] = (adv * mask).sum().item() / max(1.0, mask.sum().item())
    if spec.placement.colocate == "all":
        roles.pool.call("sleep")
    return batch, info


def _save(spec, roles, output, step, version, moments) -> None:
    root = output / "checkpoints"
    tmp = ckpt.temp_checkpoint_dir(root, step)
    (tmp / "actor").mkdir()
    roles.actor.call("save", str(tmp / "actor"))
    if roles.critic:
        (tmp / "critic").mkdir()
        roles.critic.call("save", str(tmp / "critic"))
    ckpt.write_trainer_state(tmp, {"step": step, "version": version,
                                   "reward_moments": [moments.mean, moments.var, moments.count]})
    ckpt.commit_checkpoint(tmp, root, step, spec.checkpoint.keep)
