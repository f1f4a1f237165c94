"""A rerun on an output where the job finished returns its summary and touches nothing, for
every algorithm (``run_job`` decides before any trainer starts; test_sft_engine runs it for real)."""
from pathlib import Path

import pytest

from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.load import load_spec
from elasticrl.trainers import run_job
from elasticrl.trainers.loop import mark_finished

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = {"sft": "tiny_sft", "conditional_sft": "tiny_conditional_sft", "rm": "tiny_rm", "prm": "tiny_prm",
           "dpo": "tiny_dpo", "kto": "tiny_dpo", "rejection_sampling": "tiny_rejection_sampling",
           "iterative_dpo": "tiny_rejection_sampling", "grpo": "tiny_grpo", "ppo": "tiny_ppo",
           "reinforce++": "tiny_grpo", "rloo": "tiny_grpo"}


def test_every_algorithm_has_an_example_here():
    assert set(EXAMPLE) == set(ALGORITHMS)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_rerunning_a_finished_job_keeps_its_metrics(algorithm, tmp_path):
    spec = load_spec(EXAMPLES / f"{EXAMPLE[algorithm]}.yaml", [f"algorithm={algorithm}"], check_paths=False)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    mark_finished(spec, tmp_path, {"steps": 2, "final": {"loss": 0.25}})

    again = run_job(spec, tmp_path)  # a trainer would start Ray and fail here without a cluster
    assert again == {"steps": 2, "final": {"loss": 0.25}, "already_finished": True}
    assert metrics.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n'

    relogged = load_spec(EXAMPLES / f"{EXAMPLE[algorithm]}.yaml", [f"algorithm={algorithm}", "log.every_steps=7"],
                         check_paths=False)
    assert run_job(relogged, tmp_path)["already_finished"]  # reporting fields are not a new job
    reseeded = load_spec(EXAMPLES / f"{EXAMPLE[algorithm]}.yaml", [f"algorithm={algorithm}", "seed=99"],
                       check_paths=False)
    with pytest.raises(ValueError, match=r"holds a finished run of another spec \(seed changed\)"):
        run_job(reseeded, tmp_path)  # no checkpoint to continue from: refused, metrics kept
    assert metrics.read_text().count("\n") == 2
