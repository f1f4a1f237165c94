"""Resumable checkpoints and Hugging Face export of a DeepSpeed engine.

A checkpoint folder holds DeepSpeed's own state (weights, optimizer, LR schedule), one RNG
file per rank (safetensors) and ``trainer_state.json`` (step and data position). Every
rank writes into a temp folder that the driver renames to ``step_NNNNNNN`` once all ranks
are done (``new_checkpoint``), so a crash mid-save leaves no checkpoint rather than a
broken one.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from elasticrl import backend
from elasticrl.files import atomic_folder, write_text
from elasticrl.weights.shards import save_sharded

DS_TAG = "deepspeed"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_engine_state(engine, folder: str | Path, rank: int) -> None:
    """Called on every rank, inside the temp folder the driver created."""
    folder = Path(folder)
    engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)
    save_file(backend.rng_state(), str(folder / f"rng_rank{rank}.safetensors"))


def load_engine_state(engine, folder: str | Path, rank: int) -> None:
    folder = Path(folder)
    # DeepSpeed's checkpoint format holds pickled optimizer objects: it loads them itself
    # (it is our own file, written by this run); nothing from elsewhere is unpickled.
    path, _ = engine.load_checkpoint(str(folder), tag=DS_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"{folder}: no DeepSpeed state under tag {DS_TAG!r}")
    rng = folder / f"rng_rank{rank}.safetensors"
    if rng.is_file():  # absent when resuming at a larger world size: keep the fresh seed
        backend.set_rng_state(load_file(str(rng)))


def write_trainer_state(folder: Path, state: dict) -> None:
    write_text(folder / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))


def read_trainer_state(folder: Path) -> dict:
    return json.loads((Path(folder) / STATE_FILE).read_text())


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


@contextlib.contextmanager
def new_checkpoint(root: Path, step: int, keep: int) -> Iterator[Path]:
    """Yields the temp folder every rank saves into; when the block succeeds it becomes
    ``step_NNNNNNN`` and the checkpoints older than the newest ``keep`` are removed."""
    for stale in Path(root).glob(".step_*"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_folder(Path(root) / f"step_{step:07d}") as tmp:
        yield tmp
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full weights on rank 0 (None elsewhere). Collective: call on every rank."""
    import torch.distributed as dist

    if engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
        return engine._consolidated_16bit_state_dict()
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def export_hf(engine, tokenizer, folder: str | Path, max_shard_bytes: int, dtype: torch.dtype) -> None:
    """Write an HF model folder (config, sharded safetensors, tokenizer) atomically.

    Collective: every rank calls it; rank 0 writes.
    """
    import torch.distributed as dist

    state = consolidated_state_dict(engine)
    if dist.get_rank() == 0:
        with atomic_folder(folder) as tmp:
            state = {k: v.to(dtype) for k, v in state.items()}
            config = engine.module.config
            config.dtype = dtype
            config.save_pretrained(tmp)
            if getattr(engine.module, "generation_config", None) is not None:
                engine.module.generation_config.save_pretrained(tmp)
            save_sharded(state, tmp, max_shard_bytes)
            tokenizer.save_pretrained(tmp)
    dist.barrier()
