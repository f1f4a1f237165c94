"""Starting points built on demand and cached by their settings: a warm-start SFT model and
a Bradley-Terry reward model, both on the embedded tiny world."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

from elasticrl import run_folder as rf
from elasticrl.backend import resolve_dtype
from elasticrl.files import atomic_folder
from elasticrl.spec import JobSpec, load_spec, spec_to_dict
from elasticrl.world import world_paths
from elasticrl.world.build import cache_root, world_key
from elasticrl.world.reasoning import SFT_LENGTH

log = logging.getLogger(__name__)


def _cached(spec: JobSpec, kind: str) -> str:
    """The job ``spec`` run once per distinct spec; returns its cached ``final`` export."""
    from elasticrl.trainers import run_job

    # The world's key too: both train on the world's data, so a new world format must retrain.
    # How it reports (log) is not part of what it trains; the dtype is the one it resolves to.
    fields = {k: v for k, v in spec_to_dict(spec).items() if k != "log"}
    fields["model"]["dtype"] = resolve_dtype(spec.model.dtype)
    blob = {"spec": fields, "world": world_key(spec.world)}
    key = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / f"{kind}-{key}"
    if not (final / rf.FINAL / "config.json").is_file():
        log.warning("%s: training %s (cached in %s)", kind, spec.algorithm, final)
        with atomic_folder(final) as tmp:
            run_job(spec, tmp)
    return str(final / rf.FINAL)


def _small_job(spec: JobSpec, algorithm: str, steps: int, lr: float, model_path: str | None) -> JobSpec:
    """The same job whatever the asking job's layout (one cache entry serves every job of a
    seed, precision and step count): 2 ranks of 32 rows, evaluated by the job that uses it."""
    dp, mbs = 2, 32
    data, budget = {}, {}
    if spec.world.task == "reasoning":  # chains of up to SFT_LENGTH tokens, cut by tokens (their lengths spread 10x)
        data, budget = {"max_length": SFT_LENGTH}, {"max_tokens_per_micro_batch": 16 * SFT_LENGTH}
    return load_spec({"algorithm": algorithm, "seed": spec.seed, "world": dataclasses.asdict(spec.world),
                      "model": {"dtype": spec.model.dtype, "path": model_path}, "data": data,
                      "train": {"num_ranks": dp, "zero_stage": 2, "micro_batch_size": mbs,
                                "global_batch_size": mbs * dp,
                                "max_steps": steps, "lr": lr, "warmup_ratio": 0.05, "min_lr_ratio": 0.05, **budget},
                      "eval": {"enabled": False}, "checkpoint": {"resume": None},
                      "log": {"progress_bar": spec.log.progress_bar, "every_steps": 10}})


def warm_start(spec: JobSpec) -> str:
    """The embedded model fine-tuned for ``init.sft_steps`` on the world's SFT data."""
    return _cached(_small_job(spec, "sft", spec.init.sft_steps, spec.init.sft_lr, None), "warmstart")


def initial_model(spec: JobSpec) -> str:
    """What a job starts from: ``model.path``, else the warm start, else the raw tiny model."""
    if spec.model.path:
        return spec.model.path
    if spec.init.sft_steps:
        return warm_start(spec)
    return str(world_paths(spec.world)["model"])


def trained_reward_model(spec: JobSpec) -> str:
    """A Bradley-Terry reward model on the world's preference pairs, from the job's start."""
    return _cached(_small_job(spec, "rm", spec.init.rm_steps, spec.init.rm_lr, initial_model(spec)), "rewardmodel")
