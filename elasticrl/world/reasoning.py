"""The reasoning world (``world.task: reasoning``): answers that need a chain of thought of
hundreds to thousands of tokens, for long chain-of-thought RL (examples/tiny_reasoning.yaml).

A problem ``052+7...>020=`` asks where counting up from 52 in steps of 7 stands once it has
gone more than 20 past its start. The solution works it line by line, each line the running
value, the step, the new value and what is left of the distance: ``052+7=059 013``,
``059+7=066 006``, ``066+7=073 -01``; a line whose distance left is below zero ends the
count, and a last line gives the answer, ``73``. Numbers are written with three digits, so
every line has the same shape and its work is local for a small model: add the step to the
line above's value, take it from the line above's distance, stop when that goes below zero.
The chain is as long as the count, 14 tokens a line with the character-per-token tokenizer: a
problem of 100 lines is a 1,400-token answer.

The warm start sees only short chains (at most ``SFT_LINES`` lines); the RL prompts and the
held-out set draw their line counts from a long tail up to ``MAX_LINES`` (log-uniform), so
about half are longer than any chain the warm start saw and a tail passes 1,000 tokens.

(Two earlier forms failed in the warm start: numbers written as they are, whose additions the
2M-parameter model got wrong, and a limit to pass, ``y<limit`` on each line, whose comparison
it did not learn, stopping after as many lines as the longest chain it was taught.)
"""
from __future__ import annotations

import math
import random

# What a reasoning world holds: worlds and warm starts are cached by their settings, not by this
# code, so a change here bumps build.FORMAT_VERSION.
STEPS = range(1, 10)   # step sizes
SFT_LINES = 20         # the warm start's longest chain
MAX_LINES = 100        # the RL and held-out problems' longest
SFT_LENGTH = 320       # tokens of the warm start's longest row (prompt, 20 lines, answer, end of text)


def prompt(start: int, step: int, distance: int) -> str:
    return f"{start:03d}+{step}...>{distance:03d}="


def solution(start: int, step: int, distance: int) -> str:
    """The worked chain, one addition and one subtraction a line, then the answer."""
    lines, value, left = [], start, distance
    while left >= 0:
        value, left = value + step, left - step
        lines.append(f"{value - step:03d}+{step}={value:03d} " + (f"{left:03d}" if left >= 0 else f"-{-left:02d}"))
    return "\n".join(lines + [str(value)])


def answer(start: int, step: int, distance: int) -> int:
    return start + step * (distance // step + 1)


def _problem(rng: random.Random, lines: int) -> tuple[int, int, int]:
    """A problem whose chain has ``lines`` lines, every value within three digits."""
    step = rng.choice(STEPS)
    return rng.randint(0, 999 - lines * step), step, (lines - 1) * step + rng.randrange(step)


def make_records(num_train: int, num_eval: int, seed: int) -> dict[str, list[dict]]:
    """SFT rows (chains of 1 to SFT_LINES lines), RL prompts and held-out prompts (long-tailed
    up to MAX_LINES); no held-out problem is trained on."""
    rng = random.Random(seed + 4)  # its own stream: the arithmetic datasets keep their bytes

    def long_tail() -> int:  # log-uniform over 4..MAX_LINES
        return round(math.exp(rng.uniform(math.log(4), math.log(MAX_LINES))))

    held_out: dict[tuple, None] = {}
    while len(held_out) < num_eval:
        held_out.setdefault(_problem(rng, long_tail()))
    rl = [p for p in (_problem(rng, long_tail()) for _ in range(num_train)) if p not in held_out]
    sft = [p for p in (_problem(rng, rng.randint(1, SFT_LINES)) for _ in range(num_train)) if p not in held_out]

    def rows(problems, with_solution: bool):
        return [{"prompt": prompt(*p), "response": solution(*p)} if with_solution
                else {"prompt": prompt(*p), "answer": str(answer(*p))} for p in problems]
    return {"sft": rows(sft, True), "rl_prompts": rows(rl, False), "eval": rows(held_out, False)}
