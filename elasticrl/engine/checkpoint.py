"""Resumable checkpoints and the Hugging Face export of a DeepSpeed engine.

A checkpoint ``step_NNNNNNN/`` holds one folder per trained role (``actor/``, ``critic/``),
each a Hugging Face folder of the fp32 master weights with the optimizer moments, the
schedule and each rank's RNG beside them (``engine.state``: rank-unaware, so any world size
and ZeRO stage resumes it), and ``trainer_state.json``: the step, the data position, what the
trainer carries between steps, the spec and the code version that wrote it. Only
safetensors and JSON are written, and a folder holding anything else is refused before
anything is loaded: nothing is ever unpickled. Every rank writes into a temp folder that the
driver renames once all are done (``new_checkpoint``), so a crash mid-save leaves no
checkpoint rather than a broken one, and older ones are pruned only after that.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import elasticrl
from elasticrl.files import atomic_folder, read_json, write_text

FORMAT = 2  # of what a checkpoint holds; bump when a reader of the old one would misread it
CHECKPOINTS = "checkpoints"  # OUTPUT/checkpoints/step_NNNNNNN/
STATE_FILE = "trainer_state.json"
RESUMING = "resuming from checkpoint"  # the console line `elasticrl status` looks for
_STEP_DIR = re.compile(r"^step_(\d+)$")
# the only files elasticrl writes into a checkpoint (a tokenizer's chat template is Jinja text)
SAFE_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt")
# spec fields a resumed job may change: how long it runs, how it reports, where and on how many
# ranks it runs (the data order and the global batch do not depend on them)
MAY_CHANGE = ("train.max_steps", "train.num_epochs", "rl.num_steps", "rounds.num_rounds", "eval.", "log.",
              "checkpoint.", "export.", "ray.", "placement.", "train.num_ranks", "train.threads",
              "train.micro_batch_size", "train.tp_size", "train.zero_stage", "train.offload_optimizer",
              "train.offload_params", "train.comm_timeout_s", "critic.num_ranks", "model.gradient_checkpointing",
              "rollout.num_engines", "rollout.tp_size", "rollout.cpus_per_engine", "rollout.kv_cache_gib",
              "rollout.gpu_memory_utilization", "rollout.weight_sync", "rollout.bucket_mb", "rollout.cpu_sleep",
              "rollout.max_restarts", "rollout.hang_factor", "rewards.workers", "fault.")


def step_dir(root: Path, step: int) -> Path:
    """The folder of the checkpoint of ``step`` in ``root`` (a run's OUTPUT/checkpoints)."""
    return Path(root) / f"step_{step:07d}"


@dataclass(frozen=True)
class Resume:
    """Where a run starts: a checkpoint ``folder`` and its trainer ``state``, or (folder None)
    the start."""

    folder: Path | None = None
    state: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.state.get("step", 0)

    def role(self, name: str) -> str | None:
        """The folder a trained role (``actor``, ``critic``) loads from; None at the start."""
        return str(self.folder / name) if self.folder else None


def resume_from(folder: Path) -> Resume:
    return Resume(Path(folder), read_trainer_state(folder))


def _check_roles(folder: Path) -> None:
    """Each trained role's folder is whole: its engine state, config and weights."""
    from elasticrl.engine.state import ENGINE_STATE
    from elasticrl.models.check import check_model_folder

    roles = [p for p in sorted(folder.iterdir()) if p.is_dir()]
    if not roles:
        raise ValueError(f"checkpoint.resume: {folder} holds no trained role (actor/); the checkpoint is incomplete: "
                         "resume from another (checkpoint.resume: PATH) or start fresh (checkpoint.resume: null)")
    for role in roles:
        if not (role / ENGINE_STATE).is_file():
            raise ValueError(f"checkpoint.resume: {role} has no {ENGINE_STATE}; the checkpoint is incomplete: resume "
                             "from another (checkpoint.resume: PATH) or start fresh (checkpoint.resume: null)")
        check_model_folder(role, "checkpoint.resume", tokenizer=False)


def write_trainer_state(folder: Path, spec, state: dict) -> None:
    """``trainer_state.json``: ``state`` plus the format, the code version and the spec."""
    from elasticrl.spec import spec_to_dict

    doc = {"format": FORMAT, "elasticrl": elasticrl.__version__, **state, "spec": spec_to_dict(spec)}
    write_text(folder / STATE_FILE, json.dumps(doc, indent=2, sort_keys=True))


def read_trainer_state(folder: Path) -> dict:
    path = Path(folder) / STATE_FILE
    state = read_json(path, "the checkpoint is damaged: resume from another (checkpoint.resume: PATH) or start "
                            "fresh (checkpoint.resume: null)", whole=False)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path}: not a trainer state (no step); the checkpoint is damaged: resume from another "
                         "(checkpoint.resume: PATH) or start fresh (checkpoint.resume: null)")
    return state


def check_resumable(folder: Path, spec) -> dict:
    """The trainer state of checkpoint ``folder`` once it is safe and fit to resume ``spec``:
    it holds only files elasticrl writes, its format is this code's, and the spec differs
    from the one that wrote it only in fields that may change. Errors name the fix."""
    from elasticrl.spec import spec_to_dict

    folder = Path(folder)
    state = read_trainer_state(folder)
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix not in SAFE_SUFFIXES:
            raise ValueError(f"checkpoint.resume: {path} is not a file elasticrl writes (only safetensors and JSON); "
                             "refusing to resume from a folder that holds it (a pickle could run code)")
    if state.get("format") == FORMAT:
        _check_roles(folder)
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint.resume: {folder} is of checkpoint format {state.get('format', 1)} "
                         f"(elasticrl {state.get('elasticrl', '< 0.2')}); this elasticrl reads format {FORMAT}: "
                         "start fresh with checkpoint.resume: null")
    changed = changed_fields(state["spec"], spec_to_dict(spec))
    fixed = [k for k in changed if not k.startswith(MAY_CHANGE)]
    if fixed:
        shown = ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in fixed)
        raise ValueError(f"checkpoint.resume: {folder} was written by a job that differs in {shown}, which a "
                         "resumed job may not change (it may change step counts, eval, log, checkpoint, export, "
                         "placement and rank counts); set them back, or use another --output")
    return state


def changed_fields(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted field -> (old, new) of every leaf that differs between two spec dicts."""
    out = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(changed_fields(a, b, f"{prefix}{key}."))
        elif a != b and not (isinstance(a, list) and isinstance(b, tuple) and list(b) == a):
            out[f"{prefix}{key}"] = (a, b)
    return out


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
    with atomic_folder(step_dir(root, step)) as tmp:
        yield tmp
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def consolidated_state_dict(engine) -> dict:
    """Full weights on rank 0 (None elsewhere). Collective: call on every rank."""
    import torch.distributed as dist

    if engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
        return engine._consolidated_16bit_state_dict()
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def export_hf(engine, tokenizer, folder: str | Path, max_shard_bytes: int, dtype) -> None:
    """Write an HF model folder (config, sharded safetensors, tokenizer) atomically.

    Collective: every rank calls it; rank 0 writes.
    """
    import torch.distributed as dist

    from elasticrl.weights.shards import save_sharded

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
