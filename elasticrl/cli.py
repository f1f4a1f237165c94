"""``elasticrl``: the command line (typer). Nothing imports this module; what a command does
lives in the package (``driver.run_spec`` runs a job, ``launch.submit`` launches one)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from components import LOST_S
from components import OUTPUT as LAUNCH_OUTPUT

# rich_markup_mode=None: click's plain help, which rewraps each paragraph and reads no markup
# (with rich's, `ROLE[/N]` in a help text ended `elasticrl --help` in a MarkupError)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="RL alignment of language models, one job spec from a workstation to a cluster.")


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def run(
    spec: Path = typer.Argument(..., help="Job spec (YAML). See examples/ and `elasticrl spec`."),
    output: Path = typer.Option(..., "--output", "-o", help="Folder for metrics, checkpoints and the final model."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set train.lr=3e-4 (repeatable)."),
):
    """Run a job on this machine (a private Ray starts and stops with it)."""
    from elasticrl.driver import run_spec

    code = run_spec(spec, output, set_ or [])
    if code in (130, 143):
        # Interrupted or terminated: the run has shut its Ray down and swept what it started.
        # Python's own finalisation is skipped: with Ray stopped mid-start, its C++ threads
        # crashed it (SIGSEGV after "error: interrupted") in 1 of ~10 interrupts here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)


@app.command("spec")
def spec_reference(
    path: Optional[Path] = typer.Argument(None, help="Validate this spec and print it resolved."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the reference as a Markdown table."),
):
    """Print every spec field with its default and meaning, or a spec resolved."""
    from elasticrl.spec import SpecError, describe, load_spec, spec_to_dict

    if path is None:
        for field, default, doc in describe():
            typer.echo(f"| `{field}` | `{default}` | {doc} |" if markdown else f"{field:34} {default:10} {doc}")
        return
    try:
        import yaml

        typer.echo(yaml.safe_dump(spec_to_dict(load_spec(path, set_ or [])), sort_keys=False), nl=False)
    except SpecError as exc:
        _fail(str(exc), 2)


@app.command()
def doctor(
    spec: Optional[Path] = typer.Argument(None, help="Job spec (YAML) to check as well as the machine."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where the job will write (default "
                                          "runs/ALGORITHM)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
):
    """Check the machine (and a job) before a long run: packages, device, a collective, ports;
    with a spec also its model, data, output folder, shared memory and memory fit."""
    from elasticrl.doctor import report, run_checks
    from elasticrl.spec import SpecError, load_spec

    try:
        job = load_spec(spec, set_ or [], check_paths=False) if spec else None
    except SpecError as exc:
        _fail(str(exc), 2)
    found = run_checks(job, output)
    typer.echo(report(found))
    failed = [f.check for f in found if f.status == "fail"]
    if failed:
        _fail(f"{len(failed)} check(s) failed: {', '.join(failed)}", 1)


@app.command()
def launch(
    spec: Path = typer.Argument(..., help="Job spec (YAML), relative to the job's working directory."),
    scheduler: str = typer.Option("local_cwd", "--scheduler", "-s", help="local_cwd, slurm or kubernetes."),
    output: str = typer.Option(LAUNCH_OUTPUT, "--output", "-o", help="The job's output folder."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
    cfg: Optional[str] = typer.Option(None, "--cfg", help="Scheduler options: partition=debug,time=30,..."),
    dryrun: bool = typer.Option(False, "--dryrun", help="Print the app and the scheduler's request; submit nothing."),
    gpus: int = typer.Option(0, "--gpus", help="GPUs to plan for (with --gpu-mem); 0: size pools in CPUs."),
    gpu_mem: float = typer.Option(0, "--gpu-mem", help="Memory of one GPU, GB."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes the GPUs are spread over."),
    host_mem: Optional[float] = typer.Option(None, "--host-mem", help="Host memory per node, GB, checked by the plan "
                                             "(local_cwd: this machine's by default)."),
    role_nodes: Optional[List[str]] = typer.Option(None, "--role-nodes", help="Without --gpus: NAME=N spreads app "
                                                   "role NAME's CPUs over N nodes (repeatable; default 1 each)."),
    image: Optional[str] = typer.Option(None, "--image", help="Working dir (local_cwd, slurm) or container image."),
    detach: bool = typer.Option(False, "--detach", help="Return after submitting (not for local_cwd)."),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0,
                                     help="Restart the job when its driver or a node dies, up to N times; it resumes "
                                          "from its newest checkpoint (set checkpoint.every_steps)."),
    lost_s: int = typer.Option(LOST_S, "--lost-s", min=1, help="Seconds a node waits for a head that stopped answering "
                                                           "before it fails (then the app fails and can restart)."),
):
    """Launch a job through TorchX: a Ray head plus one app role per placement group of model roles
    (actor, critic, reference, reward, rollout; colocated ones joined), on local processes,
    Slurm or Kubernetes.

    Prints the plan, the app roles and the app handle, then streams the head's log until the job ends; the
    exit code is the job's. `elasticrl status|logs|cancel HANDLE` work from another shell
    (Slurm; local_cwd apps live only as long as this command). With --max-restarts, Slurm
    requeues a failed job itself; on local_cwd this command submits it again."""
    from elasticrl.plan import Inventory, PlanError, plan_job, render
    from elasticrl.plan.apps import app_role_sizes, render_apps
    from elasticrl.spec import SpecError, explicit_fields, load_spec, read_raw
    from launch import submit

    if scheduler not in submit.SCHEDULERS:
        _fail(f"--scheduler: expected one of {', '.join(submit.SCHEDULERS)}, got {scheduler!r}", 2)
    if detach and scheduler == "local_cwd":
        _fail("--detach: local_cwd apps end with the command that launched them; use slurm or kubernetes", 2)
    sets = list(set_ or [])
    try:
        spread = submit.parse_role_nodes(role_nodes)
        raw = read_raw(spec, sets)
        job = load_spec(raw, check_paths=scheduler == "local_cwd")
        plan = None
        if gpus:
            if host_mem is None and scheduler == "local_cwd":
                from elasticrl.plan.cpu import available_gb

                host_mem = available_gb("MemTotal")
            plan = plan_job(job, Inventory(gpus, gpu_mem, nodes, host_mem), explicit_fields(raw))
            typer.echo(render(plan))
            sets += plan.overrides()
            job = load_spec(read_raw(spec, sets), check_paths=False)  # as planned
        apps = app_role_sizes(job, plan, spread)
        app_def = submit.build_app(str(spec), output, sets, apps, scheduler, image, max_restarts, lost_s)
        described = submit.describe_app(app_def)  # before TorchX adds its scheduler's variables
        info = submit.dryrun(app_def, scheduler, submit.parse_cfg(cfg))
    except (SpecError, PlanError, ValueError) as exc:
        _fail(f"{spec}: {exc}", 2)
    typer.echo(render_apps(apps))
    if dryrun:
        typer.echo(described)
        typer.echo(f"--- {scheduler} request ---")
        typer.echo(str(info))
        return
    try:
        state = submit.run_app(app_def, scheduler, submit.parse_cfg(cfg), output, detach, max_restarts, typer.echo,
                               lambda line: typer.echo(line, err=True))
    except submit.SchedulerError as exc:
        _fail(str(exc), 1)
    if state == "INTERRUPTED":
        _fail("interrupted", 130)
    if state not in ("SUCCEEDED", "SUBMITTED"):
        _fail(f"the job ended {state}, and {output}/logs", 1)


@app.command()
def status(handle: str = typer.Argument(..., help="The app handle printed by elasticrl launch.")):
    """Show an app's state (and its replicas' where the scheduler tells)."""
    from launch import submit

    try:
        state, detail = submit.status(handle)
    except ValueError as exc:
        _fail(str(exc), 2)
    typer.echo(f"{handle}: {state}" + (f"  ({detail})" if detail else ""))


@app.command()
def logs(
    handle: str = typer.Argument(..., help="The app handle printed by elasticrl launch."),
    role: str = typer.Argument("head", help="The app role, and which of its nodes: head, actor, rollout/1, ..."),
    tail: bool = typer.Option(False, "--tail", "-f", help="Follow until the app ends."),
):
    """Print one node's log (Slurm: its stderr, where elasticrl logs): ROLE[/N], N from 0."""
    from launch import submit

    try:
        name, replica = submit.parse_replica(role)
        for line in submit.log_lines(handle, name, replica, tail):
            typer.echo(line.rstrip("\n"))
    except ValueError as exc:
        _fail(str(exc), 2)


@app.command()
def cancel(handle: str = typer.Argument(..., help="The app handle printed by elasticrl launch.")):
    """Cancel an app."""
    from launch import submit

    try:
        submit.cancel(handle)
    except ValueError as exc:
        _fail(str(exc), 2)
    typer.echo(f"{handle}: cancel requested")


@app.command()
def scale(
    output: Path = typer.Argument(..., help="The --output folder of a running job (elasticrl run or launch)."),
    engines: Optional[int] = typer.Option(None, "--engines", help="Rollout engines the job should have."),
    join: Optional[str] = typer.Option(None, "--join", help="A running Slurm app's handle: also submit a node that "
                                                            "joins its Ray (run it in the launch folder)."),
    role: str = typer.Option("rollout", "--role", help="With --join: the app role the node serves (rollout: for "
                                                       "the engines added; another: room for that role's ranks, as "
                                                       "after a lost node)."),
    node_gpus: int = typer.Option(0, "--node-gpus", min=0, help="With --join: GPUs of the node (0: CPUs, as many "
                                                                "as the engines added or the app role takes)."),
    cfg: Optional[str] = typer.Option(None, "--cfg", help="With --join: Slurm options of the node's job."),
):
    """Grow or shrink a running job's rollout engines; it applies at the next step boundary
    (new engines serve once started and synced; see rollout/engines in metrics.jsonl). With
    --join, a new node joins a running Slurm app as a node of app role --role: for the engines
    added, or to hold another role's ranks (a re-formed role waits fault.place_timeout_s for it)."""
    from elasticrl.trainers.loop import ask_engines, engines_now
    from launch import submit

    try:
        if role == "rollout" and engines is None:
            raise ValueError("--engines: how many rollout engines the job should have (a rollout node is for more)")
        if role != "rollout" and (engines is not None or not join):
            raise ValueError(f"--role {role}: a node for another app role than rollout joins with --join and "
                             "without --engines")
        have = engines_now(output) if engines is not None else 0
        if join and engines is not None and engines <= have:
            raise ValueError(f"--join: a node is for more engines: ask for more than the {have} the job has")
        attempt = submit.running_attempt(join) if join else None
        if engines is not None:
            ask_engines(output, engines)
        if join:
            handle = submit.join_node(attempt, str(output), role, (engines or 0) - have, node_gpus,
                                      submit.parse_cfg(cfg))
            typer.echo(f"{output}: a node of app role {role} submitted: {handle}")
    except ValueError as exc:
        _fail(str(exc), 2)
    if engines is not None:
        typer.echo(f"{output}: asked for {engines} rollout engine(s); the job applies it at its next step")


@app.command("plan")
def plan_cmd(
    spec: Path = typer.Argument(..., help="Job spec (YAML)."),
    gpus: int = typer.Option(..., "--gpus", help="GPUs in all."),
    gpu_mem: float = typer.Option(..., "--gpu-mem", help="Memory of one GPU, GB."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes the GPUs are spread over (evenly)."),
    host_mem: Optional[float] = typer.Option(None, "--host-mem", help="Host memory per node, GB (checked if given)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override or pin a field (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
):
    """Fit a job's roles to GPUs: ZeRO stage, offload, colocation, vLLM TP and engines, micro-batch.

    Fields the spec sets itself are pinned (checked, not changed). Prints predicted memory per
    GPU and the --set overrides that realise the plan."""
    from elasticrl.plan import Inventory, PlanError, plan_job, render
    from elasticrl.plan.apps import app_role_sizes, render_apps
    from elasticrl.spec import SpecError, explicit_fields, load_spec, read_raw

    try:
        raw = read_raw(spec, set_ or [])
        job = load_spec(raw, check_paths=False)
        plan = plan_job(job, Inventory(gpus, gpu_mem, nodes, host_mem), explicit_fields(raw))
        apps = app_role_sizes(load_spec(read_raw(spec, (set_ or []) + plan.overrides()), check_paths=False), plan)
    except (SpecError, PlanError, ValueError) as exc:
        _fail(f"{spec}: {exc}", 2)
    if as_json:
        typer.echo(json.dumps({"settings": plan.settings, "pinned": plan.pinned, "overrides": plan.overrides(),
                               "peak_gb_per_gpu": {g: round(v["peak"] / 1e9, 2) for g, v in plan.groups.items()},
                               "host_gb": round(plan.host_bytes / 1e9, 1),
                               "app_roles": [a._asdict() for a in apps]}))
        return
    typer.echo(render(plan))
    typer.echo(render_apps(apps))
    typer.echo("run it with: " + " ".join(f"--set {o}" for o in plan.overrides()))


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="A run's --output folder (holds metrics.jsonl).")):
    """Write PNG curves of a run's metrics into RUN_DIR/plots/."""
    from elasticrl.plot import plot_run

    try:
        files = plot_run(run_dir)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc), 2)
    for f in files:
        typer.echo(str(f))


def main() -> None:
    app(prog_name="elasticrl")


if __name__ == "__main__":
    sys.exit(main())
