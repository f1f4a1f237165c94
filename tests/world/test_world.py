"""The embedded tiny world: same bytes everywhere, a working tokenizer, a clean task split."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from elasticrl.spec.schema import WorldSpec
from elasticrl.world import content_hash, reasoning, world_dir
from elasticrl.world.calculator import calc, parse_calls, with_calculator
from elasticrl.world.model import PRESETS, tiny_config
from elasticrl.world.task import enumerate_problems, is_correct, make_records, parse_answer, split_problems
from elasticrl.world.tokenizer import VOCAB_SIZE, build_tokenizer

# Recorded from a build of the default world (torch 2.13.0, transformers 5.19.0). A change
# here means users' worlds changed: bump build.FORMAT_VERSION and record the new values.
DEFAULT_WORLD_SHA256 = "f5e435cd047e7d64a121a46523a1d1d300a06119c8c5eb7e0006b4ec81505c28"  # 5: 8,192 positions
DEFAULT_DATA_SHA256 = {
    "eval.jsonl": "b3ec73d17c4b02c2a0fd64d369c3a01b1afd4c2c324cd8c364292c40d769c572",
    "preference.jsonl": "ac9d77a7e9bc054758080ae7edb97b5856823a9440da0d14c652810e69d49af2",
    "preference_eval.jsonl": "2b40b3876ef5951f57ecebe2000c0916aba8b5cd24e50f50499080169aa69841",
    "prm.jsonl": "a18dc24b4cac398b48f1f41cfcfa3786b004bb0dba47f348aff41d25cfb2a40a",
    "prm_eval.jsonl": "c266cb8652d36ee349a257d3838548d975ce7393ed9ca04f078fa19ead420cef",
    "rl_prompts.jsonl": "45600853b9c97bcdb7c44e49677b4da859f2811f57ccc972157b83909869c625",
    "sft.jsonl": "e6cfbdecd7fb2f28f99df76e237124d17f12e29d4d110b7830b6adf17195ff56",
}


def test_default_world_has_the_recorded_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICRL_CACHE", str(tmp_path))
    d = world_dir(WorldSpec())
    manifest = json.loads((d / "MANIFEST.json").read_text())
    assert manifest["content_sha256"] == DEFAULT_WORLD_SHA256
    assert content_hash(d) == DEFAULT_WORLD_SHA256
    for name, digest in DEFAULT_DATA_SHA256.items():
        assert hashlib.sha256((d / "data" / name).read_bytes()).hexdigest() == digest, name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_rebuild_in_another_place_is_identical(tmp_path, monkeypatch):
    small = WorldSpec(model_size="0.5m", num_train=500, num_eval=50, seed=7)
    hashes = []
    for sub in ("a", "b"):
        monkeypatch.setenv("ELASTICRL_CACHE", str(tmp_path / sub))
        hashes.append(content_hash(world_dir(small)))
    assert hashes[0] == hashes[1]
    monkeypatch.setenv("ELASTICRL_CACHE", str(tmp_path / "c"))
    assert content_hash(world_dir(WorldSpec(model_size="0.5m", num_train=500, num_eval=50, seed=8))) != hashes[0]


def test_tokenizer_round_trip_and_chat_template():
    tok = build_tokenizer()
    assert len(tok) == VOCAB_SIZE
    text = "What is 17+5? It is 22.\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "17+5="}, {"role": "assistant", "content": "22"}],
                                   tokenize=False)
    assert chat == "<bos><|user|>17+5=<|assistant|>22<eos>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 2 + 4 + 1  # bos, user, "1+1=", assistant
    assert tok.decode([tok.convert_tokens_to_ids("<reserved_3>"), ids[2]], skip_special_tokens=True) == "1"


def test_task_split_is_disjoint_and_answers_are_right():
    train, held_out = split_problems(30, "+-*", 200, seed=0)
    assert len(held_out) == 200
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    for prompt, answer in train + held_out:
        assert eval(prompt[:-1]) == answer >= 0  # "17-5=" -> 12
    assert len(enumerate_problems(3, "+")) == 16


def test_records_are_consistent():
    rec = make_records(20, "+-", 100, 30, seed=1)
    assert len(rec["sft"]) == 100 and len(rec["eval"]) == 30
    for r in rec["preference"]:
        assert eval(r["prompt"][:-1]) == int(r["chosen"]) != int(r["rejected"])
    evals = {r["prompt"] for r in rec["eval"]}
    assert not evals & {r["prompt"] for r in rec["sft"]}
    assert not evals & {r["prompt"] for r in rec["rl_prompts"]}


def test_step_labels_follow_the_problem():
    rec = make_records(20, "+-", 400, 40, seed=1)
    assert len(rec["prm_eval"]) == 4 * 10 and len(rec["prm"]) == 4 * 40
    assert not {r["prompt"] for r in rec["prm_eval"]} & {r["prompt"] for r in rec["prm"]}
    kinds = set()
    for r in rec["prm"] + rec["prm_eval"]:
        (expr1, x), (expr2, y) = (step.split("=") for step in r["steps"])
        assert eval(expr1) == int(x) and eval(expr2) == int(y)  # each step's own arithmetic is right
        # step 1 is on track when it restates the problem's first operation; step 2 when it
        # also goes on from step 1's result with the problem's last operation
        problem = r["prompt"][:-1]
        first_ok = problem.startswith(expr1) and problem[len(expr1)] in "+-"
        second_ok = first_ok and expr2 == x + problem[len(expr1):]
        assert r["labels"] == [int(first_ok), int(second_ok)], r
        kinds.add((tuple(r["labels"]), int(y) == eval(problem)))
    # right; misread and carried on; a wrong value carried into step 2; two misreads that cancel
    assert kinds == {((1, 1), True), ((0, 0), False), ((1, 0), False), ((0, 0), True)}


@pytest.mark.parametrize("completion, answer, ok", [
    ("22", "22", True), (" 22<eos>", "22", True), ("22 and 23", "22", True), ("23", "22", False),
    ("", "22", False), ("-3", "-3", True), ("abc", "abc", True), ("abd", "abc", False)])
def test_is_correct(completion, answer, ok):
    assert is_correct(completion, answer) is ok


def test_parse_answer():
    assert parse_answer("x = 41, y = 2") == 41 and parse_answer("none") is None


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_have_their_size_and_shard_for_tp2(preset):
    from transformers import LlamaForCausalLM

    cfg = tiny_config(preset, build_tokenizer())
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    nominal = float(preset.rstrip("m")) * 1e6
    assert 0.75 * nominal <= n <= 1.25 * nominal, n
    assert cfg.num_attention_heads % 2 == 0 and cfg.num_key_value_heads % 2 == 0 and cfg.vocab_size % 8 == 0


def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else():
    assert (calc("37*48"), calc("2+3*4"), calc("10-2-3"), calc("-4*5")) == (1776, 14, 5, -20)
    for bad in ("__import__('os').getcwd()", "2**10", "1/2", "x", "1.5*2", "", "(1+", "9" * 65):
        with pytest.raises(ValueError):
            calc(bad)
    assert parse_calls("calc(37*48) and calc( 2+2 )") == [{"name": "calc", "arguments": {"expression": "37*48"}},
                                                          {"name": "calc", "arguments": {"expression": " 2+2 "}}]
    assert parse_calls("1776") == []


def test_the_calculator_worlds_sft_rows_call_it_in_their_share():
    records = with_calculator(make_records(99, "*", 1000, 50, 0, mul_max=99), 0.2, 0)
    calls = [r["messages"] for r in records["sft"] if len(r["messages"]) == 4]
    assert 0.15 < len(calls) / 1000 < 0.25
    for user, call, tool, answer in calls:
        assert call == {"role": "assistant", "content": f"calc({user['content'].rstrip('=')})"}
        assert tool == {"role": "tool", "content": str(calc(user["content"].rstrip("=")))} and answer["content"] == \
            tool["content"]
    direct = [r["messages"] for r in records["sft"] if len(r["messages"]) == 2]
    assert len(direct) + len(calls) == 1000 and all(is_correct(a["content"], str(calc(u["content"][:-1])))
                                                    for u, a in direct)
    # multiplication past the arithmetic world's 12 x 12, held out as there
    assert max(int(r["prompt"].split("*")[0]) for r in records["eval"]) > 12
    assert not {r["prompt"] for r in records["eval"]} & {r["prompt"] for r in records["rl_prompts"]}


def test_reasoning_chains_are_worked_right_and_held_out_problems_untrained():
    rec = reasoning.make_records(2000, 100, seed=0)

    def lines_of(row):  # checks the worked chain line by line; its line count
        start, step, distance = map(int, row["prompt"][:-1].replace("...>", "+").split("+"))
        *chain, last = (row.get("response") or reasoning.solution(start, step, distance)).split("\n")
        for i, line in enumerate(chain, 1):  # value and distance left after i steps, three digits or -0d
            left = distance - i * step
            assert line == f"{start + (i - 1) * step:03d}+{step}={start + i * step:03d} " + (
                f"{left:03d}" if left >= 0 else f"-0{-left}") and (left < 0) == (i == len(chain))
        assert int(last) == start + len(chain) * step == reasoning.answer(start, step, distance) < 1000
        assert int(row.get("answer", last)) == int(last)
        return len(chain)

    sft, rl = [lines_of(r) for r in rec["sft"]], [lines_of(r) for r in rec["rl_prompts"] + rec["eval"]]
    assert max(sft) == reasoning.SFT_LINES and max(rl) == reasoning.MAX_LINES
    assert sum(n > max(sft) for n in rl) > len(rl) / 3  # RL's chains outgrow the warm start's
    assert max(len(r["prompt"]) + len(r["response"]) for r in rec["sft"]) + 4 <= reasoning.SFT_LENGTH
    assert not {r["prompt"] for r in rec["eval"]} & {r["prompt"] for r in rec["sft"] + rec["rl_prompts"]}
