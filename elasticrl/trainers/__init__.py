"""The training loops. ``run_job`` runs a job with its algorithm's trainer (``spec.algorithms``)."""
from __future__ import annotations

import importlib
from pathlib import Path

from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.schema import JobSpec


def run_job(spec: JobSpec, output: Path) -> dict:
    """Run the job into ``output``; a job that finished there already is not run again (its
    summary comes back), one that stopped resumes from its newest checkpoint."""
    from elasticrl.models.check import check_job_models
    from elasticrl.trainers.loop import finished_run, mark_finished

    done = finished_run(spec, output)
    if done is not None:
        return done
    check_job_models(spec)  # model folders and tensor-parallel sizes, before Ray starts
    module, _, name = ALGORITHMS[spec.algorithm].trainer.partition(":")
    summary = getattr(importlib.import_module(module), name)(spec, output)
    mark_finished(spec, output, summary)
    return summary
