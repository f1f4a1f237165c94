"""The CPU layout (plan/cpu.py): hand-worked cases, and what `elasticrl run` does with it."""
from __future__ import annotations

from elasticrl.driver import cpu_layout
from elasticrl.plan.cpu import plan_cpu
from elasticrl.spec import explicit_fields, load_spec, read_raw
from tests.conftest import EXAMPLES

BENCH = EXAMPLES.parent / "benchmarks" / "rl_step.yaml"


def _plan(path, sets=(), cores=2, memory_gb=20.0):
    raw = read_raw(path, list(sets))
    return plan_cpu(load_spec(raw, check_paths=False), cores, memory_gb, explicit_fields(raw))


def test_a_grpo_spec_without_a_layout_gets_one_rank_with_every_core_and_an_engine_per_core():
    # 2 cores, 20 GB: 1 rank x 2 threads; engines min(2 cores, 20 x 0.5 // (2 + 1 GiB KV) = 3, 16 prompts) = 2,
    # each of 2 // 2 = 1 thread (1 is the spec's default already, so not listed)
    assert _plan(BENCH) == {"train.num_ranks": 1, "train.threads": 2, "rollout.num_engines": 2}
    # 16 cores, 64 GB: engines limited by memory, 64 x 0.5 // 3 = 10, each of 16 // 10 = 1 thread
    assert _plan(BENCH, cores=16, memory_gb=64) == {"train.num_ranks": 1, "train.threads": 16,
                                                    "rollout.num_engines": 10}
    # 8 cores, 7 GB: 7 x 0.5 // 3 = 1 engine, of 8 threads
    assert _plan(BENCH, cores=8, memory_gb=7) == {"train.num_ranks": 1, "train.threads": 8,
                                                  "rollout.cpus_per_engine": 8}


def test_fields_the_user_set_are_kept():
    # two ranks asked: each gets 8 // 2 = 4 threads; engines asked: their threads stay the user's
    got = _plan(BENCH, ["train.num_ranks=2", "rollout.num_engines=1"], cores=8)
    assert got == {"train.threads": 4}
    # 4 cores, 20 GB: min(4 cores, 20 x 0.5 // 3 = 3) engines
    assert _plan(BENCH, ["train.threads=1", "rollout.cpus_per_engine=1"], cores=4) == {
        "train.num_ranks": 1, "rollout.num_engines": 3}
    # AutoTP asks for its ranks
    assert "train.num_ranks" not in _plan(BENCH, ["train.tp_size=2", "train.num_ranks=2"])


def test_a_job_without_rollouts_only_gets_its_trainer_layout():
    assert _plan(EXAMPLES / "tiny_sft.yaml", cores=4) == {"train.threads": 2}  # the example asks for 2 ranks
    assert _plan(EXAMPLES / "tiny_sft.yaml", ["train.num_ranks=1"], cores=4) == {"train.threads": 4}


def test_run_applies_the_layout(monkeypatch):
    monkeypatch.setattr("elasticrl.plan.cpu.machine_cores", lambda: 2)
    monkeypatch.setattr("elasticrl.plan.cpu.available_gb", lambda: 20.0)
    job, layout = cpu_layout(BENCH, ["rl.num_steps=2"], load_spec(BENCH, ["rl.num_steps=2"]))
    t, r = job.train, job.rollout
    assert (t.num_ranks, t.threads, r.num_engines, r.cpus_per_engine, job.rl.num_steps) == (1, 2, 2, 1, 2)
    assert layout == {"train.num_ranks": 1, "train.threads": 2, "rollout.num_engines": 2}
    # ray.num_cpus caps the cores the layout counts
    job, _ = cpu_layout(BENCH, ["ray.num_cpus=1"], load_spec(BENCH, ["ray.num_cpus=1"]))
    assert (job.train.threads, job.rollout.num_engines) == (1, 1)
