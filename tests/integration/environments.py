"""Environments and tools the episode tests run (imported by the environment processes)."""
from __future__ import annotations

import os
import signal
import time

from elasticrl.envs import Environment


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom() -> str:
    """A tool that raises."""
    raise RuntimeError("the tool broke")


def hang() -> str:
    """A tool that hangs."""
    time.sleep(60)
    return "never"


def weird() -> object:
    """A tool whose result is not JSON."""
    return object()


TOOLS = ["add", "boom", "hang", "weird"]


def every_turn_calls(text: str) -> list[dict]:
    """A parser for a model that knows no tool format: each turn calls one tool, by its length."""
    name = TOOLS[len(text) % len(TOOLS)]
    return [{"name": name, "arguments": {"a": len(text), "b": 1} if name == "add" else {}}]


class Chatty(Environment):
    """Two to four model turns (by the prompt's length), each answered by a tool message; the
    last turn ends the episode with a reward of 1 and each other turn earns 0.25."""

    def start(self, row: dict) -> list[dict]:
        self.left = 1 + len(row["prompt"]) % 3
        return super().start(row)

    def step(self, text: str) -> dict:
        if self.left == 0:
            return {"messages": [], "reward": 1.0, "done": True}
        self.left -= 1
        return {"messages": [{"role": "tool", "content": f"= {len(text)}"}], "reward": 0.25, "done": False}


class Killer(Chatty):
    """Chatty, and a row's ``kill`` PID (a rollout engine's) gets SIGKILL at its second turn."""

    def start(self, row: dict) -> list[dict]:
        self.victim = row.get("kill")
        return super().start(row)

    def step(self, text: str) -> dict:
        if self.victim and self.left == 1:
            try:
                os.kill(self.victim, signal.SIGKILL)
            except ProcessLookupError:  # the row's other episode killed it already
                pass
            self.victim = None
        return super().step(text)


class Moody(Chatty):
    """Chatty whose tool messages are random: told the same turns again, it answers otherwise."""

    def step(self, text: str) -> dict:
        out = super().step(text)
        for m in out["messages"]:
            m["content"] += f" ({os.urandom(4).hex()})"
        return out
