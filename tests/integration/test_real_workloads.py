"""A user's model and data: a Qwen2 model written by plain ``transformers`` and named by its
Hub id (read offline from a Hugging Face cache laid out here), its BPE tokenizer's ChatML
template, multi-turn conversations from a ``save_to_disk`` folder, word problems from
parquet, the math verifier, TensorBoard and W&B (offline). The data are the word-problem
world's (``elasticrl.world.wordmath``), made here, as a user's would be."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elasticrl.spec import load_spec
from elasticrl.trainers.rl import run_rl
from elasticrl.trainers.sft import run_sft
from elasticrl.world.wordmath import wordmath_dir

pytestmark = pytest.mark.slow


def _rows(output) -> list[dict]:
    return [json.loads(ln) for ln in (output / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _plain_qwen2(folder, world) -> None:
    """A model folder as another tool writes it: transformers' own init and save_pretrained,
    the world's tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world / "model")
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok) + 8, hidden_size=128, intermediate_size=384,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=512, tie_word_embeddings=True,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def _hub_cache(home, repo_id: str) -> Path:
    """A Hugging Face cache under ``home`` as huggingface_hub lays it out, holding ``repo_id``'s
    main revision (a snapshot folder, named by its commit, that refs/main points to): its folder."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "3f2a9c1e" * 5
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_sft_then_grpo_on_a_users_qwen2_by_hub_id_conversations_and_word_problems(ray_cluster, tmp_path, monkeypatch):
    world = wordmath_dir()
    # the model by Hub id, from the Hugging Face cache, offline (nothing downloads in the tests)
    snapshot = _hub_cache(tmp_path / "hf", "acme/qwen2-tiny")
    _plain_qwen2(snapshot, world)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = {"model": {"dtype": "fp32"}, "log": {"every_steps": 10, "progress_bar": False},
              "checkpoint": {"resume": None}, "eval": {"num_prompts": 16, "max_new_tokens": 24}}
    # SFT on multi-turn conversations (a save_to_disk folder): only the assistant turns train
    sft = load_spec({**common, "algorithm": "sft", "model": {"path": "acme/qwen2-tiny", "dtype": "fp32"},
                     "data": {"train": str(world / "data" / "sft"), "eval": str(world / "data" / "eval.parquet"),
                              "max_length": 192},
                     # both cores for the one rank (Ray gives an actor one thread): this model is large
                     # enough for the second to pay (the test took 35 s with one, 28 with two)
                     "train": {"num_ranks": 1, "threads": 2, "micro_batch_size": 16, "global_batch_size": 32,
                               "max_steps": 40, "lr": 3e-3, "warmup_ratio": 0.05},
                     "eval": {**common["eval"], "every_steps": 0}})
    assert sft.model.path == str(snapshot)  # resolved once, before any worker: each loads this folder
    summary = run_sft(sft, tmp_path / "sft")
    rows = _rows(tmp_path / "sft")
    trained = [r for r in rows if "loss" in r]  # and the evaluation of the start (step 0), before them
    assert rows[0]["step"] == 0 and trained[0]["step"] == 1
    assert trained[-1]["loss"] < trained[0]["loss"] / 4, rows  # it learned the solutions' form
    exported = json.loads((tmp_path / "sft" / "final" / "config.json").read_text())
    assert exported["model_type"] == "qwen2" and summary["export"]
    # TensorBoard holds what metrics.jsonl holds, and the spec and environment as text
    scalars = _scalars(tmp_path / "sft" / "tensorboard")
    assert scalars["loss"] == pytest.approx({r["step"]: r["loss"] for r in rows if "loss" in r}, rel=1e-6)
    assert scalars["eval/accuracy"] == {0: pytest.approx(rows[0]["eval/accuracy"]),
                                        40: pytest.approx(rows[-1]["eval/accuracy"])}

    # GRPO from the SFT model on parquet prompts, the math verifier judging; a second reward
    # function of weight 0 records what the verifier was shown
    record = tmp_path / "seen.jsonl"
    monkeypatch.setenv("ELASTICRL_TEST_RECORD", str(record))
    grpo = load_spec({**common, "algorithm": "grpo",
                      "model": {"path": str(tmp_path / "sft" / "final"), "dtype": "fp32"},
                      "data": {"train": str(world / "data" / "rl_prompts.parquet"),
                               "eval": str(world / "data" / "eval"), "max_length": 192},
                      "rewards": {"functions": [{"path": "verifier"},
                                                {"path": "tests.rewards.misbehaving:record", "weight": 0.0}]},
                      "train": {"num_ranks": 1, "threads": 2, "micro_batch_size": 8, "global_batch_size": 16,
                                "lr": 1e-4},
                      "rl": {"num_steps": 2, "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 24,
                             "eval_samples": 2},
                      "rollout": {"max_model_len": 256},
                      "log": {**common["log"], "every_steps": 1, "wandb": "elasticrl-test", "wandb_mode": "offline"}})
    assert grpo.rewards.verifier == "math"  # 'auto' on a user's data
    run_rl(grpo, tmp_path / "grpo")
    from math_verify import parse, verify

    seen = [json.loads(ln) for ln in record.read_text().splitlines()]
    assert len(seen) == 2 * 16 and sum("\\boxed{" in s["completion"] for s in seen) >= 16  # the SFT form
    steps = {r["step"]: r for r in _rows(tmp_path / "grpo")}
    for step in (1, 2):  # the step's accuracy and reward are math-verify's verdicts on its samples
        batch = seen[(step - 1) * 16: step * 16]
        right = [verify(parse(f"${s['answer']}$"), parse(s["completion"])) for s in batch]
        assert steps[step]["accuracy"] == pytest.approx(sum(right) / 16)
        assert steps[step]["reward/mean"] == pytest.approx(steps[step]["accuracy"])
        assert steps[step]["reward/errors"] == 0
    assert 0.0 <= steps[0]["eval/accuracy"] <= 1.0 and "eval/pass@2" in steps[2]
    assert set(_scalars(tmp_path / "grpo" / "tensorboard")["reward/mean"]) == {1, 2}
    runs = list((tmp_path / "grpo" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
