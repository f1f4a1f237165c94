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
import tempfile
import traceback
from pathlib import Path

from elasticrl import run_folder as rf
from elasticrl.files import claim_output, write_text


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_spec(spec_path: str | Path, output: str | Path, overrides: list[str] = ()) -> int:
    from elasticrl.spec import SpecError, load_spec
    from elasticrl.spec.rules import notes

    output = Path(output)
    try:
        job = load_spec(spec_path, list(overrides))
    except SpecError as exc:
        error(str(exc) if str(exc).startswith(str(spec_path)) else f"{spec_path}: {exc}")
        return 2
    from elasticrl.weights.transports import unknown

    problem = unknown(job.rollout.weight_sync)  # the transports are modules, which the spec layer sits below
    if problem:
        error(f"{spec_path}: {problem}")
        return 2
    for line in notes(job):
        print(f"note: {line}", file=sys.stderr, flush=True)
    problem = output_problem(output)
    if problem:
        error(problem)
        return 2
    claim = claim_output(output)
    if claim is None:
        error(f"--output {output}: another elasticrl run on this machine writes there; let it end (or stop it), "
              "or give another --output")
        return 2
    with claim:
        fresh = not any(output.iterdir())
        layout: dict = {}
        if job.ray.address == "local":
            localhost_only()
            job, layout = cpu_layout(spec_path, list(overrides), job)
        code = _run(job, output, {"layout": layout} if layout else {})
        if code and fresh:
            _remove_what_a_failed_run_began(output)
        return code


def cpu_layout(spec_path, overrides: list[str], job):
    """On a machine without GPUs, ``job`` with the layout fields its spec leaves open set for
    this machine's cores (``plan.cpu``), and those fields' values (in the run's summary). Not
    in a job ``elasticrl launch`` started: its head runs the job in a Ray it already joined."""
    from elasticrl import backend
    from elasticrl.plan.cpu import available_gb, machine_cores, plan_cpu
    from elasticrl.plan.planner import as_overrides
    from elasticrl.spec import explicit_fields, load_spec, read_raw

    launched = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # its pools were sized for the spec
    if backend.has_gpu() or launched:
        return job, {}
    cores = min(machine_cores(), job.ray.num_cpus or machine_cores())
    value_bytes = 2 if backend.resolve_dtype(job.model.dtype) == "bf16" else 4
    settings = plan_cpu(job, cores, available_gb(), explicit_fields(read_raw(spec_path, overrides)), value_bytes)
    return (load_spec(spec_path, overrides + as_overrides(settings)) if settings else job), settings


def _run(job, output: Path, extra: dict) -> int:
    """``extra``: what the summary printed at the end adds (the CPU layout chosen)."""
    from elasticrl.cluster import RoleError
    from elasticrl.cluster.session import Terminated
    from elasticrl.files import disk_problem
    from elasticrl.spec import SpecError

    quiet_libraries()
    from elasticrl.plot import plot_run
    from elasticrl.trainers import run_job

    try:
        summary = run_job(job, output)
    except (SpecError, ValueError, FileNotFoundError) as exc:
        error(str(exc))
        return 2
    except Terminated:
        error("terminated (SIGTERM); run the same command again to resume from the newest checkpoint")
        return 143
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - a rank, an engine, a reward source, the disk: one line, the trace in a file
        problem = disk_problem(exc)
        if problem and getattr(exc, "filename", None):
            first = f"{exc.filename}: {problem[0]}; {problem[1]}"
        elif isinstance(exc, (RoleError, RuntimeError)):
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            first = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        error(f"{first} (full trace: {_trace(exc, output)})")
        return 1
    print(json.dumps({"output": str(output), **extra, **summary}, default=str), flush=True)
    plot_run(output)
    print(f"curves: {output / 'plots'}/  (metrics: {output / 'metrics.jsonl'})", flush=True)
    return 0


def _trace(exc: BaseException, output: Path) -> Path | str:
    """The full traceback in OUTPUT/error.log (or, when OUTPUT cannot take it, a temp file)."""
    text = "".join(traceback.format_exception(exc))
    for folder in (output, Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return write_text(folder / ("error.log" if folder == output else f"elasticrl-error-{os.getpid()}.log"),
                              text)
        except OSError:
            continue
    return "not written: no folder takes it"


def output_problem(output: Path) -> str | None:
    """Why ``--output`` cannot take a run (made if missing), in one line; None when it can."""
    from elasticrl.files import disk_problem

    if output.exists() and not output.is_dir():
        return f"--output {output} is a file; give a folder (made if missing)"
    try:
        output.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=output, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what, fix = disk_problem(exc) or (exc.strerror or str(exc), "give another --output")
        return f"--output {output}: {what}; {fix}"
    return None


def _remove_what_a_failed_run_began(output: Path) -> None:
    """A run that failed in a folder that was empty leaves no spec.yaml and no empty metrics
    file there (nothing that looks like a run); the folder goes too when nothing else is left."""
    for name in (rf.SPEC, rf.METRICS):
        path = output / name
        if path.is_file() and (name == rf.SPEC or path.stat().st_size == 0):
            path.unlink()
    try:
        output.rmdir()  # only when empty
    except OSError:
        pass


def localhost_only() -> None:
    """A run of its own Ray on one machine listens on 127.0.0.1 only: every Ray server, agent
    and metrics endpoint binds where Ray's node address is, and Ray takes the loopback one
    when its flag for one-machine clusters is off (read once, when Ray is first imported). It
    takes token authentication, Ray's default for a new local cluster, asked for by name: Ray
    then says nothing of it (left to its default, it prints a notice on every run)."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    for name in ("DeepSpeed", "deepspeed", "ray", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
