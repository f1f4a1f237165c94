"""A model folder checked before any worker loads it: its ``config.json`` parses, its weights
are safetensors and complete (every file's header reads, every shard an index names is
there), its tokenizer loads. Each error is one line naming the field and the file."""
from __future__ import annotations

import json
from pathlib import Path

from elasticrl.files import read_json

PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_model_folder(path: str | Path, field: str, trust_remote_code: bool = False,
                       tokenizer: bool = True) -> dict:
    """The folder's config, once the folder is fit to load; ValueError otherwise."""
    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{field}: {folder} has no config.json; give a Hugging Face model folder")
    try:
        cfg = read_json(config, "the folder is damaged: copy it again")
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    for shard in _weight_files(folder, field):
        _check_safetensors(shard, field)
    if tokenizer:
        from elasticrl.models.load import load_tokenizer

        try:
            load_tokenizer(folder, trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - transformers' errors vary by tokenizer class
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ValueError(f"{field}: {folder}: the tokenizer does not load ({type(exc).__name__}: "
                             f"{first})") from None
    return cfg


def _weight_files(folder: Path, field: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{field}: {index}: not a safetensors index (no weight_map)") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{field}: {folder} lacks {missing[0]}, named in {index.name}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; copy it again")
        return [folder / n for n in names]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = [p.name for pattern in PICKLED for p in folder.glob(pattern)]
        if pickled:
            raise ValueError(f"{field}: {folder} holds only pickled weights ({pickled[0]}); elasticrl loads "
                             "safetensors only (a pickle can run code): save the model with safe_serialization")
        raise ValueError(f"{field}: {folder} has no weights (no *.safetensors)")
    return shards


def _check_safetensors(path: Path, field: str) -> None:
    """The header parses and the data it describes is all there."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        total = path.stat().st_size
        try:
            header = json.loads(fh.read(size)) if 0 < size <= total - 8 else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{field}: {path}: not a safetensors file (its header does not parse); copy it again")
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError(f"{field}: {path}: not a safetensors file (its header lacks data offsets)") from None
    if 8 + size + end > total:
        raise ValueError(f"{field}: {path} is cut short ({total} bytes of {8 + size + end}); copy it again")


def check_job_models(spec) -> None:
    """Every model folder a job names, and the tensor-parallel sizes against the policy's
    attention heads (vLLM and AutoTP shard whole heads), before Ray starts."""
    from elasticrl import backend
    from elasticrl.plan.arch import arch_of

    folders = [("model.path", spec.model.path, True), ("critic.path", spec.critic.path, False)]
    folders += [(f"rewards.models[{i}].path", m.path, True) for i, m in enumerate(spec.rewards.models)]
    configs = {field: check_model_folder(path, field, spec.model.trust_remote_code, with_tokenizer)
               for field, path, with_tokenizer in folders if path}
    arch = arch_of(spec.model.path, spec.world.model_size)
    where = f"{spec.model.path}/config.json" if spec.model.path else f"the tiny {spec.world.model_size} model"
    head_dim = configs.get("model.path", {}).get("head_dim") or arch.head_dim
    problem = backend.rollout_head_size_problem(head_dim, backend.uses_vllm(spec.rollout.backend))
    if problem:
        raise ValueError(f"rollout.backend: {problem} ({where}); set rollout.backend: hf (transformers' generate, "
                         "slower) for this model on CPUs")
    for field, tp in (("rollout.tp_size", spec.rollout.tp_size), ("train.tp_size", spec.train.tp_size)):
        kv_ok = arch.kv_heads % tp == 0 or (field == "rollout.tp_size" and tp % arch.kv_heads == 0)
        if arch.heads % tp or not kv_ok:
            fits = [d for d in range(1, arch.heads + 1) if arch.heads % d == 0 and
                    (arch.kv_heads % d == 0 or (field == "rollout.tp_size" and d % arch.kv_heads == 0))]
            raise ValueError(f"{field}: {tp} does not divide the model's {arch.heads} attention heads and "
                             f"{arch.kv_heads} key-value heads ({where}); use one of {fits}")
