"""Run one job and report it: the spec in, an exit code out. ``elasticrl run`` calls it on a
workstation, the head node of ``elasticrl launch`` calls it as a driver of the job's Ray.

Exit codes: 0 done, 2 bad input (the spec, the data, a path), 1 a rank, an engine or a reward
source failed (one line on the console, the full trace in OUTPUT/error.log), 130 interrupted.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_spec(spec_path: str | Path, output: str | Path, overrides: list[str] = ()) -> int:
    from elasticrl.cluster import RoleError
    from elasticrl.spec import SpecError, load_spec

    output = Path(output)
    try:
        job = load_spec(spec_path, list(overrides))
    except SpecError as exc:
        error(str(exc) if str(exc).startswith(str(spec_path)) else f"{spec_path}: {exc}")
        return 2
    quiet_libraries()
    from elasticrl.plot import plot_run
    from elasticrl.trainers import run_job

    try:
        summary = run_job(job, output)
    except (SpecError, ValueError, FileNotFoundError) as exc:
        error(str(exc))
        return 2
    except (RoleError, RuntimeError) as exc:
        log = output / "error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(exc)))
        error(f"{str(exc).splitlines()[0]} (full trace: {log})")
        return 1
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    print(json.dumps({"output": str(output), **summary}, default=str), flush=True)
    plot_run(output)
    print(f"curves: {output / 'plots'}/  (metrics: {output / 'metrics.jsonl'})", flush=True)
    return 0


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    for name in ("DeepSpeed", "deepspeed", "ray", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
