"""Micro-batches cut by tokens (``train.max_tokens_per_micro_batch``), not by rows.

A mini-batch's rows go to the data-parallel ranks balanced by their tokens (longest first, each
to the rank holding the fewest so far), so that ranks with long samples do not hold up the rest;
each rank's rows are then cut, longest first, into micro-batches of at most the budget: a
padded micro-batch costs its rows times its longest (the tensor it computes), a packed one the
sum of its lengths. A row longer than the budget alone is a micro-batch of its own. Every rank
runs the same number of micro-batches (ZeRO-2 reduces and ZeRO-3 gathers at each one): a rank
with fewer splits its largest, and one with too few rows runs empty ones (``None``), which the
trainers compute on a stand-in row with no weight in the loss. Every rank plans every rank's
split from the lengths it was sent, so no collective is needed. The losses divide by the
mini-batch's global counts, so any cut sums to the padded computation's loss and gradients.
"""
from __future__ import annotations


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Positions of ``lengths`` over ``parts`` ranks with near-equal token sums (longest first to
    the rank with the fewest tokens, then the fewest rows); each rank's in ascending order."""
    tokens, out = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(parts), key=lambda r: (tokens[r], len(out[r]), r))
        tokens[r] += lengths[i]
        out[r].append(i)
    return [sorted(p) for p in out]


def cost(lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch of these lengths computes: their sum packed, rows x longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def cut(positions: list[int], lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """``positions`` (a rank's rows) in micro-batches of at most ``budget`` tokens, longest first."""
    out: list[list[int]] = []
    for i in sorted(positions, key=lambda i: (-lengths[i], i)):
        if out and cost([lengths[j] for j in out[-1]] + [lengths[i]], packed) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def plan(lengths: list[int], parts: int, budget: int, packed: bool) -> list[list[list[int] | None]]:
    """Every rank's micro-batches of a mini-batch (positions into ``lengths``), the same number
    on each: ``None`` where a rank has no rows left for one."""
    ranks = [cut(p, lengths, budget, packed) for p in balance(lengths, parts)]
    count = max(len(r) for r in ranks)
    for micro in ranks:
        while len(micro) < count and max(map(len, micro), default=0) > 1:
            big = max(range(len(micro)), key=lambda m: len(micro[m]))
            half = len(micro[big]) // 2
            micro[big:big + 1] = [micro[big][:half], micro[big][half:]]
        micro.extend([None] * (count - len(micro)))
    return ranks


def imbalance(lengths: list[int], shares: list[list[int]]) -> float:
    """How much longer the busiest rank's tokens are than the ranks' mean: max / mean - 1."""
    sums = [sum(lengths[i] for i in s) for s in shares]
    mean = sum(sums) / max(1, len(sums))
    return max(sums) / mean - 1 if mean else 0.0
