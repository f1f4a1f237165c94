"""The DeepSpeed config and the LR schedule, from the spec."""
from __future__ import annotations

import pytest

from elasticrl.engine.strategy import ds_config, lr_lambda
from elasticrl.spec import load_spec


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    # warm-up: (step+1)/4
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over 8 steps from 1 to 0.1: 0.1 + 0.9 * (1 + cos(pi * k / 8)) / 2
    assert f(4) == pytest.approx(1.0, abs=1e-12)
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-12)  # halfway: cos(pi/2) = 0
    assert f(12) == pytest.approx(0.1, abs=1e-12) and f(20) == pytest.approx(0.1, abs=1e-12)
    assert lr_lambda(0, 10, 0.0)(0) == pytest.approx(1.0)


def test_ds_config_reflects_the_spec():
    t = load_spec({}, ["train.zero_stage=3", "train.offload_optimizer=true", "train.offload_params=true",
                       "train.tp_size=2", "train.global_batch_size=64", "train.micro_batch_size=16"]).train
    cfg = ds_config(t, "bf16", grad_accum=4)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and cfg["bf16"] == {"enabled": True}
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 16
