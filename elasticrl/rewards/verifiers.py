"""Verifiers: whether a completion answers a task, ``fn(prompt, completion, answer) -> float``
(1.0 right, 0.0 wrong), the same signature as reward functions.

One verifier per job (``rewards.verifier``) scores the default reward and every accuracy
figure (``accuracy``, ``eval/accuracy``, ``eval/pass@k``), so the reward the policy learns
and the accuracy it is judged by cannot disagree. In a run they score in the reward
functions' processes (``rewards.isolated``), in parallel and under ``rewards.timeout_s``.
"""
from __future__ import annotations

import json
import re
import threading

from elasticrl.spec.schema import VERIFIERS
from elasticrl.world.task import is_correct

VERIFIER = "verifier"  # a reward function's path that means the job's verifier
_INTEGER = re.compile(r"-?\d+")


def integer(prompt: str, completion: str, answer) -> float:
    """The tiny arithmetic task's matcher: the completion's first integer is the answer."""
    return float(answer is not None and is_correct(completion, answer))


def last_integer(prompt: str, completion: str, answer) -> float:
    """The completion's last integer is the answer (a worked chain's result)."""
    found = _INTEGER.findall(completion)
    return float(answer is not None and bool(found) and int(found[-1]) == int(answer))


def math(prompt: str, completion: str, answer) -> float:
    """Mathematical equivalence by ``math-verify``: the completion's answer (a ``\\boxed{}``
    one first, else the last expression) equals the reference (LaTeX or plain: ``1/2``,
    ``\\frac{1}{2}`` and ``0.5`` agree). Its own timeouts use SIGALRM, so they are on in a main
    thread only; elsewhere the caller's process timeout bounds it."""
    from math_verify import parse, verify

    if answer is None:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(str(answer)), parsing_timeout=timeout)
    said = parse(completion, parsing_timeout=timeout)
    return float(bool(gold) and bool(said) and verify(gold, said, timeout_seconds=timeout))


def _as_math(text: str) -> str:
    """A plain reference answer (``12``, ``1/2``) in math mode, so it parses as an expression."""
    return text if "$" in text or "\\" in text else f"${text}$"


def exact(prompt: str, completion: str, answer) -> float:
    """The completion, stripped, is the answer, stripped."""
    return float(answer is not None and completion.strip() == str(answer).strip())


def regex(prompt: str, completion: str, answer) -> float:
    """The answer is a regular expression found in the completion."""
    return float(answer is not None and re.search(str(answer), completion) is not None)


def json_schema(prompt: str, completion: str, answer) -> float:
    """The completion is JSON valid against the answer, a JSON schema (an object or its text)."""
    import jsonschema

    if answer is None:
        return 0.0
    schema = json.loads(answer) if isinstance(answer, str) else answer
    try:
        jsonschema.validate(json.loads(completion), schema)
    except (ValueError, jsonschema.ValidationError):
        return 0.0
    return 1.0


def verifier_path(spec) -> str:
    """The import path of the job's verifier, ``rewards.verifier`` by name or path (the spec
    loader has resolved 'auto')."""
    name = spec.rewards.verifier
    return f"{__name__}:{name}" if name in VERIFIERS else name


def function_path(path: str, spec) -> str:
    """A reward function's import path, ``verifier`` standing for the job's verifier."""
    return verifier_path(spec) if path == VERIFIER else path


def full_marks(score) -> bool:
    """Whether a verifier's score (a number, or an error's text) counts as right."""
    return not isinstance(score, str) and score >= 1.0
