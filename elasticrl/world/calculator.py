"""The calculator world (``world.task: calculator``): multiplication of numbers up to
``world.max_operand``, too hard for the tiny model alone, and a calculator it can call.

The tiny model's call format is short, ``calc(37*48)``, read by ``parse_calls`` (the job's
``rollout.tool_parser``); the calculator's answer comes back as a tool message, which the tiny
world's chat template renders as a user turn. Its SFT rows are conversations: a share
(``world.tool_demos``) call the calculator and copy its answer, the rest answer directly.
"""
from __future__ import annotations

import ast
import random
import re

_CALL = re.compile(r"calc\(([^()]*)\)")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def calc(expression: str) -> int:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. 37*48
    """
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an expression of integers with +, - and *: {expression!r}")
    if len(expression) > 64:
        raise ValueError("an expression longer than 64 characters")
    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not an expression of integers with +, - and *: {expression!r}") from None


def parse_calls(text: str) -> list[dict]:
    """``calc(EXPRESSION)`` calls in the model's text (``rollout.tool_parser``)."""
    return [{"name": "calc", "arguments": {"expression": e}} for e in _CALL.findall(text)]


def with_calculator(records: dict, share: float, seed: int) -> dict:
    """The arithmetic world's datasets, its SFT rows as conversations, ``share`` of them calling
    the calculator."""
    rng = random.Random(seed + 3)  # its own stream: the other datasets keep their bytes
    sft = []
    for r in records["sft"]:
        user, answer = {"role": "user", "content": r["prompt"]}, r["response"]
        turns = [{"role": "assistant", "content": f"calc({r['prompt'].rstrip('=')})"},
                 {"role": "tool", "content": answer}] if rng.random() < share else []
        sft.append({"messages": [user, *turns, {"role": "assistant", "content": answer}]})
    return {**records, "sft": sft}
