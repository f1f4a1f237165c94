"""Resumable checkpoints and the Hugging Face export of a DeepSpeed engine.

A checkpoint ``step_NNNNNNN/`` holds one folder per trained role (``actor/``, ``critic/``):
each rank's pieces of the fp32 master weights and optimizer moments, the schedule and
counters, each rank's RNG, the model's config and tokenizer (``engine.state``: any world
size, ZeRO stage and tensor-parallel size resumes it), and ``trainer_state.json``: the step,
the data position, what the trainer carries between steps, the spec and the code version
that wrote it. Only safetensors and JSON are written, and a folder holding anything else is
refused before anything is loaded: nothing is ever unpickled. Every rank writes into a temp
folder (``begin_checkpoint``) that the driver renames once all are done (``commit_checkpoint``),
so a crash mid-save leaves no checkpoint rather than a broken one, and older ones are pruned
only after that.
The export (``export_hf``) is written the same way: by every rank, into a folder the driver
renames.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import elasticrl
from elasticrl.files import read_json, replace_folder, write_text

FORMAT = 3  # of what a checkpoint holds; bump when a reader of the old one would misread it
STATE_FILE = "trainer_state.json"
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
    """Each trained role's folder is whole: its engine state, config and every rank's pieces."""
    from elasticrl.engine.state import ENGINE_STATE, Pieces
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
        try:
            Pieces(role)
        except ValueError as exc:
            raise ValueError(f"checkpoint.resume: {exc}") from None


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


def begin_checkpoint(root: Path, step: int) -> Path:
    """The temp folder the ranks save step ``step``'s checkpoint into (``commit_checkpoint``
    puts it in place); what an interrupted save left is removed first."""
    for stale in Path(root).glob(".step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{step_dir(root, step).name}.tmp-"))


def commit_checkpoint(tmp: Path, root: Path, step: int, keep: int) -> None:
    """``tmp`` becomes ``step_NNNNNNN``; the checkpoints older than the newest ``keep`` go."""
    os.chmod(tmp, 0o755)
    replace_folder(tmp, step_dir(root, step))
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _export_plan(engine, dtype, max_shard_bytes: int) -> tuple[list, list[list[str]], int]:
    """(name, tensor) of every entry of the model's state dict in order, the files they go
    into (``plan_shards``) and their total bytes: the same on every rank, from whole shapes."""
    import torch

    from elasticrl.engine import state
    from elasticrl.weights.shards import plan_shards

    tensors = dict(engine.module.named_parameters(remove_duplicate=False))
    tensors.update(engine.module.named_buffers(remove_duplicate=False))
    sliced = state.tp_slices(engine)
    entries, sizes = [], []
    for name in engine.module.state_dict().keys():
        t = tensors[name]
        shape = list(getattr(t, "ds_shape", t.shape))
        if id(t) in sliced:
            layer, dim = sliced[id(t)]
            shape[dim] = sum(layer._partition_sizes)
        entries.append((name, t))
        sizes.append((name, math.prod(shape) * torch.tensor([], dtype=dtype).element_size()))
    return entries, plan_shards(sizes, max_shard_bytes), sum(n for _, n in sizes)


def export_hf(engine, tokenizer, folder: str | Path, max_shard_bytes: int, dtype) -> None:
    """Write a Hugging Face model folder (config, sharded safetensors and their index,
    tokenizer) into ``folder``, which the driver made and renames when every rank is done.

    The ranks write in parallel: file i of the plan is rank i mod world size's. ZeRO-3 gathers
    one parameter at a time and AutoTP one layer's slices, for their owner to keep; no rank
    holds more than its files' tensors. Collective: every rank calls it."""
    import torch.distributed as dist
    from deepspeed.runtime.zero import GatheredParameters

    from elasticrl.engine import state
    from elasticrl.weights.shards import shard_names, write_index, write_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    entries, shards, total = _export_plan(engine, dtype, max_shard_bytes)
    names = shard_names(len(shards))
    file_of = {key: i for i, keys in enumerate(shards) for key in keys}
    sliced = state.tp_slices(engine)
    mine: dict[int, list] = {i: [] for i in range(len(shards)) if i % world == rank}
    for name, t in entries:
        keep = file_of[name] in mine
        if hasattr(t, "ds_id"):  # ZeRO-3: every rank takes part in the gather
            with GatheredParameters([t]):
                whole = t.data.to(dtype).cpu().clone() if keep else None
        elif id(t) in sliced:
            layer, dim = sliced[id(t)]
            whole = layer._all_gather_shards(t.data.contiguous(), layer._partition_sizes, dim)
            whole = whole.to(dtype).cpu() if keep else None
        else:
            whole = t.detach().to(dtype).cpu() if keep else None
        if keep:
            mine[file_of[name]].append((name, whole.contiguous()))
            if len(mine[file_of[name]]) == len(shards[file_of[name]]):  # the file is whole: write it, let it go
                write_safetensors(folder / names[file_of[name]], mine.pop(file_of[name]), {"format": "pt"})
    if rank == 0:
        config = engine.module.config
        config.dtype = dtype
        config.save_pretrained(folder)
        if getattr(engine.module, "generation_config", None) is not None:
            engine.module.generation_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if len(shards) > 1:
            write_index(folder, total, {key: names[i] for i, keys in enumerate(shards) for key in keys})


ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_BASE = "lora_base.json"  # in a LoRA checkpoint: the base its adapters belong to


def base_identity(model_path: str) -> dict:
    """The frozen base of a LoRA run: its folder and a fingerprint of its weight files (their
    names, sizes and safetensors headers, and 16 evenly spread 64 KiB samples of each: read in
    milliseconds, where a whole hash of a 7B model would read 14 GB)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            h.update(head + fh.read(int.from_bytes(head, "little")))
            for k in range(16):
                fh.seek(size * k // 16)
                h.update(fh.read(2**16))
    return {"path": str(model_path), "fingerprint": h.hexdigest()}


def check_base(folder: str | Path, model_path: str) -> None:
    """Refuse to resume adapters onto another base than the one they were trained on."""
    saved = Path(folder) / LORA_BASE
    if not saved.is_file():
        return
    was, now = read_json(saved, "resume from a checkpoint written whole"), base_identity(model_path)
    if was["fingerprint"] != now["fingerprint"]:
        raise ValueError(f"checkpoint {folder}: its LoRA adapters were trained on the base {was['path']}, and "
                         f"model.path {model_path} holds other weights; resume with that base, or set "
                         "checkpoint.resume: null to start over")


def export_adapters(engine, tokenizer, folder: str | Path) -> None:
    """Write a peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, the
    tokenizer) of a LoRA-trained model into ``folder``: the adapters only, in fp32, which peft
    and vLLM load onto the base; rank 0 writes (the adapters are small). Collective."""
    from elasticrl.weights.params import adapter_tensors
    from elasticrl.weights.shards import write_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adapters = adapter_tensors(engine)
    if adapters:
        write_safetensors(folder / ADAPTER_WEIGHTS, [(k, v.contiguous()) for k, v in sorted(adapters.items())],
                          {"format": "pt"})
        engine.module.peft_config["default"].save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def export_merged(engine, tokenizer, folder: Path, max_shard_bytes: int, dtype) -> None:
    """A LoRA-trained model as a plain Hugging Face folder, its adapters merged into the base
    weights (``export.merge``): the weights the engines get under ``rollout.lora_sync: merged``
    (``weights.params.iter_full_params``: ZeRO-3 gathers one module at a time), written by rank 0
    a shard at a time. Collective."""
    import torch.distributed as dist

    from elasticrl.weights.params import iter_full_params
    from elasticrl.weights.shards import shard_names, write_index, write_safetensors

    rank0 = dist.get_rank() == 0
    folder.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary file name, its tensors' names)
    part: list = []

    def flush() -> None:
        name = f"part-{len(written)}.safetensors"
        write_safetensors(folder / name, part, {"format": "pt"})
        written.append((name, [n for n, _ in part]))
        part.clear()

    size = total = 0
    for name, t in iter_full_params(engine):
        if not rank0:
            continue
        t = t.to(dtype).cpu().contiguous()
        n = t.numel() * t.element_size()
        if part and size + n > max_shard_bytes:
            flush()
            size = 0
        part.append((name, t))
        size, total = size + n, total + n
    if not rank0:
        return
    flush()
    names = shard_names(len(written))  # known once the last shard is written: files are renamed
    for (tmp, _), final in zip(written, names):
        (folder / tmp).rename(folder / final)
    if len(written) > 1:
        write_index(folder, total, {key: final for (_, keys), final in zip(written, names) for key in keys})
    config = engine.module.get_base_model().config
    config.dtype = dtype
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
