"""Reward functions in a process of their own (``elasticrl.rewards.child``): a call that
hangs is stopped at ``rewards.timeout_s`` (the process is killed by its PID and started
again), one that crashes the process costs that call only; the driver never runs user
reward code itself. Each call's outcome is a number or the error it ended in."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

EOF = "eof"  # what _line answers once the process's output has closed


class ChildProcess:
    """``python -m MODULE ARGS...`` speaking JSON lines: ready first, then one request line and
    one reply line per item of it (``{"v": value}`` or ``{"e": "what went wrong"}``). A reply
    that does not come within ``timeout_s`` or a process that ends loses that item and the
    rest of the request; the process is killed by its PID and the next request starts another."""

    def __init__(self, module: str, args: list[str], timeout_s: float, what: str, setting: str):
        """``what``: the process as errors name it; ``setting``: the spec field of ``timeout_s``."""
        self.module, self.args, self.timeout_s, self.what, self.setting = module, args, timeout_s, what, setting
        self.proc: subprocess.Popen | None = None
        self.starts = 0  # how many processes have served (a new one holds none of the old one's state)
        self._buffer = b""

    def start(self) -> None:
        """Start the process; one that cannot set up (user code that does not import) is a
        ValueError with its reason."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, sys.path)])}
        # a session of its own: Ctrl-C in a terminal (SIGINT to its process group) is the run's to
        # handle, which closes this process, not a KeyboardInterrupt trace from it on the console
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._buffer, self.starts = b"", self.starts + 1
        first = self._line(max(60.0, self.timeout_s))
        if not isinstance(first, dict) or "ready" not in first:
            self.close()
            raise ValueError(first["e"] if isinstance(first, dict) and "e" in first else
                             f"{self.what} did not start ({', '.join(self.args)})")

    def ask(self, request: dict, count: int) -> list:
        """Send ``request``; its ``count`` replies: each a value, or the error text. A process
        lost on the way answers that item with why and the items after it with None."""
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died after its last reply
            return [self._lost(ended=True)] + [None] * (count - 1)
        out: list = []
        while len(out) < count:
            reply = self._line(self.timeout_s)
            if not isinstance(reply, dict):  # hung or dead
                return out + [self._lost(ended=reply == EOF)] + [None] * (count - len(out) - 1)
            out.append(reply["v"] if "v" in reply else reply["e"])
        return out

    def _line(self, timeout_s: float) -> dict | str | None:
        """The next reply; None when none came within ``timeout_s``, EOF when the process ended."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return EOF
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _lost(self, ended: bool) -> str:
        if not ended:
            what = f"timed out after {self.timeout_s:g} s ({self.setting})"
        else:
            code = self.proc.wait()  # its output closed: it is exiting
            what = f"{self.what} died ({f'signal {-code}' if code < 0 else f'exit {code}'})"
        self.close()
        return what

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.proc = None


class FunctionProcess(ChildProcess):
    def __init__(self, paths: list[str], timeout_s: float):
        super().__init__("elasticrl.rewards.child", paths, timeout_s, "the reward process", "rewards.timeout_s")

    def __call__(self, index: int, items: list[list]) -> list[float | str]:
        """Function ``index`` on each [prompt, completion, answer]: a float, or the error text;
        the items a lost process left unanswered go to a new one."""
        out: list[float | str] = []
        while len(out) < len(items):
            replies = self.ask({"f": index, "items": items[len(out):]}, len(items) - len(out))
            out += [r for r in replies if r is not None]
        return out


class FunctionPool:
    """``workers`` function processes: a batch is split among them and scored side by side, so
    one slow function or verifier does not serialise the step."""

    def __init__(self, paths: list[str], timeout_s: float, workers: int):
        self.procs = [FunctionProcess(paths, timeout_s) for _ in range(workers)]

    @property
    def started(self) -> bool:
        return all(p.proc is not None for p in self.procs)

    def start(self) -> None:
        try:
            self._each(lambda p: p.start() if p.proc is None else None, self.procs)
        except BaseException:
            self.close()
            raise

    def __call__(self, index: int, items: list[list]) -> list[float | str]:
        from elasticrl.data.records import row_share

        n = len(self.procs)
        parts = [items[row_share(len(items), n, k)] for k in range(n)]
        answers = self._each(lambda pp: pp[0](index, pp[1]) if pp[1] else [], list(zip(self.procs, parts)))
        return [v for part in answers for v in part]

    @staticmethod
    def _each(fn, things: list) -> list:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(things)) as ex:
            return list(ex.map(fn, things))

    def close(self) -> None:
        for p in self.procs:
            p.close()
