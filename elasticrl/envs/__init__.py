"""Environments: what a multi-turn episode talks to (``rollout.environment``).

An environment is a class named by import path, one instance per episode, living in an
environment process (``elasticrl.envs.child``), never in the driver:

    class Environment:
        tools = []                      # plain functions offered to the model
        def start(self, row) -> list    # the opening messages, from a data row
        def step(self, text) -> dict    # the model's turn -> {"messages", "reward", "done"}

``step`` gets the text of the model's assistant turn and returns the observation that
follows it (tool results, a user turn: chat messages), an optional reward for the turn, and
whether the episode is over. ``ToolEnvironment`` is the built-in one: it answers each tool
call of a turn with the tool's result and ends the episode at a turn without one. A tool is a
plain Python function with type hints and a Google-style docstring, from which its JSON
schema comes (transformers' ``get_json_schema``); the chat template offers the schemas to the
model (``apply_chat_template(tools=...)``). Calls are parsed from the model's text by
``rollout.tool_parser``: ``hermes`` (the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks of Hermes and Qwen templates) or an import path of your own parser (text -> a list of
{"name", "arguments"}; raise ValueError for a malformed call).
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
from typing import Callable

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(Exception):
    """A tool call that went wrong: the model sees this as the call's result."""


def parse_hermes(text: str) -> list[dict]:
    """Tool calls in Hermes/Qwen format; a block that is not {"name", "arguments"} JSON raises."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a tool call that is not JSON ({exc.msg})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("a tool call without a name")
        args = call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args or "{}")
        if not isinstance(args, dict):
            raise ValueError(f"tool {call['name']}: arguments that are not an object")
        calls.append({"name": call["name"], "arguments": args})
    return calls


class Environment:
    """The base: one user turn from the row, the model answers once."""

    tools: list[Callable] = []

    def start(self, row: dict) -> list[dict]:
        """The opening messages: the row's ``messages``, else its ``prompt`` as a user turn."""
        if isinstance(row.get("messages"), list):
            return [m for m in row["messages"] if m.get("role") != "assistant"]
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, text: str) -> dict:
        return {"messages": [], "reward": None, "done": True}


class ToolEnvironment(Environment):
    """Answers the tool calls of each turn with their results (``role: tool`` messages); a turn
    without a call is the model's answer and ends the episode. ``parser`` and ``timeout_s``
    come from ``rollout.tool_parser`` and ``rollout.tool_timeout_s``."""

    parser: Callable[[str], list[dict]] = staticmethod(parse_hermes)
    timeout_s: float = 10.0

    def step(self, text: str) -> dict:
        try:
            calls = type(self).parser(text)
        except ValueError as exc:
            return {"messages": [_tool_message("error", f"error: {exc}")], "tool_calls": 1, "tool_errors": 1,
                    "done": False}
        if not calls:
            return {"messages": [], "done": True}
        by_name = {fn.__name__: fn for fn in self.tools}
        messages, errors = [], 0
        for call in calls:
            try:
                content = self.call(by_name, call)
            except ToolError as exc:
                content, errors = f"error: {exc}", errors + 1
            messages.append(_tool_message(call["name"], content))
        return {"messages": messages, "tool_calls": len(calls), "tool_errors": errors, "done": False}

    def call(self, tools: dict, call: dict) -> str:
        """One call's result as text (JSON unless a string); every failure is a ToolError."""
        fn = tools.get(call["name"])
        if fn is None:
            raise ToolError(f"no tool named {call['name']!r} (tools: {', '.join(tools) or 'none'})")
        try:
            with _deadline(self.timeout_s):
                result = fn(**call["arguments"])
        except _Timeout:
            raise ToolError(f"{call['name']} timed out after {self.timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 - the tool's own failure: the model is told it
            raise ToolError(f"{call['name']} raised {type(exc).__name__}: {exc}") from None
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            raise ToolError(f"{call['name']} returned {type(result).__name__}, which is not JSON") from None


class RemoteEnvironment(Environment):
    """An environment served over HTTP (``rollout.environment: http(s)://HOST/PATH``), JSON in
    and out: POST PATH/start {"row": {...}} -> {"episode": an id, "messages": [...]}, then for
    each turn POST PATH/step {"episode": id, "text": "..."} -> {"messages", "reward", "done"}.
    A request times out at ``rollout.tool_timeout_s`` and is retried after a timeout, a lost
    connection or an HTTP 5xx (``rollout.environment_retries``, backing off); the retries are
    counted (``episode/env_retries``), a request that fails for good ends the episode."""

    url: str = ""
    timeout_s: float = 30.0
    retries: int = 3

    def _post(self, path: str, body: dict) -> dict:
        from elasticrl.rewards.remote import post_json

        reply, failed = post_json(self.url.rstrip("/") + path, body, self.timeout_s, self.retries, 0.2,
                                  f"environment {self.url}")
        self.retried = getattr(self, "retried", 0) + failed
        if not isinstance(reply, dict):
            raise RuntimeError(f"environment {self.url}{path}: expected a JSON object, got {str(reply)[:80]}")
        return reply

    def start(self, row: dict) -> list[dict]:
        reply = self._post("/start", {"row": row})
        self.episode = reply.get("episode")
        return reply.get("messages", [])

    def step(self, text: str) -> dict:
        reply = self._post("/step", {"episode": self.episode, "text": text})
        reply["retries"], self.retried = self.retried, 0
        return reply


def tool_schemas(tools: list[Callable]) -> list[dict]:
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


def _tool_message(name: str, content: str) -> dict:
    return {"role": "tool", "name": name, "content": content}


class _Timeout(BaseException):  # not an Exception: a tool's own ``except Exception`` does not swallow it
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    """Interrupt the code inside after ``seconds`` (SIGALRM: the environment process's main
    thread; code stuck in C without returning to Python is the process timeout's to stop)."""
    def ring(*_):
        raise _Timeout
    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
