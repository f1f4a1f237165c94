"""The toy task: small-number arithmetic with a verifiable answer.

Problems like ``17+5=`` with the answer ``22``. All distinct problems are enumerated and
split once into train and held-out sets, so evaluation never sees a training problem.
"""
from __future__ import annotations

import random
import re

_INT = re.compile(r"-?\d+")


def enumerate_problems(max_operand: int, operators: str) -> list[tuple[str, int]]:
    """Every distinct (prompt, answer); subtraction keeps answers non-negative."""
    out = []
    for op in operators:
        hi = min(max_operand, 12) if op == "*" else max_operand
        for a in range(hi + 1):
            for b in range(hi + 1):
                if op == "-" and b > a:
                    continue
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                out.append((f"{a}{op}{b}=", answer))
    return out


def split_problems(max_operand: int, operators: str, num_eval: int, seed: int):
    problems = enumerate_problems(max_operand, operators)
    random.Random(seed).shuffle(problems)
    num_eval = min(num_eval, len(problems) // 4)
    return problems[num_eval:], problems[:num_eval]


def parse_answer(text: str) -> int | None:
    """The first integer in a completion, or None."""
    match = _INT.search(text)
    return int(match.group()) if match else None


def is_correct(completion: str, answer: str | int) -> bool:
    """Numeric answers compare as integers; any other answer as the stripped text."""
    expected = parse_answer(str(answer))
    if expected is not None and str(answer).strip() == str(expected):
        return parse_answer(completion) == expected
    return completion.strip() == str(answer).strip()


def make_records(max_operand: int, operators: str, num_train: int, num_eval: int, seed: int) -> dict:
    """The world's datasets as lists of dicts, deterministic in their arguments."""
    train, held_out = split_problems(max_operand, operators, num_eval, seed)
    rng = random.Random(seed + 1)
    sft, prompts = [], []
    for _ in range(num_train):
        prompt, answer = train[rng.randrange(len(train))]
        sft.append({"prompt": prompt, "response": str(answer)})
    for prompt, answer in train:
        prompts.append({"prompt": prompt, "answer": str(answer)})
    rng.shuffle(prompts)
    prefs = _preference_pairs(train, rng)
    evals = [{"prompt": p, "answer": str(a)} for p, a in held_out]
    return {"sft": sft, "rl_prompts": prompts, "preference": prefs, "eval": evals,
            "preference_eval": _preference_pairs(held_out, rng)}


def _preference_pairs(problems, rng, per_problem: int = 4) -> list[dict]:
    """The right answer chosen over wrong ones, from near misses (off by one in a digit) to
    far ones, ``per_problem`` distinct negatives each."""
    pairs = []
    for prompt, answer in problems:
        deltas = rng.sample([-20, -11, -10, -5, -3, -2, -1, 1, 2, 3, 5, 10, 11, 20], per_problem)
        for delta in deltas:
            wrong = answer + delta if answer + delta >= 0 else answer - delta
            pairs.append({"prompt": prompt, "chosen": str(answer), "rejected": str(wrong)})
    rng.shuffle(pairs)
    return pairs
