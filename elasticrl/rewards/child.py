"""The process reward functions run in (``python -m elasticrl.rewards.child PATH...``).

JSON lines both ways, never pickle. In: ``{"f": i, "items": [[prompt, completion, answer], ...]}``.
Out: ready, then one line per item: ``{"v": number}`` or ``{"e": "what went wrong"}``. What
the user's functions print goes to stderr: stdout is the protocol's."""
from __future__ import annotations

import json
import math
import os
import sys


class BadValue(ValueError):
    """A function returned something that is not a finite number."""


def number(value) -> float:
    """``value`` as a finite float, or BadValue saying what the function returned."""
    try:
        x = float(value) if not isinstance(value, (str, bytes)) else None
    except (TypeError, ValueError):
        x = None
    if x is None:
        raise BadValue(f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    if not math.isfinite(x):
        raise BadValue(f"returned {x}")
    return x


def main(paths: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the functions' prints, even from C, go to stderr
    sys.stdout = sys.stderr
    from elasticrl.rewards.functions import load_function

    try:
        fns = [load_function(p, f"rewards.functions[{i}].path") for i, p in enumerate(paths)]
    except ValueError as exc:
        out.write(json.dumps({"e": str(exc)}) + "\n")
        return 2
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        fn = fns[request["f"]]
        for prompt, completion, answer in request["items"]:
            try:
                reply = {"v": number(fn(prompt, completion, answer))}
            except BadValue as exc:
                reply = {"e": str(exc)}
            except Exception as exc:  # noqa: BLE001 - the user's code: any failure is that call's error
                reply = {"e": f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__}
            out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
