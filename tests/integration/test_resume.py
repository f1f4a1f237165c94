"""Resume anything (elasticity L0 and L1): a run stopped after step k and resumed from its
checkpoint gives the uninterrupted run's metrics after k, for GRPO (also at another number of
trainer ranks, both ways), PPO (the critic included), DPO and a rounds algorithm; and (L3) a
GRPO run whose trainer rank is killed or stopped recovers in the job to the same metrics.
Real Ray, vLLM and DeepSpeed on the tiny world; fp32, so the arithmetic repeats exactly."""
from __future__ import annotations

import json
import math
import threading

import pytest

from elasticrl.spec import load_spec
from elasticrl.trainers import run_job
from tests.conftest import EXAMPLES, SEED, metric_rows, resumes_exactly, same_after, stopped_at
from tests.integration.test_preference import BASE as PREFERENCE_BASE
from tests.integration.test_preference import (
    PREFERENCE,
    ROUNDS,
    ROUNDS_LEARNING,
    check_preference_learned,
    check_rounds_learned,
)
from tests.integration.test_rl import BASE as RL_BASE
from tests.integration.test_rl import HF_ENGINE

pytestmark = pytest.mark.slow

GRPO = RL_BASE + ["rl.num_steps=6", "checkpoint.every_steps=2", "checkpoint.keep=3", "eval.every_steps=3",
                  HF_ENGINE]


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
    same_after(straight, one, 2, tol=1e-5)
    two = stopped_at(one, 4, tmp_path / "two")
    run_job(spec("checkpoint.resume=auto"), two)
    same_after(straight, two, 4, tol=1e-5)
    state = json.loads((two / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    assert state["version"] == 6 and state["prompts_seen"] == 6 * 8 and state["spec"]["train"]["num_ranks"] == 2
    # at load, the weights and moments are the saved ones bit for bit: 2 ranks' checkpoint on 1, 1's on 2
    for folder, ranks in ((straight / "checkpoints" / "step_0000002", 1), (one / "checkpoints" / "step_0000004", 2)):
        assert _loaded_actor(spec(f"train.num_ranks={ranks}"), folder / "actor") == _saved(folder / "actor")


def _saved(folder) -> list[str]:
    """Names of the saved tensors, each with a digest of its bytes (the ranks' pieces put together)."""
    from elasticrl.engine.state import whole_tensors

    return _digests(whole_tensors(folder))


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


def test_async_grpo_with_a_remote_reward_stays_within_its_bound_and_resumes_exactly(ray_cluster, tmp_path):
    """Async GRPO (rl.max_staleness 2) whose reward is an HTTP endpoint (a real local server
    that refuses the first request with 503, so the client must retry), beside a function of
    weight 0 that raises on 1 call in 10: counted in reward/errors, scored 0, and the run goes
    on. Rollouts run ahead, but not past a checkpoint (after steps 4 and 6), so a run resumed
    from step 4 rolls out as this one did and repeats its metrics."""
    from http.server import ThreadingHTTPServer

    from tests.integration.test_rl import _Scorer

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        spec = load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + [
            "rl.async_rollout=true", "rl.max_staleness=2", "checkpoint.every_steps=4", "checkpoint.resume=auto",
            "rewards.functions=[{path: 'tests.rewards.misbehaving:flaky', weight: 0.0}]",
            f"rewards.remote=[{{url: '{url}', retries: 2, timeout_s: 30}}]"])
        straight = tmp_path / "straight"
        summary = run_job(spec, straight)
        assert _Scorer.calls == [32] * 7  # one refused, then one per step
        resumed = stopped_at(straight, 4, tmp_path / "resumed")
        run_job(spec, resumed)
    finally:
        server.shutdown()
    rows = metric_rows(straight)
    # generation ran ahead of training (two versions old at steps 3-4), and restarted at the checkpoint
    assert [rows[s]["rl/staleness"] for s in range(1, 7)] == [0, 1, 2, 2, 0, 1]
    # rl.is_correction auto is tis here: the engine's log-probs of a fresh batch are the trainer's; those of a
    # stale one are an older policy's once the policy moved (not before its first reward)
    for s in range(1, 7):
        assert rows[s]["is/masked_frac"] == 0, rows[s]  # tis weighs, never masks
        if rows[s]["rl/staleness"] == 0:
            assert rows[s]["mismatch/kl"] < 1e-7 and abs(rows[s]["is/ratio_mean"] - 1) < 1e-4, rows[s]
    assert max(rows[s]["mismatch/kl"] for s in range(1, 7)) > 1e-4  # the policy moved between versions
    assert summary["final"]["sync/version"] == 6
    # flaky raises on calls 10, 20, ... of each of the 2 reward processes (rewards.workers), which score 16 of a
    # step's 32 samples each: per step, calls 1-16 (one error each), 17-32 (two), 33-48, 49-64, 65-80, 81-96
    assert [rows[s]["reward/errors/flaky"] for s in range(1, 7)] == [2, 4, 2, 4, 4, 2]
    for s in range(1, 7):  # the endpoint scores exact answers: its mean is the batch accuracy
        assert rows[s]["reward/errors"] == rows[s]["reward/errors/flaky"]
        assert rows[s]["reward/mean"] == pytest.approx(rows[s]["accuracy"], abs=1e-6)
    same_after(straight, resumed, 4)


def test_ppo_with_four_model_roles_colocated_in_pairs_resumes_exactly_with_its_critic(ppo_in_pairs, tmp_path):
    """PPO's four model roles (actor and reference sharing a placement group, critic and reward
    model another; the separate layout, a group per role, is what every other RL test uses, and
    the Slurm job of test_launch.py, each role on its own node, repeats this run's metrics), 3
    steps checkpointed at 2; resumed from step 2, the critic included, it repeats the
    uninterrupted run. In the first run a frozen model's rank (the reference's or the reward
    model's) is SIGKILLed as step 3 begins: that role alone is built again and step 3 scored
    anew, so its metrics are the resumed run's, which lost nothing; the actor, critic and engine
    processes are the same."""
    spec, straight, summary, seen = ppo_in_pairs.spec, ppo_in_pairs.out, ppo_in_pairs.summary, ppo_in_pairs.seen
    ppo_in_pairs.kill.check()
    reformed = [r for r in summary["recoveries"] if r.get("role")]
    assert len(reformed) == 1 and reformed[0]["step"] == 3 and reformed[0]["role"] in ("reference", "reward0"), \
        summary["recoveries"]
    assert len(seen) == 2 and seen[0] == seen[1] and all(seen[0].values()), seen  # none of them restarted
    assert summary["final"]["fault/trainer_restarts"] == 0 and summary["final"]["fault/engine_deaths"] == 0
    # train.threads reaches every trained and frozen rank (Ray alone would give each 1)
    assert summary["threads"] == {"actor": 2, "reference": 2, "critic": 2, "reward0": 2}, summary["threads"]
    where = summary["placement"]
    assert {"actor", "reference", "critic", "reward0", "rollout"} <= set(where)
    assert where["actor"] == where["reference"] and where["critic"] == where["reward0"]
    assert len({where["actor"], where["critic"], where["rollout"]}) == 3
    steps = {s: r for s, r in metric_rows(straight).items() if s > 0}
    assert sorted(steps) == [1, 2, 3]
    assert "policy_loss" not in steps[1]  # the actor is frozen while the critic warms up
    # frozen through step 1, the actor is the reference at steps 1 and 2: the k1 KL is 0 there
    assert abs(steps[1]["kl"]) < 1e-6 and abs(steps[2]["kl"]) < 1e-6 and abs(steps[3]["kl"]) > 1e-6, steps
    for n in (2, 3):  # 2 mini-batches a step: the second sees updated weights, so the ratio moved
        assert math.isfinite(steps[n]["policy_loss"]) and 0.0 <= steps[n]["clip_frac"] <= 1.0
        assert steps[n]["approx_kl"] > 0, steps[n]
    for row in steps.values():
        assert row["value_loss"] > 0 and row["sync/version"] == row["step"]
    assert summary["reward_model"].endswith("final")
    assert (straight / "checkpoints" / "step_0000002" / "critic" / "pieces-rank00000.safetensors").is_file()
    resumed = stopped_at(straight, 2, tmp_path / "resumed")
    assert "recoveries" not in run_job(spec, resumed)
    same_after(straight, resumed, 2)  # step 3, scored again after the loss, as the resumed run scored it
    assert all("value_loss" in r for s, r in metric_rows(resumed).items() if s > 2)


def test_dpo_with_a_precomputed_reference_and_packed_pairs_learns_and_resumes_exactly(ray_cluster, tmp_path, capsys):
    """DPO's learning run (test_preference.py's bars, in fp32 whatever the CPU, so the resumed
    run repeats it bit for bit), checkpointed and evaluated at step 12, resumed from there."""
    spec = load_spec(EXAMPLES / "tiny_dpo.yaml", PREFERENCE_BASE + PREFERENCE + [
        "algorithm=dpo", "preference.reference=precomputed", "data.packing=true", SEED,
        "checkpoint.every_steps=12", "eval.every_steps=12", "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    summary = run_job(spec, straight)
    check_preference_learned(spec, straight, summary)
    assert "eval/margin" in metric_rows(straight)[12]
    resumes_exactly(run_job, spec, straight, 12, capsys)


def test_iterative_dpo_learns_in_rounds_and_resumes_exactly_after_one(ray_cluster, tmp_path, capsys):
    """The rounds' learning run (test_preference.py's bars, in fp32 whatever the CPU, so the
    resumed run repeats it bit for bit), with evaluation off, checkpointed at each round's end,
    resumed after round 2."""
    spec = load_spec(EXAMPLES / "tiny_rejection_sampling.yaml", ROUNDS + ROUNDS_LEARNING + [
        "algorithm=iterative_dpo", "checkpoint.every_steps=16", "checkpoint.resume=auto", SEED,
        "eval.enabled=false"])
    straight = tmp_path / "straight"
    summary = run_job(spec, straight)
    check_rounds_learned(spec, straight, summary)
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step_0000032", "step_0000048"]
    resumed = resumes_exactly(run_job, spec, straight, 32, capsys)
    # the resumed run wrote round 3's data again, the same pairs
    assert (resumed / "rounds" / "3.jsonl").read_text() == (straight / "rounds" / "3.jsonl").read_text()


def test_a_trainer_rank_killed_and_later_one_hung_are_recovered_in_the_job(grpo, tmp_path, capsys):
    """Elasticity L3, twice in one run (fault.memory_copy_steps 1, a checkpoint every 2 steps):
    an actor rank is SIGKILLed in step 2, before any checkpoint: the actor is re-formed on 2
    ranks from the driver's in-memory copy of step 1, which becomes a checkpoint, while the
    engine stays up; later a rank is SIGSTOPped in step 5: the watchdog finds the hang and the
    actor is re-formed from the newest complete source (the step-4 checkpoint, written in the
    background, or the copy of step 5, whichever the stop left whole). The steps after each source are redone with
    the same data and seeds, so every metric equals the uninterrupted run's (exact: the
    restores are at step boundaries, on the same layout)."""
    import signal

    from tests.integration.faults import Fault

    out = tmp_path / "run"
    # at once: a step lasts 0.23 s on the fastest CPU seen, and the kill must land before step 2's
    # checkpoint is written (written in the background, it takes the end of the step)
    killed = Fault(out, "ActorWorker", after=1, sig=signal.SIGKILL)
    hung = Fault(out, "ActorWorker", after=4, sig=signal.SIGSTOP, delay=0.3)
    killed.start()
    hung.start()
    summary = run_job(load_spec(EXAMPLES / "tiny_grpo.yaml", GRPO + ["fault.memory_copy_steps=1",
                                                                     "checkpoint.keep=5"]), out)
    killed.check()
    hung.check()
    said = capsys.readouterr().err
    first, second = summary["recoveries"]
    assert (first["step"], first["from_step"], first["from"], first["ranks"]) == (2, 1, "the in-memory copy", 2)
    # the hang lands in step 5 or 6: found in a call, or in taking the copy; the newest complete
    # source is the step-4 checkpoint (its background writes done before the stop) or the copy
    # of step 5, else the copy of step 3: at most two steps redone, on 2 ranks
    assert second["step"] in (5, 6) and second["ranks"] == 2 and second["step"] - second["from_step"] <= 2, second
    assert second["from"] == ("the newest checkpoint" if second["from_step"] % 2 == 0 else "the in-memory copy")
    assert "died (ActorDiedError)" in first["what"] and "stopped answering" in second["what"]
    for recovery, fault in ((first, killed), (second, hung)):
        assert recovery["recovered_at"] - fault.at < 60  # detected and recovered within a minute
        assert f"{recovery['what']} at step {recovery['step']}; recovered in" in said
        assert f"from step {recovery['from_step']} ({recovery['from']}) on 2 rank(s)" in said
        print(f"{recovery['what']}: recovered {recovery['recovered_at'] - fault.at:.1f} s after the signal "
              f"(re-forming {recovery['seconds']} s) from {recovery['from']}")
    # the copy (each rank's pieces, held by a keeper process, not the driver) became a checkpoint
    # when the recovery needed it; taking it is timed in the rows of the steps it was taken at
    assert (out / "checkpoints" / "step_0000001" / "trainer_state.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints" / "step_0000001" / "actor").glob("pieces-*")) == [
        "pieces-rank00000.safetensors", "pieces-rank00001.safetensors"]
    assert metric_rows(out)[5]["fault/seconds_copying"] > 0
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == list(range(7))
    assert metric_rows(out)[6]["fault/trainer_restarts"] == 2 and metric_rows(out)[6]["fault/seconds_lost"] > 0
    same_after(grpo, out, 0)
