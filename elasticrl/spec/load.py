"""Load a job spec from YAML, apply ``--set`` overrides, validate into the typed tree.

Every error names the field path and what would fix it, e.g.
``train.micro_batch_size: expected an integer >= 1, got -1``.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from elasticrl.files import write_text
from elasticrl.spec import hub
from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS, advantage_of, reward_model_first
from elasticrl.spec.schema import VERIFIERS, JobSpec


class SpecError(ValueError):
    """A job spec the loader refuses; ``str()`` is a one-line message for the user."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


def load_spec(source: str | os.PathLike | dict | None = None, overrides: list[str] = (),
              check_paths: bool = True) -> JobSpec:
    """Build a validated ``JobSpec`` from a YAML file (or dict) plus ``a.b=c`` overrides.
    ``check_paths=False`` skips the checks that model and data paths exist here (planning a
    job for another machine)."""
    spec = _convert(JobSpec, read_raw(source, overrides), "")
    if check_paths:  # where the job runs: models named by Hub id become folders of the Hub cache
        spec = hub.resolve(spec)
    _check_cross_fields(spec, check_paths)
    if spec.rewards.verifier == "auto":  # resolved once, so a trainer that swaps the data keeps the user's
        verifier = "integer" if spec.data.train is None else "math"
        spec = dataclasses.replace(spec, rewards=dataclasses.replace(spec.rewards, verifier=verifier))
    return spec


def read_raw(source: str | os.PathLike | dict | None = None, overrides: list[str] = ()) -> dict:
    """The user's own fields (YAML plus overrides), before defaults and validation."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raw = _read_yaml(Path(source))
    for item in overrides:
        _apply_override(raw, item)
    return raw


def explicit_fields(raw: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every leaf the user wrote (what the planner must not change)."""
    out = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(explicit_fields(value, path + "."))
        else:
            out[path] = value
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"field {key!r} is written twice (first at line {seen[key] + 1}); keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise SpecError("", f"spec file {path} {what}; pass the path of a YAML job spec (see examples/)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"{path}: not a text file (byte {exc.start} is not UTF-8); pass a YAML job spec") from None
    except OSError as exc:
        raise SpecError("", f"{path}: cannot read it ({exc.strerror})") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        raise SpecError("", f"{path}: the spec is empty; write at least the algorithm (algorithm: grpo), "
                            "see examples/")
    if not isinstance(raw, dict):
        raise SpecError("", f"{path}: the top level must be a mapping of fields, got "
                            f"{type(raw).__name__}")
    return raw


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SpecError("", f"--set {item!r}: expected FIELD.PATH=VALUE, e.g. train.lr=3e-4")
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(".".join(parts[: i + 1]), f"--set {item!r}: this field is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = text


def _convert(tp, value: Any, path: str, meta: dict | None = None) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _convert_section(tp, value, path)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, path, meta)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        shown = ", ".join(repr(c) for c in choices)
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise SpecError(path, f"expected one of {shown}, got {value!r}{extra}")
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise SpecError(path, f"expected a list, got {value!r}")
        return [_convert(item, v, f"{path}[{i}]", meta) for i, v in enumerate(value)]
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise SpecError(path, f"expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]", meta) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"expected {_bounded('an integer', meta)}, got {value!r}")
        _check_bounds(value, path, meta, "an integer")
        if abs(value) >= 2 ** 63:
            raise SpecError(path, f"expected an integer of at most 63 bits, got {value}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"expected {_bounded('a number', meta)}, got {value!r}")
        if not math.isfinite(value):
            raise SpecError(path, f"expected {_bounded('a finite number', meta)}, got {value!r}")
        return _check_bounds(float(value), path, meta, "a number")
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"spec field {path} has an unsupported type {tp!r}")  # a schema bug


def _bounded(kind: str, meta: dict | None) -> str:
    if not meta:
        return kind
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        if kind == "an integer" and lo == 1:
            return "a positive integer"
        return f"{kind} {'>' if meta.get('exclusive_min') else '>='} {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def _check_bounds(value, path, meta, kind):
    if meta:
        lo, hi = meta.get("min"), meta.get("max")
        too_low = lo is not None and (value <= lo if meta.get("exclusive_min") else value < lo)
        if too_low or (hi is not None and value > hi):
            raise SpecError(path, f"expected {_bounded(kind, meta)}, got {value!r}")
    return value


def _convert_section(cls, value: Any, path: str):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise SpecError(path, f"expected a section (mapping of fields), got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            sub = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(fields)}"
            raise SpecError(sub, f"unknown field; {hint}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], sub, dict(f.metadata))
        elif dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _convert_section(hints[name], {}, sub)
    return cls(**kwargs)


LORA_LR = 2e-4  # below this, a note says adapters usually want more


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


def _check_qlora(spec: JobSpec, here: bool) -> None:
    """A 4-bit base (``model.lora.quantize``); ``here``: the job runs on this machine."""
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


def _check_cross_fields(spec: JobSpec, check_paths: bool = True) -> None:
    t = spec.train
    if t.num_ranks % t.tp_size:
        raise SpecError("train.tp_size", f"must divide train.num_ranks ({t.num_ranks}), got {t.tp_size}")
    dp = t.num_ranks // t.tp_size
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise SpecError("train.global_batch_size",
                        f"must be a multiple of micro_batch_size x data-parallel ranks = {per_step}, "
                        f"got {t.global_batch_size}; try {max(per_step, t.global_batch_size // per_step * per_step)}")
    if t.offload_params and t.zero_stage != 3:
        raise SpecError("train.offload_params", "needs train.zero_stage: 3 (ZeRO-1/2 keep full "
                                                "parameters on every rank)")
    if t.offload_optimizer and t.zero_stage == 0:
        raise SpecError("train.offload_optimizer", "needs train.zero_stage >= 1")
    if spec.model.lora.rank and lora_refusal(spec):
        raise SpecError("model.lora.rank", lora_refusal(spec))
    if spec.model.lora.quantize != "none":
        _check_qlora(spec, check_paths)
    alg = ALGORITHMS[spec.algorithm]
    rl = spec.rl
    if alg.family == "rl":
        _check_rl(spec)
    elif spec.rollout.environment:
        raise SpecError("rollout.environment", f"multi-turn episodes train with the RL algorithms (grpo, ppo, "
                                               f"reinforce++, rloo), not {spec.algorithm}")
    if rl.dual_clip is not None and rl.dual_clip <= 1:
        raise SpecError("rl.dual_clip", f"expected a number > 1 or null, got {rl.dual_clip}")
    for i, m in enumerate(spec.rewards.models):
        if not m.path or (check_paths and not Path(m.path).is_dir()):
            raise SpecError(f"rewards.models[{i}].path", f"{m.path!r} is not a folder; give a reward model folder "
                                                         "(train one with algorithm: rm)")
    v = spec.rewards.verifier
    if v != "auto" and v not in VERIFIERS and ":" not in v:
        raise SpecError("rewards.verifier", f"{v!r} is neither a verifier ({', '.join(VERIFIERS)}, auto) nor an "
                                            "import path package.module:function")
    for i, r in enumerate(spec.rewards.remote):
        if not r.url.startswith(("http://", "https://")):
            raise SpecError(f"rewards.remote[{i}].url", f"expected an http(s) URL, got {r.url!r}")
    for name in ("eval_attributes", "compare_attributes"):
        try:
            parse_attributes(getattr(spec.conditional, name), f"conditional.{name}")
        except ValueError as exc:
            raise SpecError(f"conditional.{name}", str(exc).split(": ", 1)[1]) from None
    if rl.samples_per_prompt < alg.min_samples:
        raise SpecError("rl.samples_per_prompt", f"{spec.algorithm} pairs a prompt's best and worst samples: needs "
                                                 f">= {alg.min_samples}, got {rl.samples_per_prompt}")
    if alg.family == "rounds":
        if spec.rewards.models:
            raise SpecError("rewards.models", f"{spec.algorithm} scores with reward functions or remote endpoints; "
                                              "scoring its rounds with a reward model is not built yet")
        if not (spec.rewards.functions or spec.rewards.remote):
            raise SpecError("rewards", f"{spec.algorithm} needs a reward function or remote endpoint to score samples")
        if spec.train.global_batch_size > spec.rounds.prompts_per_round:
            raise SpecError("train.global_batch_size", f"{spec.train.global_batch_size} is more than "
                                                       f"rounds.prompts_per_round ({spec.rounds.prompts_per_round}), "
                                                       "the most records a round can yield")
    if alg.reference and not alg.precomputed_reference and spec.preference.reference == "precomputed":
        takes = ", ".join(name for name, a in ALGORITHMS.items() if a.precomputed_reference)
        raise SpecError("preference.reference", f"'precomputed' works for {takes} only (kto's reference point and "
                                                "iterative dpo's new pairs need the reference during training); use "
                                                "colocated")
    if spec.critic.path is not None and check_paths and not Path(spec.critic.path).is_dir():
        raise SpecError("critic.path", f"{spec.critic.path} is not a folder")
    if check_paths:
        for field, path in [("model.path", spec.model.path), ("critic.path", spec.critic.path),
                            *((f"rewards.models[{i}].path", m.path) for i, m in enumerate(spec.rewards.models))]:
            if path and (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
                raise SpecError(field, f"{path} is a LoRA adapter folder (peft), not a whole model; give its merged "
                                       "export (export.merge: true writes final/merged)")
    bad_ops = set(spec.world.operators) - set("+-*")
    if not spec.world.operators or bad_ops:
        raise SpecError("world.operators", f"expected a non-empty subset of '+-*', got {spec.world.operators!r}")
    if not check_paths:
        return
    if spec.model.path is not None and not Path(spec.model.path).is_dir():
        raise SpecError("model.path", f"{spec.model.path} is not a folder; give a Hugging Face model "
                                      "folder or null for the embedded tiny model")
    for name in ("train", "eval"):
        p = getattr(spec.data, name)
        if p is not None and not p.startswith("hf://") and not Path(p).exists():
            raise SpecError(f"data.{name}", f"{p} not found; give a data file (JSON lines, JSON, parquet, CSV), "
                                            "a datasets.save_to_disk folder, hf://ORG/NAME, or null for the embedded "
                                            "data")


def _check_rl(spec: JobSpec) -> None:
    """The RL trainers' rules: reward sources, the estimator's needs, whole mini-batches."""
    rl, t = spec.rl, spec.train
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
    ro = spec.rollout
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
    if rl.min_tokens > rl.max_new_tokens:
        raise SpecError("rl.min_tokens", f"{rl.min_tokens} is more than rl.max_new_tokens ({rl.max_new_tokens}); "
                                         "lower it or raise rl.max_new_tokens")
    name = advantage_of(spec.algorithm, rl.advantage)
    estimator = ADVANTAGE_ESTIMATORS[name]
    if estimator.critic and not ALGORITHMS[spec.algorithm].critic:
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
    if ALGORITHMS[spec.algorithm].critic and t.global_batch_size % spec.critic.num_ranks:
        raise SpecError("critic.num_ranks", f"must divide train.global_batch_size ({t.global_batch_size}), "
                                            f"got {spec.critic.num_ranks}")


def spec_to_dict(spec) -> dict:
    def plain(v):
        if dataclasses.is_dataclass(v):
            return spec_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return {f.name: plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def dump_spec(spec: JobSpec, path: Path) -> None:
    """Write the resolved spec (defaults filled in) atomically: temp file, then rename."""
    write_text(path, yaml.safe_dump(spec_to_dict(spec), sort_keys=False))


def describe(cls=JobSpec, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, default, doc) for every leaf field: the spec reference."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], path + ".")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        default = spec_to_dict(default) if dataclasses.is_dataclass(default) else default
        if isinstance(default, (list, tuple)):
            default = [spec_to_dict(d) if dataclasses.is_dataclass(d) else d for d in default]
        if isinstance(default, str) and not default.isprintable():  # "\n" as YAML writes it in a spec
            shown = json.dumps(default)
        else:
            shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        rows.append((path, shown, f.metadata.get("doc", "")))
    return rows


def parse_attributes(text: str, field: str) -> dict[str, str]:
    """'quality:1,helpful:3' -> {'quality': '1', 'helpful': '3'}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition(":")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{field}: {item!r} is not name:value (e.g. quality:1,helpful:3)")
        out[name.strip()] = value.strip()
    return out
