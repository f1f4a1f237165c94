"""The spec's rules across fields, each beside the section it governs: ``RULES`` holds, per
section, the function that checks it against the whole spec (as a validator sits on its
model), and ``check_rules`` runs them in the order a user fixes them (the training layout,
the model, the algorithm's own sections, the data, then what must exist on this machine).
What sets an algorithm apart is a field of its row (``spec.algorithms``), never its name here.
The single fields' types, choices and bounds are the loader's (``load``), from the schema.
"""
from __future__ import annotations

from pathlib import Path

from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS, advantage_of, reward_model_first
from elasticrl.spec.schema import VERIFIERS, JobSpec

LORA_LR = 2e-4  # below this, a note says adapters usually want more


class SpecError(ValueError):
    """A job spec the loader refuses; ``str()`` is a one-line message for the user."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


def check_rules(spec: JobSpec, here: bool = True) -> None:
    """Every section's rules; ``here``: the job runs on this machine (its paths must exist)."""
    for _, check in RULES:
        check(spec, here)


def notes(spec: JobSpec) -> list[str]:
    """What a valid spec may still want changed, said once at the start of a run."""
    if spec.model.lora.rank and spec.train.lr < LORA_LR:
        return [f"model.lora.rank {spec.model.lora.rank} with train.lr {spec.train.lr:g}: adapters train a small "
                "share of the weights and usually want several times a full fine-tune's rate "
                "(examples/tiny_grpo_lora.yaml: 1e-3 against tiny_grpo.yaml's 8e-5; docs/lora.md)"]
    return []


def lora_refusal(spec: JobSpec) -> str | None:
    """Why this job cannot train LoRA adapters (with the fix), or None when it can."""
    if not ALGORITHMS[spec.algorithm].lora:
        takes = ", ".join(name for name, alg in ALGORITHMS.items() if alg.lora)
        return (f"adapters do not train with {spec.algorithm} yet ({takes} take them); set model.lora.rank: 0 to "
                "train every weight")
    if spec.train.tp_size > 1:
        return "adapters do not train under AutoTP; set train.tp_size: 1 (ZeRO-3 shards the frozen base instead)"
    return None


def parse_attributes(text: str, field: str) -> dict[str, str]:
    """'quality:1,helpful:3' -> {'quality': '1', 'helpful': '3'}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition(":")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{field}: {item!r} is not name:value (e.g. quality:1,helpful:3)")
        out[name.strip()] = value.strip()
    return out


# --- the sections ------------------------------------------------------------------------
def _train(spec: JobSpec, here: bool) -> None:
    t = spec.train
    if t.num_ranks % t.tp_size:
        raise SpecError("train.tp_size", f"must divide train.num_ranks ({t.num_ranks}), got {t.tp_size}")
    if t.sp_size > 1:
        _sequence_parallel(spec)
    per_step = t.micro_batch_size * (t.num_ranks // t.tp_size // t.sp_size)
    if t.global_batch_size % per_step:
        raise SpecError("train.global_batch_size",
                        f"must be a multiple of micro_batch_size x data-parallel ranks = {per_step}, "
                        f"got {t.global_batch_size}; try {max(per_step, t.global_batch_size // per_step * per_step)}")
    if t.offload_params and t.zero_stage != 3:
        raise SpecError("train.offload_params", "needs train.zero_stage: 3 (ZeRO-1/2 keep full "
                                                "parameters on every rank)")
    if t.offload_optimizer and t.zero_stage == 0:
        raise SpecError("train.offload_optimizer", "needs train.zero_stage >= 1")
    alg = ALGORITHMS[spec.algorithm]
    if t.max_tokens_per_micro_batch and (alg.pairs or alg.unpaired):
        raise SpecError("train.max_tokens_per_micro_batch", f"{spec.algorithm}'s micro-batches are counted in rows "
                        "(data.packing lays them end to end); set it to 0 and size train.micro_batch_size")


def _sequence_parallel(spec: JobSpec) -> None:
    t, field = spec.train, "train.sp_size"
    if ALGORITHMS[spec.algorithm].family != "rl":
        raise SpecError(field, f"slices the RL actor's and critic's sequences; {spec.algorithm} trains whole ones: "
                               "set 1")
    if t.num_ranks % t.sp_size or (ALGORITHMS[spec.algorithm].critic and spec.critic.num_ranks % t.sp_size):
        raise SpecError(field, f"must divide train.num_ranks ({t.num_ranks})"
                        + (f" and critic.num_ranks ({spec.critic.num_ranks})" if ALGORITHMS[spec.algorithm].critic
                           else "") + f", got {t.sp_size}")
    if t.tp_size > 1:
        raise SpecError(field, "does not combine with train.tp_size > 1; slice sequences or tensors, not both")
    if spec.data.packing:
        raise SpecError(field, "slices padded rows; packed rows need their block masks whole: set data.packing: "
                               "false")
    if spec.rl.ptx_coef > 0:
        raise SpecError(field, "slices the RL sequences, not rl.ptx_coef's SFT ones (whole on every rank): set "
                               "rl.ptx_coef: 0")


def _model(spec: JobSpec, here: bool) -> None:
    if spec.model.lora.rank and lora_refusal(spec):
        raise SpecError("model.lora.rank", lora_refusal(spec))
    if spec.model.lora.quantize != "none":
        _qlora(spec, here)


def _qlora(spec: JobSpec, here: bool) -> None:
    """A 4-bit base (``model.lora.quantize``)."""
    import importlib.util

    from elasticrl import backend

    field = "model.lora.quantize"
    if not spec.model.lora.rank:
        raise SpecError(field, "quantizes the frozen base of LoRA adapters: set model.lora.rank (16, say), or "
                               "model.lora.quantize: none")
    if spec.train.zero_stage == 3 or spec.train.offload_params:
        raise SpecError(field, "a 4-bit base trains at train.zero_stage 0-2 without train.offload_params (ZeRO-3 "
                               "does not shard bitsandbytes' packed weights); set train.zero_stage: 2")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SpecError(field, "needs bitsandbytes: pip install bitsandbytes")
    if here and spec.rollout.lora_sync == "adapter" and not backend.has_gpu():
        raise SpecError("rollout.lora_sync", "served adapters on a 4-bit base are a GPU path (vLLM's bitsandbytes "
                                             "loader); on this CPU use rollout.lora_sync: auto (merged)")


def _rl(spec: JobSpec, here: bool) -> None:
    """The RL trainers' rules: reward sources, the estimator's needs, whole mini-batches."""
    rl, t, alg = spec.rl, spec.train, ALGORITHMS[spec.algorithm]
    if rl.dual_clip is not None and rl.dual_clip <= 1:
        raise SpecError("rl.dual_clip", f"expected a number > 1 or null, got {rl.dual_clip}")
    if rl.samples_per_prompt < alg.min_samples:
        raise SpecError("rl.samples_per_prompt", f"{spec.algorithm} pairs a prompt's best and worst samples: needs "
                                                 f">= {alg.min_samples}, got {rl.samples_per_prompt}")
    if alg.family != "rl":
        return
    if not (spec.rewards.functions or spec.rewards.models or spec.rewards.remote or reward_model_first(spec)):
        raise SpecError("rewards", "an RL job needs at least one reward function, model or remote endpoint "
                                   "(or, for ppo, init.rm_steps to train a reward model first)")
    if rl.async_rollout and spec.placement.colocate == "all":
        raise SpecError("rl.async_rollout", "rolls out while the trainers train, but placement.colocate 'all' puts the "
                                            "engines to sleep then; use one or the other")
    if rl.temperature <= 0:
        raise SpecError("rl.temperature",
                        f"RL learns from sampled rollouts: expected a number > 0, got {rl.temperature}")
    if rl.dynamic_sampling_max_draws > 1 and rl.async_rollout:
        raise SpecError("rl.dynamic_sampling_max_draws", "refills draw prompts while the step is scored, but "
                                                          "rl.async_rollout has drawn the next steps' already; use one")
    if rl.fully_async and not rl.async_rollout:
        raise SpecError("rl.fully_async", "is a mode of async rollouts; set rl.async_rollout: true as well")
    if rl.fully_async and (rl.stop or rl.dynamic_sampling):
        raise SpecError("rl.fully_async", "generates in rounds of rl.chunk_tokens, across which rl.stop strings are "
                                          "not seen, and trains on whichever groups finish, which rl.dynamic_sampling "
                                          "would filter again; set rl.stop: [] and rl.dynamic_sampling: false")
    if rl.overlong_buffer > rl.max_new_tokens:
        raise SpecError("rl.overlong_buffer", f"{rl.overlong_buffer} is more than rl.max_new_tokens "
                                              f"({rl.max_new_tokens}): the punishment starts that many tokens before "
                                              "the limit")
    if rl.min_tokens > rl.max_new_tokens:
        raise SpecError("rl.min_tokens", f"{rl.min_tokens} is more than rl.max_new_tokens ({rl.max_new_tokens}); "
                                         "lower it or raise rl.max_new_tokens")
    name = advantage_of(spec.algorithm, rl.advantage)
    estimator = ADVANTAGE_ESTIMATORS[name]
    if estimator.critic and not alg.critic:
        raise SpecError("rl.advantage", f"{name} needs a critic's values; use algorithm: ppo, or an estimator "
                                        "without a critic (grpo, dr_grpo, rloo, reinforce++, reinforce++_baseline)")
    if estimator.group and rl.samples_per_prompt < 2:
        raise SpecError("rl.samples_per_prompt", f"the {name} advantage compares the samples of a prompt: needs >= 2, "
                                                 f"got {rl.samples_per_prompt}")
    responses = rl.prompts_per_step * rl.samples_per_prompt
    if responses % t.global_batch_size:
        raise SpecError("train.global_batch_size",
                        f"must divide rl.prompts_per_step x rl.samples_per_prompt = {responses} (whole mini-batches "
                        f"per step), got {t.global_batch_size}")


def _rollout(spec: JobSpec, here: bool) -> None:
    """Episodes and tools: import paths, the chat template, an RL algorithm to train on them."""
    ro = spec.rollout
    if ro.environment and ALGORITHMS[spec.algorithm].family != "rl":
        raise SpecError("rollout.environment", f"multi-turn episodes train with the RL algorithms (grpo, ppo, "
                                               f"reinforce++, rloo), not {spec.algorithm}")
    remote = (ro.environment or "").startswith(("http://", "https://"))
    named = [("rollout.environment", "" if remote else ro.environment or "", " or an http(s) URL"),
             ("rollout.tool_parser", "" if ro.tool_parser == "hermes" else ro.tool_parser, " or hermes"),
             *((f"rollout.tools[{i}]", p, "") for i, p in enumerate(ro.tools))]
    for field, path, other in named:
        if path and ":" not in path:
            raise SpecError(field, f"{path!r} is not an import path; write package.module:name{other}")
    if ro.environment and not spec.data.apply_chat_template:
        raise SpecError("data.apply_chat_template", "episodes (rollout.environment) are conversations in the chat "
                                                    "template; turn it on")
    if ro.tools and not ro.environment:
        raise SpecError("rollout.tools", "tools are offered in multi-turn episodes: set rollout.environment: "
                                         "elasticrl.envs:ToolEnvironment")


def _rewards(spec: JobSpec, here: bool) -> None:
    r = spec.rewards
    for i, m in enumerate(r.models):
        if not m.path or (here and not Path(m.path).is_dir()):
            raise SpecError(f"rewards.models[{i}].path", f"{m.path!r} is not a folder; give a reward model folder "
                                                         "(train one with algorithm: rm)")
    if r.verifier != "auto" and r.verifier not in VERIFIERS and ":" not in r.verifier:
        raise SpecError("rewards.verifier", f"{r.verifier!r} is neither a verifier ({', '.join(VERIFIERS)}, auto) nor "
                                            "an import path package.module:function")
    for i, remote in enumerate(r.remote):
        if not remote.url.startswith(("http://", "https://")):
            raise SpecError(f"rewards.remote[{i}].url", f"expected an http(s) URL, got {remote.url!r}")


def _conditional(spec: JobSpec, here: bool) -> None:
    for name in ("eval_attributes", "compare_attributes"):
        try:
            parse_attributes(getattr(spec.conditional, name), f"conditional.{name}")
        except ValueError as exc:
            raise SpecError(f"conditional.{name}", str(exc).split(": ", 1)[1]) from None


def _rounds(spec: JobSpec, here: bool) -> None:
    if ALGORITHMS[spec.algorithm].family != "rounds":
        return
    if spec.rewards.models:
        raise SpecError("rewards.models", f"{spec.algorithm} scores with reward functions or remote endpoints; "
                                          "scoring its rounds with a reward model is not built yet")
    if not (spec.rewards.functions or spec.rewards.remote):
        raise SpecError("rewards", f"{spec.algorithm} needs a reward function or remote endpoint to score samples")
    if spec.train.global_batch_size > spec.rounds.prompts_per_round:
        raise SpecError("train.global_batch_size", f"{spec.train.global_batch_size} is more than "
                                                   f"rounds.prompts_per_round ({spec.rounds.prompts_per_round}), "
                                                   "the most records a round can yield")


def _preference(spec: JobSpec, here: bool) -> None:
    alg = ALGORITHMS[spec.algorithm]
    if alg.reference and not alg.precomputed_reference and spec.preference.reference == "precomputed":
        takes = ", ".join(name for name, a in ALGORITHMS.items() if a.precomputed_reference)
        raise SpecError("preference.reference", f"'precomputed' works for {takes} only (kto's reference point and "
                                                "iterative dpo's new pairs need the reference during training); use "
                                                "colocated")


def _critic(spec: JobSpec, here: bool) -> None:
    if ALGORITHMS[spec.algorithm].critic and spec.train.global_batch_size % spec.critic.num_ranks:
        raise SpecError("critic.num_ranks", f"must divide train.global_batch_size ({spec.train.global_batch_size}), "
                                            f"got {spec.critic.num_ranks}")
    if spec.critic.path is not None and here and not Path(spec.critic.path).is_dir():
        raise SpecError("critic.path", f"{spec.critic.path} is not a folder")


def _world(spec: JobSpec, here: bool) -> None:
    if not spec.world.operators or set(spec.world.operators) - set("+-*"):
        raise SpecError("world.operators", f"expected a non-empty subset of '+-*', got {spec.world.operators!r}")


def _paths(spec: JobSpec, here: bool) -> None:
    """What must exist where the job runs: model folders (not adapter folders) and data."""
    if not here:
        return
    for field, path in [("model.path", spec.model.path), ("critic.path", spec.critic.path),
                        *((f"rewards.models[{i}].path", m.path) for i, m in enumerate(spec.rewards.models))]:
        if path and (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
            raise SpecError(field, f"{path} is a LoRA adapter folder (peft), not a whole model; give its merged "
                                   "export (export.merge: true writes final/merged)")
    if spec.model.path is not None and not Path(spec.model.path).is_dir():
        raise SpecError("model.path", f"{spec.model.path} is not a folder; give a Hugging Face model "
                                      "folder or null for the embedded tiny model")
    for name in ("train", "eval"):
        p = getattr(spec.data, name)
        if p is not None and not p.startswith("hf://") and not Path(p).exists():
            raise SpecError(f"data.{name}", f"{p} not found; give a data file (JSON lines, JSON, parquet, CSV), "
                                            "a datasets.save_to_disk folder, hf://ORG/NAME, or null for the embedded "
                                            "data")


RULES = [("train", _train), ("model", _model), ("rl", _rl), ("rollout", _rollout), ("rewards", _rewards),
         ("conditional", _conditional), ("rounds", _rounds), ("preference", _preference), ("critic", _critic),
         ("world", _world), ("paths", _paths)]
