"""The driver's handle on the environment processes (``elasticrl.envs.child``)."""
from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

from elasticrl.rewards.isolated import ChildProcess
from elasticrl.spec import JobSpec


@contextlib.contextmanager
def environments(spec: JobSpec):
    """The job's environment processes (``rollout.environment``; ``rewards.workers`` of them),
    started, or None without an environment: one that does not import fails here, in one line."""
    ro = spec.rollout
    if not ro.environment:
        yield None
        return
    pool = EnvironmentPool({"environment": ro.environment, "tools": ro.tools, "parser": ro.tool_parser,
                            "timeout_s": ro.tool_timeout_s, "retries": ro.environment_retries},
                           ro.environment_timeout_s, spec.rewards.workers)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


class EnvironmentPool:
    """``workers`` environment processes; episode ``k`` lives in process ``k % workers``. A
    process that hangs past ``timeout_s`` or dies is killed and started again, and the episodes
    that lived in it end with that error."""

    def __init__(self, config: dict, timeout_s: float, workers: int):
        self.procs = [ChildProcess("elasticrl.envs.child", [json.dumps(config)], timeout_s, "the environment process",
                                   "rollout.environment_timeout_s") for _ in range(workers)]
        self.born: dict[int, int] = {}  # episode -> the start count of the process it lives in

    def start(self) -> None:
        """Start the processes: an environment or tool that does not import fails here, in one line."""
        with ThreadPoolExecutor(len(self.procs)) as ex:
            list(ex.map(lambda p: p.start() if p.proc is None else None, self.procs))

    def ask(self, items: list[dict]) -> list:
        """One reply per item (a value, or the error text), the processes side by side."""
        n = len(self.procs)
        out: list = [None] * len(items)
        mine = [[i for i, it in enumerate(items) if it["id"] % n == k] for k in range(n)]

        def serve(k: int) -> None:
            proc, todo = self.procs[k], []
            for i in mine[k]:
                ep = items[i]["id"]
                if items[i]["op"] != "start" and self.born.get(ep) != proc.starts:
                    out[i] = "its environment process was lost"
                else:
                    todo.append(i)
            if todo:
                if proc.proc is None:
                    proc.start()
                replies = proc.ask({"items": [items[i] for i in todo]}, len(todo))
                for i, reply in zip(todo, replies):
                    out[i] = reply if reply is not None else "its environment process was lost"
                    if items[i]["op"] == "start":
                        self.born[items[i]["id"]] = proc.starts

        with ThreadPoolExecutor(n) as ex:
            list(ex.map(serve, range(n)))
        return out

    def close(self) -> None:
        for p in self.procs:
            p.close()
