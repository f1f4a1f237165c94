"""Elasticity L2: the rollout pool survives an engine that dies or hangs mid-rollout. Real
Ray, vLLM's CPU build and DeepSpeed; the engine's process is SIGKILLed (or SIGSTOPped) by its
PID from outside. Each prompt is seeded, so the run's metrics equal the uninterrupted run's."""
from __future__ import annotations

import json
import signal

import pytest

from elasticrl.spec import load_spec
from elasticrl.trainers import run_job
from tests.conftest import EXAMPLES, SAME
from tests.integration.faults import Fault
from tests.integration.test_rl import BASE

pytestmark = pytest.mark.slow

# 2 engines; completions of exactly 64 tokens make a rollout last about a second, so a kill
# lands in it, and a reward that varies on them (the share of digits) keeps the updates real
ELASTIC = BASE + ["rollout.num_engines=2", "rl.num_steps=16", "eval.enabled=false", "rl.ignore_eos=true",
                  "rl.max_new_tokens=64", "rl.prompts_per_step=16", "rollout.max_model_len=96",
                  "rewards.functions=[{path: 'tests.integration.faults:digit_share'}]"]


def _rows(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic") / "straight"
    run_job(load_spec(EXAMPLES / "tiny_grpo.yaml", ELASTIC), out)
    return out


def _equal_runs(a, b) -> None:
    ra, rb = _rows(a), _rows(b)
    assert sorted(ra) == sorted(rb)
    for step in sorted(ra):
        for key in SAME:
            if key in ra[step]:
                assert rb[step][key] == ra[step][key], (step, key, ra[step][key], rb[step][key])


def test_a_hung_engine_is_found_by_its_deadline_and_its_prompts_served_elsewhere(ray_cluster):
    """A pool of 2 engines (no trainer): one is SIGSTOPped; the next request finds it hung
    (no answer within rollout.hang_factor x what the measured rate allows), generates its
    prompts on the other, with the same samples, and starts a replacement."""
    import os
    import time

    import ray

    from elasticrl.rollout.pool import RolloutPool, sampling_params
    from elasticrl.trainers.sft import resolve_paths

    # found after 3x (1 s + what the rate gives): ~4 s, where the default 8x waits ~10
    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", ELASTIC + ["rollout.hang_factor=3"])
    pool = RolloutPool(resolve_paths(spec)["model"], spec.rollout, "fp32", spec.seed)
    try:
        prompts = [[1, 4, 7 + i % 9, 13, 78, 11, 86, 5] for i in range(16)]
        sampling = sampling_params(spec, 3)
        before = pool.generate(prompts, sampling)  # and the rate is measured
        pid = ray.get(pool.group.actors[1].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        after = pool.generate(prompts, sampling)
        found = time.time() - t0
        assert pool.live == [0] and pool.deaths == 1 and 1 in pool.starting
        assert "rollout engine 1 stopped answering" in pool.events[0] and "replacement is starting" in pool.events[0]
        assert [(r.prompt_index, r.token_ids) for r in after] == [(r.prompt_index, r.token_ids)
                                                                         for r in before]
        print(f"the hang was found and its prompts served elsewhere in {found:.1f} s")
    finally:
        pool.shutdown()


def test_engines_killed_one_then_the_last_then_added_and_removed_live_change_no_metric(straight, tmp_path):
    """Two engines. One is SIGKILLed 0.3 s into step 2's rollout: its prompts go to the other
    and a replacement starts. That other, now the only one serving, is SIGKILLed 0.3 s into
    step 3's: the rollout waits for a replacement. Then `elasticrl scale OUTPUT --engines 3`
    (another shell), and `--engines 1` once the three serve: the pool grows and shrinks at step
    boundaries. The samples, seeded per prompt, and so every metric stay the uninterrupted
    run's."""
    import threading
    import time

    from tests.conftest import run_cli
    from tests.integration.faults import logged_step

    out = tmp_path / "run"
    # the newest process first; then the oldest, the original left (replacements are newer)
    faults = [Fault(out, "RolloutEngine", after=1, delay=0.3), Fault(out, "RolloutEngine", after=2, delay=0.3, index=0)]
    for fault in faults:
        fault.start()
    said = {}

    def operator():  # another shell, asking by the real command
        while logged_step(out) < 3:
            time.sleep(0.05)
        said["up"] = run_cli("scale", str(out), "--engines", "3", timeout=120)
        while 3 not in [r.get("rollout/engines") for r in _rows(out).values()]:
            if (out / "finished.json").exists():
                return
            time.sleep(0.2)
        said["down"] = run_cli("scale", str(out), "--engines", "1", timeout=120)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    summary = run_job(load_spec(EXAMPLES / "tiny_grpo.yaml", ELASTIC), out)
    for fault in faults:
        fault.check()
    thread.join(timeout=10)
    rows = _rows(out)
    assert faults[0].pid != faults[1].pid
    # lost in steps 2 and 3; removals are no deaths
    assert rows[2]["fault/engine_deaths"] == 1 and rows[3]["fault/engine_deaths"] == 2
    assert summary["final"]["fault/engine_deaths"] == 2 and rows[16]["fault/engine_deaths"] == 2
    assert said["up"].returncode == 0 and "asked for 3 rollout engine(s)" in said["up"].stdout
    assert "down" in said, "the added engines never served before the end"
    engines = [r["rollout/engines"] for s, r in sorted(rows.items()) if s]
    print(f"killed pids {faults[0].pid} and {faults[1].pid}: step 2's rollout took {rows[2]['time/rollout']:.1f} s, "
          f"step 3's, waiting for a replacement, {rows[3]['time/rollout']:.1f} s (uninterrupted "
          f"{_rows(straight)[2]['time/rollout']:.1f} and {_rows(straight)[3]['time/rollout']:.1f} s); "
          f"engines per step: {engines}")
    assert engines[:2] == [2, 1] and engines[2] >= 1 and 3 in engines  # step 3 served by a replacement
    last3 = max(i for i, e in enumerate(engines) if e == 3)
    assert engines[last3 + 1:] and set(engines[last3 + 1:]) == {1}  # up, then down
    _equal_runs(straight, out)
    refused = run_cli("scale", str(out), "--engines", "2", timeout=120)
    assert refused.returncode == 2 and "that job has finished" in refused.stderr


FULLY_ASYNC = BASE + ["rollout.num_engines=2", "rl.num_steps=4", "eval.enabled=false", "rl.async_rollout=true",
                      "rl.fully_async=true", "rl.max_staleness=2", "rl.chunk_tokens=2", "checkpoint.every_steps=2",
                      "checkpoint.resume=auto"]


def test_fully_async_survives_a_lost_engine_and_trainer_rank_and_resumes_exactly_with_samples_in_flight(
        ray_cluster, tmp_path):
    """rl.fully_async on 2 engines, 6-token completions in rounds of 2 tokens, a token at most 2
    versions behind. The checkpoint after step 2 holds the samples in flight (their tokens and
    versions); an engine is SIGKILLed 0.3 s after step 2, while the rounds go on (the checkpoint
    shows samples part-way): its samples, tokens so far, go on on the other engine. A run
    resumed from that checkpoint, in which a trainer rank is SIGKILLed once step 3 is logged
    (L3: the rounds in flight stop, the trainers re-form from that checkpoint, and the queue is
    put back as it has it), repeats steps 3-4: the engine's loss changed no sample (each request
    is seeded by its sample), and the resume and the recovery continued the samples in flight."""
    import shutil

    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", FULLY_ASYNC)
    killed = tmp_path / "killed"
    fault = Fault(killed, "RolloutEngine", after=2, delay=0.3)
    fault.start()
    run_job(spec, killed)
    fault.check()
    state = json.loads((killed / "checkpoints" / "step_0000002" / "trainer_state.json").read_text())
    resumed = tmp_path / "resumed"  # what a run stopped after step 2 leaves
    shutil.copytree(killed / "checkpoints" / "step_0000002", resumed / "checkpoints" / "step_0000002")
    (resumed / "metrics.jsonl").write_text("".join(ln + "\n" for ln in (killed / "metrics.jsonl").read_text()
                                                   .splitlines() if json.loads(ln)["step"] <= 2))
    rank = Fault(resumed, "ActorWorker", after=3)
    rank.start()
    summary = run_job(spec, resumed)
    rank.check()
    _equal_runs(killed, resumed)
    assert [(r["step"], r["from_step"]) for r in summary["recoveries"]] == [(4, 2)], summary["recoveries"]
    rows = _rows(killed)
    print(f"killed engine pid {fault.pid}; seconds per step " + ", ".join(
        f"{rows[s]['time/step']:.1f} (rollout {rows[s]['time/rollout']:.1f}, sync {rows[s]['time/sync']:.1f})"
        for s in range(1, 5)))
    assert rows[2]["fault/engine_deaths"] == 0 and rows[4]["fault/engine_deaths"] == 1
    # the checkpoint's queue: 24 groups drawn, 8 trained per step, the rest in flight, each sample once
    stream = state["stream"]
    groups = {}
    for item in stream["items"]:
        groups.setdefault(item["group"], []).append(item["j"])
    assert stream["groups"] == state["prompts_seen"] and len(groups) == stream["groups"] - 2 * 8
    assert all(sorted(js) == [0, 1, 2, 3] for js in groups.values())
    partial = [i for i in stream["items"] if i["tokens"] and i["finish"] is None]
    assert partial and all(len(i["tokens"]) == len(i["versions"]) == len(i["logprobs"]) for i in stream["items"])
    # the staleness bound, token by token: at step s (trained at version s - 1) no token older than 2 versions
    for s in range(1, 5):
        lags = [int(k.rsplit("/", 1)[1]) for k in rows[s] if k.startswith("rl/token_staleness/")]
        assert max(lags) == rows[s]["rl/token_staleness_max"] <= 2 and rows[s]["rl/staleness"] <= 2, rows[s]
    assert max(rows[s]["rl/token_staleness_max"] for s in range(1, 5)) == 2  # samples did run across updates
    assert max(rows[s]["rl/versions_per_sample"] for s in range(1, 5)) > 1
