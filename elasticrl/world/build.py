"""Build (once) and locate the embedded tiny world: model, tokenizer, datasets.

The world lives in ``$ELASTICRL_CACHE`` (default ``~/.cache/elasticrl``) under a folder
named by a hash of its settings, written to a temp folder and renamed into place, so
concurrent builders and interrupted builds never leave a half-written world.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from elasticrl.files import atomic_folder

if TYPE_CHECKING:  # the spec's schema reads the world's presets: no import of it at run time
    from elasticrl.spec.schema import WorldSpec

DATASETS = ("sft", "rl_prompts", "preference", "eval", "preference_eval", "prm", "prm_eval")
FORMAT_VERSION = 5  # bump when what a world contains changes (5: models take 8,192 positions)


def cache_root() -> Path:
    return Path(os.environ.get("ELASTICRL_CACHE", Path.home() / ".cache" / "elasticrl"))


def world_key(world: WorldSpec) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, **dataclasses.asdict(world)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def world_dir(world: WorldSpec) -> Path:
    """The world's folder, building it first if it is not there yet."""
    final = cache_root() / f"world-{world.task}-{world.model_size}-{world_key(world)}"
    if (final / "MANIFEST.json").is_file():
        return final
    with atomic_folder(final, keep_existing=True) as tmp:  # a world built by another process is the same
        _build_into(world, tmp)
    return final


def _build_into(world: WorldSpec, out: Path) -> None:
    from elasticrl.world.model import build_model
    from elasticrl.world.task import make_records
    from elasticrl.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(world.model_size, tokenizer, world.seed)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    calculator = world.task == "calculator"
    records = make_records(world.max_operand, world.operators, world.num_train, world.num_eval, world.seed,
                           mul_max=world.max_operand if calculator else 12)
    if calculator:
        from elasticrl.world.calculator import with_calculator

        records = with_calculator(records, world.tool_demos, world.seed)
    if world.task == "reasoning":
        from elasticrl.world import reasoning

        records.update(reasoning.make_records(world.num_train, world.num_eval, world.seed))
    (out / "data").mkdir()
    for name in DATASETS:
        with open(out / "data" / f"{name}.jsonl", "w") as fh:
            for rec in records[name]:
                fh.write(json.dumps(rec, sort_keys=True) + "\n")
    manifest = {"format": FORMAT_VERSION, "world": dataclasses.asdict(world),
                "content_sha256": content_hash(out)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def content_hash(folder: Path) -> str:
    """Hash of what a world *means*: tensor bytes, data bytes, vocabulary and config values.

    File bytes of config/tokenizer JSON carry library versions, so those are hashed by
    content; tensors by name, dtype, shape and bytes.
    """
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MANIFEST.json"):
        rel = path.relative_to(folder).as_posix()
        h.update(rel.encode())
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                for name in sorted(f.keys()):
                    t = f.get_tensor(name).contiguous()
                    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        elif path.name == "tokenizer.json":
            tj = json.loads(path.read_text())
            meaning = {"vocab": tj["model"]["vocab"], "pre": tj["pre_tokenizer"], "decoder": tj["decoder"],
                       "added": sorted((t["id"], t["content"], t["special"]) for t in tj["added_tokens"])}
            h.update(json.dumps(meaning, sort_keys=True).encode())
        elif path.name in ("config.json", "generation_config.json"):
            cfg = json.loads(path.read_text())
            cfg.pop("transformers_version", None)
            h.update(json.dumps(cfg, sort_keys=True).encode())
        elif path.suffix == ".jsonl":
            h.update(path.read_bytes())
    return h.hexdigest()


def world_paths(world: WorldSpec) -> dict[str, Path]:
    root = world_dir(world)
    paths = {name: root / "data" / f"{name}.jsonl" for name in DATASETS}
    paths["model"] = root / "model"
    return paths
