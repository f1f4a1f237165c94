"""Held-out evaluation on the rollout engines, for the trainers that have them (RL and the
rounds algorithms): greedy accuracy and pass@k, judged by the job's verifier. (A trainer
without engines evaluates in its ranks: ``models.evaluate.greedy_accuracy``.)"""
from __future__ import annotations

from elasticrl.data.records import prompt_text
from elasticrl.rewards.verifiers import full_marks
from elasticrl.rollout.pool import RolloutPool, sampling_params
from elasticrl.rollout.sample import Sample
from elasticrl.spec import JobSpec


def evaluate_answers(spec: JobSpec, pool: RolloutPool, eval_ids: list[list[int]], evals, verify,
                     episodes=None) -> dict:
    """Held-out accuracy of greedy answers, and pass@k and mean accuracy of ``rl.eval_samples``
    sampled ones, as ``verify(prompts, completions, answers)`` (the job's verifier) scores them;
    ``episodes(rows, sampling)``: they are the last turns of multi-turn episodes."""
    k = spec.rl.eval_samples

    def generate(sampling: dict) -> list[Sample]:
        return pool.generate(eval_ids, sampling) if episodes is None else episodes(evals[:len(eval_ids)], sampling)

    def right(results: list[Sample]) -> list[bool]:
        recs = [evals[r.prompt_index] for r in results]
        scores = verify([prompt_text(e, spec.data) for e in recs], [r.text for r in results],
                        [e.get(spec.data.answer_key) for e in recs])
        return [full_marks(v) for v in scores]

    greedy = generate({"temperature": 0.0, "max_tokens": spec.eval.max_new_tokens,
                                      **({"stop": list(spec.rl.stop)} if spec.rl.stop else {})})
    out = {"eval/accuracy": sum(right(greedy)) / len(eval_ids)}
    if k > 1:
        sampled = generate({**sampling_params(spec, None, spec.eval.max_new_tokens), "n": k})
        hit, oks = [False] * len(eval_ids), right(sampled)
        for r, ok in zip(sampled, oks):
            hit[r.prompt_index] |= ok
        out[f"eval/pass@{k}"] = sum(hit) / len(eval_ids)
        out[f"eval/mean@{k}"] = sum(oks) / len(oks)  # the sampled answers' accuracy: steadier than greedy's
    return out
