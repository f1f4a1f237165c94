"""Resume anything (elasticity L0 and L1): a run stopped after step k and resumed from its
checkpoint gives the uninterrupted run's metrics after k, for GRPO (also at another number of
trainer ranks, both ways), PPO (the critic included), DPO and a rounds algorithm; and (L3) a
GRPO run whose trainer rank is killed or stopped recovers in the job to the same metrics.
Real Ray, vLLM and DeepSpeed on the tiny world; fp32, so the arithmetic repeats exactly."""
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


@pytest.fixture(scope="module")
def grpo(ray_cluster, tmp_path_factory):
    """6 GRPO steps on 2 trainer ranks, checkpointed every 2: the uninterrupted run."""
    out = tmp_path_factory.mktemp("grpo") / "straight"
    run_job(load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO), out)
    return out


def test_grpo_resumes_exactly_at_fewer_and_at_more_trainer_ranks(grpo, tmp_path):
    """2 ranks throughout; 2 -> 1 after step 2; and that 1-rank run's step-4 checkpoint -> 2."""
    spec = lambda *extra: load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + list(extra))  # noqa: E731
    straight = grpo
    one = stopped_at(straight, 2, tmp_path / "one")
    run_job(spec("train.num_ranks=1", "checkpoint.resume=auto"), one)
    # the reduction order of one rank's sums differs from two ranks': float tolerance, not bits
    _same_after(straight, one, 2, tol=1e-5)
    two = stopped_at(one, 4, tmp_path / "two")
    run_job(spec("checkpoint.resume=auto"), two)
    _same_after(straight, two, 4, tol=1e-5)
    state = json.loads((two / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    assert state["version"] == 6 and state["prompts_seen"] == 6 * 8 and state["spec"]["train"]["num_ranks"] == 2
    # at load, the weights and moments are the saved ones bit for bit: 2 ranks' checkpoint on 1, 1's on 2
    for folder, ranks in ((straight / "checkpoints" / "step_0000002", 1), (one / "checkpoints" / "step_0000004", 2)):
        assert _loaded_actor(spec(f"train.num_ranks={ranks}"), folder / "actor") == _saved(folder / "actor")


def _saved(folder) -> list[str]:
    """Names of the saved tensors, each with a digest of its bytes."""
    from elasticrl.weights.shards import load_sharded

    return _digests({**load_sharded(folder), **load_sharded(folder / "optimizer")})


def _digests(tensors: dict) -> list[str]:
    import hashlib

    return sorted(f"{k}:{hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()}" for k, v in tensors.items())


def _loaded_actor(spec, folder) -> list[str]:
    """What an RL actor of ``spec``'s rank count holds once it has loaded ``folder``, whole."""
    from elasticrl.cluster import RoleGroup
    from elasticrl.engine.state import full_state
    from elasticrl.spec import spec_to_dict
    from elasticrl.trainers.rl import resolve_rl_paths
    from elasticrl.trainers.rl_workers import ActorWorker

    group = RoleGroup("actor", ActorWorker, spec.train.num_ranks, spec_to_dict(spec), resolve_rl_paths(spec)["model"])
    try:
        group.setup(12, resume=str(folder))
        weights, moments = group.call("__ray_call__", lambda w: full_state(w.core.engine))[0]
    finally:
        group.shutdown()
    return _digests({**weights, **moments})


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


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"], ids=["killed", "hung"])
def test_a_trainer_rank_lost_mid_step_is_recovered_in_the_job(grpo, tmp_path, capsys, sig):
    """Elasticity L3: an actor rank is SIGKILLed (or stopped: the watchdog finds the hang) in
    step 4: the actor is re-formed on 2 ranks while the engine stays up, from the step-2
    checkpoint (killed: steps 3-4 redone) or from the driver's in-memory copy of step 3
    (hung, with fault.memory_copy_steps=1: only step 4 redone), with the same data and seeds,
    and every metric equals the uninterrupted run's (exact: the restore is at a step
    boundary, on the same layout)."""
    import signal

    from tests.integration.faults import Fault

    out = tmp_path / "run"
    copy = ["fault.memory_copy_steps=1"] if sig == "SIGSTOP" else []
    fault = Fault(out, "ActorWorker", after=3, sig=getattr(signal, sig), delay=0.3)
    fault.start()
    summary = run_job(load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + copy), out)
    fault.check()
    [recovery] = summary["recoveries"]
    source, start = ("the in-memory copy", 3) if copy else ("the newest checkpoint", 2)
    assert (recovery["step"], recovery["from_step"], recovery["from"], recovery["ranks"]) == (4, start, source, 2)
    assert ("died (ActorDiedError)" if sig == "SIGKILL" else "stopped answering") in recovery["what"]
    assert recovery["recovered_at"] - fault.at < 60  # detected and recovered within a minute
    said = capsys.readouterr().err
    assert f"{recovery['what']} at step 4; recovered in" in said and f"from step {start} ({source}) on 2 rank(s)" in said
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == list(range(7))
    assert _rows(out)[6]["fault/trainer_restarts"] == 1 and _rows(out)[6]["fault/seconds_lost"] > 0
    if copy:  # the copy became a checkpoint when the recovery needed it
        assert (out / "checkpoints" / "step_0000003" / "trainer_state.json").is_file()
    print(f"{recovery['what']}: recovered {recovery['recovered_at'] - fault.at:.1f} s after the signal "
          f"(re-forming {recovery['seconds']} s) from {source}; step(s) {start + 1} to 4 redone")
    _same_after(grpo, out, 0)
