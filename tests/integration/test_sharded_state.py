"""Sharded state at a size where it shows: a 50.5 M-parameter actor (606 MB of fp32 masters
and Adam moments) saved by 4 ZeRO-3 ranks and by 2 AutoTP ranks. Each rank's peak resident
memory while it saves and loads (VmHWM from /proc, reset through /proc/self/clear_refs) grows
by its own pieces plus a fixed overhead, never by the model; the 4-rank checkpoint loads
bit-exact (SHA-256 of every tensor) on 4 ranks, on 2 AutoTP ranks (ZeRO-1) and on 1 rank at
ZeRO-2, which also loads the AutoTP one."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from elasticrl.cluster import RoleGroup
from elasticrl.engine.state import load_engine
from elasticrl.spec import load_spec, spec_to_dict
from elasticrl.trainers.sft import SFTWorker, resolve_paths

pytestmark = pytest.mark.slow

BASE = ["world.model_size=51m", "model.dtype=fp32", "train.micro_batch_size=1", "train.threads=1",
        "data.max_length=32", "train.lr=1e-3", "train.warmup_ratio=0"]
OVERHEAD = 48 * 2**20  # bytes a rank may grow by besides its pieces: allocator and safetensors headers


def _peak(worker, what: str, folder: str) -> tuple[int, int]:
    """(increase of this rank's peak resident memory during ``what``, bytes of its pieces)."""
    import gc

    import torch.distributed as dist

    from elasticrl.engine import state

    def status(key: str) -> int:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key))
        return int(line.split()[1]) * 1024

    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    if what == "save":
        worker.save(folder, background=True)
        worker.saved(wait=True)
    else:
        state.load_engine(worker.core.engine, folder)
    peak = status("VmHWM:") - before
    dist.barrier()
    mine = Path(folder) / state.PIECES.format(dist.get_rank())
    return peak, mine.stat().st_size if mine.is_file() else 0


def _digests(group) -> dict[str, str]:
    from elasticrl.engine.state import full_state

    weights, moments = group.call("__ray_call__", lambda w: full_state(w.core.engine))[0]
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in {**weights, **moments}.items()}


def _group(ranks: int, *extra, resume: str | None = None) -> RoleGroup:
    spec = load_spec({}, BASE + [f"train.num_ranks={ranks}", f"train.global_batch_size={4}", *extra])
    group = RoleGroup("trainer", SFTWorker, ranks, spec_to_dict(spec), resolve_paths(spec))
    group.setup(4, resume=resume)
    return group


def test_each_rank_saves_and_loads_its_own_pieces_and_any_layout_loads_them_bit_exact(ray_cluster, tmp_path):
    z3, tp = tmp_path / "zero3", tmp_path / "autotp"
    z3.mkdir(), tp.mkdir()
    group = _group(4, "train.zero_stage=3")
    try:
        group.call("train_step", 0)  # the moments exist
        params = group.call("__ray_call__", lambda w: sum(p.ds_numel for p in w.engine.module.parameters()))[0]
        whole = 12 * params  # fp32 master and two moments
        (z3 / "actor").mkdir()
        saves = group.call("__ray_call__", lambda w: _peak(w, "save", str(z3 / "actor")))
        loads = group.call("__ray_call__", lambda w: _peak(w, "load", str(z3 / "actor")))
        saved = _digests(group)
    finally:
        group.shutdown()
    assert params >= 50e6 and len(saved) == 3 * len([k for k in saved if not k.startswith("exp_avg")])
    shards = [size for _, size in saves]
    assert max(shards) < 0.3 * whole and sum(shards) == pytest.approx(whole, rel=0.01)  # a quarter each
    for (save_peak, shard), (load_peak, _) in zip(saves, loads):
        assert save_peak < shard + OVERHEAD and load_peak < shard + OVERHEAD, (save_peak, load_peak, shard)
    assert shards[0] + OVERHEAD < whole / 2  # the bound is far below what a gather would need

    group = _group(2, "train.tp_size=2", "train.zero_stage=1", resume=str(z3 / "actor"))
    try:
        assert _digests(group) == saved
        (tp / "actor").mkdir()
        tp_saves = group.call("__ray_call__", lambda w: _peak(w, "save", str(tp / "actor")))
        tp_loads = group.call("__ray_call__", lambda w: _peak(w, "load", str(tp / "actor")))
    finally:
        group.shutdown()
    for (save_peak, shard), (load_peak, _) in zip(tp_saves, tp_loads):
        assert shard < 0.6 * whole and save_peak < shard + OVERHEAD and load_peak < shard + OVERHEAD

    group = _group(1, "train.zero_stage=2", resume=str(z3 / "actor"))
    try:
        assert _digests(group) == saved
        group.call("__ray_call__", lambda w: load_engine(w.core.engine, str(tp / "actor")))
        assert _digests(group) == saved  # the AutoTP ranks' checkpoint of the same state
    finally:
        group.shutdown()
    mb = 1e6
    print(f"{params / mb:.1f} M parameters, {whole / mb:.0f} MB of state; 4 ZeRO-3 ranks: pieces up to "
          f"{max(shards) / mb:.0f} MB, peak increase up to {max(p for p, _ in saves) / mb:.0f} MB saving and "
          f"{max(p for p, _ in loads) / mb:.0f} MB loading; 2 AutoTP ranks: pieces up to "
          f"{max(s for _, s in tp_saves) / mb:.0f} MB, peaks up to {max(p for p, _ in tp_saves) / mb:.0f} and "
          f"{max(p for p, _ in tp_loads) / mb:.0f} MB")
