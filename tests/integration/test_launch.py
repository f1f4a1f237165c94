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
    """What an app must not leave behind: Ray temp dirs of its nodes, its auth token."""
    out = [str(p) for p in Path("/tmp").glob("erl-*") if not p.name.startswith("erl-ray-")]
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


RESTARTED = SHORT[1:] + ["rl.num_steps=6", "checkpoint.every_steps=2", "eval.every_steps=3"]


def _launch_and_kill_the_head(args: list[str], tmp_path, heads, env=None) -> tuple[str, float]:
    """Run ``elasticrl ARGS`` until OUTPUT has its step-2 checkpoint, SIGKILL the head node's
    process (``heads(launch_pid)`` finds it), wait for the end: (its output, the kill's time)."""
    out = Path(args[args.index("--output") + 1])
    proc = subprocess.Popen([sys.executable, "-m", "elasticrl.cli", *args], cwd=tmp_path, text=True,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while not (out / "checkpoints" / "step_0000002").is_dir():
            assert proc.poll() is None and time.time() < deadline, "the job never reached step 2"
            time.sleep(0.5)
        found = heads(proc.pid)
        assert len(found) == 1, found
        killed = time.time()
        os.kill(found[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))  # once each, none lost
    return output, killed


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
def test_local_cwd_launch_restarts_a_job_whose_head_died_and_goes_on_smaller_without_a_node(tmp_path):
    """The tiny GRPO job on local processes, its two actor ranks on the two nodes of its actor app role.
    L0: the head node's process is SIGKILLed mid-run; its Ray goes with it, the other nodes
    give up, the app fails, `launch --max-restarts 1` submits it again and the job resumes
    from its newest checkpoint. L3 on fewer ranks: in that second attempt a whole train node
    is SIGKILLed; the driver re-forms the actor on the one rank the live nodes hold (the
    global batch kept by gradient accumulation) and finishes the job, which succeeds. Every
    step's metrics exactly once, weights broadcast across nodes, the policy exported, and
    nothing of either attempt left behind."""
    before = set(_leftovers(tmp_path))
    out = tmp_path / "run"
    args = ["launch", str(ROOT / "examples/tiny_grpo.yaml"), "--output", str(out), "--max-restarts",
            "1", "--lost-s", "10", "--role-nodes", "actor=2", *_sets(RESTARTED)]
    loss = None

    def heads(pid):
        nonlocal loss
        loss = _NodeLoss(out, pid, after=4)  # step 4 comes in the second attempt only
        loss.start()
        return [p for p, cmd in _descendants(pid) if "launch.node head" in cmd]

    output, killed = _launch_and_kill_the_head(args, tmp_path, heads)
    resumed = int(re.search(r"restart 1 of 1, resuming from step (\d+)", output).group(1))
    assert resumed >= 2
    print(f"resumed from step {resumed}; {time.time() - killed:.0f} s from the kill to the end")
    assert re.search(r"app handle: local_cwd://\w+/elasticrl-\w+", output)
    assert output.count("4 Ray node(s) up; running the job") == 2  # each attempt
    assert loss.killed, "no train node hosted an actor rank"
    shrunk = re.search(r"actor rank \d (?:died|failed)[^\n]* at step [45]; recovered in ([\d.]+) s from step (\d) "
                       r"\(the newest checkpoint\) on 1 rank\(s\)", output)
    assert shrunk and "re-forming actor on 1 rank(s)" in output, output[-4000:]
    assert "the job finished; a node failed during it" in output
    print(f"a train node lost: {shrunk.group(0)}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
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
    start = load_file(os.path.join(initial_model(load_spec(ROOT / "examples/tiny_grpo.yaml", RESTARTED)),
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


@pytest.fixture(scope="module")
def slurm():
    """A real Slurm of 4 nodes on this machine, for this module's Slurm tests."""
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


@pytest.mark.slow
def test_slurm_job_takes_a_node_survives_a_trainer_rank_and_its_head_killed_and_cancels(tmp_path, slurm):
    """One Slurm job, each app role on its own node, driven from other shells (status, logs,
    sacct, scale, cancel), through four events:
    1. a node joins it while it runs (`elasticrl scale --engines 2 --join HANDLE`, a Slurm job of
       its own): the second engine starts there and serves;
    2. L3: an actor rank's process, on the actor app role's node, is SIGKILLed: the driver on the
       head node re-forms the actor there and goes on;
    3. L0: the head node's process is SIGKILLed after a checkpoint: the job fails, Slurm
       requeues it (--max-restarts, TorchX's retries), it resumes from its newest checkpoint,
       and `elasticrl status` tells the restart and the recovery;
    4. `elasticrl cancel` stops every node, the joined node's job ends too, and nothing of the
       job is left behind. Every logged step once."""
    from tests.integration.faults import Fault, logged_step

    before = set(_leftovers(tmp_path))
    out = tmp_path / "run"
    proc = _run(["launch", str(ROOT / "examples/tiny_grpo.yaml"), "-s", "slurm", "--detach", "--output", str(out),
                 "--max-restarts", "1", "--lost-s", "10",
                 *_sets(SHORT[1:] + ["rl.num_steps=1000", "eval.enabled=false", "checkpoint.every_steps=2"])],
                tmp_path, timeout=300, env=slurm)
    assert proc.returncode == 0, proc.stderr[-3000:]
    handle = re.search(r"app handle: (slurm://\S+)", proc.stdout).group(1)
    job_id = handle.rsplit("/", 1)[1]
    _wait_for_start(handle, tmp_path)
    sacct = ["sacct", "-X", "-n", "-P", "-o", "JobName,NodeList,State", "-j"]
    env = {**os.environ, **slurm}

    # 1. a node joins; the joined node is the only room for a second engine (the rollout node's CPU holds the first)
    joined = _run(["scale", str(out), "--engines", "2", "--join", handle], tmp_path, timeout=120, env=slurm)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    node_job = re.search(r"submitted: slurm://\S+/(\d+)", joined.stdout).group(1)
    _until("the joined node's engine serving", lambda: 2 in [r.get("rollout/engines") for r in _metrics(out)], 400)
    where = {name: node for name, node, _ in (ln.split("|") for ln in subprocess.run(
        sacct + [job_id], capture_output=True, text=True, env=env).stdout.split())}
    assert where["head-0"] != where["actor-0"] and where["head-0"] != where["rollout-0"], where
    listed = _run(["status", handle], tmp_path, timeout=120, env=slurm).stdout  # each app role's node and state
    for name in ("head-0", "actor-0", "rollout-0"):
        assert f"{name} on {where[name]} RUNNING" in listed, listed
    served = logged_step(out)
    print(f"a joined node's engine served from step {served}")

    # 2. an actor rank killed on the train node: re-formed in the job
    trainer = Fault(out, "ActorWorker", after=served, delay=0.3, root=1)
    trainer.start()
    recovered = _until("the actor re-formed", lambda: re.search(
        r"actor rank \d died \(ActorDiedError\) at step \d+; recovered in ([\d.]+) s from step \d+ "
        r"\((the newest checkpoint|the start)\)", _head_log(handle, tmp_path)), 300)
    trainer.check()
    assert any("launch.node worker" in c and "--role actor " in c for c in trainer.parents), trainer.parents

    # 3. the head killed after a later checkpoint: Slurm requeues the job and it resumes
    step = logged_step(out)
    _until("a checkpoint after the recovery", lambda: any(
        int(p.name.split("_")[1]) > step for p in (out / "checkpoints").glob("step_*")), 300)
    heads = [p for p, cmd in _descendants(1)  # the Python process itself, not srun's or the script's line
             if cmd.startswith(sys.executable + " -m launch.node head") and str(tmp_path) in cmd]
    assert len(heads) == 1, heads
    os.kill(heads[0], signal.SIGKILL)
    killed = time.time()
    told = _until("the requeued job resumed", lambda: (lambda st: st if "RUNNING" in st and "restarted 1 time(s), "
                                                       "resumed from step " in st else None)(
        _run(["status", handle], tmp_path, timeout=120, env=slurm).stdout), 600, every_s=3)
    assert "trainer re-formed 1 time(s)" in told, told
    resumed = int(re.search(r"resumed from step (\d+)", told).group(1))
    _until("a step after the resume", lambda: logged_step(out) > resumed, 400)
    print(f"trainer recovered in {recovered.group(1)} s; {time.time() - killed:.0f} s from the head's kill to the "
          f"resumed job's first step (from step {resumed})")

    # 4. cancelled from another shell: every node stops, the joined one's job ends too
    assert _run(["cancel", handle], tmp_path, timeout=120, env=slurm).returncode == 0
    _until("CANCELLED", lambda: "CANCELLED" in _run(["status", handle], tmp_path, timeout=120, env=slurm).stdout,
           300, every_s=3)  # TorchX 0.7.0 cannot parse 'CANCELLED by 0'; status falls back to sacct
    _until("the joined node's job ended", lambda: re.search(r"COMPLETED|FAILED|CANCELLED", subprocess.run(
        sacct[:-2] + ["State", "-j", node_job], capture_output=True, text=True, env=env).stdout), 120, every_s=2)
    # scancel's SIGTERM reached the nodes: each stops the Ray it started (within Slurm's KillWait, 30 s here)
    left = lambda: sorted(set(_leftovers(tmp_path)) - before)  # noqa: E731
    try:
        _until("every node's files gone", lambda: not left(), 45)
    except AssertionError as exc:
        logs = {p.name: _tail(p) for p in tmp_path.glob("slurm-*.err")}
        raise AssertionError(f"{exc}: left {left()}; the nodes' last lines: {logs}") from None
    logged = [r["step"] for r in _metrics(out)]
    assert logged == list(range(logged[0], logged[-1] + 1)), logged  # every step once, none lost


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(ln) for ln in lines if ln.strip().endswith("}")]
