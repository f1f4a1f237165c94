"""The transports of weights into rollout engines, one module each, sender and receiver side by side.

A transport's module (named as ``rollout.weight_sync`` names it) holds:

- ``Sender(Transport)``: the trainer ranks' half, which ``sync.WeightSender`` drives: it sends
  each rank's AutoTP pieces (``send_sliced``, where the transport can write slices) or rank 0's
  whole tensors (``send_gathered``), as one ``Payload`` kind: the weights whole, only what
  changed, or a LoRA adapter's tensors;
- ``Receiver``: the half in every engine worker, one per worker and transport, whose methods
  the sender calls by name through the engine (``engine.weights(transport, method, *args)``,
  which returns each worker's answer); it receives into the worker's parameters or hands
  (name, tensor) pairs to ``worker.erl_land``.

Adding a transport is adding a module here (and its test): this package finds it by name.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass
class Payload:
    """What one sync carries: ``kind`` "full" (the weights, as the engines load them), "delta"
    (only the words that changed since the last sync, counted by ``delta``, a
    ``slices.Delta``) or "adapter" (a LoRA adapter's tensors, ``adapter`` its peft config,
    which the engines serve instead of loading them)."""
    kind: str = "full"
    adapter: dict | None = None
    delta: Any = None

    def message(self) -> dict:
        """What a receiver is told (plain values: it crosses Ray and vLLM's messages)."""
        return {"kind": self.kind, "adapter": self.adapter}


class Transport:
    """A transport's sending half on one trainer rank, for one ``sync.WeightSender`` (``s``):
    its engines, ranks, layouts, copy plans and who sends what."""

    name = ""
    sliced = False  # can send each rank's pieces (``send_sliced``) into engines with copy plans

    def __init__(self, s):
        self.s = s

    def delta_pays(self) -> bool:
        """Whether a delta costs less than the bytes it saves here (decided on every rank alike)."""
        return False

    def call(self, engine: int, method: str, *args):
        """A Ray ref of ``method`` of this transport's receivers in one engine (each worker's answer)."""
        return self.s.engines[engine].weights.remote(self.name, method, *args)

    def call_all(self, method: str, *args) -> list:
        return [self.call(e, method, *args) for e in range(len(self.s.engines))]

    def send_sliced(self, tensors, mine: list[tuple[int, int, list]], payload: Payload) -> int:
        """Every rank: the (name, local tensor) pairs in order, my (engine, worker, pieces); the bytes sent."""
        raise NotImplementedError(f"rollout.weight_sync {self.name}: no sliced sends")

    def send_gathered(self, params, size: int, payload: Payload) -> int | None:
        """Rank 0: (name, full tensor) pairs, buckets of ``size`` bytes; the bytes that reached
        the engines (None: every tensor once per engine)."""
        raise NotImplementedError

    def stats(self) -> dict:
        """This transport's own figures for a sync's metrics row."""
        return {}

    def forget(self) -> None:
        """A sync failed: the engines may hold part of it, and the next one goes whole."""

    def release(self) -> None:
        """The engines restarted: what this transport held of them is gone."""

    def close(self) -> None:
        """The sender is done with these engines."""
        self.release()


def each_piece(tensors, targets: list[tuple[Any, list]], copy) -> int:
    """``copy(target, piece, tensor)`` for every piece of ``targets`` ((target, its pieces)) as the
    (name, tensor) pairs come; the bytes it says it sent. After a failure the tensors are still
    walked (ZeRO-3 gathers them collectively), then it is raised."""
    by_name: dict[str, list] = {}
    for target, pieces in targets:
        for piece in pieces:
            by_name.setdefault(piece.name, []).append((target, piece))
    sent, error = 0, None
    for name, t in tensors:
        for target, piece in by_name.get(name, ()) if error is None else ():
            try:
                sent += copy(target, piece, t)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = exc
                break
    if error is not None:
        raise error
    return sent


def names() -> tuple[str, ...]:
    """Every transport, from this package's modules (none imported)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


@cache
def module(name: str):
    if name not in names():
        raise ValueError(unknown(name))
    return importlib.import_module(f"{__name__}.{name}")


def unknown(name: str) -> str | None:
    """The one-line error for a ``rollout.weight_sync`` that names no transport (None: it does)."""
    if name == "auto" or name in names():
        return None
    close = difflib.get_close_matches(name, names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"rollout.weight_sync: unknown transport {name!r}{hint}; choose auto or one of {', '.join(names())}"


def choose(requested: str, one_node: bool, gpu: bool) -> str:
    """``auto``: memory copies on one node (shm on CPU, ipc on GPUs), else broadcast."""
    if requested == "shm" and gpu:
        raise ValueError("rollout.weight_sync: shm writes into CPU engines' memory; on GPUs use ipc (one node) "
                         "or broadcast")
    if requested != "auto":
        module(requested)
        return requested
    return ("ipc" if gpu else "shm") if one_node else "broadcast"


def receiver(worker, transport: str, method: str, args) -> Any:
    """In an engine's worker: ``method`` of its receiver of ``transport`` (made at the first call)."""
    held = worker.__dict__.setdefault("_erl_receivers", {})
    if transport not in held:
        held[transport] = module(transport).Receiver(worker)
    return getattr(held[transport], method)(*args)


def release_receivers(worker) -> None:
    for r in worker.__dict__.pop("_erl_receivers", {}).values():
        r.release()


class ReceiverBase:
    """A transport's receiving half in one engine worker; ``worker`` provides ``erl_params()``
    (its parameters, in ``named_parameters`` order), ``erl_land(weights, message)`` (load
    (name, tensor) pairs, or serve them as the adapter), ``erl_plans()`` (copy plans or None),
    ``erl_rank()`` (its tensor-parallel rank) and ``erl_device()``."""

    def __init__(self, worker):
        self.worker = worker

    def release(self) -> None:
        """The engine shuts down or restarts: let go of what this receiver maps."""
