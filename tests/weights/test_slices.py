"""Slice-to-slice pieces: boxes of narrow views, pieces that reshard AutoTP slices into a vLLM
worker's fused and sliced parameters, buckets, and the balance of senders. Expectations are
worked out by hand in the comments; the resharding cases are also checked against replaying
the whole tensor through the same plan (the gathered path)."""
from __future__ import annotations

import pytest
import torch

from elasticrl.weights.plan import Arena, replay
from elasticrl.weights.slices import Layout, assign, buckets, receive_order, view_box, worker_pieces
from elasticrl.weights.transports.shm import write_piece


def test_a_narrow_view_is_a_box_and_a_transpose_is_not():
    # a 4x6 tensor: rows 2..3 start at element 2*6 = 12; columns 3..5 start at element 3
    assert view_box((4, 6), 12, (2, 6), (6, 1)) == ((2, 4), (0, 6))
    assert view_box((4, 6), 3, (4, 3), (6, 1)) == ((0, 4), (3, 6))
    assert view_box((4, 6), 0, (6, 4), (1, 6)) is None  # the transpose
    assert view_box((4, 6), 18, (2, 6), (6, 1)) is None  # rows 3..4 run past the end


def _copy(param, dst_off, dst_shape, src_off, src_shape, full_cols):
    """A vLLM-style copy: a contiguous destination block from a narrow of a row-major tensor."""
    dst_strides = [dst_shape[1], 1] if len(dst_shape) == 2 else [1]
    src_strides = [full_cols, 1] if len(src_shape) == 2 else [1]
    return ("copy", param, dst_off, dst_shape, dst_strides, "float32", src_off, src_shape, src_strides)


def _apply(pieces_by_rank, locals_by_rank, sizes):
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    arena = Arena(buf, [sum(sizes[:i]) for i in range(len(sizes))])
    sent = [0] * len(pieces_by_rank)
    for k, pieces in enumerate(pieces_by_rank):
        for piece in pieces:
            sent[k] += write_piece(arena, piece, locals_by_rank[k][piece.name])
    return buf.view(torch.float32), sent


def test_two_autotp_slices_fill_one_fused_qkv_and_half_a_row_parallel_weight_each():
    # Trainer T=2: q (4x3) and k (2x3) are column-parallel (rows cut 2+2 and 1+1), o (3x4) is
    # row-parallel (columns cut 2+2). Worker T'=1 fuses qkv as rows [q; k] (6x3, param 0) and
    # holds o whole (param 1, from byte 72).
    q, k, o = torch.arange(12.).view(4, 3), 100 + torch.arange(6.).view(2, 3), 200 + torch.arange(12.).view(3, 4)
    layouts = {"q": Layout((4, 3), 0, (2, 2)), "k": Layout((2, 3), 0, (1, 1)), "o": Layout((3, 4), 1, (2, 2))}
    plans = {"q": [_copy(0, 0, [4, 3], 0, [4, 3], 3)], "k": [_copy(0, 48, [2, 3], 0, [2, 3], 3)],
             "o": [_copy(1, 0, [3, 4], 0, [3, 4], 4)]}
    load = [0, 0]
    pieces = worker_pieces(plans, layouts, 2, load)
    # rank 1's q rows 2..3 land at row 2 of the fused weight: byte 2*3*4 = 24; its k row at
    # fused row 5: byte 48 + 12 = 60; its o columns 2..3 at byte 2*4 = 8, strides of a 3x4
    assert [(p.name, p.shape, p.src_off, p.dst_off) for p in pieces[1]] == [
        ("q", (2, 3), 0, 24), ("k", (1, 3), 0, 60), ("o", (3, 2), 0, 8)]
    assert load == [4 * (6 + 3 + 6)] * 2  # each rank sends exactly its slices: 15 floats
    local = [{"q": q[2 * r:2 * r + 2].clone(), "k": k[r:r + 1].clone(), "o": o[:, 2 * r:2 * r + 2].clone()}
             for r in range(2)]
    got, sent = _apply(pieces, local, [72, 48])
    want = torch.zeros(30).view(torch.uint8)
    whole = Arena(want, [0, 72])
    for name, t in (("q", q), ("k", k), ("o", o)):
        replay(plans[name], t, whole)
    assert torch.equal(got, want.view(torch.float32)) and sent == [60, 60]


def test_one_sender_feeds_two_workers_half_a_row_parallel_weight_each():
    # Trainer T=1 holds o (2x4) whole; worker r of T'=2 copies columns 2r..2r+1 (a narrow at
    # element offset 2r) into its 2x2 parameter.
    o = torch.arange(8.).view(2, 4)
    layouts = {"o": Layout((2, 4))}
    for r in range(2):
        [[piece]] = worker_pieces({"o": [_copy(0, 0, [2, 2], 2 * r, [2, 2], 4)]}, layouts, 1, [0])
        assert (piece.src_off, piece.src_strides, piece.shape) == (2 * r, (4, 1), (2, 2))
        got, sent = _apply([[piece]], [{"o": o}], [16])
        assert got.tolist() == o[:, 2 * r:2 * r + 2].flatten().tolist() and sent == [16]


def test_autotp_two_into_four_sends_each_worker_one_piece_from_one_rank():
    # q 8x2 cut 4+4 on the trainer, 2+2+2+2 on the engine: worker w's rows 2w..2w+1 lie in rank w // 2
    layouts = {"q": Layout((8, 2), 0, (4, 4))}
    for w in range(4):
        pieces = worker_pieces({"q": [_copy(0, 0, [2, 2], 4 * w, [2, 2], 2)]}, layouts, 2, [0, 0])
        owner = w // 2
        assert [len(p) for p in pieces] == [int(owner == 0), int(owner == 1)]
        assert pieces[owner][0].src_off == (w % 2) * 4  # row 2w - 4*owner of the local 4x2 slice


def test_whole_tensors_go_to_the_least_loaded_sender_and_fills_to_one():
    layouts = {"a": Layout((4,)), "b": Layout((4,)), "c": Layout((2,))}
    plans = {n: [_copy(i, 0, [s], 0, [s], 0)] for i, (n, s) in enumerate((("a", 4), ("b", 4), ("c", 2)))}
    plans["c"].append(("fill", 2, 8, [2], [1], "float32", 0.0, [], []))
    load = [0, 0]
    pieces = worker_pieces(plans, layouts, 2, load)
    # a -> rank 0 (tie), b -> rank 1, c -> rank 0 again (both at 16 bytes, tie to the lower)
    assert [[p.name for p in ps] for ps in pieces] == [["a", "c", "c"], ["b"]]
    assert load == [24, 16] and pieces[0][2].fill == 0.0


def test_buckets_keep_order_align_pieces_and_the_receiver_waits_by_last_tensor():
    layouts = {n: Layout((s,)) for n, s in (("a", 3), ("b", 20), ("c", 5))}
    plans = {n: [_copy(i, 0, [lay.full_shape[0]], 0, [lay.full_shape[0]], 0)]
             for i, (n, lay) in enumerate(layouts.items())}
    [mine] = worker_pieces(plans, layouts, 1, [0])
    # 64-byte buckets: a (12 B) at 0; b (80 B) does not fit after it: its own bucket; c at 0 of a third
    packed = buckets(mine, 64)
    assert [[(p.name, off) for p, off in b] for b in packed] == [[("a", 0)], [("b", 0)], [("c", 0)]]
    # 160-byte buckets: b fits at 64 (ends at 144); c would start at 192: a second bucket
    assert [[(p.name, off) for p, off in b] for b in buckets(mine, 160)] == [[("a", 0), ("b", 64)], [("c", 0)]]
    queue, fills = receive_order({7: mine[:1], 3: mine[1:]}, {"a": 0, "b": 1, "c": 2}, 64)
    assert [(sender, b[-1][0].name, n) for sender, b, n in queue] == [(7, "a", 12), (3, "b", 80), (3, "c", 20)]
    assert fills == []


def test_engines_go_to_replicas_biggest_first_balancing_bytes():
    assert assign([10, 10, 10], 2) == [0, 1, 0]
    # 30 (engine 1) -> replica 0; 20 -> 1; 10 -> 1 (20 < 30); 5 -> 0 (30 = 30, the lower)
    assert assign([5, 30, 20, 10], 2) == [0, 0, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn])
def test_changed_units_match_a_unit_by_unit_comparison_across_chunks_and_sizes(monkeypatch, dtype):
    """Chunk by chunk (chunks of 64 bytes here, so a tensor spans many), on ragged sizes (whole
    8-byte words where the size allows, else single elements), sign-only changes (-0.0) and
    NaNs: the indices are exactly those a unit-wise bit comparison finds, the values those
    units' elements, ``old`` ends equal to ``new`` bit for bit, and past the limit the answer is
    None with ``old`` whole all the same."""
    from elasticrl.weights import slices

    monkeypatch.setattr(slices, "CHUNK_BYTES", 64)
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    for numel in (1, 7, 64, 1001, 4096):
        k = slices.unit(numel, size)
        assert k == (8 // size if numel % (8 // size) == 0 else 1)
        old = torch.randn(numel, generator=g).to(dtype)
        new = old.clone()
        flip = torch.randperm(numel, generator=g)[: max(1, numel // 50)]
        new[flip] = torch.randn(len(flip), generator=g).to(dtype)
        if dtype != torch.float8_e4m3fn:
            new[flip[:1]] = -old[flip[:1]]  # a change of sign alone
        if dtype.is_floating_point and numel > 3 and dtype != torch.float8_e4m3fn:
            new[2] = float("nan")
        bits = slices.BITS[size * k]
        expected = (new.view(bits) != old.view(bits)).nonzero().view(-1)
        index, values = slices.changed_units(new, old, numel)
        assert index.dtype == torch.int32 and torch.equal(index.long(), expected), numel
        assert torch.equal(values.view(bits), new.view(bits)[expected])
        assert torch.equal(old.view(bits), new.view(bits))
        if len(expected) > 1:  # the same change, now past a limit below its size
            old.zero_()
            again = (new.view(bits) != old.view(bits)).sum().item()
            assert slices.changed_units(new, old, again - 1) is None
            assert torch.equal(old.view(bits), new.view(bits))


def test_a_packed_delta_sends_the_changed_words_against_what_was_sent_last():
    """What a sender sends where it cannot read the engine (broadcast, ipc, files): the first time
    whole (count -1, 24 bf16 = 48 bytes); then, against what it sent, the 2 words (4 bf16 each)
    holding the changed elements 7 and 20, as int32 word indices [1, 5] then the words' 8
    values (2 x 12 = 24 bytes); receivers' strided (a transposed parameter), contiguous and
    off-word views end equal to the source cast, bit for bit. A source that starts off a
    word is compared from an aligned copy."""
    from elasticrl.weights.slices import Delta, unpack

    src, held, delta = torch.zeros(4, 6), {}, Delta()
    src[0, 0] = 3.0
    out = torch.zeros(64, dtype=torch.uint8)
    param = torch.full((6, 4), 9.0, dtype=torch.bfloat16)
    flat = torch.full((25,), 9.0, dtype=torch.bfloat16)  # [1:] starts off a word
    assert delta.pack(held, "w", src, torch.bfloat16, out) == (-1, 48)
    for dst in (param.t(), flat[1:].view(4, 6)):
        assert unpack(dst, out, -1) == 48 and torch.equal(dst, src.to(torch.bfloat16))
    src[1, 1], src[3, 2] = 0.5, -0.0  # flat 1 * 6 + 1 = 7 and 3 * 6 + 2 = 20
    out.zero_()
    assert delta.pack(held, "w", src, torch.bfloat16, out) == (2, 24)
    cast = src.to(torch.bfloat16).view(-1)
    assert out[:8].view(torch.int32).tolist() == [1, 5]
    assert torch.equal(out[8:24].view(torch.int16), torch.cat([cast[4:8], cast[20:24]]).view(torch.int16))
    assert (delta.changed, delta.total) == (24 + 8, 48)
    words = torch.full((4, 6), 9.0, dtype=torch.bfloat16)
    for dst in (param.t(), flat[1:].view(4, 6), words):
        if dst is words:  # a contiguous worker view on a word: written word by word
            dst.view(-1)[4:8], dst.view(-1)[20:24] = 1.0, 1.0
            dst.view(-1)[:4], dst.view(-1)[8:20] = cast[:4], cast[8:20]
        assert unpack(dst, out, 2) == 24
        assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(held["w"], src.to(torch.bfloat16))
    odd = torch.arange(13, dtype=torch.float32)[1:].view(3, 4)  # a trainer slice off a word
    held, out = {}, torch.zeros(96, dtype=torch.uint8)
    delta.pack(held, "odd", odd, torch.bfloat16, out)
    moved = odd.clone()
    moved[2, 3] = -5.0
    assert delta.pack(held, "odd", moved, torch.bfloat16, out) == (1, 16)  # word 2 of 3; its index padded to 8 bytes
    assert out[:4].view(torch.int32).tolist() == [2]


def test_a_file_delta_lands_through_the_copy_plans_in_the_fused_and_sliced_parameters():
    """A 4 x 3 tensor whose rows 0-1 and 2-3 land in two parameters (as a TP 2 slice, or q and k
    into one fused qkv): a change at (1, 2) and (2, 0) goes as the two words (of 2 fp32) that hold
    them, which land at (1, 1)-(1, 2) of the first and (0, 0)-(0, 1) of the second, the unchanged
    elements with their own values; the first plan's padding fill is left alone; a third
    parameter taking columns 1-2 (a box that is not one run of the tensor) gets its part of the
    same words element by element."""
    from elasticrl.weights.slices import Delta
    from elasticrl.weights.transports.files import DELTA_KEYS, file_delta, replay_delta

    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    held, delta = {}, Delta()
    assert set(file_delta(delta, held, "w", full, "float32")) == {"w"}
    params = [torch.zeros(3, 3), torch.zeros(2, 3), torch.zeros(4, 2)]
    plans = [("copy", 0, 0, [2, 3], [3, 1], "float32", 0, [2, 3], [3, 1]),
             ("fill", 0, 24, [1, 3], [3, 1], "float32", 0.0, [], []),
             ("copy", 1, 0, [2, 3], [3, 1], "float32", 6, [2, 3], [3, 1]),
             ("copy", 2, 0, [4, 2], [2, 1], "float32", 1, [4, 2], [3, 1])]  # columns 1-2: element by element
    new = full.clone()
    new[1, 2], new[2, 0] = -1.0, -2.0
    sent = file_delta(delta, held, "w", new, "float32")
    # the words (2 fp32 each) holding (1, 2) and (2, 0): elements 4-5 and 6-7
    assert sent["w" + DELTA_KEYS[0]].tolist() == [2, 3] and sent["w" + DELTA_KEYS[1]].tolist() == [4.0, -1.0, -2.0, 7.0]

    def view(param, offset, shape, strides):
        return params[param].as_strided(shape, strides, offset // 4)
    replay_delta(plans, *(sent["w" + k] for k in DELTA_KEYS), view)
    assert params[0].tolist() == [[0, 0, 0], [0, 4.0, -1.0], [0, 0, 0]]
    assert params[1].tolist() == [[-2.0, 7.0, 0], [0, 0, 0]]
    new[3, 2] = -3.0  # one word (an odd count: its index padded in the packing, not in the file)
    sent = file_delta(delta, held, "w", new, "float32")
    assert sent["w" + DELTA_KEYS[0]].tolist() == [5] and sent["w" + DELTA_KEYS[1]].tolist() == [10.0, -3.0]
    replay_delta(plans, *(sent["w" + k] for k in DELTA_KEYS), view)
    assert params[1].tolist() == [[-2.0, 7.0, 0], [0, 10.0, -3.0]]
    assert params[2].tolist() == [[0, 0], [4.0, -1.0], [7.0, 0], [10.0, -3.0]]
    sent = file_delta(delta, held, "w", new, "float32")  # nothing changed since: an empty delta
    assert sent["w" + DELTA_KEYS[0]].numel() == 0 == sent["w" + DELTA_KEYS[1]].numel()
    replay_delta(plans, *(sent["w" + k] for k in DELTA_KEYS), view)
    assert params[2].tolist() == [[0, 0], [4.0, -1.0], [7.0, 0], [10.0, -3.0]]
