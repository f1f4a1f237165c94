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
    # KV cache per engine: its share of 16 x 4 sequences, each ceil(256 / 128) = 2 blocks of 128 tokens, at
    # 2 (K, V) x 14 layers x 4 KV heads x 64 x 4 bytes (fp32) = 28672 bytes a token, x 1.25, up to 1/32 GiB.
    # 2 engines: 1.25 x 32 x 256 x 28672 / 2**30 = 0.2734 -> 9/32 GiB
    # 2 cores, 20 GB: 1 rank x 2 threads; engines min(2 cores, 16 prompts) = 2, 2 x (2 + 0.28) <= 10 GB,
    # each of 2 // 2 = 1 thread (1 is the spec's default already, so not listed)
    # the benchmark's KL (0.04) needs a reference: a frozen copy in the actor's process
    # one rank: ZeRO stage 0 (stage 2 partitions nothing on one rank)
    assert _plan(BENCH) == {"train.num_ranks": 1, "train.threads": 2, "rollout.num_engines": 2,
                            "rollout.kv_cache_gib": 9 / 32, "placement.reference": "in_actor", "train.zero_stage": 0}
    # 16 cores, 64 GB: 16 engines (4 sequences each: 0.0342 -> 2/32 GiB) need 16 x 2.0625 = 33 > 32 GB;
    # 15 (5 sequences each: 0.0427 -> 2/32) need 30.9, each of 16 // 15 = 1 thread
    assert _plan(BENCH, cores=16, memory_gb=64) == {"train.num_ranks": 1, "train.threads": 16,
                                                    "rollout.num_engines": 15, "rollout.kv_cache_gib": 2 / 32,
                                                    "placement.reference": "in_actor", "train.zero_stage": 0}
    # 8 cores, 7 GB: 2 engines need 2 x 2.28 > 3.5; 1 engine of 8 threads holds all 64 sequences:
    # 1.25 x 64 x 256 x 28672 / 2**30 = 0.547 -> 18/32 GiB
    assert _plan(BENCH, cores=8, memory_gb=7) == {"train.num_ranks": 1, "train.threads": 8,
                                                  "rollout.cpus_per_engine": 8, "rollout.kv_cache_gib": 18 / 32,
                                                  "placement.reference": "in_actor", "train.zero_stage": 0}
    # bf16 halves the bytes: 0.1367 -> 5/32 GiB
    raw = read_raw(BENCH, [])
    assert plan_cpu(load_spec(raw, check_paths=False), 2, 20.0, explicit_fields(raw), value_bytes=2)[
        "rollout.kv_cache_gib"] == 5 / 32
    # a rounds algorithm's batch is a round: 80 prompts x 4 / 2 engines = 160 sequences -> 1.367 -> 44/32 GiB
    assert _plan(BENCH, ["algorithm=rejection_sampling", "rounds.prompts_per_round=80"])[
        "rollout.kv_cache_gib"] == 44 / 32
    # with evaluation: 256 prompts x pass@4 / 2 engines = 512, at most the 256 vLLM decodes at once, of one
    # block each (8 new tokens) = 256 blocks, more than the step's 32 x 2: 1.25 x 256 x 128 x 28672 / 2**30
    # = 1.09375 GiB exactly
    assert _plan(BENCH, ["eval.enabled=true"])["rollout.kv_cache_gib"] == 35 / 32
    # 512 prompts x 4 on one engine: 2048 sequences, 256 at once, x 2 blocks: 2.1875 GiB
    assert _plan(BENCH, ["rl.prompts_per_step=512", "rollout.num_engines=1"])["rollout.kv_cache_gib"] == 70 / 32


def test_async_rollouts_split_the_cores_between_the_trainer_and_the_engines():
    # they run at once: half the cores to the engines. 2 cores -> min(1, 16 prompts) = 1 engine (the default,
    # not listed) of 1 thread, 2 - 1 = 1 for the rank; the engine's KV cache holds all 64 sequences: 18/32 GiB
    assert _plan(BENCH, ["rl.async_rollout=true", "rl.kl_coef=0"]) == {
        "train.num_ranks": 1, "train.threads": 1, "rollout.kv_cache_gib": 18 / 32, "train.zero_stage": 0}
    # 16 cores, 64 GB: 8 engines of 1 thread, 16 - 8 = 8 threads for the rank
    got = _plan(BENCH, ["rl.async_rollout=true"], cores=16, memory_gb=64)
    assert (got["train.threads"], got["rollout.num_engines"]) == (8, 8) and "rollout.cpus_per_engine" not in got
    # engines asked for (2, of the default 1 thread): the rank gets the 8 - 2 cores left
    assert _plan(BENCH, ["rl.async_rollout=true", "rollout.num_engines=2"], cores=8)["train.threads"] == 6


def test_fields_the_user_set_are_kept():
    # two ranks asked: each gets 8 // 2 = 4 threads; engines and KV cache asked: kept
    got = _plan(BENCH, ["train.num_ranks=2", "rollout.num_engines=1", "rollout.kv_cache_gib=2",
                        "placement.reference=role"], cores=8)
    assert got == {"train.threads": 4}
    # 4 cores, 20 GB: min(4 cores, 16 prompts) = 4 engines of 16 sequences (0.137 -> 5/32 GiB)
    assert _plan(BENCH, ["train.threads=1", "rollout.cpus_per_engine=1"], cores=4) == {
        "train.num_ranks": 1, "rollout.num_engines": 4, "rollout.kv_cache_gib": 5 / 32,
        "placement.reference": "in_actor", "train.zero_stage": 0}
    # a stage or an offload asked: the stage stays
    assert "train.zero_stage" not in _plan(BENCH, ["train.zero_stage=2"])
    assert "train.zero_stage" not in _plan(BENCH, ["train.offload_optimizer=true"])
    # AutoTP asks for its ranks
    assert "train.num_ranks" not in _plan(BENCH, ["train.tp_size=2", "train.num_ranks=2"])


def test_a_job_without_rollouts_only_gets_its_trainer_layout():
    assert _plan(EXAMPLES / "tiny_sft.yaml", cores=4) == {"train.threads": 2}  # the example asks for 2 ranks
    assert _plan(EXAMPLES / "tiny_sft.yaml", ["train.num_ranks=1"], cores=4) == {"train.threads": 4}


def test_run_applies_the_layout(monkeypatch):
    monkeypatch.setattr("elasticrl.plan.cpu.machine_cores", lambda: 2)
    monkeypatch.setattr("elasticrl.plan.cpu.available_gb", lambda: 20.0)
    sets = ["rl.num_steps=2", "model.dtype=fp32"]  # fp32: the KV cache's size does not depend on this CPU
    job, layout = cpu_layout(BENCH, sets, load_spec(BENCH, sets))
    t, r = job.train, job.rollout
    assert (t.num_ranks, t.threads, r.num_engines, r.cpus_per_engine, job.rl.num_steps) == (1, 2, 2, 1, 2)
    assert layout == {"train.num_ranks": 1, "train.threads": 2, "rollout.num_engines": 2,
                      "rollout.kv_cache_gib": 9 / 32, "placement.reference": "in_actor", "train.zero_stage": 0}
    assert job.placement.reference == "in_actor"
    # ray.num_cpus caps the cores the layout counts
    job, _ = cpu_layout(BENCH, ["ray.num_cpus=1"], load_spec(BENCH, ["ray.num_cpus=1"]))
    assert (job.train.threads, job.rollout.num_engines) == (1, 1)
