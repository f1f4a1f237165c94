"""What every trainer's driver does the same way: output folder, metrics, progress, resume."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from elasticrl.engine import checkpoint as ckpt
from elasticrl.engine.checkpoint import list_checkpoints, read_trainer_state
from elasticrl.files import write_text
from elasticrl.spec import JobSpec, dump_spec


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, flushed as written."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.unlink(missing_ok=True)
        elif path.exists():  # drop lines past the checkpoint: the resumed run rewrites them
            kept = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            write_text(path, "".join(ln + "\n" for ln in kept))
        self.fh = open(path, "a")

    def write(self, row: dict) -> None:
        self.fh.write(json.dumps(row, sort_keys=False) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def finish_run(group, spec: JobSpec, output: Path, summary: dict, row: dict, progress, metrics) -> dict:
    """Close the console and the metrics, export the final model, complete the summary."""
    progress.close()
    metrics.close()
    if spec.export.enabled:
        group.call("export", str(output / "final"))
        summary["export"] = str(output / "final")
    summary["final"] = row
    return summary


def prepare_output(spec: JobSpec, output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    dump_spec(spec, output / "spec.yaml")
    return output


def find_resume(spec: JobSpec, output: Path) -> Path | None:
    """The checkpoint to resume from, per ``checkpoint.resume``."""
    choice = spec.checkpoint.resume
    if choice is None:
        return None
    if choice == "auto":
        found = list_checkpoints(output / "checkpoints")
        return found[-1][1] if found else None
    path = Path(choice)
    try:
        read_trainer_state(path)
    except FileNotFoundError:
        raise ValueError(f"checkpoint.resume: {path} is not a checkpoint folder (no trainer_state.json)") from None
    return path


def num_steps(max_steps: int, num_epochs: float, num_records: int, global_batch: int) -> int:
    return max_steps or max(1, math.ceil(num_epochs * num_records / global_batch))


class Progress:
    """A tqdm bar with the latest figures, or plain lines when the console is not a terminal."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        self.start = time.time()

    def update(self, **figures) -> None:
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in figures.items()},
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def save_checkpoint(group, spec: JobSpec, output: Path, step: int) -> None:
    with ckpt.new_checkpoint(output / "checkpoints", step, spec.checkpoint.keep) as tmp:
        group.call("save", str(tmp))
        ckpt.write_trainer_state(tmp, {"step": step, "samples_seen": step * spec.train.global_batch_size,
                                       "num_ranks": spec.train.num_ranks})


def offline_loop(spec: JobSpec, group, output: Path, total: int, step_row, evaluate, show: str) -> dict:
    """The driver of the trainers on a fixed dataset (rm, dpo, kto): evaluate the start, then
    step, log, evaluate every ``eval.every_steps`` and at the end, checkpoint, export.
    ``step_row(results of the data-parallel leaders)`` makes a step's metrics; ``show`` names
    the eval figure on the progress bar."""
    metrics = MetricsLog(output / "metrics.jsonl", resume_step=None)
    progress = Progress(total, 0, spec.log.progress_bar, desc=spec.algorithm)
    summary = {"initial": evaluate()}
    metrics.write({"step": 0, **summary["initial"]})
    every = spec.eval.every_steps
    row: dict = {}
    for step in range(total):
        t0 = time.time()
        res = [r for r in group.call("train_step", step) if r["leader"]]
        done = step + 1
        row = {"step": done, **step_row(res), "step_seconds": time.time() - t0}
        evaluated = (every and done % every == 0) or done == total
        if evaluated:
            row.update(evaluate())
        if done % spec.log.every_steps == 0 or evaluated:
            metrics.write(row)
        if spec.checkpoint.every_steps and done % spec.checkpoint.every_steps == 0:
            save_checkpoint(group, spec, output, done)
        progress.update(loss=row["loss"], **({show: row[f"eval/{show}"]} if evaluated else {}))
    return finish_run(group, spec, output, summary, row, progress, metrics)
