"""The alignment trainers of the paper's appendix end to end on the tiny world with 2
DeepSpeed ranks: the reward model must rank held-out pairs; the process reward model must
learn to find the wrong step; DPO, IPO, conservative DPO and KTO must move the policy towards
the chosen answers on held-out pairs; rejection sampling and iterative DPO must sample with
vLLM, keep the right records, train, sync and answer their prompts better; conditional SFT must
train on attribute-marked prompts and answer differently when asked for another attribute.
Each algorithm's learning run is also the straight run of its resume: stopped after a
checkpoint and resumed, it gives the same rows bit for bit, in bf16 too where the CPU has it
(the reward models, KTO, rejection sampling; conditional SFT in fp32, where its bar was
measured; DPO's and iterative DPO's are in test_resume.py)."""
from __future__ import annotations

import json
import math

import pytest

from elasticrl import backend
from elasticrl.data.records import read_records, sample_indices, tokenize_sft
from elasticrl.spec import load_spec
from elasticrl.trainers.conditional import run_conditional
from elasticrl.trainers.preference import run_preference
from elasticrl.trainers.prm import run_prm
from elasticrl.trainers.rm import run_rm
from elasticrl.trainers.rounds import run_rounds
from elasticrl.trainers.warm_start import initial_model
from elasticrl.world import world_paths
from elasticrl.world.task import is_correct
from tests.conftest import EXAMPLES, LEARNING, SEED, resumes_exactly

pytestmark = pytest.mark.slow

BASE = ["model.dtype=fp32", "log.progress_bar=false", "log.every_steps=1", "checkpoint.resume=null",
        "init.sft_steps=60", "train.num_ranks=2", "train.micro_batch_size=8", "train.global_batch_size=32",
        "train.max_steps=12", "train.lr=2e-4", "eval.every_steps=0", "eval.num_prompts=64", "eval.max_new_tokens=6"]


# Single-digit operands, as for the reward models below: all 152 held-out pairs, learned within
# CI's minutes. On the default world 12 steps moved the held-out margin by chance only (seeds 1
# and 3: 0.006 and -0.024); here, under 4 seeds in fp32 and one in bf16, every variant ended
# with a margin of 0.10-0.28, log pi(chosen) - log pi(rejected) up by 1.0-2.8, and pairwise
# accuracy 0.645-0.763 (KTO, which never contrasts a pair, 0.572-0.717) (docs/development.md).
PREFERENCE = ["world.max_operand=9", "eval.num_prompts=0", "train.max_steps=24"]


@pytest.mark.parametrize("variant", [
    ["algorithm=dpo", "preference.loss=ipo"],
    ["algorithm=dpo", "preference.label_smoothing=0.1"],
], ids=["ipo", "cdpo"])
def test_preference_training_raises_the_held_out_margin(ray_cluster, tmp_path, variant):
    """(DPO's own run, with a precomputed reference and packed pairs, is the straight run of its
    resume test, in test_resume.py.)"""
    spec = load_spec(EXAMPLES / "tiny_dpo.yaml", BASE + PREFERENCE + variant + LEARNING)
    summary = run_preference(spec, tmp_path / "run")
    check_preference_learned(spec, tmp_path / "run", summary)


def test_kto_with_lora_and_packed_examples_learns_and_resumes_exactly(ray_cluster, tmp_path, capsys):
    """A pair gives KTO two examples: twice the steps see the same pairs as DPO's 24; LoRA
    adapters (at 10x the rate) on the frozen model, which with its adapters off is the
    reference, so the margin starts at exactly 0 too (B = 0 at the start). Checkpointed at 36,
    resumed there: its reference point (a batch's mismatched pairs) repeats too."""
    spec = load_spec(EXAMPLES / "tiny_dpo.yaml", BASE + PREFERENCE + [
        "algorithm=kto", "data.packing=true", "train.max_steps=48", "model.lora.rank=8", "train.lr=2e-3", *LEARNING,
        "checkpoint.every_steps=36", "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    check_preference_learned(spec, straight, run_preference(spec, straight))
    resumes_exactly(run_preference, spec, straight, 36, capsys)


def check_preference_learned(spec, out, summary) -> None:
    """What a learning run of a preference variant (BASE + PREFERENCE) must show in ``out``."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-1]
    steps = spec.train.max_steps
    assert first["step"] == 0 and last["step"] == steps
    # at step 0 the policy is the reference: the implicit reward margin is 0 (in bf16 the policy's
    # engine and the reference's plain module round differently: -4.4e-5 was seen)
    exact = backend.resolve_dtype(spec.model.dtype) == "fp32"
    assert first["eval/margin"] == pytest.approx(0.0, abs=1e-5 if exact else 1e-3)
    # the pairs' implicit rewards now favour the right answer
    bar = 0.5 if spec.algorithm == "kto" else 0.55
    assert last["eval/margin"] > 0.05 and last["eval/pairwise_accuracy"] > bar, last
    # the policy's own preference for the right answer grew
    assert last["eval/logp_margin"] > first["eval/logp_margin"] + 0.5, (first, last)
    exported = "adapter_model.safetensors" if spec.model.lora.rank else "model.safetensors"
    assert summary["final"]["step"] == steps and (out / "final" / exported).is_file()
    if spec.algorithm == "kto":
        assert all(r["kl_ref"] >= 0 for r in rows[1:])  # the reference point is clamped at 0
    else:
        assert last["reward/margin"] > 0


# Single-digit operands, the world of the learning tests here: one warm start serves them all,
# and all 38 held-out problems are evaluated in seconds (the sampling test).
ROUNDS = ["model.dtype=fp32", "log.progress_bar=false", "checkpoint.resume=null", "init.sft_steps=60",
          "world.max_operand=9", "train.num_ranks=2", "train.micro_batch_size=8", "train.global_batch_size=16",
          "rounds.num_rounds=3", "rounds.prompts_per_round=64", "rounds.steps_per_round=4", "rl.samples_per_prompt=4",
          "rl.eval_samples=2", "eval.num_prompts=0", "eval.max_new_tokens=6"]


# Learning in rounds: single-digit operands, 8 samples of 64 prompts and 16 steps a round at the
# example's lr (1e-4; a fresh AdamW at 3e-4 raised the SFT loss of a round's own records and
# lowered its accuracy on them). Over 3 rounds, under 3 seeds, greedy accuracy on the prompts the
# rounds sampled rose by 7.7-13.4 points for both algorithms; held-out accuracy (38 problems) by
# 0-18 points, too unevenly to assert (docs/development.md).
ROUNDS_LEARNING = ["rl.samples_per_prompt=8", "rounds.steps_per_round=16"]


def _greedy_accuracy(model_dir, records) -> float:
    from elasticrl.models.evaluate import greedy_accuracy
    from elasticrl.models.load import load_causal_lm, load_tokenizer

    # the default spec's data keys and verifier (the tiny task's integer match)
    correct, total = greedy_accuracy(load_causal_lm(model_dir), load_tokenizer(model_dir), records, load_spec({}),
                                     max_new_tokens=6, dp_rank=0, dp_size=1, synced=False, device="cpu")
    return correct / total


def test_rejection_sampling_learns_in_rounds_without_evaluation_and_resumes_exactly(ray_cluster, tmp_path, capsys):
    """With evaluation off (eval.enabled: false; it once ended the run after its first round),
    checkpointed at each round's end, resumed after round 2. (Iterative DPO's learning run is
    the straight run of its resume test, in test_resume.py.)"""
    spec = load_spec(EXAMPLES / "tiny_rejection_sampling.yaml", ROUNDS + ROUNDS_LEARNING + [
        "eval.enabled=false", "checkpoint.every_steps=16", "checkpoint.resume=auto", *LEARNING])
    straight = tmp_path / "straight"
    check_rounds_learned(spec, straight, run_rounds(spec, straight))
    resumed = resumes_exactly(run_rounds, spec, straight, 32, capsys)
    assert (resumed / "rounds" / "3.jsonl").read_text() == (straight / "rounds" / "3.jsonl").read_text()


def check_rounds_learned(spec, out, summary) -> None:
    """What a learning run of a rounds algorithm (ROUNDS + ROUNDS_LEARNING) must show in ``out``:
    every round sampled, kept the right records, trained and synced, and the greedy answers to
    the prompts the rounds sampled improved."""
    algorithm = spec.algorithm
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    if spec.eval.enabled:
        assert [r["round"] for r in rows] == [0, 1, 2, 3] and all("eval/accuracy" in r for r in rows)
    else:  # no round 0 and no evaluation
        rows = [{"round": 0}] + rows
        assert [r["round"] for r in rows] == [0, 1, 2, 3] and not any("eval/accuracy" in r for r in rows)
    prompts = read_records(world_paths(spec.world)["rl_prompts"], ("prompt", "answer"))
    answers = {r["prompt"]: r["answer"] for r in prompts}
    for rnd in (1, 2, 3):
        data = read_records(out / "rounds" / f"{rnd}.jsonl", ("prompt",))
        assert rows[rnd]["round/records"] == len(data) > 0
        for rec in data:  # the integer verifier scores 1 or 0: kept answers are right, rejected ones wrong
            if algorithm == "rejection_sampling":
                assert is_correct(rec["response"], answers[rec["prompt"]])
            else:
                assert is_correct(rec["chosen"], answers[rec["prompt"]])
                assert not is_correct(rec["rejected"], answers[rec["prompt"]])
        # both losses are positive: a mean NLL, a mean -log sigmoid
        assert rows[rnd]["sync/version"] == rnd and 0 < rows[rnd]["loss"] < math.inf
    assert summary["final"]["round"] == 3 and (out / "final" / "model.safetensors").is_file()
    # the rounds taught the task they were rewarded on: greedy answers to the prompts they sampled
    # improved (same prompts, the starting model against the final one)
    prompts = read_records(world_paths(spec.world)["rl_prompts"], ("prompt", "answer"))
    n = spec.rounds.prompts_per_round
    seen = sorted({i for rnd in range(3) for i in sample_indices(len(prompts), spec.seed, rnd * n, n)})
    before = _greedy_accuracy(initial_model(spec), [prompts[i] for i in seen])
    after = _greedy_accuracy(out / "final", [prompts[i] for i in seen])
    assert after >= before + 0.04, (before, after)


def test_rounds_and_evaluation_sample_with_top_k(ray_cluster, tmp_path):
    """rl.top_k reaches the rounds' sampling and pass@k: with top_k 1 sampling picks the most
    likely token, so a prompt's samples are all alike (iterative DPO finds no pair whose rewards
    differ) and pass@k equals the greedy accuracy."""
    spec = load_spec(EXAMPLES / "tiny_rejection_sampling.yaml", ROUNDS + [
        "algorithm=iterative_dpo", "rl.top_k=1", "rounds.num_rounds=1", "rounds.steps_per_round=1"])
    run_rounds(spec, tmp_path / "run")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1] and rows[1]["round/records"] == 0
    assert (tmp_path / "run" / "rounds" / "1.jsonl").read_text() == ""
    for row in rows:
        assert row["eval/pass@2"] == row["eval/accuracy"], row


def test_conditional_sft_follows_its_attribute_and_resumes_exactly(ray_cluster, tmp_path, capsys):
    """From the single-digit world's SFT warm start (init.sft_steps: SteerLM starts from an SFT
    model), 60 steps on attribute-marked data: asked for [quality:1], the model answers the
    world's training problems (data.eval: its RL prompts) right far more often than asked for
    [quality:0], which it was taught writes near misses (fp32: seed 1234 0.51 against 0.18, seed
    7 0.53 against 0.28, of 117 problems; the warm start answered 0.11 and 0.09 at seed 1234:
    the attribute meant nothing to it).
    Checkpointed at step 40 and resumed there, it gives the same rows."""
    problems = world_paths(load_spec({}, ["world.max_operand=9"]).world)["rl_prompts"]
    spec = load_spec(EXAMPLES / "tiny_conditional_sft.yaml", [
        "model.dtype=fp32", "log.progress_bar=false", "world.max_operand=9", "init.sft_steps=60", SEED,
        "train.max_steps=60", "eval.every_steps=0", "eval.num_prompts=0", "eval.max_new_tokens=6",
        f"data.eval={problems}", "checkpoint.every_steps=40", "checkpoint.resume=auto"])
    summary = run_conditional(spec, tmp_path / "run")
    folder = tmp_path / "run" / "conditional"
    train = read_records(folder / "train.jsonl", ("prompt", "response"))
    prompts = read_records(world_paths(spec.world)["rl_prompts"], ("prompt", "answer"))
    answers = {r["prompt"]: r["answer"] for r in prompts}
    marked = {"[quality:0] ": 0, "[quality:1] ": 0}
    for rec in train:
        tag, prompt = rec["prompt"][:12], rec["prompt"][12:]
        marked[tag] += 1
        if prompt in answers:  # near misses are marked 0, right answers 1
            assert is_correct(rec["response"], answers[prompt]) == (tag == "[quality:1] ")
    assert marked["[quality:0] "] > 0 and marked["[quality:1] "] > marked["[quality:0] "]
    assert all(e["prompt"].startswith("[quality:1] ") for e in read_records(folder / "eval.jsonl", ("prompt",)))
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-2]
    assert rows[-1] == {"step": 60, "eval/compare_accuracy": summary["compare_accuracy"]}
    assert first["step"] == 0 and last["step"] == 60 and (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # the attribute now steers the answers: right when asked for quality 1, wrong when asked for 0
    with capsys.disabled():
        print(f"conditional SFT: asked for quality 1 {first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f}, "
              f"for quality 0 {summary['compare_accuracy']:.3f}")
    assert last["eval/accuracy"] >= summary["compare_accuracy"] + 0.15, (last, summary)
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.2, (first, last)
    resumes_exactly(run_conditional, spec, tmp_path / "run", 40, capsys)


# Single-digit operands: the 2M model learns to judge these answers within CI's minutes
# (two-digit ones take it far longer; docs/preference.md has both).
SMALL_WORLD = ["world.max_operand=9", "eval.num_prompts=0", "train.lr=1e-3", "train.micro_batch_size=32",
               "train.global_batch_size=64"]


def test_reward_model_with_lora_ranks_held_out_pairs_exports_a_merged_model_and_resumes(ray_cluster, tmp_path,
                                                                                          capsys):
    """Rank-8 adapters and a value head trained whole (the full fine-tune trains in tests.prepare,
    PPO's reward model), its micro-batches packed (data.packing); ``export.merge`` writes a plain
    sequence-classification model that scores the held-out pairs, one sequence at a time and
    unpadded, as the trained one did packed. Resumed from its step-40 checkpoint it repeats the
    last 20 steps."""
    import torch

    from elasticrl.models.load import load_tokenizer, load_value_model, token_values

    spec = load_spec(EXAMPLES / "tiny_rm.yaml", BASE + SMALL_WORLD + [
        "train.max_steps=60", "train.lr=5e-3", "model.lora.rank=8", "export.merge=true", "data.packing=true", *LEARNING,
        "checkpoint.every_steps=40", "checkpoint.resume=auto"])
    summary = run_rm(spec, tmp_path / "run")
    resumes_exactly(run_rm, spec, tmp_path / "run", 40, capsys)  # the adapters and the value head go on
    first, last = summary["initial"], summary["final"]
    # full fine-tunes at lr 5e-4 under 4 seeds: margin 0.001-0.023 -> 1.70-2.99, pairwise accuracy
    # (152 pairs) 0.73-0.77; with LoRA at 5e-3 (bf16, seed 1234): 0.021 -> 3.25, 0.757. A random
    # head already orders 0.54-0.69 of the pairs, so the margin is the sign of learning
    assert abs(first["eval/margin"]) < 0.1 and last["eval/margin"] > 1.0, (first, last)
    assert last["eval/pairwise_accuracy"] > 0.68, last
    final = tmp_path / "run" / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    model, tok = load_value_model(final / "merged").eval(), load_tokenizer(final / "merged")
    pairs = read_records(world_paths(spec.world)["preference_eval"], ("prompt", "chosen", "rejected"))
    margins = []
    with torch.no_grad():
        for p in pairs:
            ids = [tokenize_sft(tok, p["prompt"], p[k], spec.data.apply_chat_template, spec.data.max_length)[0]
                   for k in ("chosen", "rejected")]
            r = [token_values(model, torch.tensor([x]), torch.ones(1, len(x), dtype=torch.long))[0, -1] for x in ids]
            margins.append(float(r[0] - r[1]))
    tol = 1e-4 if backend.resolve_dtype(spec.model.dtype) == "fp32" else 0.05  # the export is in the run's dtype
    assert sum(margins) / len(margins) == pytest.approx(last["eval/margin"], abs=tol)
    assert sum(m > 0 for m in margins) / len(margins) == pytest.approx(last["eval/pairwise_accuracy"], abs=0.02)


def test_process_reward_model_learns_to_find_the_wrong_step_and_resumes(ray_cluster, tmp_path, capsys):
    # 400 steps: after 200, step accuracy was 0.680-0.744 and best-of-4 0.297-0.609 under 3 seeds
    # (0.676 on another CPU); after 400 they were 0.754-0.824 and 0.484-0.672 (docs/development.md).
    # One rank of 64 rows, not two of 32 (the same global batch): 84 CPU-s of steps against 120
    # (0.795 and 0.469 at 400 steps, bf16), and a core left to the other worker's tests
    spec = load_spec(EXAMPLES / "tiny_prm.yaml", BASE + SMALL_WORLD + [
        "train.max_steps=400", *LEARNING, "train.num_ranks=1", "train.micro_batch_size=64",
        "checkpoint.every_steps=380", "checkpoint.resume=auto"])
    summary = run_prm(spec, tmp_path / "run")
    resumes_exactly(run_prm, spec, tmp_path / "run", 380, capsys)
    first, last = summary["initial"], summary["final"]
    # 3 steps in 8 are on track: a head that always says 'wrong' scores 62.5 %; picking one
    # of a prompt's 4 solutions at random finds the right one 25 % of the time
    assert last["eval/step_accuracy"] > 0.7, (first, last)
    assert last["eval/best_of_n_accuracy"] > 0.4
    assert last["eval/first_error_accuracy"] > first["eval/first_error_accuracy"]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
