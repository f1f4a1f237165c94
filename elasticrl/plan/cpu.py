"""The layout of a job on one machine without GPUs (``elasticrl run`` on a CPU workstation).

On CPUs the phases of a step take turns on the same cores, so each phase should get all of
them (async rollouts generate while the trainers train: half the cores go to the engines,
the rest to the trainers). Training: one data-parallel rank using every core (ranks on
one machine only split the same cores, and add an all-reduce and an optimizer copy each);
the frozen models (reward) run in ranks of the same size, between the trainer's phases; an
RL job's reference is a frozen copy in the actor's process (``placement.reference:
in_actor``: one process fewer importing the stack and holding its memory). Rollout: engines
of one thread each, one per core, as far as memory allows (vLLM's CPU decode at small
batches scales better over engines than over threads: on the step benchmark's 44m model,
two engines of one thread rolled out a step in 5.0 s where one engine of two took 9.0; see
docs/benchmarks.md). One rank trains at ZeRO stage 0 (unless the spec sets a stage or an
offload): stage 2 partitions nothing there, yet its first step sets up its buffers (the step
benchmark in bf16 on a 2-core AMX CPU: step 1's update 10.8 s at stage 2 against 7.6 at stage
0, later ones 5.9-6.4 against 5.7-5.9; earlier, on an AMD CPU, 10.7-12.0 s against 10.6-11.1
per step). KV cache: each engine's
holds its share of a step's sequences at full length (``kv_cache_gib``), not vLLM's 1 GiB
floor of whole GiB: the step benchmark's two engines need 0.22 GiB each in fp32 (0.28 with
the margin), and a cache of 0.25 GiB generated as fast as one of 1 GiB (20.8 s against
18.8-19.5 s for 32 x 128 tokens; one of 0.06 GiB, which makes vLLM preempt, took 31.7 s).

Fields the user set (in the spec or with ``--set``) are kept. The choices come back as
field values, which ``planner.as_overrides`` turns into ``--set`` overrides as the GPU
planner's are, so the resolved spec.yaml holds them.
"""
from __future__ import annotations

import math
import os

from elasticrl.plan.arch import arch_of
from elasticrl.plan.roles import job_roles
from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.schema import JobSpec

ENGINE_GB = 2.0   # one in-process vLLM CPU engine besides its KV cache (measured 1.7-1.9 GB RSS)
ENGINE_SHARE = 0.5  # of the available memory, the most the engines may take together
KV_MARGIN = 1.25    # over the KV bytes of an engine's share of the sequences at full length
KV_BLOCK = 128      # tokens per block of vLLM's CPU KV cache: a sequence takes whole blocks
MAX_SEQS = 256      # sequences a vLLM CPU engine decodes at once (its max_num_seqs default)
KV_STEP_GIB = 1 / 32


def machine_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_gb(field: str = "MemAvailable") -> float | None:
    """This machine's available (or, ``field="MemTotal"``, installed) memory in GiB; None where
    /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def kv_cache_gib(spec: JobSpec, engines: int, value_bytes: int) -> float | None:
    """KV cache for one of ``engines`` engines, in steps of 1/32 GiB, with a margin: room for
    its share of a step's (or a round's) sequences at ``rollout.max_model_len``, or of an
    evaluation's at one block each (short prompts and answers), whichever is more, at most
    the sequences vLLM decodes at once; None where the model's architecture is not known here."""
    try:
        per_token = arch_of(spec.model.path, spec.world.model_size).kv_bytes_per_token(value_bytes)
    except ValueError:
        return None

    def seqs(total: int) -> int:
        return min(MAX_SEQS, math.ceil(total / engines))

    rounds = ALGORITHMS[spec.algorithm].family == "rounds"
    prompts = spec.rounds.prompts_per_round if rounds else spec.rl.prompts_per_step
    blocks = seqs(prompts * spec.rl.samples_per_prompt) * math.ceil(spec.rollout.max_model_len / KV_BLOCK)
    if spec.eval.enabled:
        evals = (spec.eval.num_prompts or MAX_SEQS) * spec.rl.eval_samples
        blocks = max(blocks, seqs(evals) * math.ceil(spec.eval.max_new_tokens / KV_BLOCK))
    need = KV_MARGIN * blocks * KV_BLOCK * per_token / 2**30
    return math.ceil(need / KV_STEP_GIB) * KV_STEP_GIB


def plan_cpu(spec: JobSpec, cores: int, memory_gb: float | None, pinned: dict, value_bytes: int = 4) -> dict:
    """Field -> value for the layout fields the user left open (``pinned``: those set);
    ``value_bytes``: of the model's dtype, 2 in bf16."""
    roles, t, r = job_roles(spec), spec.train, spec.rollout
    out: dict = {}
    if "train.num_ranks" not in pinned and t.tp_size == 1:  # one rank takes any batch the spec's ranks take
        out["train.num_ranks"] = 1
    ranks = out.get("train.num_ranks", t.num_ranks)
    # async rollouts generate while the trainers train: the cores are split between them, not taken in turn
    overlap = "rollout" in roles and spec.rl.async_rollout
    for_engines, engine_cores = (max(1, cores // 2) if overlap else cores), 0
    if "rollout" in roles:
        def kv(n: int) -> float:
            sized = None if "rollout.kv_cache_gib" in pinned else kv_cache_gib(spec, n, value_bytes)
            return r.kv_cache_gib if sized is None else sized

        engines = r.num_engines
        if "rollout.num_engines" not in pinned:
            engines = max(1, min(for_engines // r.tp_size, spec.rl.prompts_per_step))
            budget = float("inf") if memory_gb is None else memory_gb * ENGINE_SHARE
            while engines > 1 and engines * (ENGINE_GB + kv(engines)) > budget:
                engines -= 1
            out["rollout.num_engines"] = engines
        out["rollout.kv_cache_gib"] = kv(engines)
        if "rollout.cpus_per_engine" not in pinned and "rollout.num_engines" not in pinned:
            out["rollout.cpus_per_engine"] = max(1, for_engines // (engines * r.tp_size))
        engine_cores = engines * r.tp_size * out.get("rollout.cpus_per_engine", r.cpus_per_engine) if overlap else 0
    if "train.threads" not in pinned:
        out["train.threads"] = max(1, (cores - engine_cores) // ranks)
    if ranks == 1 and t.tp_size == 1 and "train.zero_stage" not in pinned and not (
            t.offload_optimizer or t.offload_params):  # one rank: ZeRO partitions nothing, and costs a first step
        out["train.zero_stage"] = 0
    if "reference" in roles and "placement.reference" not in pinned and ALGORITHMS[spec.algorithm].family == "rl":
        out["placement.reference"] = "in_actor"  # its forward takes the same cores: one process fewer to start
    return {k: v for k, v in out.items() if v != _current(spec, k)}


def _current(spec: JobSpec, path: str):
    section, name = path.split(".")
    return getattr(getattr(spec, section), name)

