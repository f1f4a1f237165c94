"""The process environments run in (``python -m elasticrl.envs.child CONFIG``), JSON lines
both ways as the reward process (``rewards.isolated.ChildProcess``), never pickle.

CONFIG: {"environment": import path or http(s) URL, "tools": [import paths], "parser":
"hermes" or an import path, "timeout_s": seconds per tool call or remote request, "retries":
a remote request's}. A request is {"items": [...]}, each item
{"op": "start", "id": episode, "row": {...}}, {"op": "step", "id": episode, "text": "..."}
or {"op": "end", "id": episode}; one reply per item: {"v": ...} or {"e": "what went wrong"}.
A start answers {"messages", "tools"} (the tools' JSON schemas), a step {"messages",
"reward", "done", "tool_calls", "tool_errors", "retries"}."""
from __future__ import annotations

import json
import math
import os
import sys

from elasticrl.envs import Environment, RemoteEnvironment, ToolEnvironment, parse_hermes, tool_schemas


def environment_class(config: dict) -> type:
    """The configured class, with the configured tools, parser and timeout (ValueError: what
    does not import, naming its field)."""
    from elasticrl.rewards.functions import load_function

    if config["environment"].startswith(("http://", "https://")):
        return type("Remote", (RemoteEnvironment,), {"url": config["environment"], "timeout_s": config["timeout_s"],
                                                     "retries": config["retries"]})
    cls = load_function(config["environment"], "rollout.environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)) and not (
            hasattr(cls, "start") and hasattr(cls, "step")):
        raise ValueError(f"rollout.environment: {config['environment']!r} is not a class with start(row) and "
                         "step(text) (subclass elasticrl.envs.Environment)")
    tools = [load_function(p, f"rollout.tools[{i}]") for i, p in enumerate(config["tools"])]
    parser = parse_hermes if config["parser"] == "hermes" else load_function(config["parser"], "rollout.tool_parser")
    extra = {"tools": list(getattr(cls, "tools", [])) + tools, "timeout_s": config["timeout_s"]}
    if issubclass(cls, ToolEnvironment):
        extra["parser"] = staticmethod(parser)
    return type(cls.__name__, (cls,), extra)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value):
        raise ValueError(f"gave {str(value)[:80]!r}, not a list of {{role, content}} messages")
    return value


def _turn(value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"step gave {type(value).__name__}, not a dict of messages, reward, done")
    reward = value.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ValueError(f"step gave reward {reward!r}, not a finite number or None")
    return {"messages": _messages(value.get("messages", [])), "reward": reward, "done": bool(value.get("done")),
            "tool_calls": int(value.get("tool_calls", 0)), "tool_errors": int(value.get("tool_errors", 0)),
            "retries": int(value.get("retries", 0))}


def main(config: dict) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the environment prints goes to stderr: stdout is the protocol's
    sys.stdout = sys.stderr
    try:
        cls = environment_class(config)
        schemas = tool_schemas(cls.tools)
    except Exception as exc:  # noqa: BLE001 - a bad environment or tool: said once, in one line
        out.write(json.dumps({"e": str(exc) if isinstance(exc, ValueError) else
                              f"rollout.environment: {type(exc).__name__}: {exc}"}) + "\n")
        return 2
    out.write(json.dumps({"ready": True}) + "\n")
    episodes: dict = {}
    for line in sys.stdin:
        for item in json.loads(line)["items"]:
            try:
                if item["op"] == "start":
                    episodes[item["id"]] = env = cls()
                    reply = {"v": {"messages": _messages(env.start(item["row"])), "tools": schemas}}
                elif item["op"] == "step":
                    reply = {"v": _turn(episodes[item["id"]].step(item["text"]))}
                else:
                    episodes.pop(item["id"], None)
                    reply = {"v": None}
                text = json.dumps(reply)
            except Exception as exc:  # noqa: BLE001 - the user's code: any failure is that episode's error
                text = json.dumps({"e": f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__})
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
