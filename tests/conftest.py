"""Shared fixtures: a private cache for the tiny world, paths, and a CLI runner."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# One world cache for the whole session (built once, ~5 s); tests never touch ~/.cache.
os.environ.setdefault("ELASTICRL_CACHE", str(ROOT / ".venv" / "elasticrl-test-cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tests about learning (a model must get better) train at `model.dtype: auto`, as users' runs do:
# bf16 on CPUs with AVX512-BF16 or AMX, fp32 elsewhere; every other test pins fp32. The margins
# of the learning tests were checked under both precisions and several seeds (docs/development.md,
# Development); ELASTICRL_TEST_DTYPE and ELASTICRL_TEST_SEED rerun them under others.
SEED = f"seed={os.environ.get('ELASTICRL_TEST_SEED', '1234')}"  # alone: the learning runs pinned to fp32
LEARNING = [f"model.dtype={os.environ.get('ELASTICRL_TEST_DTYPE', 'auto')}", SEED]


class JsonHandler(BaseHTTPRequestHandler):
    """A test server's request handler: the POSTed JSON (``body``), a JSON reply (``reply``), no
    log lines."""

    def body(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, value) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``elasticrl`` as a user would, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "elasticrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def run_together(*commands: list[str], timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """Each command in ``ROOT``, side by side (one that mostly imports and waits leaves the other
    core to the next); their results in order. One that times out leaves none of them running."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for cmd in commands]
    done = []
    try:
        for cmd, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def run_clis(*argvs: list[str], timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """``run_cli`` for each argument list, side by side (``run_together``)."""
    return run_together(*([sys.executable, "-m", "elasticrl.cli", *argv] for argv in argvs), timeout=timeout)


# `make test` runs two pytest workers (pytest-xdist): one alone left the two cores idle a quarter
# of the time, while a lone process computed and the rest waited on it. Each group below runs
# whole on one worker: a module (its module fixtures built once), the unit tests together (so a
# worker starts the integration package's Ray once, entering it after them), test_resume.py with
# test_launch.py (both take `ppo_in_pairs`, the package's PPO run). The groups go out in the
# order of ORDER, longest first by their time in the CI of 262f276 (tests/README, Costs: 754 s
# for test_resume's group, which test_launch joins, down to 24 s), so that no long one starts
# last; the unit tests first, which puts that group alone on the other worker. A group not named
# goes after them.
TOGETHER = {"test_launch": "test_resume"}
ORDER = ["unit", "test_resume", "test_sft_engine", "test_preference", "test_rl", "test_faults", "test_rollout_tp",
         "test_sharded_state", "test_agents", "test_hard_edges", "test_weight_sync", "test_real_workloads"]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = Path(nodeid.split("::")[0])
            module = path.stem if path.parent.name == "integration" else "unit"
            return TOGETHER.get(module, module)

        def _assign_work_unit(self, node) -> None:
            for scope in sorted(self.workqueue, key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER)):
                self.workqueue.move_to_end(scope)  # ORDER's groups first, in its order; the rest as they were
            super()._assign_work_unit(node)
    return Grouped(config, log)


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return EXAMPLES


def stopped_at(run: Path, step: int, into: Path) -> Path:
    """What a run that stopped after ``step`` leaves in its output: the checkpoint of that step
    and its metrics up to then (and later rows, which a resumed run must drop, from ``run``)."""
    import shutil

    (into / "checkpoints").mkdir(parents=True)
    name = f"step_{step:07d}"
    shutil.copytree(run / "checkpoints" / name, into / "checkpoints" / name)
    shutil.copy(run / "metrics.jsonl", into / "metrics.jsonl")
    return into


# the metrics a resumed or recovered run must repeat; timings and throughputs do not
SAME = ("reward/mean", "accuracy", "policy_loss", "value_loss", "kl", "entropy", "grad_norm", "lr", "eval/accuracy",
        "eval/pass@2", "loss", "eval/margin", "eval/pairwise_accuracy", "reward/margin", "round/records",
        "round/reward_mean", "sync/version", "rl/staleness", "step_accuracy", "eval/step_accuracy",
        "eval/best_of_n_accuracy", "kl_ref", "eval/compare_accuracy")


def metric_rows(out: Path) -> dict[int, dict]:
    """A run's metrics rows by step (rows of one step merged: conditional SFT's last two)."""
    from elasticrl.run_folder import metric_rows as read_rows

    rows: dict[int, dict] = {}
    for row in read_rows(out):
        rows.setdefault(row["step"], {}).update(row)
    return rows


def same_after(a: Path, b: Path, step: int, tol: float = 0.0) -> None:
    """Every row of run ``a`` after ``step`` is in run ``b`` with the same figures (to ``tol``),
    and ``b`` has no other rows."""
    ra, rb = metric_rows(a), metric_rows(b)
    assert sorted(rb) == sorted(ra), (sorted(ra), sorted(rb))
    for s in sorted(k for k in ra if k > step):
        for key in SAME:
            if key in ra[s]:
                assert rb[s][key] == pytest.approx(ra[s][key], abs=tol, rel=0), (s, key, ra[s][key], rb[s][key])


def resumes_exactly(run, spec, straight: Path, step: int, capsys) -> Path:
    """``straight`` stopped after ``step`` (``stopped_at``) and resumed by ``run(spec, folder)``:
    the run says it resumed there (one that started over would repeat the same rows) and
    repeats the rows after it (``same_after``). Returns the resumed run's folder."""
    from elasticrl.run_folder import RESUMING

    resumed = stopped_at(straight, step, straight.parent / f"resumed-at-{step}")
    capsys.readouterr()
    run(spec, resumed)
    assert f"{RESUMING} step_{step:07d} (step {step})" in capsys.readouterr().err
    same_after(straight, resumed, step)
    return resumed
