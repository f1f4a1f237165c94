"""`elasticrl launch` through TorchX: golden dry-runs for local_cwd, slurm and kubernetes, and
the tiny GRPO job run for real on local processes and on a real multi-node Slurm (started
on this machine by tests/slurm/cluster.sh; skipped with the reason where it cannot run)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from elasticrl.spec import load_spec
from elasticrl.trainers.warm_start import initial_model
from launch.node import _tail
from tests.conftest import ROOT, run_cli

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
# the warm start of the RL tests (cached once per test session): init.sft_steps, dtype, ranks
SHORT = ["rl.num_steps=3", "eval.every_steps=2", "eval.num_prompts=32", "log.progress_bar=false", "init.sft_steps=60",
         "model.dtype=fp32", "rl.eval_samples=2"]
SLURM_DIR = "/tmp/elasticrl-slurm"


def _sets(items):
    return [x for kv in items for x in ("--set", kv)]


def _normalise(text: str) -> str:
    """Stable text of a dry-run: no machine paths, generated app ids or temp folders."""
    text = text.replace(sys.executable, "<PYTHON>").replace(str(ROOT), "<ROOT>")
    text = re.sub(r"elasticrl-[a-z0-9]{8,}", "elasticrl-<ID>", text)
    text = re.sub(r"/tmp/torchx_[a-z0-9_]+", "/tmp/<TORCHX>", text)
    return "\n".join(ln.rstrip() for ln in text.splitlines() if "Warning" not in ln and "warnings.warn" not in ln)


# a job, its --set items and flags -> the app roles elasticrl launch builds after the head
DRYRUNS = {
    "grpo": (["examples/tiny_grpo.yaml", *_sets(SHORT)], ["actor", "rollout"]),
    "ppo": (["examples/tiny_ppo.yaml", *_sets(["rl.kl_coef=0.01", "init.rm_steps=300"])],
            ["actor", "critic", "reference", "reward", "rollout"]),
    "ppo_pairs": (["examples/tiny_ppo.yaml", *_sets(["rl.kl_coef=0.01", "init.rm_steps=300",
                                                     "placement.colocate=actor_ref+critic_reward"])],
                  ["actor-reference", "critic-reward", "rollout"]),
    "sft": (["examples/tiny_sft.yaml", "--role-nodes", "actor=2"], ["actor"]),
}


@pytest.mark.parametrize("job", DRYRUNS)
@pytest.mark.parametrize("scheduler", ["local_cwd", "slurm", "kubernetes"])
def test_dryrun_prints_one_app_role_per_placement_group_and_the_request(job, scheduler):
    args, roles = DRYRUNS[job]
    proc = run_cli("launch", *args, "--dryrun", "-s", scheduler, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # where sinfo reaches no controller (no Slurm running here yet), one line says so
    assert not re.search(r"^sinfo: ", proc.stderr, re.M) and proc.stderr.count("note: sinfo") <= 1, proc.stderr
    got = _normalise(proc.stdout).rstrip("\n")
    golden = GOLDEN / f"launch_{job}_{scheduler}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(got + "\n")
    assert got == golden.read_text().rstrip("\n"), f"regenerate with UPDATE_GOLDEN=1 if intended: {golden}"
    assert re.findall(r"^role ([\w-]+):", got, re.M) == ["head", *roles]  # the head first
    assert re.findall(r"^  ([\w-]+) +\d+ node", got, re.M) == roles  # the table printed before the app
    # each node joins Ray as its app role's, and the head waits for all of them
    nodes = [int(n) for n in re.findall(r"^role [\w-]+: (\d+) replica", got, re.M)]
    assert f"--expect {sum(nodes)} " in got and all(f"--role {r} " in got for r in roles)


def test_a_planned_gpu_job_asks_each_app_role_for_its_gpus_on_slurm():
    """7B PPO planned on 2 nodes of 8 x 80 GB, the pairs colocated: three app roles with the
    planned GPUs each, and Slurm's hetjob asks for them per task (one task a node)."""
    proc = run_cli("launch", "examples/ppo_7b.yaml", "--dryrun", "-s", "slurm", "--gpus", "16", "--gpu-mem", "80",
                   "--nodes", "2", "--set", "placement.colocate=actor_ref+critic_reward", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = _normalise(proc.stdout).rstrip("\n")
    golden = GOLDEN / "launch_ppo_7b_gpus_slurm.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(got + "\n")
    assert got == golden.read_text().rstrip("\n"), f"regenerate with UPDATE_GOLDEN=1 if intended: {golden}"
    gpus = dict(re.findall(r"^  ([\w-]+) +1 node\(s\) x cpu \d+, gpu (\d+)", got, re.M))
    assert list(gpus) == ["actor-reference", "critic-reward", "rollout"] and sum(map(int, gpus.values())) <= 16
    for role, n in gpus.items():
        assert re.search(rf"--job-name={role}-0 .*--gpus-per-task={n}\b", got), role


def test_launch_refuses_bad_input_in_one_line():
    bad = run_cli("launch", "examples/tiny_grpo.yaml", "-s", "pbs", timeout=120)
    assert bad.returncode == 2 and "--scheduler: expected one of local_cwd, slurm, kubernetes" in bad.stderr
    bad = run_cli("launch", "examples/tiny_grpo.yaml", "--dryrun", "-s", "slurm", "--cfg", "partition", timeout=120)
    assert bad.returncode == 2 and "--cfg 'partition': expected KEY=VALUE" in bad.stderr
    bad = run_cli("launch", "examples/tiny_grpo.yaml", "--dryrun", "--role-nodes", "critic=2", timeout=120)
    assert bad.returncode == 2 and "--role-nodes critic: this job's app roles are actor, rollout" in bad.stderr
    bad = run_cli("status", "not-a-handle", timeout=120)
    assert bad.returncode == 2 and "is not an app handle" in bad.stderr
    bad = run_cli("logs", "slurm://torchx/1", "actor/x", timeout=120)
    assert bad.returncode == 2 and "'actor/x': expected ROLE or ROLE/N" in bad.stderr
    assert "Traceback" not in bad.stderr


def _leftovers(app_dir: Path) -> list[str]:
    """What an app must not leave behind: its nodes' folders (Ray's temp dirs, `launch.node`'s
    /tmp/erl-<8 hex>), its auth token. (Tests on the other pytest worker make folders of other
    names there: a run's erl-ray-*, the sync check's.)"""
    out = [str(p) for p in Path("/tmp").glob("erl-*") if re.fullmatch(r"erl-[0-9a-f]{8}", p.name)]
    out += [str(p) for p in (app_dir / ".elasticrl").glob("*")] if (app_dir / ".elasticrl").is_dir() else []
    return out


def _run(args, cwd, timeout=1200, env=None):
    return subprocess.run([sys.executable, "-m", "elasticrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid``, from /proc."""
    parent, cmd = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out += [(p, cmd[p]) for p in frontier]
    return out


NODE_LOST = SHORT[1:] + ["rl.num_steps=6", "checkpoint.every_steps=2", "eval.every_steps=3"]


class _NodeLoss(threading.Thread):
    """Once ``out``'s run logged step ``after``, SIGKILLs a whole actor node of the app
    that ``launch_pid`` runs: its ``launch.node worker`` and every process below it (its
    Ray node and the actor rank there), as when the machine is gone."""

    def __init__(self, out: Path, launch_pid: int, after: int):
        super().__init__(daemon=True)
        self.out, self.launch_pid, self.after = out, launch_pid, after
        self.at, self.killed = None, []

    def run(self) -> None:
        from tests.integration.faults import logged_step

        deadline = time.time() + 900
        while logged_step(self.out) < self.after and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)  # into the next step
        nodes = [p for p, cmd in _descendants(self.launch_pid)
                 if "launch.node worker" in cmd and "--role actor " in cmd]
        hosting = [p for p in nodes if any(c.startswith("ray::ActorWorker") for _, c in _descendants(p))]
        if hosting:
            tree = [p for p, _ in _descendants(hosting[-1])][::-1] + [hosting[-1]]  # the node's supervisor last
            self.at = time.time()
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.killed = tree


@pytest.mark.slow
def test_local_cwd_launch_goes_on_smaller_without_a_node(tmp_path):
    """The tiny GRPO job on local processes, its two actor ranks on the two nodes of its actor
    app role. L3 on fewer ranks: after step 3 a whole actor node is SIGKILLed (its node process,
    its Ray node and the actor rank there); the driver re-forms the actor on the one rank the
    live nodes hold (the global batch kept by gradient accumulation) from the step-2
    checkpoint and finishes the job, which succeeds. Every step's metrics exactly once, weights
    broadcast across nodes, the policy exported, and nothing left behind. (L0 on local_cwd,
    `launch --max-restarts`: the restart test below; a requeued job resuming: the Slurm test.)"""
    before = set(_leftovers(tmp_path))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "elasticrl.cli", "launch", str(ROOT / "examples/tiny_grpo.yaml"),
                             "--output", str(out), "--lost-s", "10", "--role-nodes", "actor=2", *_sets(NODE_LOST)],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    loss = _NodeLoss(out, proc.pid, after=3)
    loss.start()
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert re.search(r"app handle: local_cwd://\w+/elasticrl-\w+", output)
    assert "4 Ray node(s) up; running the job" in output
    assert loss.killed, "no actor node hosted an actor rank"
    shrunk = re.search(r"actor rank \d (?:died|failed)[^\n]* at step [45]; recovered in ([\d.]+) s from step [24] "
                       r"\(the newest checkpoint\) on 1 rank\(s\)", output)
    assert shrunk and "re-forming actor on 1 rank(s)" in output, output[-4000:]
    assert "the job finished; a node failed during it" in output
    print(f"an actor node lost: {shrunk.group(0)}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))  # once each, none lost
    steps = [r for r in rows if r["step"] > 0]
    # engines on the rollout app role's node, trainers on the actor's: weights cross nodes;
    # the version goes on from the checkpoint's
    assert [r["sync/version"] for r in steps] == [1, 2, 3, 4, 5, 6] and steps[0]["sync/transport"] == "broadcast"
    for row in steps:
        assert row["sync/gbytes"] > 0 and row["rl/staleness"] == 0 and row["time/rollout"] > 0
        # the sync as the driver waited for it, and as the sending ranks measured it (within it)
        assert row["time/sync"] >= row["sync/seconds"] > 0
        # the verifier (weight 1) is the only reward: its mean is the batch accuracy
        assert row["reward/mean"] == pytest.approx(row["accuracy"], abs=1e-6)
        assert math.isfinite(row["policy_loss"])
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3, 6] and "eval/pass@2" in steps[-1]
    assert {"eval.png", "reward.png", "time.png", "sync.png"} <= {p.name for p in (out / "plots").glob("*.png")}
    # the trained policy is what was exported, and it moved away from the start
    start = load_file(os.path.join(initial_model(load_spec(ROOT / "examples/tiny_grpo.yaml", NODE_LOST)),
                                   "model.safetensors"))
    final = load_file(out / "final" / "model.safetensors")
    assert start.keys() == final.keys() and any(not start[k].equal(final[k]) for k in start)
    assert set(_leftovers(tmp_path)) <= before


@pytest.mark.slow
def test_a_failing_job_ends_the_whole_app_non_zero(tmp_path):
    # a reward function that does not import: the driver fails after every node joined
    before = set(_leftovers(tmp_path))
    out = tmp_path / "run"
    proc = _run(["launch", str(ROOT / "examples/tiny_grpo.yaml"), "--output", str(out), *_sets(
        SHORT + ["rewards.functions=[{path: 'no_such_module:score'}]"])], tmp_path, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "3 Ray node(s) up; running the job" in proc.stderr
    assert "rewards.functions[0].path: cannot import 'no_such_module:score'" in proc.stderr
    assert "the job ended FAILED" in proc.stderr
    assert set(_leftovers(tmp_path)) <= before  # every node stopped what it started


def test_a_failed_local_cwd_app_is_submitted_again_up_to_max_restarts(tmp_path):
    """L0 on local_cwd (`launch --max-restarts N`): `launch.submit.run_app`, TorchX's real
    local_cwd scheduler, an app whose head fails each attempt: submitted again twice, each
    restart saying the step the job resumes from (its output's newest checkpoint), then
    FAILED. (A job resuming there: the Slurm test's requeued job, the driver's same path.)"""
    from torchx import specs

    from elasticrl.engine.checkpoint import STATE_FILE
    from launch import submit

    out = tmp_path / "run"
    (out / "checkpoints" / "step_0000004").mkdir(parents=True)
    (out / "checkpoints" / "step_0000004" / STATE_FILE).write_text("{}")
    head = specs.Role("head", image=str(tmp_path), entrypoint=sys.executable,
                      args=["-c", "import sys; print('attempt', file=sys.stderr); sys.exit(3)"],
                      resource=specs.Resource(cpu=1, gpu=0, memMB=256))
    said, logged = [], []
    state = submit.run_app(specs.AppDef("fails", roles=[head]), "local_cwd", {}, str(out), False, 2, said.append,
                           logged.append)
    assert state.startswith("FAILED; see elasticrl logs local_cwd://"), state
    assert logged.count("attempt") == 3, logged  # the first and two more
    restarts = [ln.split(": ", 1)[1] for ln in said if "restart" in ln]
    assert restarts == ["FAILED; restart 1 of 2, resuming from step 4", "FAILED; restart 2 of 2, resuming from step 4"]


def test_ctrl_c_while_following_a_local_cwd_app_stops_it(tmp_path):
    """Ctrl-C (SIGINT to this process, where TorchX's local scheduler put its handler) while
    `launch` follows a local_cwd app: the app, which cannot outlive the command, is stopped
    and run_app answers INTERRUPTED (the CLI's exit 130); before, the first Ctrl-C only ended
    the log stream and the command went on waiting for the job."""
    import signal

    from torchx import specs

    from elasticrl.files import started
    from launch import submit

    head = specs.Role("head", image=str(tmp_path), entrypoint=sys.executable,
                      args=["-c", "import os, sys, time; print('pid', os.getpid(), file=sys.stderr, flush=True); "
                                  "time.sleep(120)"],
                      resource=specs.Resource(cpu=1, gpu=0, memMB=256))
    said, pids = [], []

    def log(line: str) -> None:
        if line.startswith("pid "):
            pids.append(int(line.split()[1]))
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        state = submit.run_app(specs.AppDef("sleeps", roles=[head]), "local_cwd", {}, str(tmp_path / "run"), False,
                               0, said.append, log)
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert state == "INTERRUPTED" and said[-1].endswith(": interrupted; stopping the app"), said
    assert len(pids) == 1 and started(pids[0]) is None  # the head's process is gone


@pytest.fixture(scope="module")
def slurm():
    """A real Slurm of 8 nodes on this machine, for this module's Slurm tests."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (daemons, /etc/hosts); run the tests as root to include it")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("Slurm is not installed and cannot be (no apt-get)")
    script = ROOT / "tests" / "slurm" / "cluster.sh"
    start = subprocess.run(["bash", str(script), "start", SLURM_DIR], capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        pytest.skip(f"could not start a local Slurm: {start.stderr.strip().splitlines()[-1:]}")
    yield {"SLURM_CONF": f"{SLURM_DIR}/etc/slurm.conf"}
    subprocess.run(["bash", str(script), "stop", SLURM_DIR], capture_output=True, text=True, timeout=300)


def _wait_for_start(handle: str, tmp_path: Path) -> None:
    deadline = time.time() + 300
    head_log = tmp_path / f"slurm-{handle.rsplit('/', 1)[1]}-head-0.err"
    while not (head_log.is_file() and "running the job" in head_log.read_text()):
        assert time.time() < deadline, "the job never started: " + (head_log.read_text()[-2000:] if head_log.is_file()
                                                                    else "no head log")
        time.sleep(2)


def _head_log(handle: str, tmp_path: Path) -> str:
    log = tmp_path / f"slurm-{handle.rsplit('/', 1)[1]}-head-0.err"
    return log.read_text(errors="replace") if log.is_file() else ""


def _until(what: str, check, timeout_s: float, every_s: float = 1.0):
    """``check()`` once it is truthy, polled every ``every_s``; fails naming ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while not (found := check()):
        assert time.time() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(every_s)
    return found


def _node_workers(tmp_path: Path) -> list[tuple[str, int, str]]:
    """(app role, PID, Slurm node) of this test's running `launch.node worker` processes (the
    node from the environment Slurm gave the process)."""
    out = []
    for pid, cmd in _descendants(1):
        if cmd.startswith(sys.executable + " -m launch.node worker") and str(tmp_path) in cmd:
            with contextlib.suppress(OSError):
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                           if "=" in kv)
                out.append((re.search(r"--role (\S+)", cmd).group(1), pid, env["SLURMD_NODENAME"]))
    return out


STEPS = 11  # the Slurm PPO job's: its events take about the first 6-8 (the head killed before step 9)
# each app role's Ray actors, by the class Ray names their processes after
ROLE_ACTORS = {"actor": ["ActorWorker"], "critic": ["CriticWorker"], "reference": ["FrozenWorker"],
               "reward": ["FrozenWorker"], "rollout": ["RolloutEngine"]}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # its setup and the job: 373 s beside the other worker's tests (600 s is the default)
def test_slurm_ppo_runs_each_model_role_on_its_own_nodes_and_survives_a_lost_reward_node_and_head(
        tmp_path, slurm, ppo_in_pairs):
    """tiny_ppo.yaml with its four model roles and the engine as five app roles, each on its own
    Slurm node (and the head on a sixth), driven from other shells (status, sacct, scale, cancel):
    1. each model role's Ray actors run below the node process of its own app role, on that
       app role's Slurm node (by PID and node);
    2. the reward role's node is lost whole (every process of it SIGKILLed); `elasticrl scale
       --join HANDLE --role reward` brings a node of that app role (a Slurm job of its own),
       the driver builds the reward model again there and scores the step again; the actor,
       critic and engine processes are the same ones (a second engine joined: `elasticrl
       scale --engines 2 --join HANDLE` as the job started brought a rollout node, whose engine
       serves), and steps 1-3 repeat the `run_job` of the same spec (its roles in pairs, in
       one Ray: `ppo_in_pairs`) figure for figure: it learns as that run does;
    3. `elasticrl cancel` of the joined rollout node's job: that node stops the Ray it
       started, its engine is lost, the job goes on;
    4. L0: the head node's process is SIGKILLed after a checkpoint: the job fails, Slurm
       requeues it (--max-restarts, TorchX's retries), it resumes from its newest checkpoint,
       `elasticrl status` tells the restart, the re-formed role and the engine lost, and the
       job finishes: its policy exported, every step's metrics row once, every node gone
       and nothing of the job left behind;
    5. a Slurm that answers with an error: `elasticrl status` says so in one line, exit 2."""
    from tests.conftest import SAME
    from tests.integration.conftest import PPO_ROLES
    from tests.integration.faults import actor_pids, logged_step
    from tests.integration.test_rl import BASE, PPO

    before = set(_leftovers(tmp_path))
    out = tmp_path / "run"
    sets = BASE + PPO + PPO_ROLES + [f"rl.num_steps={STEPS}", "fault.place_timeout_s=240"]
    proc = _run(["launch", str(ROOT / "examples/tiny_ppo.yaml"), "-s", "slurm", "--detach", "--output", str(out),
                 "--max-restarts", "1", "--lost-s", "10", *_sets(sets)], tmp_path, timeout=300, env=slurm)
    assert proc.returncode == 0, proc.stderr[-3000:]
    handle = re.search(r"app handle: (slurm://\S+)", proc.stdout).group(1)
    job_id = handle.rsplit("/", 1)[1]
    _wait_for_start(handle, tmp_path)
    sacct = ["sacct", "-X", "-n", "-P", "-o", "JobName,NodeList,State", "-j"]
    env = {**os.environ, **slurm}
    # a rollout node joins for a second engine (the rollout node's CPU holds the first)
    engine = _run(["scale", str(out), "--engines", "2", "--join", handle], tmp_path, timeout=120, env=slurm)
    assert engine.returncode == 0, engine.stdout + engine.stderr
    engine_app, engine_job = re.search(r"submitted: (slurm://\S+/(\d+))", engine.stdout).groups()

    # 1. each model role on its own app role's node
    _until("step 1", lambda: logged_step(out) >= 1, 400, every_s=0.5)
    where = {name: node for name, node, _ in (ln.split("|") for ln in subprocess.run(
        sacct + [job_id], capture_output=True, text=True, env=env).stdout.split())}
    apps = ["actor", "critic", "reference", "reward", "rollout"]
    assert len({where[f"{a}-0"] for a in apps} | {where["head-0"]}) == 6, where
    workers = {role: (pid, node) for role, pid, node in _node_workers(tmp_path) if node == where.get(f"{role}-0")}
    assert sorted(workers) == apps, workers  # (the joined rollout node, if up, is on another node)
    for app in apps:
        pid, node = workers[app]
        below = sorted(c for c in ("ActorWorker", "CriticWorker", "FrozenWorker", "RolloutEngine")
                       for _ in actor_pids(c, pid))
        assert below == ROLE_ACTORS[app], (app, below)
    listed = _run(["status", handle], tmp_path, timeout=120, env=slurm).stdout  # each app role's node and state
    for app in ["head"] + apps:
        assert f"{app}-0 on {where[f'{app}-0']} RUNNING" in listed, listed

    # 2. the reward node lost whole; a node of the reward app role joins and the reward model is built there
    job_actors = lambda c: sorted(p for _, node_pid, _ in _node_workers(tmp_path)  # noqa: E731
                                  for p in actor_pids(c, node_pid))  # this job's, not another test's
    kept = {c: job_actors(c) for c in ("ActorWorker", "CriticWorker", "RolloutEngine")}
    reward_node = workers["reward"][0]
    for pid in [p for p, _ in _descendants(reward_node)][::-1] + [reward_node]:  # the node's supervisor last
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    joined = _run(["scale", str(out), "--join", handle, "--role", "reward"], tmp_path, timeout=120, env=slurm)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    node_job = re.search(r"submitted: slurm://\S+/(\d+)", joined.stdout).group(1)
    reformed = _until("the reward model re-formed", lambda: re.compile(
        r"^reward0 re-formed on (\S+) \(Ray node \w+\) in ([\d.]+) s; scoring step (\d+) again", re.M).search(
        _head_log(handle, tmp_path)), 400)
    joined_node = subprocess.run(sacct + [node_job], capture_output=True, text=True, env=env).stdout.split("|")[1]
    assert reformed.group(1) == joined_node != where["reward-0"], (reformed.group(0), joined_node)  # as Slurm names it
    _until("step 3", lambda: logged_step(out) >= 3, 300, every_s=0.5)
    now = {c: job_actors(c) for c in kept}  # the trained roles and the engine went on
    assert now["ActorWorker"] == kept["ActorWorker"] and now["CriticWorker"] == kept["CriticWorker"], (kept, now)
    assert set(kept["RolloutEngine"]) <= set(now["RolloutEngine"]), (kept, now)
    rows, straight = _rows_by_step(out), _rows_by_step(ppo_in_pairs.out)
    for s in (1, 2, 3):  # the same figures as the run of the same spec in one Ray
        assert {k: rows[s][k] for k in SAME if k in straight[s]} == {k: straight[s][k] for k in SAME
                                                                       if k in straight[s]}, s
    print(f"reward model lost at step {reformed.group(3)}, re-formed on the joined node {joined_node} in "
          f"{reformed.group(2)} s")
    served = _until("the joined rollout node's engine serving", lambda: next(
        (r["step"] for r in _metrics(out) if r.get("rollout/engines") == 2), None), 300)
    print(f"a joined node's engine served from step {served}")

    # 3. the joined rollout node cancelled from another shell: it stops the Ray it started, its
    #    engine is lost, and the job goes on with the first
    # (each wait polls the cheap source, sacct or the head's log, and then asks `elasticrl status`:
    # a status call is a Python process, ~0.4 s of a core that the job's steps would wait for)
    assert _run(["cancel", engine_app], tmp_path, timeout=120, env=slurm).returncode == 0
    _until("the rollout node's job CANCELLED in sacct", lambda: "CANCELLED" in subprocess.run(
        sacct[:-2] + ["State", "-j", engine_job], capture_output=True, text=True, env=env).stdout, 120, every_s=2)
    _until("the rollout node's job CANCELLED", lambda: "CANCELLED" in _run(
        ["status", engine_app], tmp_path, timeout=120, env=slurm).stdout, 60, every_s=2)
    _until("its engine lost", lambda: re.search(r"rollout engine \d+ died", _head_log(handle, tmp_path)), 120)

    # 4. the head killed after a later checkpoint: Slurm requeues the job, it resumes and finishes
    step = logged_step(out)
    _until("a checkpoint after the recovery", lambda: any(
        int(p.name.split("_")[1]) > step for p in (out / "checkpoints").glob("step_*")), 300)
    heads = [p for p, cmd in _descendants(1)  # the Python process itself, not srun's or the script's line
             if cmd.startswith(sys.executable + " -m launch.node head") and str(tmp_path) in cmd]
    assert len(heads) == 1 and logged_step(out) < STEPS - 2, (heads, logged_step(out))
    os.kill(heads[0], signal.SIGKILL)
    killed = time.time()
    _until("the requeued job resuming", lambda: "resuming from checkpoint" in _head_log(handle, tmp_path), 600)
    told = _until("the requeued job resumed", lambda: (lambda st: st if "RUNNING" in st and "restarted 1 time(s), "
                                                       "resumed from step " in st else None)(
        _run(["status", handle], tmp_path, timeout=120, env=slurm).stdout), 120, every_s=3)
    assert "reward0 re-formed 1 time(s)" in told and "1 rollout engine(s) lost" in told, told
    resumed = int(re.search(r"resumed from step (\d+)", told).group(1))
    _until("a step after the resume", lambda: logged_step(out) > resumed, 400)
    print(f"{time.time() - killed:.0f} s from the head's kill to the resumed job's first step (from step {resumed})")
    ended = _until("the head's end", lambda: re.search(r"done, exit code (\d+)", _head_log(handle, tmp_path)), 400)
    assert ended.group(1) == "0", _head_log(handle, tmp_path)[-3000:]  # (the killed head wrote no such line)
    _until("the job COMPLETED in sacct", lambda: set(subprocess.run(
        sacct[:-2] + ["State", "-j", job_id], capture_output=True, text=True, env=env).stdout.split()) == {"COMPLETED"},
           120, every_s=0.5)
    _until("the job SUCCEEDED", lambda: "SUCCEEDED" in _run(["status", handle], tmp_path, timeout=120,
                                                              env=slurm).stdout, 60)
    print(f"{time.time() - killed:.0f} s from the head's kill to the app's end")
    assert (out / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in _metrics(out)] == list(range(1, STEPS + 1))  # every step once, none lost
    for joined_job in (node_job, engine_job):  # the joined reward node left when its head was lost
        _until("the joined nodes' jobs ended", lambda: re.search(r"COMPLETED|FAILED|CANCELLED", subprocess.run(
            sacct[:-2] + ["State", "-j", joined_job], capture_output=True, text=True, env=env).stdout), 120, every_s=2)
    # every node, the cancelled one included (scancel's SIGTERM, within Slurm's KillWait, 30 s
    # here), stopped the Ray it started
    left = lambda: sorted(set(_leftovers(tmp_path)) - before)  # noqa: E731
    try:
        _until("every node's files gone", lambda: not left(), 45)
    except AssertionError as exc:
        logs = {p.name: _tail(p) for p in tmp_path.glob("slurm-*.err")}
        raise AssertionError(f"{exc}: left {left()}; the nodes' last lines: {logs}") from None
    print(f"{time.time() - killed:.0f} s from the head's kill to every node's files gone")
    # 5. a Slurm that answers with an error (an empty configuration: its commands exit 1 at once,
    #    'ClusterName needs to be specified'): one line, not TorchX's trace
    (tmp_path / "empty.conf").write_text("")
    bad = _run(["status", handle], tmp_path, timeout=120, env={"SLURM_CONF": str(tmp_path / "empty.conf")})
    said = [ln for ln in bad.stderr.splitlines() if ln.startswith("error: ")]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(said) == 1, bad.stderr[-3000:]
    assert said[0].startswith(f"error: slurm: `sacct --parsable2 -j {job_id}` ended with exit status 1 (its message "
                              "is above); check that Slurm answers"), said


def _rows_by_step(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _metrics(out)}


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(ln) for ln in lines if ln.strip().endswith("}")]
