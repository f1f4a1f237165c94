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
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {path!r} ({exc})") from None
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not callable")
    return fn

