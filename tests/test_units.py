"""Pure pieces with hand-derived expectations: schedule, data order, masking, log-probs, shards."""
from __future__ import annotations

import json
import math

import pytest
import torch

from elasticrl.algorithms.logprobs import masked_mean, response_mask, token_logprobs
from elasticrl.data.records import pad_batch, read_jsonl, sample_indices, tokenize_sft
from elasticrl.engine.checkpoint import commit_checkpoint, list_checkpoints, temp_checkpoint_dir, write_trainer_state
from elasticrl.engine.strategy import ds_config, lr_lambda
from elasticrl.spec import load_spec
from elasticrl.weights.shards import INDEX, atomic_folder, load_sharded, plan_shards, save_sharded
from elasticrl.world.tokenizer import build_tokenizer


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    # warm-up: (step+1)/4
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over 8 steps from 1 to 0.1: 0.1 + 0.9 * (1 + cos(pi * k / 8)) / 2
    assert f(4) == pytest.approx(1.0, abs=1e-12)
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-12)  # halfway: cos(pi/2) = 0
    assert f(12) == pytest.approx(0.1, abs=1e-12) and f(20) == pytest.approx(0.1, abs=1e-12)
    assert lr_lambda(0, 10, 0.0)(0) == pytest.approx(1.0)


def test_sample_order_is_a_pure_function_of_position():
    n = 10
    first_epoch = sample_indices(n, seed=3, start=0, count=n)
    assert sorted(first_epoch) == list(range(n))  # each record once per epoch
    assert sample_indices(n, 3, 4, 8) == (first_epoch + sample_indices(n, 3, 10, 10))[4:12]
    assert sample_indices(n, 3, 10, n) != first_epoch  # a new permutation each epoch
    assert sample_indices(n, 4, 0, n) != first_epoch


def test_sft_tokens_mask_the_prompt():
    tok = build_tokenizer()
    ids, plen = tokenize_sft(tok, "1+1=", "2", apply_chat_template=True, max_length=64)
    assert tok.decode(ids) == "<bos><|user|>1+1=<|assistant|>2<eos>"
    assert plen == 7
    batch = pad_batch([ids, ids[:5]], tok.pad_token_id, [plen, 5])
    assert batch["labels"][0].tolist() == [-100] * 7 + [ids[7], tok.eos_token_id]
    assert batch["labels"][1].tolist() == [-100] * 9  # prompt-only and padding carry no loss
    assert batch["attention_mask"].sum(1).tolist() == [9, 5]
    ids, plen = tokenize_sft(tok, "1+1=", "2", True, max_length=5)
    assert len(ids) == 5 and plen == 5


def test_token_logprobs_against_a_hand_computation():
    # Vocabulary of 3; logits chosen so softmax is easy: [0, ln 2, ln 3] -> probs [1/6, 2/6, 3/6].
    row = torch.tensor([0.0, math.log(2), math.log(3)])
    logits = row.repeat(1, 4, 1)  # [B=1, T=4, V=3]
    labels = torch.tensor([[-100, 2, 1, -100]])
    lp = token_logprobs(logits, labels)
    assert lp.shape == (1, 3)
    torch.testing.assert_close(lp, torch.tensor([[math.log(3 / 6), math.log(2 / 6), 0.0]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(response_mask(labels), torch.tensor([[1.0, 1.0, 0.0]]))
    # mean over the two scored tokens: (ln .5 + ln 1/3) / 2
    assert masked_mean(lp, response_mask(labels)).item() == pytest.approx((math.log(0.5) + math.log(1 / 3)) / 2)


def test_ds_config_reflects_the_spec():
    t = load_spec({}, ["train.zero_stage=3", "train.offload_optimizer=true", "train.offload_params=true",
                       "train.tp_size=2", "train.global_batch_size=64", "train.micro_batch_size=16"]).train
    cfg = ds_config(t, "bf16", grad_accum=4)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and cfg["bf16"] == {"enabled": True}
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 16


def test_plan_shards_respects_the_bound():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 10**6) == [["a", "b", "c", "d", "e"]]


def test_sharded_round_trip_with_index(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(5)}
    state["tied"] = state["layer0.weight"]  # shared storage is written as its own copy
    names = save_sharded(state, tmp_path, max_shard_bytes=64 * 64 * 4 * 2)
    assert INDEX in names and len(names) == 4  # 6 tensors of 16 KiB, 2 per 32 KiB shard
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == set(state) and index["metadata"]["total_size"] == 6 * 64 * 64 * 4
    loaded = load_sharded(tmp_path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "export"
    with pytest.raises(RuntimeError):
        with atomic_folder(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_folder(final) as tmp:
        (tmp / "ok").write_text("1")
    with atomic_folder(final) as tmp:  # replaces the old one whole
        (tmp / "new").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["new"] and len(list(tmp_path.iterdir())) == 1


def test_checkpoints_commit_atomically_and_rotate(tmp_path):
    for step in (2, 4, 6):
        tmp = temp_checkpoint_dir(tmp_path, step)
        write_trainer_state(tmp, {"step": step})
        commit_checkpoint(tmp, tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    temp_checkpoint_dir(tmp_path, 8)  # a save that never finished is not a checkpoint
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]


def test_read_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: missing key\(s\) \['response'\]"):
        read_jsonl(p, ("prompt", "response"))
    p.write_text('{"prompt": \n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: not valid JSON"):
        read_jsonl(p)


def test_copy_plan_replay_handles_fused_rows_views_and_fills():
    from elasticrl.weights.plan import replay

    arena = torch.zeros(64, dtype=torch.uint8)  # 16 fp32 slots
    typed = {"float32": arena.view(torch.float32)}
    flat = torch.arange(100, dtype=torch.float32)
    src = flat[40:46].view(2, 3)  # a view at storage offset 40, like a ZeRO partition
    plans = [
        ("copy", 4 * 4, [1, 3], [3, 1], "float32", 3, [1, 3], [3, 1]),  # row 1 of src -> slots 4..6
        ("copy", 8 * 4, [2, 1], [1, 1], "float32", 0, [2, 1], [3, 1]),  # column 0 -> slots 8, 9
        ("fill", 12 * 4, [4], [1], "float32", 7.0, [], []),            # padding rows -> 7
    ]
    written = replay(plans, src, typed)
    assert written == 4 * (3 + 2 + 4)
    assert typed["float32"].tolist() == [0, 0, 0, 0, 43, 44, 45, 0, 40, 43, 0, 0, 7, 7, 7, 7]


def test_prm_steps_end_with_the_marker_and_only_those_positions_are_scored():
    from elasticrl.trainers.prm import encode_steps, marker_id

    tok = build_tokenizer()
    nl = marker_id(tok, "\n")
    ids, pos = encode_steps(tok, "1+2+3=", ["1+2=3", "3+3=6"], nl, apply_chat_template=False, max_length=64)
    assert tok.decode(ids) == "1+2+3=1+2=3\n3+3=6\n"
    assert pos == [11, 17] and all(ids[p] == nl for p in pos)  # 6 prompt ids, then 5 + marker, 5 + marker
    _, cut = encode_steps(tok, "1+2+3=", ["1+2=3", "3+3=6"], nl, apply_chat_template=False, max_length=17)
    assert cut == [11]  # the second step's marker fell past max_length: that step is not scored
    with pytest.raises(ValueError, match="data.step_marker: 'ab' is 2 tokens"):
        marker_id(tok, "ab")


def test_prm_metrics_by_hand():
    from elasticrl.trainers.prm import step_metrics

    solutions = [  # (prompt, labels, scores)
        ("p", [1, 1], [0.9, 0.8]),  # right, judged right: weakest 0.8
        ("p", [1, 0], [0.9, 0.7]),  # second step missed: weakest 0.7
        ("p", [0, 0], [0.2, 0.9]),  # first error found, second step missed: weakest 0.2
        ("q", [1, 1], [0.6, 0.4]),  # right, second step doubted: weakest 0.4
        ("q", [0, 0], [0.3, 0.3]),  # all right: weakest 0.3
        ("r", [0, 1.0], [0.1, 0.2]),  # a lone solution: no best-of-n contest
    ]
    m = step_metrics(solutions)
    # steps on the right side of 0.5: 2 + 1 + 1 + 1 + 2 + 1 = 8 of 12
    assert m["eval/step_accuracy"] == pytest.approx(8 / 12, abs=1e-12)
    # first step below 0.5 vs first labelled wrong: (none, none) (none, 1) (0, 0) (1, none) (0, 0) (0, 0)
    assert m["eval/first_error_accuracy"] == pytest.approx(4 / 6, abs=1e-12)
    # p picks 0.8 (right), q picks 0.4 (right); r has one solution and no right one
    assert m["eval/best_of_n_accuracy"] == 1.0
    assert step_metrics([("q", [1, 1], [0.2, 0.9]), ("q", [0, 1], [0.6, 0.6])])["eval/best_of_n_accuracy"] == 0.0


def test_prm_records_are_checked_with_file_and_record(tmp_path):
    from elasticrl.trainers.prm import read_step_records

    spec = load_spec({"algorithm": "prm"})
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "steps": ["1+1=2"], "labels": [1]}) + "\n"
                    + json.dumps({"prompt": "1+1=", "steps": ["1+1=2", "2+0=2"], "labels": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"steps.jsonl: record 2: 'labels' must hold one number in \[0, 1\] per step"):
        read_step_records(str(path), spec)
    path.write_text(json.dumps({"prompt": "1+1=", "steps": "1+1=2", "labels": [1]}) + "\n")
    with pytest.raises(ValueError, match="record 1: 'steps' must be a non-empty list of strings"):
        read_step_records(str(path), spec)
