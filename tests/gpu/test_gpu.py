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
