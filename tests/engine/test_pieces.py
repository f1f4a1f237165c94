"""The pieces of a sharded checkpoint (engine.state) without an engine: the rectangles a flat
range makes, the file a rank writes, and a load at another layout reading what it needs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from elasticrl.engine.state import ENGINE_STATE, PIECES, Held, Pieces, _rects, stage, whole_tensors, write_staged
from elasticrl.weights.shards import write_safetensors


def test_a_flat_range_is_at_most_three_rectangles():
    # a 4 x 5 grid: [3, 17) is the rest of row 0, rows 1-2, then 2 elements of row 3
    assert list(_rects(3, 17, 5)) == [(0, 1, 3, 5, 3, 5), (1, 3, 0, 5, 5, 15), (3, 4, 0, 2, 15, 17)]
    assert list(_rects(5, 15, 5)) == [(1, 3, 0, 5, 5, 15)]          # whole rows: one rectangle
    assert list(_rects(6, 8, 5)) == [(1, 2, 1, 3, 6, 8)]            # inside one row
    assert list(_rects(4, 4, 5)) == []
    # a slice placed at column 3 of the whole (AutoTP cut along dimension 1): whole coordinates
    held = Held("w", (4, 8), torch.zeros(7), 3, 5, row0=0, col0=3)
    assert list(held.rects()) == [((0, 1), (6, 8), slice(0, 2)), ((1, 2), (3, 8), slice(2, 7))]


def test_views_of_one_buffer_write_as_safetensors_that_safe_open_reads(tmp_path):
    buf = torch.arange(12, dtype=torch.float32)
    n = write_safetensors(tmp_path / "a.safetensors", [("x", buf[:6].view(2, 3)), ("y", buf[6:])], {"k": "v"})
    assert n == (tmp_path / "a.safetensors").stat().st_size
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_tensor("x"), buf[:6].view(2, 3)) and torch.equal(f.get_tensor("y"), buf[6:])
        assert torch.equal(f.get_slice("x")[1:2, 1:3], torch.tensor([[4.0, 5.0]]))


def _save(folder, whole: torch.Tensor, layout: list[list[tuple[int, int, int, int]]]):
    """Write ``whole`` as ranks would: layout[rank] = [(col0, col1, flat start, flat stop)] of
    the column slices (AutoTP along dimension 1) and the flat ranges of them each rank holds."""
    folder.mkdir()
    for rank, held in enumerate(layout):
        pieces = []
        for c0, c1, a, b in held:
            local = whole[:, c0:c1].contiguous().view(-1)
            pieces.append(Held("w", tuple(whole.shape), local[a:b], a, c1 - c0, col0=c0))
        write_staged(stage(rank, pieces, {"world_size": len(layout)} if rank == 0 else None), folder)


def test_pieces_written_by_four_ranks_load_at_other_layouts_bit_exact(tmp_path):
    whole = torch.randn(6, 10)
    # 2 tensor-parallel ranks (columns 0-4 and 5-9), each slice split over 2 data-parallel ranks
    # at flat element 13 of its 30 (two of the four files are three rectangles each)
    _save(tmp_path / "ckpt", whole, [[(0, 5, 0, 13)], [(0, 5, 13, 30)], [(5, 10, 0, 13)], [(5, 10, 13, 30)]])
    sizes = [(tmp_path / "ckpt" / PIECES.format(r)).stat().st_size for r in range(4)]
    assert max(sizes) < 0.3 * whole.numel() * 4 + 1000  # each rank wrote its quarter, not the tensor
    pieces = Pieces(tmp_path / "ckpt")
    # one rank, no TP: the whole; 3 ranks of ZeRO over the flat tensor (20 elements each)
    assert torch.equal(whole_tensors(tmp_path / "ckpt")["w"], whole)
    for a, b in ((0, 20), (20, 40), (40, 60)):
        target = torch.full((b - a,), float("nan"))
        pieces.fill(Held("w", (6, 10), target, a, 10))
        assert torch.equal(target, whole.view(-1)[a:b])
    # 2 TP ranks cut along rows instead (rows 3-5: the second), no ZeRO
    target = torch.empty(30)
    pieces.fill(Held("w", (6, 10), target, 0, 10, row0=3))
    assert torch.equal(target, whole[3:].reshape(-1))


def test_a_missing_rank_file_or_piece_or_another_shape_is_refused_in_one_line(tmp_path):
    whole = torch.randn(4, 4)
    _save(tmp_path / "a", whole, [[(0, 4, 0, 8)], [(0, 4, 8, 16)]])
    (tmp_path / "a" / PIECES.format(1)).unlink()
    with pytest.raises(ValueError, match=r"pieces-rank00001.safetensors is missing; the checkpoint is incomplete"):
        Pieces(tmp_path / "a")
    _save(tmp_path / "b", whole, [[(0, 4, 0, 8)], [(0, 4, 9, 16)]])  # element 8 held by no rank
    with pytest.raises(ValueError, match=r"the pieces of 'w' do not cover it; the checkpoint is damaged"):
        whole_tensors(tmp_path / "b")
    _save(tmp_path / "c", whole, [[(0, 4, 0, 16)]])
    assert json.loads((tmp_path / "c" / ENGINE_STATE).read_text()) == {"world_size": 1}
    with pytest.raises(ValueError, match=r"'w' is \[4, 4\] in the checkpoint and \[4, 5\] in the model"):
        Pieces(tmp_path / "c").fill(Held("w", (4, 5), torch.empty(20), 0, 5))
