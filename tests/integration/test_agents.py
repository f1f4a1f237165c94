"""Multi-turn episodes on the real stack: vLLM's CPU engine generating each turn, tools and
environments in their own processes, a DeepSpeed actor scoring the episodes' sequences."""
from __future__ import annotations

import json

import pytest

from elasticrl.cluster import RoleGroup
from elasticrl.spec import load_spec
from elasticrl.trainers.rl import run_rl
from elasticrl.trainers.warm_start import initial_model
from tests.conftest import EXAMPLES, SAME, SEED
from tests.integration.test_rl import BASE, HF_ENGINE, assert_acid_test

pytestmark = pytest.mark.slow

TOOLS = [f"tests.integration.environments:{name}" for name in ("add", "boom", "hang", "weird")]


def _expected_mask(tok, prompt_ids: list[int], messages: list[dict], tokens: list[int], finished: bool) -> list[bool]:
    """Which of ``tokens`` are the model's, read off the template's rendering of the episode's
    conversation: the characters of each assistant turn's content and its end of turn."""
    from elasticrl.rollout.episodes import render

    model_chars = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(tok, messages[:i], [], True))
            close = len(tok.eos_token) if finished or i < len(messages) - 1 else 0
            model_chars.append((start, start + len(m["content"]) + close))
    text = render(tok, messages, [], False) if finished else render(tok, messages[:-1], [], True) + \
        messages[-1]["content"]
    pieces = [tok.decode([t], skip_special_tokens=False) for t in prompt_ids + tokens]
    assert "".join(pieces) == text  # the sequence is the conversation as the template renders it
    out, at = [], 0
    for p in pieces:
        out.append(any(a <= at < b for a, b in model_chars))
        at += len(p)
    return out[len(prompt_ids):]


def test_multi_turn_episodes_are_token_exact_and_their_engine_log_probs_are_the_trainers(ray_cluster, tmp_path):
    """Episodes of up to 4 turns whose every turn calls a tool (a parser that makes one call per
    turn): a tool that adds, one that raises, one that hangs past rollout.tool_timeout_s and one
    that returns something not JSON. Each failure is the model's next observation, counted, and
    the episodes go on. The sequences hold the observations' tokens as the template renders
    them, the loss mask exactly the model's tokens (read off the rendering, token by token), and
    at T = 0.7 the engine's log-prob of every model token is the trainer's and an independent
    fp32 forward's within 1e-4. Then, on the same two engines, episodes of 2-4 turns (an
    environment rewarding each turn) twice, the second time with one engine SIGKILLed between
    two turns (by the environment, at an episode's second turn): its turns go to the live engine
    and, each turn seeded by (step, episode, turn), every episode and figure is as before."""
    import dataclasses

    from elasticrl.data.records import read_records
    from elasticrl.envs.pool import EnvironmentPool
    from elasticrl.models import load_tokenizer
    from elasticrl.rollout.episodes import run_episodes
    from elasticrl.rollout.pool import RolloutPool, sampling_params
    from elasticrl.spec import spec_to_dict
    from elasticrl.trainers.batch import behaviour_logprobs, gather_rows, pack
    from elasticrl.trainers.rl_workers import ActorWorker
    from elasticrl.world import world_paths
    from tests.integration.faults import actor_pids

    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", BASE + ["rl.temperature=0.7", "train.num_ranks=1",
                                                          "rl.max_new_tokens=6", "rollout.max_model_len=320",
                                                          "rollout.num_engines=2"])
    model = initial_model(spec)
    tok = load_tokenizer(model)
    rows = list(read_records(world_paths(spec.world)["rl_prompts"])[:8])
    envs = EnvironmentPool({"environment": "elasticrl.envs:ToolEnvironment", "tools": TOOLS,
                            "parser": "tests.integration.environments:every_turn_calls", "timeout_s": 0.6,
                            "retries": 0},
                           timeout_s=30, workers=2)
    chatty = EnvironmentPool({"environment": "tests.integration.environments:Killer", "tools": [],
                              "parser": "hermes", "timeout_s": 5, "retries": 0}, timeout_s=30, workers=1)
    pool = RolloutPool(model, spec.rollout, "fp32", spec.seed)
    actor = RoleGroup("actor", ActorWorker, 1, spec_to_dict(spec), model)
    sampling = {**sampling_params(spec, 0), "n": 2}
    try:
        envs.start()
        chatty.start()
        actor.setup(10)
        samples, info = run_episodes(pool, envs, tok, rows, sampling, 4, 320, 320)
        batch = pack([r.prompt_ids for r in samples], [r.token_ids for r in samples], tok.pad_token_id,
                     [r.mask for r in samples])
        trainer = gather_rows(actor.call("logprobs", batch), "logprobs")
        before, talk = run_episodes(pool, chatty, tok, rows, sampling, 4, 256, 256)
        victim = actor_pids("RolloutEngine")[-1]
        after, talk_after = run_episodes(pool, chatty, tok, [{**rows[0], "kill": victim}] + rows[1:], sampling,
                                         4, 256, 256)
        deaths = pool.deaths
    finally:
        actor.shutdown()
        pool.shutdown()
        envs.close()
        chatty.close()
    assert len(samples) == 16 and [r.prompt_index for r in samples] == [k // 2 for k in range(16)]
    turns = [sum(m["role"] == "assistant" for m in r.episode["messages"]) for r in samples]
    assert info["episode/turns"] == sum(turns) / 16 and max(turns) == 4 and sum(t >= 2 for t in turns) >= 8, turns
    tool_msgs = [m["content"] for r in samples for m in r.episode["messages"] if m["role"] == "tool"]
    errors = [c for c in tool_msgs if c.startswith("error: ")]
    # every turn the environment saw made one call (the last turn's ran too, its result unseen)
    last_seen = sum(r.finish_reason == "stop" for r in samples)
    assert info["episode/tool_calls"] * 16 == len(tool_msgs) + last_seen
    assert len(errors) <= info["episode/tool_errors"] * 16 <= len(errors) + last_seen
    assert {c.split(" raised")[0].split(" timed")[0].split(" returned")[0] for c in errors} <= \
        {"error: boom", "error: hang", "error: weird"} and len(errors) >= 3, tool_msgs
    assert info["time/environment"] > 0 and info["episode/env_errors"] == 0
    for i, r in enumerate(samples):
        expected = _expected_mask(tok, r.prompt_ids, r.episode["messages"], r.token_ids, r.finish_reason == "stop")
        assert r.mask == expected and len(r.logprobs) == sum(r.mask) == batch.response_mask[i].sum()
    assert_acid_test(model, batch, trainer, behaviour_logprobs(samples, batch), 0.7)

    assert deaths == 1 and victim not in actor_pids("RolloutEngine")
    assert talk["episode/turns"] >= 2 and {k: v for k, v in talk.items() if k != "time/environment"} == \
        {k: v for k, v in talk_after.items() if k != "time/environment"}
    for a, b in zip(before, after):
        assert dataclasses.replace(a, logprobs=[]) == dataclasses.replace(b, logprobs=[])
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        turns = sum(m["role"] == "assistant" for m in a.episode["messages"])
        if a.finish_reason == "stop":  # finished: 0.25 a turn before the last, 1 for the last
            assert a.episode["reward"] == pytest.approx(0.25 * (turns - 1) + 1.0)


def test_ppo_on_episodes_rolled_out_a_step_ahead_scores_the_environments_rewards_and_reports_them(ray_cluster,
                                                                                                   tmp_path):
    """PPO with a critic (2 steps, evaluation at the start and the end; the transformers engine,
    whose vLLM import the first test pays) on episodes of 2-4 turns whose environment rewards
    every turn, with async rollouts: step 2's episodes go on in a driver thread while step 1
    trains, on the weights before it (staleness 1, weighed by rl.is_correction's tis). The
    rewards are the environment's plus the verifier's, the critic learns on the model's tokens
    (GAE skips the observations: tests/algorithms/test_rl_math.py), step 1's engine log-probs of
    every model token are the trainer's, the episode figures are in metrics.jsonl and the
    evaluations' first episodes, whole, in episodes.jsonl."""
    sets = BASE + [SEED, "train.num_ranks=1", "rl.num_steps=2", "rl.freeze_actor_steps=0", "rl.temperature=0.7",
                   "rl.max_turns=4", "rollout.max_model_len=128", "rewards.workers=1", "rl.async_rollout=true",
                   "rollout.environment=tests.integration.environments:Chatty",
                   "eval.num_prompts=8", "eval.every_steps=2", "rl.eval_samples=1", HF_ENGINE]
    run_rl(load_spec(EXAMPLES / "tiny_ppo.yaml", sets), tmp_path / "run")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
    assert len(steps) == 2 and [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
    for r in steps:
        assert 1.5 <= r["episode/turns"] <= 4 and r["episode/tool_calls"] == 0 and r["time/environment"] > 0
        # the verifier (weight 1) scores 1 for a right last turn: the accuracy; the rest is the environment's
        assert r["reward/mean"] == pytest.approx(r["episode/reward"] + r["accuracy"], abs=1e-6)
        assert r["episode/reward"] > 0.5 and r["value_loss"] > 0, r
    assert [r["rl/staleness"] for r in steps] == [0, 1]
    assert steps[0]["rollout/logprob_gap"] <= 1e-4 and steps[0]["mismatch/kl"] < 1e-7
    assert steps[1]["rollout/logprob_gap"] > 1e-3 and steps[1]["is/ratio_mean"] != pytest.approx(1.0, abs=1e-4)
    shown = [json.loads(ln) for ln in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in shown] == [0] * 4 + [2] * 4
    assert all(e["messages"][0]["role"] == "user" and e["messages"][1]["role"] == "assistant" for e in shown)
    assert any(m["role"] == "tool" for e in shown for m in e["messages"])



def test_fully_async_episodes_go_on_across_rounds_and_updates_and_a_resume_replays_their_environments(
        ray_cluster, tmp_path):
    """rl.fully_async on episodes (GRPO on the transformers engine; Chatty's 2-4 turns, at most
    3; turns of up to 6 tokens generated in rounds of 2, so a turn spans rounds, and an episode
    weight updates; a token at most 2 versions behind). The checkpoint after step 2 holds episodes in
    flight: part-way through a turn, or between turns with the observation's tokens in, each
    token-exact (its mask read off the template's rendering). A run resumed from it starts new
    environment processes, replays each episode's turns to them and repeats steps 3 and 4."""
    import shutil

    from elasticrl.models import load_tokenizer

    sets = BASE + [SEED, "train.num_ranks=1", "rl.num_steps=4", "rl.temperature=0.7", "rl.max_turns=3",
                   "rollout.max_model_len=128", "rewards.workers=1", "rl.async_rollout=true", "rl.fully_async=true",
                   "rl.chunk_tokens=2", "rl.max_staleness=2", "checkpoint.every_steps=2", "checkpoint.resume=auto",
                   "eval.enabled=false", "rollout.environment=tests.integration.environments:Chatty", HF_ENGINE]
    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", sets)
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_rl(spec, first)
    rows = {r["step"]: r for r in map(json.loads, (first / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2, 3, 4):
        r = rows[step]
        assert 1 <= r["episode/turns"] <= 3 and r["time/environment"] > 0 and r["rl/token_staleness_max"] <= 2
        assert r["episode/reward"] > 0 and r["reward/mean"] == pytest.approx(r["episode/reward"] + r["accuracy"])
    stream = json.loads((first / "checkpoints" / "step_0000002" / "trainer_state.json").read_text())["stream"]
    items = stream["items"]
    for i in items:
        assert len(i["mask"]) == len(i["tokens"]) and sum(i["mask"]) == len(i["logprobs"]) == len(i["versions"])
    assert any(i["turn"] and i["finish"] is None for i in items)  # part-way through a turn
    assert any(len(set(i["versions"])) > 1 for i in items)  # turns on weights of two versions
    assert any(i["turns"] and m["role"] == "tool" for i in items if i["finish"] is None for m in i["messages"])
    tok = load_tokenizer(initial_model(spec))
    done = [i for i in items if i["finish"] == "stop" and i["error"] is None]
    assert done
    for i in done:
        said = i["messages"] + [{"role": "assistant", "content": i["text"]}]
        assert i["mask"] == _expected_mask(tok, i["prompt_ids"], said, i["tokens"], True)
    shutil.copytree(first / "checkpoints" / "step_0000002", resumed / "checkpoints" / "step_0000002")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(rows[s]) + "\n" for s in (1, 2)))
    run_rl(spec, resumed)
    again = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    for step in (3, 4):  # step 4 trains on episodes that were between turns at the checkpoint
        same = [k for k in rows[step] if k in SAME or k.startswith(("episode/", "rl/", "rollout/rounds",
                                                                     "rollout/carried"))]
        assert len(same) > 20 and {k: again[step].get(k) for k in same} == {k: rows[step][k] for k in same}
