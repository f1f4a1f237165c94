"""What only a GPU can show (opt-in: ``pytest -m gpu``; skipped without CUDA; run by
``scripts/gpu_check.sh full``): the CUDA IPC and NCCL transports between plain processes, and
a vLLM engine colocated with a trainer rank on one GPU that sleeps, wakes its weights alone,
takes a sliced sync over CUDA IPC and then scores like the trainer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticrl import backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.has_gpu(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[2]


def test_ipc_and_nccl_transports_between_plain_processes_are_bit_exact():
    out = subprocess.run([sys.executable, "scripts/sync_check.py", "--device", "cuda", "--receivers", "1,2",
                          "--hidden", "256", "--layers", "2", "--vocab", "1024"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    ran = [r for r in rows if "bit_exact" in r]
    assert out.returncode == 0 and ran and all(r["bit_exact"] for r in ran), out.stdout + out.stderr[-3000:]
    assert {r["transport"] for r in ran} >= {"arena"}  # CUDA IPC always; NCCL with a GPU per process


@pytest.fixture(scope="module")
def ray_gpu():
    from elasticrl.cluster.session import ray_session
    from elasticrl.spec.schema import RaySpec

    with ray_session(RaySpec(num_cpus=8)):
        yield


def test_a_colocated_engine_sleeps_wakes_its_weights_takes_ipc_slices_and_scores_like_the_trainer(ray_gpu):
    from elasticrl.cluster import RoleGroup
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.trainers.sft import SFTWorker, resolve_paths
    from tests.integration.test_weight_sync import PROBE, _trainer_logprobs

    spec = load_spec({}, ["model.dtype=fp32", "train.num_ranks=1", "train.micro_batch_size=8",
                          "train.global_batch_size=8", "train.lr=3e-3", "train.warmup_ratio=0",
                          "rollout.max_model_len=64", "rollout.gpu_memory_utilization=0.3"])
    paths = resolve_paths(spec)
    pool = RolloutPool(paths["model"], spec.rollout, "fp32", seed=0, where={"gpus_per_rank": 0.5, "cpus_per_rank": 1})
    trainer = RoleGroup("trainer", SFTWorker, 1, spec_to_dict(spec), paths, gpus_per_rank=0.5)
    try:
        trainer.setup(10)
        trainer.call("train_step", 0)
        assert trainer.call("attach_rollout", pool.engines, pool.infos, "auto", 1, None)[0] == "ipc"
        assert pool.call("sleep")[0]["slept"] == "vllm_sleep"
        pool.call("wake", ["weights"])
        stats = trainer.call("sync_weights", 1)[0]
        assert stats["sync/layout"] == "sliced" and stats["sync/transport"] == "ipc"
        got, versions = pool.score(PROBE)  # wakes the KV cache first
        expected = trainer.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
        assert versions == [1]
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=2e-3, rtol=0)  # TF32 matmuls
        trainer.call("detach_rollout")
    finally:
        trainer.shutdown()
        pool.shutdown()


def test_qlora_grpo_serves_its_adapters_on_a_4bit_base(ray_gpu, tmp_path):
    """QLoRA (``model.lora.quantize: nf4``) on one GPU, the engine colocated: the trainer's base in
    bitsandbytes NF4, the engine's from vLLM's bitsandbytes loading of the same checkpoint, each
    sync the adapters alone. The two 4-bit bases come from two quantizers and run different
    kernels: the log-prob gap is printed, and bounded where garbage weights would give ~10."""
    from elasticrl.spec import load_spec
    from elasticrl.trainers.rl import run_rl
    from tests.conftest import EXAMPLES

    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", [
        "world.max_operand=9", "init.sft_steps=60", "train.num_ranks=1", "rl.num_steps=3", "eval.enabled=false",
        "rl.prompts_per_step=8", "rl.samples_per_prompt=4", "train.global_batch_size=32", "train.micro_batch_size=32",
        "model.lora.rank=8", "model.lora.quantize=nf4", "rollout.lora_sync=adapter", "rl.kl_coef=0.01",
        "rl.temperature=0.7", "train.lr=2e-3", "placement.colocate=all", "rollout.gpu_memory_utilization=0.3",
        "log.progress_bar=false", "checkpoint.resume=null"])
    summary = run_rl(spec, tmp_path / "run")
    assert "reference" not in summary["placement"]
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if r["step"] > 0]
    print(json.dumps({"qlora_logprob_gap": [r.get("rollout/logprob_gap") for r in steps],
                      "sync_gbytes": [r["sync/gbytes"] for r in steps]}))
    assert len(steps) == 3 and all(r["sync/layout"] == "adapters" and r["sync/gbytes"] < 1e-3 for r in steps)
    assert all(r.get("rollout/logprob_gap", 0.0) < 1.0 for r in steps) and steps[-1]["kl"] > 0
