"""Name -> function tables, so a job spec can pick an estimator or a loss by name."""
from __future__ import annotations

from typing import Callable


class Registry(dict):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable:
        def deco(fn):
            if name in self:
                raise KeyError(f"{self.kind} {name!r} registered twice")
            self[name] = fn
            return fn
        return deco

    def get_or_raise(self, name: str, field: str):
        if name not in self:
            raise ValueError(f"{field}: unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}")
        return self[name]
