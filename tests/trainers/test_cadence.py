"""When every trainer evaluates, logs and checkpoints: one ``Cadence``, asked by all."""
from __future__ import annotations

from elasticrl.spec import load_spec
from elasticrl.trainers.loop import Cadence


def _steps(rule, sets: list[str], total: int = 10) -> list[int]:
    when = Cadence(load_spec({}, sets), total)
    return [d for d in range(1, total + 1) if rule(when, d)]


def test_evaluation_every_n_steps_at_the_start_and_at_the_end():
    evaluate = Cadence.evaluate
    # every 3 steps and at the end (10); never with eval.enabled false; only at the end with 0
    assert _steps(evaluate, ["eval.every_steps=3"]) == [3, 6, 9, 10]
    assert _steps(evaluate, ["eval.every_steps=3", "eval.enabled=false"]) == []
    assert _steps(evaluate, ["eval.every_steps=0"]) == [10]
    # the start (step 0) whenever evaluation is on, whatever every_steps says
    assert Cadence(load_spec({}, ["eval.every_steps=0"]), 10).evaluate_start()
    assert not Cadence(load_spec({}, ["eval.enabled=false"]), 10).evaluate_start()


def test_a_metrics_row_every_n_steps_at_the_first_and_the_last_and_with_an_evaluation():
    assert _steps(lambda w, d: w.log(d, evaluated=False), ["log.every_steps=4"]) == [1, 4, 8, 10]
    assert _steps(lambda w, d: w.log(d, evaluated=d == 6), ["log.every_steps=4"]) == [1, 4, 6, 8, 10]


def test_checkpoints_every_n_steps_and_at_the_end_also_for_rounds_of_several_steps():
    checkpoint = Cadence.checkpoint
    assert _steps(checkpoint, ["checkpoint.every_steps=4"]) == [4, 8, 10]
    assert _steps(checkpoint, ["checkpoint.every_steps=0"]) == []
    # rounds of 3 optimizer steps, a checkpoint every 4 steps, 5 rounds (15 steps): after the
    # rounds that pass a multiple of 4 (rounds 2: 3-6 holds 4; 3: 6-9 holds 8; 4: 9-12 holds 12)
    # and after the last
    when = Cadence(load_spec({}, ["checkpoint.every_steps=4"]), 15)
    assert [r for r in range(1, 6) if when.checkpoint(3 * r, since=3 * (r - 1))] == [2, 3, 4, 5]


def test_rounds_evaluate_and_log_at_each_round_end_and_memory_copies_skip_checkpoint_steps():
    # a round (since given) evaluates whenever evaluation is on, and writes its row, whatever
    # every_steps says; off, it writes the row alone
    when = Cadence(load_spec({}, ["eval.every_steps=100", "log.every_steps=50"]), 40)
    assert [r for r in range(1, 5) if when.evaluate(10 * r, since=10 * (r - 1))] == [1, 2, 3, 4]
    assert all(when.log(10 * r, evaluated=False, since=10 * (r - 1)) for r in range(1, 5))
    off = Cadence(load_spec({}, ["eval.enabled=false"]), 40)
    assert not any(off.evaluate(10 * r, since=10 * (r - 1)) for r in range(1, 5))
    # fault.memory_copy_steps 2, a checkpoint every 4 steps: the copy where no checkpoint is written
    copies = ["fault.memory_copy_steps=2", "checkpoint.every_steps=4"]
    assert _steps(Cadence.memory_copy, copies) == [2, 6]
    assert _steps(Cadence.memory_copy, ["fault.memory_copy_steps=0"]) == []
