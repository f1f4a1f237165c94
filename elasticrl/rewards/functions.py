"""Reward functions: ``fn(prompt: str, completion: str, answer: str | None) -> float``,
named in the spec by import path (``package.module:function``); the verifiers
(``rewards.verifiers``) are such functions too."""
from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[str, str, "str | None"], float]


def load_function(path: str, field: str = "rewards.functions") -> RewardFn:
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ValueError(f"{field}: {path!r} is not an import path; write package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field}: cannot import {path!r} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: its own error, in one line
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{field}: cannot import {path!r}: importing {module_name} raised "
                         f"{type(exc).__name__}{': ' + first if first else ''}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{field}: cannot import {path!r} (module {module_name!r} has no attribute {attr!r})")
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not callable")
    return fn

