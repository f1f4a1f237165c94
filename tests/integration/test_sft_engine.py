"""The DeepSpeed engine under SFT, on 2 real ranks (Ray actors, gloo): ZeRO-2/3, AutoTP,
resume, export. Tiny model, fp32, a few steps each."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elasticrl.cluster import RoleGroup
from elasticrl.data.records import pad_batch
from elasticrl.spec import load_spec, spec_to_dict
from elasticrl.trainers.sft import SFTWorker, resolve_paths, run_sft
from elasticrl.weights.shards import load_sharded
from tests.conftest import stopped_at

pytestmark = pytest.mark.slow

BASE = ["model.dtype=fp32", "log.progress_bar=false", "log.every_steps=1", "eval.enabled=false",
        "eval.num_prompts=32", "train.micro_batch_size=8", "train.global_batch_size=32",
        "train.lr=1e-3", "train.warmup_ratio=0", "checkpoint.resume=null"]
STEPS = 20  # optimizer steps per transport in the delta test
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


LAYOUTS = {"zero2": ["train.zero_stage=2"], "zero3": ["train.zero_stage=3"],
           "autotp2": ["train.tp_size=2", "train.zero_stage=1", "train.micro_batch_size=16"]}


@pytest.fixture(scope="module")
def exports(ray_cluster, tmp_path_factory):
    """Each layout on 2 ranks exports its starting weights, trains 3 steps and exports again,
    in 1 MB files so that both ranks write some: {layout: (final/, the engine's logits of
    PROBE after training)}."""
    out = {}
    for name, extra in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        spec = _spec(*extra, "export.max_shard_size_mb=1")
        paths = resolve_paths(spec)
        group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), paths)
        try:
            group.setup(20)
            if name == "zero3":  # each rank holds only its partition ...
                parts = group.call_rank(1, "__ray_call__", lambda w: [
                    (p.ds_tensor.numel(), p.ds_numel) for p in w.engine.module.parameters()])
                assert all(local < full for local, full in parts)
            group.call("export", str(tmp / "step0"))  # ... and the export holds the whole weights
            initial = load_file(f"{paths['model']}/model.safetensors")
            exported = load_sharded(tmp / "step0")
            assert exported.keys() == initial.keys() and len(list((tmp / "step0").glob("model-*"))) > 2
            for key, tensor in initial.items():
                assert torch.equal(exported[key], tensor), (name, key)
            for step in range(3):
                group.call("train_step", step)
            group.call("export", str(tmp / "final"))
            logits = torch.tensor(group.call("__ray_call__", lambda w: _logits(w, PROBE))[0])  # collective
        finally:
            group.shutdown()
        assert not torch.equal(load_sharded(tmp / "final")["lm_head.weight"], initial["lm_head.weight"])
        assert not [p for p in tmp.iterdir() if p.name.startswith(".")]
        out[name] = (tmp / "final", logits)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_export_written_by_every_rank_reloads_in_transformers_with_the_trained_logits(exports, layout):
    from transformers import AutoModelForCausalLM

    final, engine_logits = exports[layout]
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    batch = pad_batch(PROBE, 0)
    with torch.no_grad():
        hf_logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(hf_logits, engine_logits, atol=1e-5, rtol=0)


RESUME = ["train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def straight(ray_cluster, tmp_path_factory):
    """8 steps of SFT on 2 ranks, ZeRO-2, checkpointed at 4 and 8, in the background: step 4's
    is committed at a later step's poll (the next, unless its writes take longer), step 8's at
    the end; each rank wrote its own pieces."""
    out = tmp_path_factory.mktemp("sft") / "straight"
    summary = run_sft(_spec(*RESUME), out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000004", "step_0000008"]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    figures = [r for r in rows if "checkpoint/seconds_total" in r]
    assert len(figures) == 1 and 5 <= figures[0]["step"] <= 8
    assert 0 < figures[0]["checkpoint/seconds_blocking"] <= figures[0]["checkpoint/seconds_total"]
    assert summary["checkpoints"]["count"] == 2 and summary["checkpoints"]["gbytes"] > 0.02
    assert sorted(p.name for p in (out / "checkpoints" / "step_0000004" / "actor").glob("pieces-*")) == [
        "pieces-rank00000.safetensors", "pieces-rank00001.safetensors"]
    return out


def test_the_exports_load_in_vllm_with_transformers_tokens_and_log_probs(straight, exports):
    """The exports of every layout (and the straight run's single-file final/) in vLLM's CPU
    build, one after another in a process of its own: its greedy tokens are transformers'
    argmax on the same folder, with the same log-probabilities (and transformers' logits are
    the trained engine's: the test above)."""
    from transformers import AutoModelForCausalLM

    finals = [straight / "final"] + [final for final, _ in exports.values()]
    prompts = _chat_prompts(finals[0], ("12+7=", "30-4=", "5+5="))
    per_folder = _vllm_greedy(prompts, finals)
    assert len(per_folder) == len(finals)
    for final, results in zip(finals, per_folder):
        _greedy_as_vllm(AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval(), prompts, results)


def _chat_prompts(folder, texts) -> list[list[int]]:
    """``texts`` as user turns in the chat template of ``folder``'s tokenizer, token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for t in texts]


def _greedy_as_vllm(model, prompts, results) -> None:
    """vLLM's greedy tokens (``results``, per prompt) are ``model``'s argmax, with its
    log-probabilities (within 1e-4)."""
    for prompt, res in zip(prompts, results):
        assert res["token_ids"], res
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + res["token_ids"]])).logits[0].float(), -1)
        steps = range(len(prompt) - 1, len(prompt) - 1 + len(res["token_ids"]))
        assert res["token_ids"] == [int(logp[i].argmax()) for i in steps]
        torch.testing.assert_close(torch.tensor(res["logprobs"]), torch.tensor(
            [logp[i, t].item() for i, t in zip(steps, res["token_ids"])]), atol=1e-4, rtol=0)


def _vllm_greedy(prompts: list[list[int]], folders: list) -> list[list[dict]]:
    """Each folder's greedy tokens and log-probs of ``prompts`` in vLLM, in a process of its own
    (``vllm_probe.py``): a list per folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_probe.py")), json.dumps(prompts),
                           *map(str, folders)], capture_output=True, text=True, timeout=400, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_every_zero_stage_offload_and_autotp_train_the_same_model(straight, tmp_path):
    """The straight run (ZeRO-2), and the same 8 steps on ZeRO-3 with its optimizer states and
    parameters offloaded (DeepSpeed's ZeRO-Offload paths: on a CPU machine the memory is the
    same, but their code runs), on AutoTP 2 x ZeRO-1 and on plain data parallelism (ZeRO-0) with
    its micro-batches packed (data.packing: sequences end to end, no padding). The ZeRO-3 and
    ZeRO-0 runs cut their micro-batches by tokens (train.max_tokens_per_micro_batch: rows
    balanced over the ranks, a varying count of micro-batches per step, padded and packed)."""
    runs = {"zero3-offload": ["train.zero_stage=3", "train.offload_optimizer=true", "train.offload_params=true",
                              "train.max_tokens_per_micro_batch=100"],
            "autotp2": ["train.tp_size=2", "train.zero_stage=1", "train.micro_batch_size=16"],
            "zero0-packed": ["train.zero_stage=0", "data.packing=true", "train.max_tokens_per_micro_batch=90"]}
    losses = {"zero2": _losses(straight)}
    for name, extra in runs.items():
        out = tmp_path / name
        summary = run_sft(_spec(*RESUME, "checkpoint.every_steps=0", *extra), out)
        losses[name] = _losses(out)
        assert summary["steps"] == 8 and (out / "final" / "model.safetensors").is_file()
    first, last = losses["zero2"][1], losses["zero2"][8]
    assert last < 0.7 * first, (first, last)  # the loss falls
    for name in runs:  # sharding and packing must not change the math
        assert sorted(losses[name]) == sorted(losses["zero2"])
        for step, value in losses["zero2"].items():
            assert losses[name][step] == pytest.approx(value, abs=2e-5), (name, step)


@pytest.mark.parametrize("layout, tol", [([], 0), (["train.num_ranks=1", "train.zero_stage=3"], 1e-6),
                                         (["train.tp_size=2", "train.zero_stage=1",
                                           "train.micro_batch_size=16"], 2e-5)],
                         ids=["same", "1-rank-zero3", "autotp2"])
def test_resume_continues_exactly_like_an_uninterrupted_run(straight, tmp_path, layout, tol):
    resumed = stopped_at(straight, 4, tmp_path / "resumed")
    summary = run_sft(_spec(*RESUME, *layout, "checkpoint.resume=auto"), resumed)
    assert summary["resumed_from"] == 4
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(1, 9))
    # the same layout repeats the arithmetic: bit-identical; one rank sums the micro-batches'
    # losses in another order (seen: equal, and 4e-6 on a 240-token sum elsewhere); AutoTP
    # splits each matmul's sum over two ranks (2e-5 is the ZeRO-vs-AutoTP bar above)
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], abs=tol), step
    steps = [json.loads(ln)["step"] for ln in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps))


def _whole(worker) -> dict:
    from elasticrl.engine.state import full_state

    weights, moments = full_state(worker.core.engine)
    return {**weights, **moments}


def _saved(folder) -> dict:
    from elasticrl.engine.state import whole_tensors

    return whole_tensors(folder)


def _loaded(spec, folder) -> dict:
    group = RoleGroup("trainer", SFTWorker, spec.train.num_ranks, spec_to_dict(spec), resolve_paths(spec))
    try:
        group.setup(8, resume=str(folder))
        return group.call("__ray_call__", _whole)[0]
    finally:
        group.shutdown()


TP2 = ["train.tp_size=2", "train.zero_stage=1", "train.micro_batch_size=16"]


@pytest.mark.parametrize("layout", [["train.num_ranks=1", "train.zero_stage=3"], ["train.zero_stage=3"],
                                    ["train.num_ranks=1", "train.zero_stage=2"], TP2],
                         ids=["1-rank-zero3", "2-ranks-zero3", "1-rank-zero2", "autotp2"])
def test_a_checkpoint_loads_bit_exact_at_another_world_size_and_stage(straight, layout):
    """Saved by 2 ranks with ZeRO-2, loaded by another layout: every fp32 master weight and
    Adam moment equals the saved one exactly (the checkpoint is whole tensors, not partitions)."""
    folder = straight / "checkpoints" / "step_0000004" / "actor"
    saved = _saved(folder)
    loaded = _loaded(_spec(*RESUME, *layout), folder)
    assert loaded.keys() == saved.keys() and len(saved) == 3 * 30
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []


def test_an_autotp_checkpoint_holds_whole_tensors_and_loads_bit_exact_without_tp(ray_cluster, tmp_path):
    """Saved by 2 AutoTP ranks (each holds half of every projection): the checkpoint holds the
    model's full shapes, and one rank without TP loads exactly what was saved."""
    out = tmp_path / "tp"
    run_sft(_spec("train.max_steps=4", "checkpoint.every_steps=4", *TP2), out)
    folder = out / "checkpoints" / "step_0000004" / "actor"
    saved = _saved(folder)
    shapes = {k: v.shape for k, v in load_file(f"{resolve_paths(_spec())['model']}/model.safetensors").items()}
    assert {k: v.shape for k, v in saved.items() if not k.startswith("exp_avg")} == shapes
    assert all(saved[f"exp_avg.{k}"].shape == shape for k, shape in shapes.items())
    # each rank wrote its own pieces: its half of every cut projection, a share of the rest
    sizes = [(folder / f"pieces-rank{r:05d}.safetensors").stat().st_size for r in range(2)]
    assert max(sizes) < 0.6 * sum(sizes), sizes
    loaded = _loaded(_spec(*RESUME, "train.num_ranks=1"), folder)
    assert loaded.keys() == saved.keys()
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []


def test_resume_refuses_a_checkpoint_holding_a_pickle_without_running_it(straight, tmp_path):
    """A crafted file beside the weights: resuming stops with one line naming it, and the
    payload (which would create a file when unpickled) never runs."""
    import pickle

    resumed = stopped_at(straight, 4, tmp_path / "resumed")
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (resumed / "checkpoints" / "step_0000004" / "actor" / "optimizer_states.pt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"optimizer_states.pt is not a file elasticrl writes .*a pickle could run"):
        run_sft(_spec(*RESUME, "checkpoint.resume=auto"), resumed)
    assert not marker.exists()
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == len(
        (straight / "metrics.jsonl").read_text().splitlines())  # nothing was touched


def test_rerunning_a_finished_job_keeps_its_output(ray_cluster, tmp_path):
    from elasticrl.trainers import run_job

    out = tmp_path / "run"
    first = run_job(_spec("train.max_steps=2", "checkpoint.resume=auto"), out)
    metrics = (out / "metrics.jsonl").read_text()
    again = run_job(_spec("train.max_steps=2", "checkpoint.resume=auto", "eval.every_steps=1"), out)
    assert again["already_finished"] and again["final"] == first["final"]
    assert (out / "metrics.jsonl").read_text() == metrics
    # more steps, but no checkpoint to continue from: refused, nothing deleted
    with pytest.raises(ValueError, match=r"holds a finished run of another spec \(train.max_steps changed\) and no "
                                         r"checkpoint to continue from"):
        run_job(_spec("train.max_steps=3", "checkpoint.resume=auto"), out)
    assert (out / "metrics.jsonl").read_text() == metrics


def test_a_full_disk_fails_the_checkpoint_in_one_line_and_keeps_the_previous_one(ray_cluster, tmp_path):
    """The output on a 40 MB file system: the step-4 checkpoint (26 MB) fits, step 8's does
    not. The run stops with one line naming the folder and the cause, no temp folder is left,
    and step 4 still resumes."""
    from elasticrl.engine.checkpoint import check_resumable

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)]).returncode:
        pytest.skip("a small file system to fill needs root and mount")
    try:
        spec = _spec("train.max_steps=8", "checkpoint.every_steps=4")
        with pytest.raises(RuntimeError) as failed:
            run_sft(spec, disk / "run")
        root = disk / "run" / "checkpoints"
        assert str(failed.value) == (f"checkpoint: cannot write step 8 into {root}: No space left on device; free "
                                     "space there or keep fewer checkpoints (checkpoint.keep); the newest checkpoint, "
                                     f"{root / 'step_0000004'}, is intact")
        assert [p.name for p in root.iterdir()] == ["step_0000004"]
        assert check_resumable(root / "step_0000004", spec)["step"] == 4
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a killed rank may still hold a file


LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def test_lora_trains_only_its_adapters_resumes_at_one_rank_and_exports_a_peft_folder(ray_cluster, tmp_path):
    """model.lora on 2 ranks (ZeRO-2), checkpointed at steps 4 and 8: the checkpoint holds the
    adapters and their moments, nothing of the frozen base; resumed from step 4 on 1 rank at
    ZeRO-3 (the base sharded while it loads), the losses are the uninterrupted run's; final/ is
    a peft adapter folder that peft loads onto the base, with the logits of the base whose
    weights are merged by hand (W + alpha / r x B A), as has final/merged (export.merge) in
    plain transformers, and that vLLM serves as a LoRA adapter with peft's greedy tokens and
    log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from elasticrl.engine.checkpoint import ADAPTER_WEIGHTS, LORA_BASE, check_base
    from elasticrl.engine.state import whole_tensors

    spec = _spec(*RESUME, *LORA, "export.merge=true")
    straight = tmp_path / "straight"
    run_sft(spec, straight)
    base_path = resolve_paths(spec)["model"]
    base = load_file(f"{base_path}/model.safetensors")
    saved = whole_tensors(straight / "checkpoints" / "step_0000004" / "actor")
    weights = {k for k in saved if not k.startswith("exp_avg")}
    # A and B on every linear layer but the head (7 a layer in the Llama), and their two moments
    linear = [k for k, v in base.items() if v.dim() == 2 and "embed" not in k and "lm_head" not in k]
    assert len(weights) == 2 * len(linear) and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert sorted(saved) == sorted({*weights, *(f"{m}.{k}" for k in weights for m in ("exp_avg", "exp_avg_sq"))})
    assert json.loads((straight / "checkpoints" / "step_0000004" / "actor" / LORA_BASE).read_text())["path"] == \
        str(base_path)

    resumed = stopped_at(straight, 4, tmp_path / "resumed")
    summary = run_sft(_spec(*RESUME, *LORA, "train.num_ranks=1", "train.zero_stage=3", "checkpoint.resume=auto"),
                      resumed)
    assert summary["resumed_from"] == 4
    a, b = _losses(straight), _losses(resumed)
    assert a[8] < 0.9 * a[1], a  # the adapters learn
    for step in range(5, 9):  # one rank sums the micro-batches' losses in another order
        assert b[step] == pytest.approx(a[step], abs=1e-6), step

    final = straight / "final"
    assert {"adapter_config.json", ADAPTER_WEIGHTS} <= {p.name for p in final.iterdir()}
    assert not list(final.glob("model*.safetensors"))
    adapters = load_file(final / ADAPTER_WEIGHTS)
    torch.testing.assert_close(load_file(resumed / "final" / ADAPTER_WEIGHTS), adapters, atol=1e-5, rtol=0)
    config = json.loads((final / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    merged = {}
    for key, w in base.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapters:
            merged[key] = w + scale * adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
        else:
            merged[key] = w
    assert sum(not torch.equal(merged[k], base[k]) for k in linear) == len(linear)  # every B trained off zero
    by_hand = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    by_hand.load_state_dict(merged)
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                          str(final)).eval()
    batch = pad_batch(PROBE, 0)
    with torch.no_grad():
        want = by_hand(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = with_peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        exported = AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
        plain = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=0)
    # the checkpoint names its base: resuming onto other weights is refused
    with pytest.raises(ValueError, match="LoRA adapters were trained on the base .* holds other weights"):
        check_base(straight / "checkpoints" / "step_0000004" / "actor", str(final / "merged"))

    prompts = _chat_prompts(final, ("12+7=", "30-4="))
    _greedy_as_vllm(with_peft, prompts, _vllm_greedy(prompts, [final])[0])


def test_delta_syncs_leave_the_engine_holding_what_a_full_sync_would_bit_for_bit(ray_cluster, tmp_path):
    """rollout.delta_sync from AutoTP 2 ranks into a TP 1 vLLM engine (each rank sends its slices,
    2 -> 1), bf16, real optimizer steps at lr 1e-6, over broadcast (gloo, point to point) and
    files (through the engine's copy plans), where it applies on CPU. Each transport's first sync
    goes whole (the sender has sent nothing yet); each later one a small share of the elements,
    in fewer bytes than a full sync; after each, a full sync of the same weights changes nothing
    in the engine, bit for bit. Over shm and ipc (a CPU's memory copies) it asks for whole syncs."""
    from elasticrl.rollout.pool import RolloutPool

    spec = _spec(*LAYOUTS["autotp2"], "model.dtype=bf16", "train.lr=1e-6", "rollout.delta_sync=true",
                 "rollout.max_model_len=64")
    paths = resolve_paths(spec)
    trainer = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), paths)
    pool = RolloutPool(paths["model"], spec.rollout, "bf16", seed=0)
    synced, version = {}, 0

    def full_sync(w, version: int) -> dict:  # the same sender, once without its delta
        w.core.sender.delta = False
        try:
            return w.sync_weights(version)
        finally:
            w.core.sender.delta = True
    try:
        trainer.setup(10)
        for transport in ("shm", "ipc", "broadcast", "files"):
            trainer.call("attach_rollout", pool.engines, pool.infos, transport, 1, str(tmp_path))
            for step in range(STEPS if transport in ("broadcast", "files") else 2):
                if step:
                    trainer.call("train_step", version)
                delta = trainer.call("sync_weights", version := version + 1)[0]
                held = pool.call("worker_weights", True)
                full = trainer.call("__ray_call__", full_sync, version := version + 1)[0]
                assert pool.call("worker_weights", True) == held, (transport, step)
                synced.setdefault(transport, []).append((delta, full))
            trainer.call("detach_rollout")
    finally:
        trainer.shutdown()
        pool.shutdown()
    for transport, syncs in synced.items():
        (first, full), model = syncs[0], syncs[0][1]["sync/gbytes"]
        assert first["sync/layout"] == ("gathered" if transport == "files" else "sliced")
        if transport in ("shm", "ipc"):
            assert all(s["sync/gbytes"] == model and "sync/delta_fraction" not in s for pair in syncs for s in pair)
            continue
        # whole: the bytes of a full sync (+ 8 bytes a piece of counts, point to point)
        assert first["sync/delta_fraction"] == 1 and model <= first["sync/gbytes"] < 1.001 * model, first
        for delta, full in syncs[1:]:
            assert 0 < delta["sync/delta_fraction"] < 0.5 and 0 < delta["sync/gbytes"] < model / 3, (transport, delta)
            assert full["sync/gbytes"] == model and "sync/delta_fraction" not in full
