"""The process reward model's pieces: step encoding, held-out metrics, record checks."""
from __future__ import annotations

import json

import pytest

from elasticrl.spec import load_spec
from elasticrl.world.tokenizer import build_tokenizer


def test_prm_steps_end_with_the_marker_and_only_those_positions_are_scored():
    from elasticrl.trainers.prm import encode_steps, marker_id

    tok = build_tokenizer()
    nl = marker_id(tok, "\n")
    ids, pos = encode_steps(tok, "1+2+3=", ["1+2=3", "3+3=6"], nl, apply_chat_template=False, max_length=64)
    assert tok.decode(ids) == "1+2+3=1+2=3\n3+3=6\n"
    assert pos == [11, 17] and all(ids[p] == nl for p in pos)  # 6 prompt ids, then 5 + marker, 5 + marker
    _, cut = encode_steps(tok, "1+2+3=", ["1+2=3", "3+3=6"], nl, apply_chat_template=False, max_length=17)
    assert cut == [11]  # the second step's marker fell past max_length: that step is not scored
    with pytest.raises(ValueError, match="data.step_marker: 'ab' is 2 tokens"):
        marker_id(tok, "ab")


def test_prm_metrics_by_hand():
    from elasticrl.trainers.prm import step_metrics

    solutions = [  # (prompt, labels, scores)
        ("p", [1, 1], [0.9, 0.8]),  # right, judged right: weakest 0.8
        ("p", [1, 0], [0.9, 0.7]),  # second step missed: weakest 0.7
        ("p", [0, 0], [0.2, 0.9]),  # first error found, second step missed: weakest 0.2
        ("q", [1, 1], [0.6, 0.4]),  # right, second step doubted: weakest 0.4
        ("q", [0, 0], [0.3, 0.3]),  # all right: weakest 0.3
        ("r", [0, 1.0], [0.1, 0.2]),  # a lone solution: no best-of-n contest
    ]
    m = step_metrics(solutions)
    # steps on the right side of 0.5: 2 + 1 + 1 + 1 + 2 + 1 = 8 of 12
    assert m["eval/step_accuracy"] == pytest.approx(8 / 12, abs=1e-12)
    # first step below 0.5 vs first labelled wrong: (none, none) (none, 1) (0, 0) (1, none) (0, 0) (0, 0)
    assert m["eval/first_error_accuracy"] == pytest.approx(4 / 6, abs=1e-12)
    # p picks 0.8 (right), q picks 0.4 (right); r has one solution and no right one
    assert m["eval/best_of_n_accuracy"] == 1.0
    assert step_metrics([("q", [1, 1], [0.2, 0.9]), ("q", [0, 1], [0.6, 0.6])])["eval/best_of_n_accuracy"] == 0.0


def test_prm_records_are_checked_with_file_and_record(tmp_path):
    from elasticrl.trainers.prm import read_step_records

    spec = load_spec({"algorithm": "prm"})
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "steps": ["1+1=2"], "labels": [1]}) + "\n"
                    + json.dumps({"prompt": "1+1=", "steps": ["1+1=2", "2+0=2"], "labels": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"steps.jsonl: record 2: 'labels' must hold one number in \[0, 1\] per step"):
        read_step_records(str(path), spec)
    path.write_text(json.dumps({"prompt": "1+1=", "steps": "1+1=2", "labels": [1]}) + "\n")
    with pytest.raises(ValueError, match="record 1: 'steps' must be a non-empty list of strings"):
        read_step_records(str(path), spec)
