"""The training loops. ``run_job`` runs a job with its algorithm's trainer (``spec.algorithms``)."""
from __future__ import annotations

import importlib
from pathlib import Path

from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.schema import JobSpec


def run_job(spec: JobSpec, output: Path) -> dict:
    module, _, name = ALGORITHMS[spec.algorithm].trainer.partition(":")
    return getattr(importlib.import_module(module), name)(spec, output)
