"""``elasticrl launch`` and friends: from a spec (and a plan) to a TorchX app, and back.

The app roles after the head are the job's placement groups of model roles, sized by
``elasticrl.plan.apps``: from the planner when GPUs are given (``--gpus``/``--gpu-mem``/
``--nodes``), else in CPUs from the spec (``--role-nodes NAME=N`` spreads one over N nodes).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components import LOST_S
from elasticrl import run_folder as rf

SCHEDULERS = ("local_cwd", "slurm", "kubernetes")
REACH = {"slurm": "check that Slurm answers on this machine (sinfo), or launch with --scheduler local_cwd",
         "kubernetes": "check that this machine reaches the cluster (kubectl get pods, with the same kube config)",
         "local_cwd": "check the launch folder"}


class SchedulerError(ValueError):
    """A scheduler that did not do what was asked (its command failed or is missing, no cluster
    configured, no such app): the CLI prints it as one line, as it does bad input."""


@contextlib.contextmanager
def scheduler_calls(handle: str):
    """TorchX calls to the scheduler of ``handle`` (or of that scheduler's name) inside the
    block: their failures become one SchedulerError line, not a trace."""
    from torchx.specs.api import UnknownAppException

    scheduler = handle.partition("://")[0]
    try:
        yield
    except subprocess.CalledProcessError as exc:  # sbatch, sacct, scancel: what they said is on stderr, above
        cmd = shlex.join(map(str, exc.cmd)) if isinstance(exc.cmd, (list, tuple)) else str(exc.cmd)
        raise SchedulerError(f"{scheduler}: `{cmd}` ended with exit status {exc.returncode} (its message is "
                             f"above); {REACH[scheduler]}") from None
    except FileNotFoundError as exc:  # a command (sbatch) or a file (a log) that is not there
        where = "not found" if os.sep in str(exc.filename) else "is not on this machine's PATH"
        raise SchedulerError(f"{scheduler}: {exc.filename} {where}; {REACH[scheduler]}") from None
    except UnknownAppException:
        raise SchedulerError(f"{handle}: no such app" + (" (a local_cwd app lives only as long as the elasticrl "
                                                         "launch that started it)" if scheduler == "local_cwd" else "")
                             ) from None
    except Exception as exc:  # noqa: BLE001 - the kubernetes client's errors (no config, no host, API) share no base
        if scheduler != "kubernetes":
            raise
        raise SchedulerError(f"kubernetes: {type(exc).__name__}: {exc}; {REACH[scheduler]}") from None


def parse_cfg(text: str | None) -> dict[str, str]:
    """``--cfg k=v,k2=v2`` as TorchX takes scheduler options."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--cfg {item!r}: expected KEY=VALUE (e.g. partition=debug,time=30)")
        out[key.strip()] = value.strip()
    return out


def parse_role_nodes(items: list[str] | None) -> dict[str, int]:
    """``--role-nodes NAME=N`` items as {name: nodes}."""
    out = {}
    for item in items or []:
        name, sep, n = item.partition("=")
        if not sep or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--role-nodes {item!r}: expected NAME=N, N >= 1 (e.g. actor=2)")
        out[name.strip()] = int(n)
    return out


def parse_replica(text: str) -> tuple[str, int]:
    """``ROLE[/N]`` as (role, replica)."""
    name, _, n = text.partition("/")
    if not name or (n and not n.isdigit()):
        raise ValueError(f"{text!r}: expected ROLE or ROLE/N (e.g. head, actor/1)")
    return name, int(n or 0)


def build_app(spec_path: str, output: str, sets: list[str], apps: list, scheduler: str, image: str | None,
              max_restarts: int = 0, lost_s: int = LOST_S):
    """The TorchX app of a job whose app roles are ``apps`` (``plan.apps.app_role_sizes``)."""
    from components.elasticrl import job

    python = "python" if scheduler == "kubernetes" else sys.executable
    image = image or ("ghcr.io/elasticrl/elasticrl:latest" if scheduler == "kubernetes" else os.getcwd())
    roles = ",".join(f"{a.name}={a.nodes}:{a.cpus}:{a.gpus}:{a.mem_gb}" for a in apps)
    return job(spec=spec_path, roles=roles, output=output, sets=shlex.join(sets), image=image, python=python,
               max_restarts=max_restarts, lost_s=lost_s)


def running_attempt(handle: str) -> str:
    """The app id of the running attempt of Slurm app ``handle``, as its head published its
    address in this folder (``ID.RESTARTS``); raises ValueError when there is none."""
    scheduler, _, job_id = _split(handle)
    if scheduler != "slurm":
        raise ValueError(f"--join: only a Slurm app takes nodes while it runs, got {handle} (a local_cwd job's "
                         "engines go on its own nodes: leave --join out)")
    attempts = sorted(Path(".elasticrl").glob(f"ray-address-{job_id}.*"), key=lambda f: int(f.suffix[1:] or 0))
    if not attempts:
        raise ValueError(f"--join: no running head of {handle} published its address in {Path('.elasticrl').resolve()}"
                         "; run this in the folder elasticrl launch ran in, while the job runs")
    return attempts[-1].name.removeprefix("ray-address-")


def join_node(app_id: str, output: str, role: str, engines: int, gpus: int, cfg: dict) -> str:
    """Submit one node of app role ``role`` into the running Slurm app attempt ``app_id`` of the
    job in ``output``: for ``engines`` more rollout engines, or room for another app role's
    ranks (its CPUs as ``elasticrl.plan.apps`` sizes a node of it), or ``gpus``. It joins the
    app's Ray through the address and token its head published in this folder. Returns its
    handle."""
    from components.elasticrl import node
    from elasticrl.plan.apps import CPUS_PER_GPU
    from elasticrl.plan.roles import app_role_cpus, app_roles
    from elasticrl.trainers.loop import job_spec

    spec = job_spec(Path(output))
    if role not in app_roles(spec):
        raise ValueError(f"--role {role}: this job's app roles are {', '.join(app_roles(spec))}")
    if gpus:
        cpus = CPUS_PER_GPU * gpus
    else:
        cpus = engines * spec.rollout.cpus_per_engine if role == "rollout" else app_role_cpus(spec)[role]
    app = node(app_id, role, cpus, gpus, output=output, image=os.getcwd(), python=sys.executable)
    with scheduler_calls("slurm"):
        return runner().schedule(dryrun(app, "slurm", cfg))


def resumable_step(output: str) -> int | None:
    """The step a restarted job of ``output`` resumes from (its newest checkpoint), if any."""
    from elasticrl.engine.checkpoint import list_checkpoints

    found = list_checkpoints(Path(output) / rf.CHECKPOINTS)
    return found[-1][0] if found else None


def finished_since(output: str, t0: float) -> bool:
    """Whether the job of ``output`` finished (its driver wrote ``finished.json``) after ``t0``:
    an app that failed because a pool node was lost may still have finished the job."""

    path = Path(output) / rf.FINISHED
    return path.is_file() and path.stat().st_mtime >= t0


def slurm_restarts(job_id: str) -> int | None:
    """How many times Slurm requeued the job (``scontrol show job``), None when it does not say."""
    try:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bRestarts=(\d+)", out)
    return int(m.group(1)) if m else None


def _told(handle: str, restarts: int | None) -> str:
    """What the head's log tells of a Slurm job's failures: the restart and the step it
    resumed from, rollout engines lost, trainer recoveries, frozen roles re-formed ('' when nothing)."""

    # the file itself (TorchX's log reader waits for a running job to end)
    log = Path(f"slurm-{_split(handle)[2]}-head-0.err")  # Slurm writes it where launch ran
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:  # no log (yet), or status asked from another directory: say nothing
        return ""
    out = ""
    if restarts:
        said = [ln for ln in lines if rf.RESUMING in ln]
        m = re.search(r"\((step \d+)\)", said[-1]) if said else None
        out += f"; restarted {restarts} time(s)" + (f", resumed from {m.group(1)}" if m else "")
    engines = sum(bool(re.search(r"rollout engine \d+ (died|stopped answering)", ln)) for ln in lines)
    trainers = sum("; recovered in " in ln for ln in lines)
    frozen = collections.Counter(m.group(1) for ln in lines  # trainers.rl_run.score_again_after_frozen_loss's
                                 if (m := re.match(r"(\w+) re-formed on .+ in [\d.]+ s; scoring step ", ln)))
    if engines:
        out += f"; {engines} rollout engine(s) lost"
    if trainers:
        out += f"; trainer re-formed {trainers} time(s)"
    return out + "".join(f"; {role} re-formed {n} time(s)" for role, n in sorted(frozen.items()))


def describe_app(app) -> str:
    """The AppDef as text: roles in order, their replicas, resources, command and environment."""
    lines = [f"app: {app.name}"]
    for r in app.roles:
        res = r.resource
        lines += [f"role {r.name}: {r.num_replicas} replica(s), cpu {res.cpu}, gpu {res.gpu}, memMB {res.memMB}",
                  f"  image: {r.image}", f"  command: {r.entrypoint} {' '.join(r.args)}",
                  f"  env: {' '.join(f'{k}={v}' for k, v in sorted(r.env.items()))}"]
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def runner():
    """One TorchX runner per process: local_cwd apps live in its scheduler's memory."""
    from torchx.runner import get_runner

    return get_runner()


def dryrun(app, scheduler: str, cfg: dict):
    # TorchX's Slurm request runs `sinfo`, for the partition's memory
    with _stderr_lines() if scheduler == "slurm" else contextlib.nullcontext([]) as said:
        info = runner().dryrun(app, scheduler, cfg=_with_defaults(scheduler, cfg))
    if said:
        print(f"note: {said[-1].strip()} (TorchX asked sinfo for the partition's memory; the request asks "
              "each app role for its memory regardless)", file=sys.stderr)
    if scheduler == "slurm":  # a lost node is its app role's loss, which the driver recovers from:
        for replica in info.request.replicas.values():
            replica.srun_opts.pop("kill-on-bad-exit", None)  # its task's end does not end the others',
            replica.srun_opts.pop("wait", None)              # nor a minute later,
            replica.sbatch_opts["no-kill"] = None            # nor does Slurm end the job when a node fails
    return info


@contextlib.contextmanager
def _stderr_lines():
    """What child processes write to stderr during the block, as lines in the list yielded
    (filled when the block ends), instead of on the terminal."""
    lines: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += [ln for ln in tmp.read().decode(errors="replace").splitlines() if ln.strip()]


def _with_defaults(scheduler: str, cfg: dict) -> dict:
    if scheduler == "kubernetes":
        return {"queue": "default", **cfg}
    return cfg


def slurm_state(job_id: str) -> str | None:
    """The job's state from sacct, for what TorchX 0.7.0 cannot parse ('CANCELLED by 0')."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0] if out else None


def slurm_nodes(job_id: str) -> str:
    """Each hetjob component's app role replica, node and state, from sacct ('' when it does not
    say): ``head-0 on n1 RUNNING, actor-0 on n2 RUNNING, ...``."""
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobName,NodeList,State", "-j", job_id],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    rows = [ln.split("|") for ln in out.splitlines() if ln.count("|") == 2]
    return ", ".join(f"{name} on {node} {state.split()[0]}" for name, node, state in rows if state)


def status(handle: str) -> tuple[str, str]:
    """(state, detail) of an app; ``detail`` names the app roles' replicas (on Slurm their nodes)
    and their states where known. An app the scheduler does not know is a SchedulerError."""
    from torchx.specs.api import UnknownAppException

    scheduler, _, app_id = _split(handle)
    try:
        with scheduler_calls(handle):
            st = runner().status(handle)
            if st is None:
                raise UnknownAppException(handle)
    except AssertionError:  # torchx 0.7.0 on states such as 'CANCELLED by 0'
        state = slurm_state(app_id) if scheduler == "slurm" else None
        return (state.split()[0] if state else "UNKNOWN"), ""
    if scheduler == "slurm":
        roles = slurm_nodes(app_id) + _told(handle, slurm_restarts(app_id))
    else:
        roles = ", ".join(f"{r.role}: " + " ".join(str(x.state).split(".")[-1] for x in r.replicas)
                          for r in st.roles)
    return str(st.state).split(".")[-1], roles


def _split(handle: str) -> tuple[str, str, str]:
    """``scheduler://session/app_id`` -> its parts."""
    scheduler, _, rest = handle.partition("://")
    session, _, app_id = rest.partition("/")
    if not scheduler or not app_id or (scheduler == "kubernetes" and ":" not in app_id):
        raise ValueError(f"{handle!r} is not an app handle; expected SCHEDULER://SESSION/APP_ID (kubernetes: "
                         "APP_ID is NAMESPACE:NAME), as printed by elasticrl launch")
    return scheduler, session, app_id


def log_lines(handle: str, role: str = "head", replica: int = 0, tail: bool = False):
    from torchx.schedulers.api import Stream

    scheduler, _, _ = _split(handle)
    streams = Stream.STDERR if scheduler == "slurm" else Stream.COMBINED
    with scheduler_calls(handle):
        yield from runner().log_lines(handle, role, replica, should_tail=tail, streams=streams)


def cancel(handle: str) -> None:
    _split(handle)
    with scheduler_calls(handle):
        runner().cancel(handle)


def wait(handle: str):
    with scheduler_calls(handle):
        return runner().wait(handle, wait_interval=2)


def run_app(app, scheduler: str, cfg: dict, output: str, detach: bool, max_restarts: int, say, log) -> str:
    """Submit ``app``, then, unless ``detach``, stream its head's log (``log(line)``) until it
    ends; a failed local_cwd app is submitted again, up to ``max_restarts`` times, and resumes
    from its newest checkpoint (Slurm requeues a failed job itself: TorchX's retries).
    ``say(line)`` tells the handle and each restart. Returns the final state (SUCCEEDED, or
    the state with where to look), SUBMITTED when detached, INTERRUPTED after Ctrl-C."""
    restarts = 0
    while True:
        started = time.time()
        with scheduler_calls(scheduler):
            handle = runner().schedule(dryrun(app, scheduler, cfg))
        say(f"app handle: {handle}")
        if detach:
            return "SUBMITTED"
        try:
            state = follow(handle, say, log)
        except _interrupts():
            return _interrupted(handle, scheduler, say)
        if state == "FAILED" and finished_since(output, started):  # the driver went on without it
            say(f"{handle}: the job finished; a node failed during it (see elasticrl logs {handle} ROLE)")
            state = "SUCCEEDED"
        if state == "SUCCEEDED" or scheduler != "local_cwd" or restarts >= max_restarts:
            return state if state == "SUCCEEDED" else f"{state}; see elasticrl logs {handle} ROLE"
        restarts += 1
        step = resumable_step(output)
        say(f"{handle}: {state}; restart {restarts} of {max_restarts}, "
            + (f"resuming from step {step}" if step is not None else "from the start (no checkpoint yet)"))


def _interrupts() -> tuple:
    """What Ctrl-C or SIGTERM raises in this process: KeyboardInterrupt, or TorchX's
    SignalException once its local scheduler has put in its handler."""
    from torchx.schedulers.local_scheduler import SignalException

    return KeyboardInterrupt, SignalException


def _interrupted(handle: str, scheduler: str, say) -> str:
    """Ctrl-C while following ``handle``: a local_cwd app, which cannot outlive this command, is
    stopped (its nodes end their Ray and remove their folders); a Slurm or Kubernetes job goes on."""
    if scheduler == "local_cwd":
        say(f"{handle}: interrupted; stopping the app")
        cancel(handle)
    else:
        say(f"{handle}: interrupted; the job goes on (elasticrl logs {handle}; elasticrl cancel {handle})")
    return "INTERRUPTED"


def follow(handle: str, say, log) -> str:
    """Stream the head's log until the app ends; its final state."""
    try:
        for line in log_lines(handle, "head", tail=True):
            log(line.rstrip("\n"))
    except _interrupts():
        raise
    except Exception as exc:  # noqa: BLE001 - the log may vanish with the app; the state below decides
        log(f"(log stream ended: {exc})")
    final = wait(handle)
    state = str(final.state).split(".")[-1] if final else "UNKNOWN"  # the scheduler forgot it
    say(f"{handle}: {state}")
    return state
