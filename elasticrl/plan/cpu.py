"""The layout of a job on one machine without GPUs (``elasticrl run`` on a CPU workstation).

On CPUs the phases of a step take turns on the same cores, so each phase should get all of
them. Training: one data-parallel rank using every core (ranks on one machine only split the
same cores, and add an all-reduce and an optimizer copy each); the frozen models (reference,
reward) run in ranks of the same size, between the trainer's phases. Rollout: engines of one
thread each, one per core, as far as memory allows (vLLM's CPU decode at small batches
scales better over engines than over threads: on the step benchmark's 44m model, two
engines of one thread rolled out a step in 5.0 s where one engine of two took 9.0; see
benchmarks/README.md). ZeRO stays as the spec says: for one rank, stage 0 and 2 trained
alike in speed (measured 10.7-12.0 s against 10.6-11.1 s per step).

Fields the user set (in the spec or with ``--set``) are kept. The choices come back as
field values, which ``planner.as_overrides`` turns into ``--set`` overrides as the GPU
planner's are, so the resolved spec.yaml holds them.
"""
from __future__ import annotations

import os

from elasticrl.plan.roles import job_roles
from elasticrl.spec.schema import JobSpec

ENGINE_GB = 2.0   # one in-process vLLM CPU engine besides its KV cache (measured 1.7-1.9 GB RSS)
ENGINE_SHARE = 0.5  # of the available memory, the most the engines may take together


def machine_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def plan_cpu(spec: JobSpec, cores: int, memory_gb: float | None, pinned: dict) -> dict:
    """Field -> value for the layout fields the user left open (``pinned``: those set)."""
    roles, t, r = job_roles(spec), spec.train, spec.rollout
    out: dict = {}
    if "train.num_ranks" not in pinned and t.tp_size == 1:  # one rank takes any batch the spec's ranks take
        out["train.num_ranks"] = 1
    ranks = out.get("train.num_ranks", t.num_ranks)
    if "train.threads" not in pinned:
        out["train.threads"] = max(1, cores // ranks)
    if "rollout" in roles:
        engines = r.num_engines
        if "rollout.num_engines" not in pinned:
            fit = cores if memory_gb is None else int(memory_gb * ENGINE_SHARE // (ENGINE_GB + r.kv_cache_gib))
            engines = max(1, min(cores // r.tp_size, fit, spec.rl.prompts_per_step))
            out["rollout.num_engines"] = engines
        if "rollout.cpus_per_engine" not in pinned and "rollout.num_engines" not in pinned:
            out["rollout.cpus_per_engine"] = max(1, cores // (engines * r.tp_size))
    return {k: v for k, v in out.items() if v != _current(spec, k)}


def _current(spec: JobSpec, path: str):
    section, name = path.split(".")
    return getattr(getattr(spec, section), name)

