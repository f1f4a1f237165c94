"""An RL step's experience phase: the rewards of its samples (verifiers, reward models, an
environment's own), DAPO's overlong handling and dynamic sampling, the reward shaping, the model
passes (the policy's and the reference's log-probs, the critic's values, side by side) and the
advantages the trainers learn from."""
from __future__ import annotations

import dataclasses

import ray
import torch

from elasticrl.algorithms.advantages import ADVANTAGES, last_token_rewards, overlong_penalty, varying_groups
from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.normalize import masked_whiten
from elasticrl.cluster import RoleError
from elasticrl.data.records import prompt_text
from elasticrl.rewards.verifiers import full_marks
from elasticrl.spec import JobSpec
from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, advantage_of
from elasticrl.trainers.batch import behaviour_logprobs, gather_rows, pack
from elasticrl.trainers.rl_run import Run, Step, before_scoring, score_again_after_frozen_loss, timed


def experience(run: Run, s: Step) -> None:
    """Rewards, then the batch the trainers learn from: the policy's and the reference's
    log-probs, the critic's values and the advantages. The model passes run side by side,
    and while the rewards are scored (dynamic sampling first picks the rows they see)."""
    with timed(s, "experience"):
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
    spec = run.spec
    texts = [r.text for r in s.results]
    recs = [run.prompts[s.indices[r.prompt_index]] for r in s.results]
    models = [(lambda g=g: gather_rows(g.call("score", batch_ref), "values"), w) for g, w in run.roles.rewards]
    scores = run.rewards([prompt_text(r, spec.data) for r in recs], texts, [r.get(spec.data.answer_key) for r in recs],
                         models, where=f"step {s.step + 1}")
    scores.total += torch.tensor([r.episode_reward for r in s.results]) * scores.keep  # an environment's own
    raw = _drop(run, s, scores)
    kept = raw[scores.keep]
    correct = torch.tensor([float(full_marks(v)) for v in scores.verified])
    s.info.update(length_stats([len(r.token_ids) if r.mask is None else sum(r.mask) for r in s.results]))
    s.info.update({"reward/mean": kept.mean().item() if len(kept) else 0.0,
              "reward/std": kept.std().item() if len(kept) > 1 else 0.0,
              "accuracy": correct.mean().item(), "response_length": s.batch.response_mask.sum(1).mean().item(),
              "rl/staleness": run.version - min(r.weight_version for r in s.results), **scores.info})
    if s.info["rl/staleness"] > run.source.max_staleness:
        raise RuntimeError(f"rollout staleness {s.info['rl/staleness']} exceeds the bound")  # an invariant
    return raw


def length_stats(lengths: list[int]) -> dict[str, float]:
    """The rollout's long tail: the tokens the model generated per sample (an episode's turns, not
    its observations), mean, median, 90th percentile and longest (percentiles interpolated)."""
    t = torch.tensor(lengths, dtype=torch.float64)
    p50, p90 = torch.quantile(t, torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    return {"rollout/response_length/mean": t.mean().item(), "rollout/response_length/p50": p50,
            "rollout/response_length/p90": p90, "rollout/response_length/max": t.max().item()}


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
        more = Step(s.step, *run.source.more(s.step))
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
