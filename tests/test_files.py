"""Atomic folders and checkpoints: complete or absent, never half-written."""
from __future__ import annotations

import pytest

from elasticrl.engine.checkpoint import begin_checkpoint, commit_checkpoint, list_checkpoints, write_trainer_state
from elasticrl.files import atomic_folder
from elasticrl.spec import load_spec

SPEC = load_spec({})


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
        tmp = begin_checkpoint(tmp_path, step)
        write_trainer_state(tmp, SPEC, {"step": step})
        commit_checkpoint(tmp, tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    half = begin_checkpoint(tmp_path, 8)  # a save that never finished is not a checkpoint
    write_trainer_state(half, SPEC, {"step": 8})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_0000004",
                                                                                         "step_0000006"]
    (tmp_path / ".step_0000008.tmp-killed").mkdir()  # what a SIGKILL mid-save leaves: the next save clears it
    tmp = begin_checkpoint(tmp_path, 8)
    assert not half.exists() and not (tmp_path / ".step_0000008.tmp-killed").exists()
    write_trainer_state(tmp, SPEC, {"step": 8})
    commit_checkpoint(tmp, tmp_path, 8, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000006", "step_0000008"]


def _checkpoint(tmp_path, spec, extra_files=()):
    folder = tmp_path / "checkpoints" / "step_0000004"
    (folder / "actor").mkdir(parents=True)
    write_trainer_state(folder, spec, {"step": 4})
    import torch

    from elasticrl.engine.state import Held, stage, write_staged

    # a whole role: one rank's pieces and state, a config
    write_staged(stage(0, [Held("w", (2,), torch.zeros(2), 0, 1)], {"world_size": 1}), folder / "actor")
    (folder / "actor" / "config.json").write_text("{}")
    for name in extra_files:
        (folder / name).write_bytes(b"\x80\x04N.")  # a pickle of None
    return folder


def test_a_checkpoint_resumes_under_changes_that_keep_the_math(tmp_path):
    from elasticrl.engine.checkpoint import check_resumable

    folder = _checkpoint(tmp_path, load_spec({"algorithm": "grpo"}))
    # rank counts, ZeRO stage, engines, step count, eval and logging may change
    ok = load_spec({"algorithm": "grpo"}, ["train.num_ranks=4", "train.zero_stage=3", "rollout.num_engines=2",
                                           "rl.num_steps=500", "eval.every_steps=7", "train.micro_batch_size=8"])
    assert check_resumable(folder, ok)["step"] == 4
    # the learning rate or the seed may not: the error names each field
    bad = load_spec({"algorithm": "grpo", "seed": 5}, ["train.lr=3e-4"])
    with pytest.raises(ValueError, match=r"differs in seed \(1234 -> 5\), train.lr \(0.001 -> 0.0003\), which a "
                                         r"resumed job may not change"):
        check_resumable(folder, bad)


def test_a_checkpoint_with_a_file_elasticrl_never_writes_is_refused(tmp_path):
    from elasticrl.engine.checkpoint import check_resumable

    spec = load_spec({})
    folder = _checkpoint(tmp_path, spec, ["actor/optimizer.pt"])
    with pytest.raises(ValueError, match=r"optimizer.pt is not a file elasticrl writes .* \(a pickle could run code\)"):
        check_resumable(folder, spec)


def test_a_damaged_or_old_checkpoint_is_refused_with_the_fix(tmp_path):
    from elasticrl.engine.checkpoint import STATE_FILE, check_resumable

    spec = load_spec({})
    folder = _checkpoint(tmp_path, spec)
    (folder / STATE_FILE).write_text('{"step": 4, "format": 1}')
    with pytest.raises(ValueError, match=r"is of checkpoint format 1 .* start fresh with checkpoint.resume: null"):
        check_resumable(folder, spec)
    (folder / STATE_FILE).write_text('{"step": 4,')
    with pytest.raises(ValueError, match=r"trainer_state.json: not valid JSON .* the checkpoint is damaged"):
        check_resumable(folder, spec)


def test_disk_problems_are_recognised_raised_or_wrapped_as_text():
    import errno

    from elasticrl.files import disk_problem

    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_problem(full) == ("No space left on device", "free space there")
    try:
        try:
            raise OSError(errno.EACCES, "Permission denied")
        except OSError as exc:
            raise RuntimeError("trainer rank 0 failed") from exc
    except RuntimeError as wrapped:
        assert disk_problem(wrapped)[0] == "Permission denied"
    # a rank's failure arrives as text; safetensors words a full disk in Rust's terms
    rust = RuntimeError("trainer rank 0 failed: SafetensorError: Error while serializing: IoError(Os { code: 28, "
                        "kind: StorageFull, message: \"No space left on device\" })")
    assert disk_problem(rust)[0] == "No space left on device"
    assert disk_problem(RuntimeError("StorageFull")) == ("No space left on device", "free space there")
    assert disk_problem(OSError(errno.ENOENT, "No such file or directory")) is None
    assert disk_problem(ValueError("loss is nan")) is None
