"""Resume anything (elasticity L0 and L1): a run stopped after step k and resumed from its
checkpoint gives the uninterrupted run's metrics after k, for GRPO (also at another number of
trainer ranks, both ways), PPO (the critic included), DPO and a rounds algorithm. Real Ray,
vLLM and DeepSpeed on the tiny world; fp32, so the arithmetic repeats exactly."""
from __future__ import annotations

import json

import pytest

from elasticrl.spec import load_spec
from elasticrl.trainers import run_job
from tests.conftest import EXAMPLES, stopped_at
from tests.integration.test_preference import BASE as PREFERENCE_BASE
from tests.integration.test_preference import PREFERENCE, ROUNDS
from tests.integration.test_rl import BASE as RL_BASE
from tests.integration.test_rl import PPO

pytestmark = pytest.mark.slow

# the metrics that must repeat; timings and throughputs do not
SAME = ("reward/mean", "accuracy", "policy_loss", "value_loss", "kl", "entropy", "grad_norm", "lr", "eval/accuracy",
        "eval/pass@2", "loss", "eval/margin", "eval/pairwise_accuracy", "reward/margin", "round/records",
        "round/reward_mean", "sync/version", "rl/staleness")


def _rows(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _same_after(a, b, step: int, tol: float = 0.0) -> None:
    """Every row of ``a`` after ``step`` is in ``b`` with the same figures (to ``tol``), no more rows."""
    ra, rb = _rows(a), _rows(b)
    assert sorted(rb) == sorted(ra), (sorted(ra), sorted(rb))
    for s in sorted(k for k in ra if k > step):
        for key in SAME:
            if key in ra[s]:
                assert rb[s][key] == pytest.approx(ra[s][key], abs=tol, rel=0), (s, key, ra[s][key], rb[s][key])


GRPO = RL_BASE + ["rl.num_steps=6", "checkpoint.every_steps=2", "checkpoint.keep=3", "eval.every_steps=3"]


def test_grpo_resumes_exactly_at_fewer_and_at_more_trainer_ranks(ray_cluster, tmp_path):
    """2 ranks throughout; 2 -> 1 after step 2; and that 1-rank run's step-4 checkpoint -> 2."""
    spec = lambda *extra: load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + list(extra))  # noqa: E731
    straight = tmp_path / "straight"
    run_job(spec(), straight)
    one = stopped_at(straight, 2, tmp_path / "one")
    run_job(spec("train.num_ranks=1", "checkpoint.resume=auto"), one)
    # the reduction order of one rank's sums differs from two ranks': float tolerance, not bits
    _same_after(straight, one, 2, tol=1e-5)
    two = stopped_at(one, 4, tmp_path / "two")
    run_job(spec("checkpoint.resume=auto"), two)
    _same_after(straight, two, 4, tol=1e-5)
    state = json.loads((two / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    assert state["version"] == 6 and state["prompts_seen"] == 6 * 8 and state["spec"]["train"]["num_ranks"] == 2


def test_async_grpo_resumes_exactly_with_nothing_in_flight_at_the_checkpoint(ray_cluster, tmp_path):
    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + ["rl.async_rollout=true", "rl.max_staleness=2",
                                                          "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    run_job(spec, straight)
    rows = _rows(straight)
    # rollouts run ahead, but not past a checkpoint (after steps 2 and 4): staleness restarts there
    assert [rows[s]["rl/staleness"] for s in range(1, 7)] == [0, 1, 0, 1, 0, 1]
    resumed = stopped_at(straight, 4, tmp_path / "resumed")
    run_job(spec, resumed)
    _same_after(straight, resumed, 4)


def test_ppo_resumes_exactly_with_its_critic(ray_cluster, tmp_path):
    spec = load_spec(EXAMPLES / "tiny_ppo.yaml", RL_BASE + PPO + [
        "rl.num_steps=3", "checkpoint.every_steps=2", "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    run_job(spec, straight)
    assert (straight / "checkpoints" / "step_0000002" / "critic" / "model.safetensors").is_file()
    resumed = stopped_at(straight, 2, tmp_path / "resumed")
    run_job(spec, resumed)
    _same_after(straight, resumed, 2)
    assert all("value_loss" in r for s, r in _rows(resumed).items() if s > 2)


def test_dpo_resumes_exactly(ray_cluster, tmp_path):
    spec = load_spec(EXAMPLES / "tiny_dpo.yaml", PREFERENCE_BASE + PREFERENCE + [
        "train.max_steps=8", "checkpoint.every_steps=4", "eval.every_steps=4", "checkpoint.resume=auto",
        "log.every_steps=1"])
    straight = tmp_path / "straight"
    run_job(spec, straight)
    resumed = stopped_at(straight, 4, tmp_path / "resumed")
    run_job(spec, resumed)
    _same_after(straight, resumed, 4)


def test_iterative_dpo_resumes_exactly_after_a_round(ray_cluster, tmp_path):
    spec = load_spec(EXAMPLES / "tiny_rejection_sampling.yaml", ROUNDS + [
        "algorithm=iterative_dpo", "checkpoint.every_steps=4", "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    run_job(spec, straight)
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step_0000008", "step_0000012"]
    resumed = stopped_at(straight, 8, tmp_path / "resumed")
    run_job(spec, resumed)
    _same_after(straight, resumed, 8)
    # the resumed run wrote round 3's data again, the same pairs
    assert (resumed / "rounds" / "3.jsonl").read_text() == (straight / "rounds" / "3.jsonl").read_text()
