"""Data order, prompt masking and record checks, with hand-derived expectations."""
from __future__ import annotations

import json

import pytest

from elasticrl.data.records import (
    format_prompt,
    pad_batch,
    read_records,
    row_share,
    sample_indices,
    sft_example,
    tokenize_sft,
)
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
    ids, trained = tokenize_sft(tok, "1+1=", "2", apply_chat_template=True, max_length=64)
    assert tok.decode(ids) == "<bos><|user|>1+1=<|assistant|>2<eos>"
    assert trained == [False] * 7 + [True] * 2
    batch = pad_batch([ids, ids[:5]], tok.pad_token_id, [trained, trained[:5]])
    assert batch["labels"][0].tolist() == [-100] * 7 + [ids[7], tok.eos_token_id]
    assert batch["labels"][1].tolist() == [-100] * 9  # prompt-only and padding carry no loss
    assert batch["attention_mask"].sum(1).tolist() == [9, 5]
    ids, trained = tokenize_sft(tok, "1+1=", "2", True, max_length=5)
    assert len(ids) == 5 and trained == [False] * 5


class _Data:  # the data section's keys, as the spec has them
    prompt_key, response_key, messages_key, answer_key, apply_chat_template, max_length = \
        "prompt", "response", "messages", "answer", True, 64


def test_a_conversation_trains_on_its_assistant_turns_only():
    tok = build_tokenizer()
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    ids, trained = sft_example(tok, {"messages": chat}, _Data)
    # <bos><|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>4<eos>: one token per character
    # or special; the template's <|assistant|> opener is the prompt's, the answer and its <eos> train
    assert tok.decode(ids) == "<bos><|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>4<eos>"
    assert [i for i, t in enumerate(trained) if t] == [7, 8, 15, 16]
    assert tok.decode([ids[i] for i in (7, 8, 15, 16)]) == "2<eos>4<eos>"
    # as an RL or evaluation prompt the conversation stops before its last assistant turn
    assert format_prompt(tok, chat, True) == "<bos><|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>"
    with pytest.raises(ValueError, match="data.apply_chat_template: false"):
        format_prompt(tok, chat, False)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; set data.chat_template"):
        format_prompt(tok, "1+1=", True)


def test_every_data_format_reads_the_same_rows(tmp_path):
    import datasets
    import pandas as pd

    rows = [{"prompt": "a", "answer": "1/2"}, {"prompt": "b", "answer": "x"}, {"prompt": "c", "answer": "3y"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    for name in ("d.jsonl", "d.json", "d.parquet", "d.csv", "saved", "splits"):
        got = read_records(tmp_path / name, ("prompt", "answer"))
        assert [got[i] for i in range(len(got))] == rows, name
        assert [got[1:][i] for i in range(2)] == rows[1:] and got[::2][1] == rows[2]


def test_data_errors_name_the_source_the_row_and_the_field(tmp_path):
    import pandas as pd

    pd.DataFrame([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet: row 2: no value for 'answer'"):
        read_records(tmp_path / "d.parquet", ("prompt", "answer"))
    with pytest.raises(ValueError, match=r"d.parquet: no field 'question'; set data.\*_key .* \['answer', 'prompt'\]"):
        read_records(tmp_path / "d.parquet", ("question",))
    # a row needs its messages or its prompt: either will do
    assert len(read_records(tmp_path / "d.parquet", (("messages", "prompt"),))) == 2
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"d.txt: unknown format '.txt'; use one of .jsonl"):
        read_records(tmp_path / "d.txt")
    with pytest.raises(ValueError, match=r"nothing.parquet: not found"):
        read_records(tmp_path / "nothing.parquet")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"folder: not a dataset folder"):
        read_records(tmp_path / "folder")
    with pytest.raises(ValueError, match=r"hf://gsm8k: not a Hub dataset name; write hf://ORG/NAME"):
        read_records("hf://gsm8k")


def test_read_records_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: missing key\(s\) \['response'\]"):
        read_records(p, ("prompt", "response"))
    p.write_text('{"prompt": \n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: not valid JSON"):
        read_records(p)


def test_row_share_splits_evenly_with_the_larger_shares_last():
    # 10 rows over 4 parts: boundaries at 4k*10//4 = 0, 2, 5, 7, 10 -> sizes 2, 3, 2, 3
    shares = [row_share(10, 4, k) for k in range(4)]
    assert [(s.start, s.stop) for s in shares] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert [(s.start, s.stop) for s in (row_share(8, 2, 0), row_share(8, 2, 1))] == [(0, 4), (4, 8)]
    # fewer rows than parts: the first parts are empty, every row is in exactly one share
    assert [list(range(10))[row_share(2, 3, k)] for k in range(3)] == [[], [0], [1]]
