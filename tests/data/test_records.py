"""Data order, prompt masking and record checks, with hand-derived expectations."""
from __future__ import annotations

import pytest

from elasticrl.data.records import pad_batch, read_jsonl, row_share, sample_indices, tokenize_sft
from elasticrl.world.tokenizer import build_tokenizer


def test_sample_order_is_a_pure_function_of_position():
    n = 10
    first_epoch = sample_indices(n, seed=3, start=0, count=n)
    assert sorted(first_epoch) == list(range(n))  # each record once per epoch
    assert sample_indices(n, 3, 4, 8) == (first_epoch + sample_indices(n, 3, 10, 10))[4:12]
    assert sample_indices(n, 3, 10, n) != first_epoch  # a new permutation each epoch
    assert sample_indices(n, 4, 0, n) != first_epoch
    # data.shuffle: false reads the file in order, epoch after epoch, whatever the seed
    assert sample_indices(4, 3, 2, 7, shuffle=False) == [2, 3, 0, 1, 2, 3, 0]


def test_sft_tokens_mask_the_prompt():
    tok = build_tokenizer()
    ids, plen = tokenize_sft(tok, "1+1=", "2", apply_chat_template=True, max_length=64)
    assert tok.decode(ids) == "<bos><|user|>1+1=<|assistant|>2<eos>"
    assert plen == 7
    batch = pad_batch([ids, ids[:5]], tok.pad_token_id, [plen, 5])
    assert batch["labels"][0].tolist() == [-100] * 7 + [ids[7], tok.eos_token_id]
    assert batch["labels"][1].tolist() == [-100] * 9  # prompt-only and padding carry no loss
    assert batch["attention_mask"].sum(1).tolist() == [9, 5]
    ids, plen = tokenize_sft(tok, "1+1=", "2", True, max_length=5)
    assert len(ids) == 5 and plen == 5


def test_read_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: missing key\(s\) \['response'\]"):
        read_jsonl(p, ("prompt", "response"))
    p.write_text('{"prompt": \n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: not valid JSON"):
        read_jsonl(p)


def test_row_share_splits_evenly_with_the_larger_shares_last():
    # 10 rows over 4 parts: boundaries at 4k*10//4 = 0, 2, 5, 7, 10 -> sizes 2, 3, 2, 3
    shares = [row_share(10, 4, k) for k in range(4)]
    assert [(s.start, s.stop) for s in shares] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert [(s.start, s.stop) for s in (row_share(8, 2, 0), row_share(8, 2, 1))] == [(0, 4), (4, 8)]
    # fewer rows than parts: the first parts are empty, every row is in exactly one share
    assert [list(range(10))[row_share(2, 3, k)] for k in range(3)] == [[], [0], [1]]
