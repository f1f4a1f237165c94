"""The driver stopped from outside, on the real stack: SIGTERM and SIGINT end the run in one
line (exit codes 143, 130) and leave no Ray process, temp folder or /dev/shm buffer behind;
after a SIGKILL, which nothing can catch, the run's reaper sweeps what it left within seconds
(its own folder, marked with the dead driver's PID, the Ray processes naming it and the
engines' buffers) and nothing else. While it runs, the run listens on 127.0.0.1 only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrl.files import OWNER_MARK, _processes_naming, shm_owner, sweep_orphans
from tests.conftest import EXAMPLES, ROOT
from tests.integration.faults import actor_pids, logged_step
from tests.integration.test_launch import _descendants

pytestmark = pytest.mark.slow

LONG = ["model.dtype=fp32", "log.progress_bar=false", "init.sft_steps=60", "rl.num_steps=200", "eval.enabled=false",
        "rl.eval_samples=2", "eval.num_prompts=32", "rl.prompts_per_step=8", "rl.samples_per_prompt=4",
        "train.micro_batch_size=16", "train.global_batch_size=32"]


def _running(tmp_path, step: int, more: tuple = ()) -> tuple[subprocess.Popen, Path]:
    """`elasticrl run` of a long GRPO job (``more``: --set items), once it has logged ``step``
    (-1: once its Ray runs): (its process, its Ray folder)."""
    out = tmp_path / "run"
    sets = [x for kv in LONG + list(more) for x in ("--set", kv)]
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


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket that a process in ``pids`` listens on, from /proc."""
    import ipaddress

    owner = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            if addr.version == 6 and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            found.append((owner[fields[9]], str(addr), int(hex_port, 16)))
    return found


def _gone(folder: Path, within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not folder.exists() and not _processes_naming(str(folder)):
            return True
        time.sleep(0.5)
    return False


def test_a_run_listens_on_localhost_only_and_sigterm_ends_it_leaving_nothing(tmp_path):
    """With a KL to a reference, which the CPU layout puts in the actor's process; the run
    reports its start-up per role and its footprint (PSS over its process tree)."""
    proc, folder = _running(tmp_path, 1, ("rl.kl_coef=0.01",))
    assert folder.stat().st_mode & 0o777 == 0o700  # private to the user while it runs
    assert actor_pids("ActorWorker", proc.pid) and not actor_pids("FrozenWorker", proc.pid)  # no reference process
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and 1.0 < first["memory/pss_gb"] < 20 and first["time/launch_to_first_step"] > 5
    # every server of the run (Ray's, its agents' and metrics endpoints, every worker's, the
    # trainers' process group, the weight group's) listens on the loopback address only, and
    # the dashboard's web port is not open
    run = {proc.pid, *_processes_naming(str(folder)), *(p for p, _ in _descendants(proc.pid))}
    sockets = _listening(run)
    assert len(sockets) >= 10 and {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
    assert 8265 not in {port for _, _, port in sockets}, sockets
    shm = [p for p in Path("/dev/shm").glob("elasticrl-*") if shm_owner(p) in run]
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("error: terminated (SIGTERM)"), err[-3000:]
    startup = next(ln for ln in err.splitlines() if ln.startswith("start-up: launch -> Ray up "))
    # none of what every run printed and nobody could act on (backend.VLLM_EXPECTED, the loaders'
    # progress bars, vLLM's import's FutureWarning, Ray's notice of its token authentication,
    # DeepSpeed's of finding no GPU)
    noise = [ln for ln in (out + err).splitlines() if any(m in ln for m in (
        "is not found in LD_PRELOAD", "does not officially support disabling chunked prefill", "Enforce eager set",
        "Attempted to load weight", "Loading safetensors checkpoint shards", "Loading weights:",
        "`torch.distributed.reduce_op` is deprecated", "Token authentication is enabled",
        "Setting accelerator to CPU"))]
    assert not noise, noise[:5]
    assert all(f in startup for f in ("actor import ", " + load ", " + reference load ", "rollout import ")), startup
    assert _gone(folder, 10), (folder, _processes_naming(str(folder)))
    assert shm and not [p for p in shm if p.exists()]  # the engines' weight buffers in /dev/shm too
    print(f"{len(sockets)} listening sockets, all on 127.0.0.1; SIGTERM: exit 143 in {took:.1f} s, Ray's folder, "
          f"processes and {len(shm)} /dev/shm buffer(s) gone")


def test_what_a_sigkilled_run_left_goes_at_once_and_only_that(tmp_path):
    """SIGKILL, which the run cannot catch, once its engines hold weight buffers in /dev/shm:
    its reaper (a process of its own, waiting on a pipe from the run) sees the pipe close and
    removes Ray's processes and folder and the engines' buffers within seconds, without a
    next run; unmarked folders are never swept."""
    proc, folder = _running(tmp_path, -1)
    deadline = time.time() + 300
    while True:  # the engines move their weights into /dev/shm as they start, before step 1
        run = {proc.pid, *(p for p, _ in _descendants(proc.pid))}
        if shm := [p for p in Path("/dev/shm").glob("elasticrl-*") if shm_owner(p) in run]:
            break
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    left = _processes_naming(str(folder))  # Ray's own: GCS, raylet, dashboard and runtime-env agents, ...
    other = tmp_path / "erl-ray-not-mine"  # unmarked: never swept
    other.mkdir()
    t0 = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(folder, 15), _processes_naming(str(folder))
    deadline = time.time() + 10
    while [p for p in shm if p.exists()] and time.time() < deadline:
        time.sleep(0.5)
    took = time.time() - t0
    assert shm and not [p for p in shm if p.exists()], shm
    assert sweep_orphans("erl-ray-*", root=tmp_path) == [] and other.is_dir()
    print(f"SIGKILL: its {len(left)} Ray process(es), {folder} and {len(shm)} /dev/shm buffer(s) gone in {took:.1f} s")


def test_ctrl_c_while_ray_starts_ends_the_run_in_one_line_and_leaves_nothing(tmp_path):
    """SIGINT (Ctrl-C) as soon as Ray's processes run, while its workers start."""
    proc, folder = _running(tmp_path, -1)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: interrupted", err[-3000:]
    assert _gone(folder, 10), (folder, _processes_naming(str(folder)))
