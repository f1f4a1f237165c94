"""Models named by Hugging Face Hub id (``model.path: ORG/NAME``, ``critic.path``, a reward
model's path): resolved once, on the machine that loads the spec to run it, into the snapshot
folder of huggingface_hub's cache, which every worker then loads; downloaded there when the
Hub is reachable, read from the cache alone when ``HF_HUB_OFFLINE`` is set. Only what a
safetensors model needs is fetched: configs, tokenizer files, ``*.safetensors`` (never the
pickled ``*.bin``/``*.pt`` weights, never remote code)."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

from elasticrl.spec.schema import JobSpec

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def is_hub_id(path: str | None) -> bool:
    """An ``ORG/NAME`` that is not a path here."""
    return bool(path) and HUB_ID.fullmatch(path) is not None and not Path(path).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """huggingface_hub's model cache as the environment names it now."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))


def snapshot(repo_id: str, revision: str | None, field: str) -> str:
    """The local folder of Hub model ``repo_id`` at ``revision`` (None: main); ``field`` names
    the spec field in errors (``SpecError`` imported late: load imports this module)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from elasticrl.spec.load import SpecError

    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), local_files_only=_offline(),
                                   allow_patterns=FILES)
    except GatedRepoError:
        raise SpecError(field, f"{repo_id!r} is gated on the Hub: accept its terms there and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise SpecError(field, f"{repo_id!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise SpecError(field, f"{repo_id!r} is neither a folder here nor a model on the Hub (a private one needs "
                               "HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = " (HF_HUB_OFFLINE is set)" if _offline() else ""
        pin = f" --revision {revision}" if revision else ""
        raise SpecError(field, f"{repo_id!r}{at} is neither a folder here nor in the Hugging Face cache "
                               f"({cache_dir()}), and the Hub is not reachable{why}; download it where it is "
                               f"(huggingface-cli download {repo_id}{pin}) into that cache, or give a model "
                               "folder") from None
    if not (Path(folder) / "config.json").is_file():
        raise SpecError(field, f"{repo_id!r}{at}: its snapshot {folder} has no config.json (not a transformers model)")
    return folder


def cached(repo_id: str, revision: str | None = None) -> str | None:
    """The snapshot folder of ``repo_id`` if this machine's cache holds it (no network), else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def resolve(spec: JobSpec) -> JobSpec:
    """``spec`` with each model given by Hub id replaced by its snapshot folder, said on stderr."""
    said = []

    def local(path: str | None, revision: str | None, field: str) -> str | None:
        if not is_hub_id(path):
            return path
        folder = snapshot(path, revision, field)
        said.append(f"{field}: {path} -> {folder}")
        return folder

    model = dataclasses.replace(spec.model, path=local(spec.model.path, spec.model.revision, "model.path"))
    critic = dataclasses.replace(spec.critic, path=local(spec.critic.path, None, "critic.path"))
    models = [dataclasses.replace(m, path=local(m.path, None, f"rewards.models[{i}].path"))
              for i, m in enumerate(spec.rewards.models)]
    if said:
        print("Hub models (the Hugging Face cache; each worker loads these folders): " + "; ".join(said),
              file=sys.stderr, flush=True)
    return dataclasses.replace(spec, model=model, critic=critic, rewards=dataclasses.replace(spec.rewards,
                                                                                             models=models))
