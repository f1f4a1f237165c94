"""Held-out learning at the examples' own budgets: too long for the suite (13 minutes on two
cores), so opt-in: ``pytest -m learning`` (tests/README.md has what it printed). The suite's
LoRA tests show the wiring at T = 0.7 with a KL to the base (test_rl.py)."""
from __future__ import annotations

import json

import pytest

from elasticrl.engine.checkpoint import ADAPTER_WEIGHTS
from elasticrl.spec import load_spec
from elasticrl.trainers.rl import run_rl
from tests.conftest import EXAMPLES, LEARNING

pytestmark = [pytest.mark.learning, pytest.mark.slow]

QUIET = ["log.progress_bar=false", "checkpoint.resume=null", "eval.every_steps=360"]  # evaluated at 0 and 360


def _held_out(output) -> tuple[float, float]:
    rows = [json.loads(ln) for ln in (output / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return evals[0], evals[-1]


@pytest.mark.timeout(2400)
def test_lora_grpo_gains_two_thirds_of_the_full_fine_tunes_held_out_gain(ray_cluster, tmp_path):
    """examples/tiny_grpo.yaml (every weight) and tiny_grpo_lora.yaml (rank-8 adapters served by
    vLLM, adapter syncs) at the same steps, prompts and samples: the adapters' held-out gain is at
    least two thirds of the full fine-tune's, and each sync moves the adapters' bytes alone."""
    from safetensors import safe_open

    full = run_rl(load_spec(EXAMPLES / "tiny_grpo.yaml", QUIET + LEARNING), tmp_path / "full")
    lora = run_rl(load_spec(EXAMPLES / "tiny_grpo_lora.yaml", QUIET + LEARNING), tmp_path / "lora")
    (f0, f1), (l0, l1) = _held_out(tmp_path / "full"), _held_out(tmp_path / "lora")
    print(f"held-out accuracy: full fine-tune {f0:.3f} -> {f1:.3f}, LoRA {l0:.3f} -> {l1:.3f}")
    assert f0 == l0 and f1 - f0 >= 0.08, (f0, f1)  # the same start (the warm start), and the full run learned
    assert l1 - l0 >= 2 / 3 * (f1 - f0), (f0, f1, l0, l1)
    assert "reference" not in lora["placement"] and "reference" not in full["placement"]  # rl.kl_coef: 0
    with safe_open(tmp_path / "lora" / "final" / ADAPTER_WEIGHTS, "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    rows = [json.loads(ln) for ln in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "sync/gbytes" in r]
    assert len(steps) == 360 and all(round(r["sync/gbytes"] * 1e9) == adapter_bytes for r in steps)
