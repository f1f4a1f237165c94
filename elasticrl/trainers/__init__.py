"""The training loops. ``run_job`` dispatches on ``spec.algorithm``."""
from __future__ import annotations

from pathlib import Path

from elasticrl.spec.schema import JobSpec


def run_job(spec: JobSpec, output: Path) -> dict:
    if spec.algorithm == "sft":
        from elasticrl.trainers.sft import run_sft

        return run_sft(spec, output)
    if spec.algorithm in ("grpo", "ppo", "reinforce++", "rloo"):
        from elasticrl.trainers.rl import run_rl

        return run_rl(spec, output)
    if spec.algorithm == "conditional_sft":
        from elasticrl.trainers.conditional import run_conditional

        return run_conditional(spec, output)
    if spec.algorithm in ("dpo", "kto"):
        from elasticrl.trainers.preference import run_preference

        return run_preference(spec, output)
    if spec.algorithm in ("rejection_sampling", "iterative_dpo"):
        from elasticrl.trainers.rounds import run_rounds

        return run_rounds(spec, output)
    if spec.algorithm == "rm":
        from elasticrl.trainers.rm import run_rm

        return run_rm(spec, output)
    if spec.algorithm == "prm":
        from elasticrl.trainers.prm import run_prm

        return run_prm(spec, output)
    raise ValueError(f"algorithm: {spec.algorithm!r} has no trainer yet")
