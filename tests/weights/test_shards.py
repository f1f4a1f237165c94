"""Sharded safetensors and the copy plans of the shared-memory weight sync."""
from __future__ import annotations

import json

import torch

from elasticrl.weights.shards import INDEX, load_sharded, plan_shards, save_sharded


def test_plan_shards_respects_the_bound():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 10**6) == [["a", "b", "c", "d", "e"]]


def test_sharded_round_trip_with_index(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(5)}
    state["tied"] = state["layer0.weight"]  # shared storage is written as its own copy
    names = save_sharded(state, tmp_path, max_shard_bytes=64 * 64 * 4 * 2)
    assert INDEX in names and len(names) == 4  # 6 tensors of 16 KiB, 2 per 32 KiB shard
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == set(state) and index["metadata"]["total_size"] == 6 * 64 * 64 * 4
    loaded = load_sharded(tmp_path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_copy_plan_replay_handles_fused_rows_views_and_fills():
    from elasticrl.weights.plan import Arena, replay

    arena = torch.zeros(64 + 32, dtype=torch.uint8)
    params = Arena(arena, [0, 64])  # parameter 0: 16 fp32 slots; parameter 1 from byte 64: 8 slots
    flat = torch.arange(100, dtype=torch.float32)
    src = flat[40:46].view(2, 3)  # a view at storage offset 40, like a ZeRO partition
    plans = [
        ("copy", 0, 4 * 4, [1, 3], [3, 1], "float32", 3, [1, 3], [3, 1]),  # row 1 of src -> slots 4..6
        ("copy", 0, 8 * 4, [2, 1], [1, 1], "float32", 0, [2, 1], [3, 1]),  # column 0 -> slots 8, 9
        ("fill", 0, 12 * 4, [4], [1], "float32", 7.0, [], []),            # padding rows -> 7
        ("copy", 1, 2 * 4, [3], [1], "float32", 1, [3], [1]),              # 41, 42, 43 -> its slots 2..4
    ]
    written = replay(plans, src, params)
    assert written == 4 * (3 + 2 + 4 + 3)
    assert arena.view(torch.float32).tolist() == [0, 0, 0, 0, 43, 44, 45, 0, 40, 43, 0, 0, 7, 7, 7, 7,
                                                   0, 0, 41, 42, 43, 0, 0, 0]
