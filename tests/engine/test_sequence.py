"""Sequence parallelism (train.sp_size, engine/sequence.py): two ranks, each training on half of
every row's positions, give one rank's losses, gradient norm and updated weights on rows of
2,048 and 1,512 tokens, for the actor (LoRA on ZeRO-2: clipped policy loss, KL as a loss, an
entropy bonus) and the critic (ZeRO-3, gradient checkpointing: clipped value loss); and each
rank keeps at most 0.6 of the activations one rank keeps whole (at 4,096 tokens, 0.54 and 0.43:
docs/long-sequences.md)."""
from __future__ import annotations

import json
import socket
import sys

import pytest

from tests.conftest import run_together


def _probe(world: int) -> list[list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [[sys.executable, "-m", "tests.engine.sp_probe", str(r), str(world), str(port)] for r in range(world)]


def _figures(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("PROBE "):])


def test_two_sequence_parallel_ranks_train_actor_and_critic_as_one_on_2k_token_rows_with_half_the_activations():
    # one after the other: beside a third process, the pair's collectives wait on a busy core (46 s against 19)
    sliced_all = _figures(run_together(*_probe(2), timeout=600)[0])
    everything = _figures(run_together(*_probe(1), timeout=600)[0])
    for role in ("actor", "critic"):
        whole, sliced = everything[role], sliced_all[role]
        for key in ("policy_loss_sum", "kl_loss_sum", "entropy", "value_loss_sum", "grad_norm"):
            if key in whole:
                assert sliced[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), (role, key, whole, sliced)
        # one Adam step from the same weights: the same weights after it
        assert sliced["param_sum"] == pytest.approx(whole["param_sum"], rel=1e-6, abs=1e-6), role
        assert sliced["param_sq"] == pytest.approx(whole["param_sq"], rel=1e-7), role
        assert sliced["saved_gb"] <= 0.6 * whole["saved_gb"], (role, whole["saved_gb"], sliced["saved_gb"])
        print(f"{role}: saved for backward per rank {whole['saved_gb']:.3f} GB whole, {sliced['saved_gb']:.3f} GB "
              f"sliced in two ({sliced['saved_gb'] / whole['saved_gb']:.2f})")
    assert "policy_loss_sum" in everything["actor"] and "value_loss_sum" in everything["critic"]
