"""The driver stopped from outside, on the real stack: SIGTERM ends the run in one line with
exit code 143 and leaves no Ray process or temp folder behind; after a SIGKILL, which nothing
can catch, the next run sweeps what that run left (its own folder, marked with the dead
driver's PID, and the Ray processes naming it) and nothing else."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrl.files import OWNER_MARK, _processes_naming, sweep_orphans
from tests.conftest import EXAMPLES, ROOT
from tests.integration.faults import logged_step

pytestmark = pytest.mark.slow

LONG = ["model.dtype=fp32", "log.progress_bar=false", "init.sft_steps=60", "rl.num_steps=200", "eval.every_steps=0",
        "rl.eval_samples=2", "eval.num_prompts=32"]


def _running(tmp_path, step: int) -> tuple[subprocess.Popen, Path]:
    """`elasticrl run` of a long GRPO job, once it has logged ``step`` (-1: once its Ray runs):
    (its process, its Ray folder)."""
    out = tmp_path / "run"
    sets = [x for kv in LONG for x in ("--set", kv)]
    proc = subprocess.Popen([sys.executable, "-m", "elasticrl.cli", "run", str(EXAMPLES / "tiny_grpo.yaml"),
                             "--output", str(out), *sets], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 400

    def folder():
        return [p for p in Path("/tmp").glob("erl-ray-*") if (p / OWNER_MARK).is_file()
                and (p / OWNER_MARK).read_text().split()[0] == str(proc.pid)]

    while logged_step(out) < step or not folder() or not _processes_naming(str(folder()[0])):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    return proc, folder()[0]


def _gone(folder: Path, within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not folder.exists() and not _processes_naming(str(folder)):
            return True
        time.sleep(0.5)
    return False


def test_sigterm_ends_the_run_in_one_line_and_leaves_nothing(tmp_path):
    proc, folder = _running(tmp_path, 1)
    assert folder.stat().st_mode & 0o777 == 0o700  # private to the user while it runs
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)"), err[-3000:]
    assert _gone(folder, 10), (folder, _processes_naming(str(folder)))
    print(f"SIGTERM: exit 143 in {took:.1f} s, Ray's folder and processes gone")


def test_what_a_sigkilled_run_left_is_swept_by_the_next_and_only_that(tmp_path):
    proc, folder = _running(tmp_path, -1)
    time.sleep(3)  # Ray's workers starting
    other = tmp_path / "erl-ray-not-mine"  # unmarked: never swept
    other.mkdir()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(2)
    left = _processes_naming(str(folder))
    assert folder.exists()  # a SIGKILLed process cleans nothing
    removed = sweep_orphans("erl-ray-*")  # what the next run does first
    assert folder in removed and _gone(folder, 10), _processes_naming(str(folder))
    assert sweep_orphans("erl-ray-*", root=tmp_path) == [] and other.is_dir()
    print(f"SIGKILL left {len(left)} Ray process(es) and {folder}; the next run's sweep removed them")
