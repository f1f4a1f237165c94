"""The job spec: defaults, overrides, and bad input rejected with the field's path."""
from __future__ import annotations

import re

import pytest
import yaml

from elasticrl import backend
from elasticrl.spec import JobSpec, SpecError, describe, dump_spec, load_spec, spec_to_dict
from tests.conftest import EXAMPLES, run_cli


def test_defaults_are_valid():
    import dataclasses

    spec = load_spec({})
    # the loader resolves rewards.verifier 'auto': the integer matcher on the embedded data, math on a user's
    assert JobSpec().rewards.verifier == "auto" and spec.rewards.verifier == "integer"
    assert spec == dataclasses.replace(JobSpec(), rewards=dataclasses.replace(JobSpec().rewards, verifier="integer"))
    assert spec.train.micro_batch_size == 16 and spec.algorithm == "sft"
    assert load_spec({"data": {"train": "pyproject.toml"}}).rewards.verifier == "math"
    exact = load_spec({"data": {"train": "pyproject.toml"}, "rewards": {"verifier": "exact"}})
    assert exact.rewards.verifier == "exact"
    with pytest.raises(SpecError, match=r"rewards.verifier: 'maths' is neither a verifier \(integer, math"):
        load_spec({"rewards": {"verifier": "maths"}})


def test_example_loads():
    spec = load_spec(EXAMPLES / "tiny_sft.yaml")
    assert spec.train.num_ranks == 2 and spec.train.zero_stage == 2


def test_overrides_parse_yaml_values():
    spec = load_spec({}, ["train.lr=3e-4", "train.zero_stage=3", "model.path=null",
                          "train.adam_betas=[0.8, 0.9]", "log.progress_bar=false"])
    assert spec.train.lr == pytest.approx(3e-4)
    assert spec.train.zero_stage == 3
    assert spec.train.adam_betas == (0.8, 0.9)
    assert spec.log.progress_bar is False


def test_resolved_spec_round_trips(tmp_path):
    spec = load_spec({}, ["train.lr=2e-4"])
    dump_spec(spec, tmp_path / "spec.yaml")
    assert load_spec(tmp_path / "spec.yaml") == spec
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left behind


def test_every_field_is_documented():
    rows = describe()
    assert len(rows) > 30
    assert all(doc for _, _, doc in rows), [path for path, _, doc in rows if not doc]
    assert set(path for path, _, _ in rows) >= {"train.micro_batch_size", "model.dtype", "world.model_size"}


BAD = [
    ({"train": {"micro_batch_size": -1}}, [],
     "train.micro_batch_size: expected a positive integer, got -1"),
    ({"train": {"micro_bach_size": 4}}, [], "train.micro_bach_size: unknown field; did you mean 'micro_batch_size'?"),
    ({"trian": {}}, [], "trian: unknown field; did you mean 'train'?"),
    ({"train": {"lr": "fast"}}, [], "train.lr: expected a number > 0, got 'fast'"),
    ({"train": {"lr": 0}}, [], "train.lr: expected a number > 0, got 0.0"),
    ({"train": {"zero_stage": 4}}, [], "train.zero_stage: expected one of 0, 1, 2, 3, got 4"),
    ({"model": {"dtype": "fp16"}}, [], "model.dtype: expected one of 'auto', 'bf16', 'fp32', got 'fp16'"),
    ({"algorithm": "ppx"}, [], "algorithm: expected one of 'sft', 'conditional_sft', 'rm', 'prm', 'dpo', 'kto', "
                              "'rejection_sampling', 'iterative_dpo', 'grpo', 'ppo', 'reinforce++', 'rloo', got 'ppx' "
                              "(did you mean 'ppo'?)"),
    ({"algorithm": "conditional_sft", "conditional": {"eval_attributes": "quality=1"}}, [],
     "conditional.eval_attributes: 'quality=1' is not name:value (e.g. quality:1,helpful:3)"),
    ({"algorithm": "kto", "preference": {"reference": "precomputed"}}, [],
     "preference.reference: 'precomputed' works for dpo only"),
    ({"algorithm": "rejection_sampling", "rewards": {"functions": []}}, [],
     "rewards: rejection_sampling needs a reward function or remote endpoint"),
    ({"rl": {"samples_per_prompt": 1}, "algorithm": "grpo"}, [],
     "rl.samples_per_prompt: the grpo advantage compares the samples of a prompt: needs >= 2, got 1"),
    ({"algorithm": "reinforce++", "rl": {"samples_per_prompt": 1}}, [],
     "rl.samples_per_prompt: the reinforce++_baseline advantage compares the samples of a prompt"),
    ({"algorithm": "grpo", "rl": {"advantage": "gae"}}, [],
     "rl.advantage: gae needs a critic's values; use algorithm: ppo"),
    ({"algorithm": "grpo", "rl": {"prompts_per_step": 3, "samples_per_prompt": 4}}, [],
     "train.global_batch_size: must divide rl.prompts_per_step x rl.samples_per_prompt = 12"),
    ({"algorithm": "ppo", "critic": {"num_ranks": 3}}, [],
     "critic.num_ranks: must divide train.global_batch_size (64)"),
    ({"algorithm": "grpo", "rl": {"temperature": 0}}, [], "rl.temperature: RL learns from sampled rollouts"),
    ({"algorithm": "grpo", "rl": {"async_rollout": True}, "placement": {"colocate": "all"}}, [],
     "rl.async_rollout: rolls out while the trainers train, but placement.colocate 'all'"),
    ({"algorithm": "iterative_dpo", "rl": {"samples_per_prompt": 1}}, [],
     "rl.samples_per_prompt: iterative_dpo pairs a prompt's best and worst samples"),
    ({"algorithm": "rloo", "rl": {"dual_clip": 0.5}}, [], "rl.dual_clip: expected a number > 1 or null, got 0.5"),
    ({"rewards": {"functions": [{"path": "x:y", "wieght": 2}]}}, [],
     "rewards.functions[0].wieght: unknown field; did you mean 'weight'?"),
    ({"rewards": {"remote": [{"url": "ftp://x"}]}}, [], "rewards.remote[0].url: expected an http(s) URL"),
    ({"train": {"num_ranks": True}}, [], "train.num_ranks: expected a positive integer, got True"),
    ({"train": "fast"}, [], "train: expected a section (mapping of fields), got 'fast'"),
    ({"model": {"trust_remote_code": "yes"}}, [], "model.trust_remote_code: expected true or false, got 'yes'"),
    ({"train": {"global_batch_size": 48, "micro_batch_size": 16, "num_ranks": 2}}, [],
     "train.global_batch_size: must be a multiple of micro_batch_size x data-parallel ranks = 32, got 48; try 32"),
    ({"train": {"tp_size": 3, "num_ranks": 2}}, [], "train.tp_size: must divide train.num_ranks (2), got 3"),
    ({"train": {"offload_params": True, "zero_stage": 2}}, [], "train.offload_params: needs train.zero_stage: 3"),
    ({"train": {"adam_betas": [0.9]}}, [], "train.adam_betas: expected a list of 2 values, got [0.9]"),
    ({"train": {"warmup_ratio": 1.5}}, [], "train.warmup_ratio: expected a number in [0, 1], got 1.5"),
    ({"world": {"operators": "+/"}}, [], "world.operators: expected a non-empty subset of '+-*', got '+/'"),
    ({"model": {"path": "/nonexistent/model"}}, [], "model.path: /nonexistent/model is not a folder"),
    ({"algorithm": "grpo", "rollout": {"environment": "envs.Calculator"}}, [],
     "rollout.environment: 'envs.Calculator' is not an import path; write package.module:name"),
    ({"algorithm": "grpo", "rollout": {"tools": ["tools:add"]}}, [],
     "rollout.tools: tools are offered in multi-turn episodes: set rollout.environment"),
    ({"algorithm": "dpo", "rollout": {"environment": "envs:Env"}}, [],
     "rollout.environment: multi-turn episodes train with the RL algorithms (grpo, ppo, reinforce++, rloo), not dpo"),
    ({"model": {"lora": {"quantize": "nf4"}}}, [], "model.lora.quantize: quantizes the frozen base of LoRA adapters: "
                                                   "set model.lora.rank"),
    ({"model": {"lora": {"rank": 8, "quantize": "nf4"}}, "train": {"zero_stage": 3}}, [],
     "model.lora.quantize: a 4-bit base trains at train.zero_stage 0-2 without train.offload_params"),
    ({"data": {"train": "/nonexistent.jsonl"}}, [], "data.train: /nonexistent.jsonl not found; give a data file"),
    ({}, ["train.lr"], "--set 'train.lr': expected FIELD.PATH=VALUE"),
    ({"train": {"zero_stage": 2}}, ["train.zero_stage.x=1"],
     "train.zero_stage: --set 'train.zero_stage.x=1': this field is not a section"),
]


@pytest.mark.parametrize("raw, overrides, message", BAD, ids=[b[2].split(":")[0] for b in BAD])
def test_bad_spec_is_rejected_with_its_field(raw, overrides, message):
    with pytest.raises(SpecError) as err:
        load_spec(raw, overrides)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(SpecError, match=r"bad.yaml line \d+, column \d+: not valid YAML"):
        load_spec(p)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="top level must be a mapping"):
        load_spec(p)


def test_cli_bad_spec_is_one_line_and_nonzero(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"train": {"micro_batch_size": -1}}))
    res = run_cli("run", str(p), "--output", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {p}: train.micro_batch_size: expected a positive integer, got -1"]
    assert not (tmp_path / "out").exists()  # nothing started, nothing half-written


def test_cli_spec_prints_resolved(tmp_path):
    res = run_cli("spec", str(EXAMPLES / "tiny_sft.yaml"), "--set", "train.lr=5e-4", timeout=120)
    assert res.returncode == 0, res.stderr
    resolved = yaml.safe_load(res.stdout)
    assert resolved["train"]["lr"] == 5e-4 and resolved == spec_to_dict(load_spec(resolved))


def test_the_spec_page_is_the_schema():
    """docs/spec.md's reference is what the schema generates, row for row."""
    import sys

    sys.path.insert(0, str(EXAMPLES.parent / "scripts"))
    from update_spec_doc import table

    page = (EXAMPLES.parent / "docs" / "spec.md").read_text()
    assert table() in page, "docs/spec.md differs from the schema; regenerate: python scripts/update_spec_doc.py"


def test_every_shipped_spec_loads_and_its_reward_functions_import():
    # the step benchmark's spec once named a reward function that had been renamed, and failed only when run
    from elasticrl.rewards.functions import load_function
    from elasticrl.rewards.verifiers import function_path

    shipped = sorted(EXAMPLES.glob("*.yaml")) + sorted((EXAMPLES.parent / "benchmarks").glob("*.yaml"))
    assert len(shipped) > 5
    for path in shipped:
        spec = load_spec(path, check_paths=False)
        for i, f in enumerate(spec.rewards.functions):
            assert callable(load_function(function_path(f.path, spec), f"{path.name}: rewards.functions[{i}]"))


@pytest.mark.skipif(backend.has_gpu(), reason="on a GPU vLLM's bitsandbytes loader serves them")
def test_served_adapters_on_a_4bit_base_are_refused_on_a_cpu():
    with pytest.raises(SpecError, match=r"^rollout.lora_sync: served adapters on a 4-bit base are a GPU path"):
        load_spec({"algorithm": "grpo", "model": {"lora": {"rank": 8, "quantize": "nf4"}},
                   "rollout": {"lora_sync": "adapter"}})


def test_a_lora_adapter_folder_is_not_taken_for_a_model(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    for field, spec in (("model.path", {"model": {"path": str(tmp_path / "final")}}),
                        ("rewards.models[0].path", {"algorithm": "ppo", "rewards": {"models": [{"path": str(
                            tmp_path / "final")}]}})):
        with pytest.raises(SpecError, match=rf"^{re.escape(field)}: {tmp_path}/final is a LoRA adapter folder "
                                            r"\(peft\), not a whole model; give its merged export \(export.merge"):
            load_spec(spec)


def test_a_lora_run_at_a_full_fine_tunes_rate_is_told_to_raise_it():
    from elasticrl.spec.rules import notes

    [note] = notes(load_spec(str(EXAMPLES / "tiny_grpo.yaml"), ["model.lora.rank=8"]))
    assert note.startswith("model.lora.rank 8 with train.lr 8e-05:") and "docs/lora.md" in note
    assert notes(load_spec(str(EXAMPLES / "tiny_grpo_lora.yaml"))) == []
    assert notes(load_spec(str(EXAMPLES / "tiny_grpo.yaml"))) == []
