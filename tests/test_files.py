"""Atomic folders and checkpoints: complete or absent, never half-written."""
from __future__ import annotations

import pytest

from elasticrl.engine.checkpoint import list_checkpoints, new_checkpoint, write_trainer_state
from elasticrl.files import atomic_folder


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "export"
    with pytest.raises(RuntimeError):
        with atomic_folder(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_folder(final) as tmp:
        (tmp / "ok").write_text("1")
    with atomic_folder(final) as tmp:  # replaces the old one whole
        (tmp / "new").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["new"] and len(list(tmp_path.iterdir())) == 1


def test_checkpoints_commit_atomically_and_rotate(tmp_path):
    for step in (2, 4, 6):
        with new_checkpoint(tmp_path, step, keep=2) as tmp:
            write_trainer_state(tmp, {"step": step})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    with pytest.raises(RuntimeError):  # a save that never finished is not a checkpoint
        with new_checkpoint(tmp_path, 8, keep=2) as tmp:
            write_trainer_state(tmp, {"step": 8})
            raise RuntimeError("a rank died mid-save")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000004", "step_0000006"]
    (tmp_path / ".step_0000008.tmp-killed").mkdir()  # what a SIGKILL mid-save leaves: the next save clears it
    with new_checkpoint(tmp_path, 8, keep=2) as tmp:
        write_trainer_state(tmp, {"step": 8})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000006", "step_0000008"]
