"""What each TorchX replica of an elasticrl app runs on its node.

  python -m launch.node head   --app-id ID --expect N --spec SPEC --output DIR [--set k=v ...]
  python -m launch.node worker --app-id ID --role NAME

The head starts Ray (its own temp dir, dashboard on localhost), waits until the N-1 worker
nodes have joined, runs the job as a driver of that Ray, then publishes its exit code in
Ray's key-value store and waits for the workers to leave. A worker (one of the app's, or one
that joins it later: ``elasticrl scale --join``) starts a Ray node that
carries its app role as a custom resource (``elasticrl_pool_NAME``) so that the model roles
placed there land on it, and leaves when the head says so, or fails when the head disappears.

Ray's token authentication stays on: the head writes a random token (mode 0600) into the
job folder, which every node of a TorchX app shares (the launch folder on local_cwd and
Slurm); the workers read it from there. Only processes this module started are stopped,
by their process group. The head's Ray listens on a port free when it starts (retried if
another process takes it first) and publishes its address (ip:port) beside the token.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from components import JOIN_TIMEOUT_S, LOST_S, OUTPUT
from elasticrl import run_folder as rf
from elasticrl.files import mark_owner, owned_dir, owner_gone, remove_with_processes, sweep_orphans, write_text
from elasticrl.plan.roles import POOL_PREFIX

DONE_KEY = b"elasticrl:done"
# What this node undoes on SIGTERM (``_terminated``), in order: a head's published files, its
# Ray, its temp folder.
_on_terminate: list = []


def token_file(app_id: str) -> Path:
    return Path(".elasticrl") / f"ray-token-{app_id}"


def owner_file(app_id: str) -> Path:
    """The head's PID and start time, beside its token: a later head removes the files of
    an app whose head was SIGKILLed (``_sweep_dead_heads``)."""
    return Path(".elasticrl") / f"ray-owner-{app_id}"


def _sweep_dead_heads() -> None:
    for owner in Path(".elasticrl").glob("ray-owner-*"):
        if owner_gone(owner):
            app_id = owner.name.removeprefix("ray-owner-")
            for path in (token_file(app_id), address_file(app_id), owner):
                path.unlink(missing_ok=True)


def address_file(app_id: str) -> Path:
    """Where the head publishes its GCS address, ip:port, once Ray is up (beside the token:
    shared storage); the worker nodes read it."""
    return Path(".elasticrl") / f"ray-address-{app_id}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _temp_dir(app_id: str) -> Path:
    """Ray's temp dir (short: its socket paths must fit in 107 bytes)."""
    return Path("/tmp") / f"erl-{zlib.crc32(app_id.encode()):08x}"


def _log(msg: str) -> None:
    print(f"[elasticrl node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _auth_env(app_id: str) -> dict[str, str]:
    """Ray reads these once, when it is first imported: set them before anything imports it."""
    return {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_TOKEN_PATH": str(token_file(app_id).resolve())}


# How soon the head's Ray declares a node lost whose raylet stopped answering: a failed health
# check every second, five in a row (about 5 s; Ray's default, every 3 s, about 15 s). A lost
# node's ranks are re-formed elsewhere only once Ray counts it gone.
NODE_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


def _ray_env(app_id: str) -> dict[str, str]:
    os.environ.update(_auth_env(app_id))
    from elasticrl.cluster.session import worker_env

    env = {**os.environ, **worker_env(), **NODE_HEALTH}
    # TorchX's local_cwd sets PATH to the working directory alone; compilers (DeepSpeed's
    # JIT-built ops) and the system tools must stay reachable.
    env["PATH"] = os.pathsep.join(dict.fromkeys(env["PATH"].split(os.pathsep) + ["/usr/local/bin", "/usr/bin", "/bin"]))
    return env


def _start_ray(args: list[str], app_id: str, log_path: Path) -> subprocess.Popen:
    """``ray start ... --block`` in a process group of its own (stopped as a whole later). If
    this process dies without stopping it (SIGKILL, a crash), the kernel sends it SIGTERM, on
    which ``--block`` stops the Ray it started: a dead head takes its Ray with it, so the other
    nodes see it gone and the app fails (and can be restarted) instead of hanging."""
    ray = str(Path(sys.executable).parent / "ray")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    return subprocess.Popen([ray, "start", *args, "--block", "--disable-usage-stats"], env=_ray_env(app_id),
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """TERM the ``ray start`` process, which stops its node's processes in order (the raylet,
    which leaves the cluster, then the GCS and the agents: ~2 s; TERMed all at once they wait
    on each other for half a minute), then KILL what is left of the process group we created
    (Slurm gives a cancelled step only KillWait seconds before it kills us)."""
    proc.send_signal(signal.SIGTERM)  # nothing once it has been reaped
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass


def _gcs_get(address: str, key: bytes, timeout_s: float = 10.0):
    """A value of Ray's key-value store, read in a daemon thread. With the head gone, the GCS
    client blocks ~40 s inside C++, where this process cannot act on SIGTERM; Slurm would kill
    it after KillWait, before it stopped its Ray (the Slurm cancel test caught this)."""
    box: dict = {}

    def read():
        try:
            import ray._raylet

            box["value"] = ray._raylet.GcsClient(address=address).internal_kv_get(key, None)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)  # a signal interrupts this wait
    if reader.is_alive():
        raise TimeoutError(f"no answer from the Ray head at {address} within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _node_ip(host: str | None = None) -> str:
    if host:
        return socket.gethostbyname(host)
    import ray.util

    return ray.util.get_node_ip_address()


def head(ns: argparse.Namespace) -> int:
    os.environ.update(_ray_env(ns.app_id))
    tok = token_file(ns.app_id)
    tok.parent.mkdir(parents=True, exist_ok=True)
    _sweep_dead_heads()
    published = [tok, address_file(ns.app_id), owner_file(ns.app_id)]
    _on_terminate.append(lambda: [path.unlink(missing_ok=True) for path in published])
    mark_owner(owner_file(ns.app_id))
    fd = os.open(tok, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    ip = _node_ip(ns.host)
    sweep_orphans("erl-*")  # what SIGKILLed nodes of earlier apps left
    temp = owned_dir(_temp_dir(ns.app_id))
    log_path = Path(ns.output) / rf.LOGS / "ray-head.log"
    proc, code = None, 1
    _on_terminate.append(lambda: proc is not None and _stop(proc, 1.0))
    _on_terminate.append(lambda: remove_with_processes(temp))
    try:
        import ray

        # A port free a moment ago can be taken before Ray binds it (CI once lost a fixed one):
        # a head whose Ray exits early tries another port.
        for attempt in range(3):
            port = _free_port()
            ray_args = ["--head", "--port", str(port), "--node-ip-address", ip, "--num-cpus", str(ns.cpus),
                        "--num-gpus", str(ns.gpus), "--temp-dir", str(temp / "r"), "--dashboard-host", "127.0.0.1",
                        "--include-dashboard", "false"]
            _log(f"starting Ray head on {ip}:{port}")
            proc = _start_ray(ray_args, ns.app_id, log_path)
            _wait(lambda: proc.poll() is not None or _gcs_up(f"{ip}:{port}"), ns.timeout_s,
                  f"the Ray head did not come up within {ns.timeout_s}s (log: {log_path})")
            if proc.poll() is None:
                break
            _log(f"Ray head exited with code {proc.returncode} (attempt {attempt + 1} of 3): {_tail(log_path, 1)}")
            _stop(proc, 1.0)  # whatever it had started
        else:
            raise RuntimeError(f"the Ray head failed to start 3 times; see {log_path}")
        write_text(address_file(ns.app_id), f"{ip}:{port}")
        ray.init(address=f"{ip}:{port}", logging_level="WARNING")
        signal.signal(signal.SIGTERM, _terminated)  # ray.init installs its own, which skips our cleanup
        _wait(lambda: _alive(ray) >= ns.expect, ns.timeout_s,
              lambda: f"only {_alive(ray)} of {ns.expect} Ray nodes joined within {ns.timeout_s}s; "
                      "see the workers' logs (elasticrl logs HANDLE)")
        _log(f"{ns.expect} Ray node(s) up; running the job")
        code = _run_job(ns)
    except Exception as exc:  # noqa: BLE001 - a failure anywhere: say it once, end non-zero
        _log(f"error: {exc}")
        code = 1
    finally:
        _finish(ns, proc, code)
    return code


def _run_job(ns: argparse.Namespace) -> int:
    """The job, as ``elasticrl run`` runs it, in this process: a driver of the running Ray."""
    from elasticrl.driver import run_spec

    sets = list(ns.set or []) + [base64.urlsafe_b64decode(x).decode() for x in ns.set_b64 or []]
    return run_spec(ns.spec, ns.output, sets)


def _finish(ns, proc, code: int) -> None:
    for path in (token_file(ns.app_id), address_file(ns.app_id), owner_file(ns.app_id)):
        path.unlink(missing_ok=True)
    try:
        import ray

        if ray.is_initialized():
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(DONE_KEY, str(code).encode(), overwrite=True)
            deadline = time.time() + 60
            while _alive(ray) > 1 and time.time() < deadline:  # workers leave on their own
                time.sleep(0.25)
            ray.shutdown()
    finally:
        if proc is not None:
            _stop(proc, 3.0)
        remove_with_processes(_temp_dir(ns.app_id))
        sweep_orphans(f"{_temp_dir(ns.app_id).name}-*")  # the folders of this app's nodes that were lost
        _log(f"done, exit code {code}")


def worker(ns: argparse.Namespace) -> int:
    os.environ.update(_ray_env(ns.app_id))
    published = address_file(ns.app_id)
    try:
        _wait(lambda: token_file(ns.app_id).is_file() and published.is_file(), ns.timeout_s,
              f"the head published no Ray address ({published.resolve()}) within {ns.timeout_s}s")
        address = published.read_text().strip()
        _wait(lambda: _gcs_up(address), ns.timeout_s, f"the head at {address} did not answer within {ns.timeout_s}s")
    except TimeoutError as exc:
        _log(f"error: {exc}")
        return 1
    resources = json.dumps({POOL_PREFIX + ns.role: 1000})
    args = ["--address", address, "--num-cpus", str(ns.cpus), "--num-gpus", str(ns.gpus), "--resources", resources]
    if ns.host:
        args += ["--node-ip-address", _node_ip(ns.host)]
    # Several nodes of one app may share a host (a workstation, a test): a temp dir of its own,
    # or two raylets starting together race for the same socket names.
    sweep_orphans("erl-*")
    temp = owned_dir(f"{_temp_dir(ns.app_id)}-{ns.role}-{os.getpid()}")
    args += ["--temp-dir", str(temp / "r")]  # inside a folder private to the user: Ray opens its own to all
    _log(f"joining the Ray head at {address} as a node of app role {ns.role!r}")
    proc = _start_ray(args, ns.app_id, Path(ns.output) / rf.LOGS / f"ray-{ns.role}-{os.getpid()}.log")
    _on_terminate.extend([lambda: _stop(proc, 1.0), lambda: remove_with_processes(temp)])
    lost_since = None
    try:
        while True:
            time.sleep(1)
            if proc.poll() is not None:
                _log(f"error: the Ray node exited with code {proc.returncode}")
                return 1
            asked = time.time()
            try:  # a short wait per ask: a head gone is seen within --lost-s and one ask more
                done = _gcs_get(address, DONE_KEY, timeout_s=min(10.0, max(2.0, ns.lost_s / 4)))
                lost_since = None
            except Exception:  # noqa: BLE001 - any failure to reach the head counts toward losing it
                lost_since = lost_since or asked  # it has not answered since it was asked
                if time.time() - lost_since > ns.lost_s:
                    _log(f"error: lost the head at {address} for {ns.lost_s}s before it finished")
                    return 1
                continue
            if done is not None:
                _log(f"the head finished (exit code {done.decode()}); leaving")
                return 0
    finally:
        _stop(proc, 3.0)
        remove_with_processes(temp)


def _terminated(signum, _frame):
    """scancel / TorchX cancel: Slurm signals every process of the step, Ray's own too, so a
    graceful teardown would wait on a dying Ray (a head's job teardown outlasted the step's
    KillWait). Undo what this node started, at once, and leave."""
    for undo in _on_terminate:
        try:
            undo()
        except Exception as exc:  # noqa: BLE001 - undo the rest whatever one of them raises
            _log(f"while stopping: {type(exc).__name__}: {exc}")
    _log(f"terminated (signal {signum}); what this node started is stopped")
    os._exit(128 + signum)


def _gcs_up(address: str) -> bool:
    try:
        _gcs_get(address, b"elasticrl:ping")
        return True
    except Exception:  # noqa: BLE001 - any failure: the head is not up yet
        return False


def _alive(ray) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def _wait(cond, timeout_s: float, message) -> None:
    """Until ``cond()``, asked four times a second: the start of a job is a chain of these waits
    (the head's Ray, its address, each node's Ray, all of them joined), each adding up to an ask's
    interval."""
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise TimeoutError(message() if callable(message) else message)
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.node", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kind", required=True)
    for name in ("head", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--app-id", required=True, help="The TorchX app id (all replicas share it).")
        s.add_argument("--cpus", type=int, default=1, help="CPUs this Ray node offers.")
        s.add_argument("--gpus", type=int, default=0, help="GPUs this Ray node offers.")
        s.add_argument("--host", default=None, help="This node's address (default: Ray's guess).")
        s.add_argument("--output", default=OUTPUT, help="The job's output folder (logs go there).")
        s.add_argument("--timeout-s", type=float, default=JOIN_TIMEOUT_S, help="Seconds to wait for the other nodes.")
    h = sub.choices["head"]
    h.add_argument("--expect", type=int, required=True, help="Ray nodes in all, the head included.")
    h.add_argument("--spec", required=True)
    h.add_argument("--set", action="append", help="Spec overrides, as for elasticrl run.")
    h.add_argument("--set-b64", action="append", help="An override, URL-safe base64 (one that a shell would split).")
    w = sub.choices["worker"]
    w.add_argument("--role", required=True, help="The app role this node serves (actor, rollout, critic-reward, ...).")
    w.add_argument("--lost-s", type=float, default=LOST_S, help="Seconds without the head before failing.")
    ns = p.parse_args(argv)
    # A requeued Slurm job keeps its id: the attempt keeps its files (token, address, Ray's temp
    # dir) apart from those a killed attempt left behind, which its nodes would otherwise read.
    # A node joining later is given the attempt's id whole (ID.N).
    if "." not in ns.app_id:
        ns.app_id = f"{ns.app_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"

    signal.signal(signal.SIGTERM, _terminated)
    return head(ns) if ns.kind == "head" else worker(ns)


if __name__ == "__main__":
    sys.exit(main())
