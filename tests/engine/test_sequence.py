"""Sequence parallelism (train.sp_size, engine/sequence.py): two ranks, each training on half of
every row's positions, give one rank's loss, gradient norm and updated weights on rows of 4,096
and 3,012 tokens, for the actor (clipped policy loss, KL as a loss, entropy bonus) and the critic
(clipped value loss); and each rank keeps at most 0.6 of the activations one rank keeps whole."""
from __future__ import annotations

import json
import socket
import sys

import pytest

from tests.conftest import run_together


def _probe(role: str, world: int) -> list[list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [[sys.executable, "-m", "tests.engine.sp_probe", role, str(r), str(world), str(port)] for r in range(world)]


def _figures(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("PROBE "):])


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_sequence_parallel_ranks_train_as_one_on_4k_token_rows_with_half_the_activations(role):
    procs = run_together(*_probe(role, 1), *_probe(role, 2), timeout=600)
    whole, sliced = _figures(procs[0]), _figures(procs[1])
    for key in ("policy_loss_sum", "kl_loss_sum", "entropy", "value_loss_sum", "grad_norm"):
        if key in whole:
            assert sliced[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), (key, whole, sliced)
    # one Adam step from the same weights: the same weights after it
    assert sliced["param_sum"] == pytest.approx(whole["param_sum"], rel=1e-6, abs=1e-6)
    assert sliced["param_sq"] == pytest.approx(whole["param_sq"], rel=1e-7)
    assert sliced["saved_gb"] <= 0.6 * whole["saved_gb"], (whole["saved_gb"], sliced["saved_gb"])
    print(f"{role}: saved for backward per rank {whole['saved_gb']:.3f} GB whole, {sliced['saved_gb']:.3f} GB "
          f"sliced in two ({sliced['saved_gb'] / whole['saved_gb']:.2f})")
