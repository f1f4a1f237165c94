"""The DeepSpeed engine under SFT, on 2 real ranks (Ray actors, gloo): ZeRO-2/3, AutoTP,
resume, export. Tiny model, fp32, a few steps each."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from elasticrl.cluster import RoleGroup
from elasticrl.data.records import pad_batch
from elasticrl.spec import load_spec, spec_to_dict
from elasticrl.trainers.sft import SFTWorker, resolve_paths, run_sft
from elasticrl.weights.shards import load_sharded

pytestmark = pytest.mark.slow

BASE = ["model.dtype=fp32", "log.progress_bar=false", "log.every_steps=1", "eval.every_steps=0",
        "eval.num_prompts=32", "train.micro_batch_size=8", "train.global_batch_size=32",
        "train.lr=1e-3", "train.warmup_ratio=0", "checkpoint.resume=null"]
PROBE = [[1, 4, 7, 13, 78, 11, 86, 5, 9, 9, 2], [1, 4, 8, 78, 8, 86, 5, 17, 2]]


def _spec(*extra):
    return load_spec({}, BASE + list(extra))


def _losses(output):
    rows = [json.loads(ln) for ln in (output / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _logits(worker, ids):
    batch = pad_batch(ids, 0)
    worker.engine.eval()
    with torch.no_grad():
        return worker.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.tolist()


def test_zero2_zero3_and_autotp_train_the_same_model(ray_cluster, tmp_path):
    runs = {"zero2": ["train.zero_stage=2"], "zero3": ["train.zero_stage=3"],
            "autotp2": ["train.tp_size=2", "train.zero_stage=1", "train.micro_batch_size=16"]}
    losses = {}
    for name, extra in runs.items():
        out = tmp_path / name
        summary = run_sft(_spec("train.max_steps=10", *extra), out)
        losses[name] = _losses(out)
        assert summary["steps"] == 10 and (out / "final" / "model.safetensors").is_file()
    first, last = losses["zero2"][1], losses["zero2"][10]
    assert last < 0.7 * first, (first, last)  # the loss falls
    for name in ("zero3", "autotp2"):  # sharding must not change the math
        for step, value in losses["zero2"].items():
            assert losses[name][step] == pytest.approx(value, abs=2e-5), (name, step)


@pytest.mark.parametrize("stage", [2, 3])
def test_export_equals_gathered_weights_and_reloads_with_identical_logits(ray_cluster, tmp_path, stage):
    from transformers import AutoModelForCausalLM

    spec = _spec(f"train.zero_stage={stage}")
    paths = resolve_paths(spec)
    group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), paths)
    try:
        group.setup(20)
        if stage == 3:  # each rank holds only its partition ...
            parts = group.call_rank(1, "__ray_call__", lambda w: [
                (p.ds_tensor.numel(), p.ds_numel) for p in w.engine.module.parameters()])
            assert all(local < full for local, full in parts)
        group.call("export", str(tmp_path / "step0"))  # ... and the gather returns the full weights
        initial = load_file(f"{paths['model']}/model.safetensors")
        exported = load_sharded(tmp_path / "step0")
        assert exported.keys() == initial.keys()
        for name, tensor in initial.items():
            assert torch.equal(exported[name], tensor), name

        for step in range(3):
            group.call("train_step", step)
        group.call("export", str(tmp_path / "final"))
        engine_logits = torch.tensor(group.call_rank(0, "__ray_call__", lambda w: _logits(w, PROBE))) \
            if stage == 2 else torch.tensor(group.call("__ray_call__", lambda w: _logits(w, PROBE))[0])
    finally:
        group.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    batch = pad_batch(PROBE, 0)
    with torch.no_grad():
        hf_logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.equal(load_sharded(tmp_path / "final")["lm_head.weight"], initial["lm_head.weight"])
    torch.testing.assert_close(hf_logits, engine_logits, atol=1e-5, rtol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resume_continues_exactly_like_an_uninterrupted_run(ray_cluster, tmp_path):
    extra = ["train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep=3"]
    straight = tmp_path / "straight"
    run_sft(_spec(*extra), straight)
    ckpts = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert ckpts == ["step_0000004", "step_0000008"]

    # A run that stopped after step 4: its output holds the step-4 checkpoint and metrics.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # steps beyond 4 must be dropped
    summary = run_sft(_spec(*extra, "checkpoint.resume=auto"), resumed)
    assert summary["resumed_from"] == 4
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(1, 9))
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    steps = [json.loads(ln)["step"] for ln in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps))
