"""The toy task: small-number arithmetic with a verifiable answer.

Problems like ``17+5=`` with the answer ``22``. All distinct problems are enumerated and
split once into train and held-out sets, so evaluation never sees a training problem.
"""
from __future__ import annotations

import random
import re

_INT = re.compile(r"-?\d+")


def enumerate_problems(max_operand: int, operators: str, mul_max: int = 12) -> list[tuple[str, int]]:
    """Every distinct (prompt, answer); subtraction keeps answers non-negative, multiplication
    takes operands up to ``mul_max``."""
    out = []
    for op in operators:
        hi = min(max_operand, mul_max) if op == "*" else max_operand
        for a in range(hi + 1):
            for b in range(hi + 1):
                if op == "-" and b > a:
                    continue
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                out.append((f"{a}{op}{b}=", answer))
    return out


def split_problems(max_operand: int, operators: str, num_eval: int, seed: int, mul_max: int = 12):
    problems = enumerate_problems(max_operand, operators, mul_max)
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


def make_records(max_operand: int, operators: str, num_train: int, num_eval: int, seed: int,
                 mul_max: int = 12) -> dict:
    """The world's datasets as lists of dicts, deterministic in their arguments."""
    train, held_out = split_problems(max_operand, operators, num_eval, seed, mul_max)
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
            "preference_eval": _preference_pairs(held_out, rng), **_step_records(max_operand, operators, num_train,
                                                                                 num_eval, seed)}


def _near_miss(value: int, rng) -> int:
    delta = rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])
    return value + delta if value + delta >= 0 else value - delta


def _step_records(max_operand: int, operators: str, num_train: int, num_eval: int, seed: int) -> dict:
    """Two-step problems (``12+7-5=``) solved step by step, each step labelled 1 while the
    solution is still on track and 0 from its first wrong step on (Math-Shepherd's hard labels).

    Each problem has four solutions: right; an operand misread in step 1 and carried on
    (both steps 0); a wrong value carried into step 2 (1, 0); and misreads in both steps that
    cancel out, so the final answer is right (an outcome check passes it, a process check must
    not: 0, 0). Every step's own arithmetic is right: the errors are the ones a check against
    the problem and the previous step catches. Held-out problems are never trained on.
    """
    rng = random.Random(seed + 2)  # its own stream: the other datasets keep their bytes
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    want, records = num_train // 10 + num_eval // 4, {}
    for _ in range(50 * want):
        if len(records) == want:
            break
        op1, op2 = rng.choice(operators), rng.choice(operators)
        a, b, c = (rng.randint(0, min(max_operand, 12) if "*" in (op1, op2) else max_operand) for _ in range(3))
        x = apply[op1](a, b)
        y = apply[op2](x, c) if x >= 0 else -1
        prompt = f"{a}{op1}{b}{op2}{c}="
        if y < 0 or prompt in records:
            continue
        b2 = _near_miss(b, rng)  # misread operand
        x2, x3 = apply[op1](a, b2), _near_miss(x, rng)
        # the second misread that brings the answer back to y
        c2 = next((v for v in range(4 * max_operand + 1) if v != c and x2 >= 0 and apply[op2](x2, v) == y), None)
        if x2 < 0 or c2 is None or min(apply[op2](x2, c), apply[op2](x3, c)) < 0:
            continue
        step1, misread = f"{a}{op1}{b}={x}", f"{a}{op1}{b2}={x2}"
        records[prompt] = [
            {"prompt": prompt, "steps": [step1, f"{x}{op2}{c}={y}"], "labels": [1, 1]},
            {"prompt": prompt, "steps": [misread, f"{x2}{op2}{c}={apply[op2](x2, c)}"], "labels": [0, 0]},
            {"prompt": prompt, "steps": [step1, f"{x3}{op2}{c}={apply[op2](x3, c)}"], "labels": [1, 0]},
            {"prompt": prompt, "steps": [misread, f"{x2}{op2}{c2}={y}"], "labels": [0, 0]},
        ]
    groups = list(records.values())
    held = num_eval // 4
    train = [r for group in groups[held:] for r in group]
    rng.shuffle(train)
    return {"prm": train, "prm_eval": [r for group in groups[:held] for r in group]}


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
