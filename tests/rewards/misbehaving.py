"""Reward functions that misbehave as user code does, for the tests of reward isolation.
Each misbehaves on prompts that say so: "raise", "none", "text", "nan", "sleep", "crash"."""
from __future__ import annotations

import os
import time


def moody(prompt: str, completion: str, answer: str | None) -> float:
    print("a reward function that prints")  # must not break the protocol
    if prompt == "raise":
        return 1 / 0
    if prompt == "none":
        return None
    if prompt == "text":
        return "high"
    if prompt == "nan":
        return float("nan")
    if prompt == "sleep":
        time.sleep(60)
    if prompt == "crash":
        os._exit(3)
    return float(len(completion))


_calls = 0


def flaky(prompt: str, completion: str, answer: str | None) -> float:
    """Raises on every 10th call, else 0: a function failing 1 call in 10."""
    global _calls
    _calls += 1
    if _calls % 10 == 0:
        raise RuntimeError(f"call {_calls} failed")
    return 0.0


def pid(prompt: str, completion: str, answer: str | None) -> float:
    """The process that scored the sample."""
    return float(os.getpid())


def record(prompt: str, completion: str, answer: str | None) -> float:
    """Appends the sample to the file $ELASTICRL_TEST_RECORD as a JSON line; scores 0."""
    import json

    with open(os.environ["ELASTICRL_TEST_RECORD"], "a") as fh:
        fh.write(json.dumps({"completion": completion, "answer": answer}) + "\n")
    return 0.0
