"""Failure injection for the fault tests: a real signal to a real process, by its PID, from
outside it, when the run reaches a chosen point (no mocks: Ray, vLLM and DeepSpeed as they run)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path


def actor_pids(class_name: str, root: int | None = None) -> list[int]:
    """PIDs of the Ray actor processes of ``class_name`` below ``root`` (this process), sorted.
    Ray names an actor's process ``ray::CLASS`` (``ray::CLASS.method`` while it runs one)."""
    parent, title = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                title[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = set(), {root or os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        below |= frontier
    return sorted(p for p in below if title.get(p, "").split(".")[0].split(" ")[0] == f"ray::{class_name}")


def ancestry(pid: int) -> list[str]:
    """The command lines of ``pid``'s parents, nearest first."""
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            break
    return out


def logged_step(output: Path) -> int:
    """The last step in ``output``'s metrics.jsonl (-1 before the first row)."""
    path = output / "metrics.jsonl"
    if not path.is_file():
        return -1
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip().endswith("}")]
    return max(steps, default=-1)


class Fault(threading.Thread):
    """Sends ``sig`` to the ``index``-th process of actor class ``class_name`` once the run
    writing ``output`` has logged step ``after`` (plus ``delay`` seconds: into the next step).
    ``pid``, ``at`` and ``parents`` say what was hit, when, and below which processes."""

    def __init__(self, output: Path, class_name: str, after: int, sig=signal.SIGKILL, index: int = -1,
                 delay: float = 0.0, timeout_s: float = 900, root: int | None = None):
        """``root``: the process the actor runs below (default this one; a launched job's node process)."""
        super().__init__(daemon=True)
        self.output, self.class_name, self.after, self.sig = output, class_name, after, sig
        self.index, self.delay, self.timeout_s, self.root = index, delay, timeout_s, root
        self.pid = self.at = None
        self.parents: list[str] = []
        self.error: str | None = None

    def run(self) -> None:
        deadline = time.time() + self.timeout_s
        while logged_step(self.output) < self.after:
            if time.time() > deadline:
                self.error = f"the run never logged step {self.after}"
                return
            time.sleep(0.05)
        time.sleep(self.delay)
        pids = actor_pids(self.class_name, self.root)
        if not pids:
            self.error = f"no ray::{self.class_name} process"
            return
        self.pid, self.at = pids[self.index], time.time()
        self.parents = ancestry(self.pid)
        os.kill(self.pid, self.sig)

    def check(self) -> None:
        self.join(timeout=5)
        assert self.error is None and self.pid is not None, self.error or "the fault was never injected"


def digit_share(prompt: str, completion: str, answer: str | None) -> float:
    """A reward that varies on completions of any length (the fault tests' runs ignore the
    end of sequence): the share of their characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
