"""The run folder, a job's output: every name in it, once, and the files through which a
running job and the commands outside it talk (``elasticrl status``, ``scale``, ``launch``'s
restarts). The trainers, ``launch``, ``plot`` and the benchmarks name them from here; the
docs/runs.md says what each holds."""
from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"      # a row per logged step (trainers.loop.MetricsLog)
EPISODES = "episodes.jsonl"    # evaluation's episodes written out whole (rollout.environment)
SPEC = "spec.yaml"             # the spec as the user gave it, resolved
FINAL = "final"                # the exported model (export.enabled)
FINISHED = "finished.json"     # written last: the run ended, with its summary (a rerun keeps it)
SCALE = "scale.json"           # what `elasticrl scale` asks of the running job
CHECKPOINTS = "checkpoints"    # checkpoints/step_NNNNNNN/
TENSORBOARD = "tensorboard"
PLOTS = "plots"                # `elasticrl plot`'s curves
WEIGHTS = "weights"            # rollout.weight_sync files' folders
ROUNDS = "rounds"              # rounds/N.jsonl: a round's training records (rejection sampling, iterative DPO)
LOGS = "logs"                  # a launched job's nodes' logs
RESUMING = "resuming from checkpoint"  # the console line a resumed run prints, which `elasticrl status` counts


def metric_rows(folder: Path) -> list[dict]:
    """The metrics rows a run folder holds (none before its first); a line that is not JSON is
    named with its number."""
    path, rows = Path(folder) / METRICS, []
    for n, line in enumerate(path.read_text().splitlines() if path.is_file() else [], 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg})") from None
    return rows
