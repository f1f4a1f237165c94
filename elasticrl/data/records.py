"""Reading datasets, formatting prompts and conversations, and a resumable sample order.

``data.train`` / ``data.eval`` may be a JSON-lines, JSON, parquet or CSV file, a folder that
``datasets.save_to_disk`` wrote, or a Hub dataset (``hf://ORG/NAME[:CONFIG][/SPLIT]``); all
are loaded with the ``datasets`` library, whose Arrow files are memory-mapped, so a large file
is not copied into every process. A row's prompt is a string (``data.prompt_key``) or a list
of chat messages (``data.messages_key``), rendered with the tokenizer's chat template.

The order of samples is a pure function of (seed, global sample index): step ``s`` of a
run with global batch ``B`` reads samples ``s*B .. s*B+B-1`` of an endless stream of
seeded epoch permutations. A resumed run (at any world size) therefore continues exactly
where it stopped, with nothing but the step number saved.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from elasticrl.files import write_text

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HUB = re.compile(r"hf://(?P<repo>[^/:]+/[^/:]+)(?::(?P<config>[^/]+))?(?:/(?P<split>[^/]+))?$")
Fields = tuple  # each item a key, or a tuple of keys any one of which will do (prompt or messages)


class Records(Sequence):
    """The rows of a dataset as dicts (a key whose value is null is left out, as if the row
    had none); indexing with a slice gives Records again."""

    def __init__(self, dataset, source: str):
        self.dataset, self.source = dataset, source

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Records(self.dataset.select(range(len(self))[i]), self.source)
        return {k: v for k, v in self.dataset[int(i)].items() if v is not None}


# What a row's field holds, by kind: the test of a JSON value, the test of an Arrow column
# type, and how an error says it.
KINDS = {
    "text": (lambda v: isinstance(v, str), lambda t: _pa().types.is_string(t) or _pa().types.is_large_string(t),
             "text"),
    "messages": (lambda v: isinstance(v, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                       and isinstance(m.get("content"), str) for m in v),
                 lambda t: (_pa().types.is_list(t) or _pa().types.is_large_list(t))
                 and _pa().types.is_struct(t.value_type)
                 and {"role", "content"} <= {f.name for f in t.value_type},
                 "a list of chat messages ({role, content})"),
    "label": (lambda v: isinstance(v, (bool, int, float)), lambda t: _pa().types.is_boolean(t)
              or _pa().types.is_integer(t) or _pa().types.is_floating(t), "true/false (or 1/0)"),
}


def _pa():
    import pyarrow

    return pyarrow


def field_kinds(data) -> dict[str, tuple[str, str]]:
    """The spec's data fields: row key -> (its kind in KINDS, the spec field that names it).
    A reference answer has no kind here: what it may be is the verifier's (a JSON schema is
    an object, a regex text)."""
    kinds = {"prompt_key": "text", "messages_key": "messages", "response_key": "text", "chosen_key": "text",
             "rejected_key": "text", "label_key": "label"}
    return {getattr(data, name): (kind, f"data.{name}") for name, kind in kinds.items()}


def read_records(source: str | Path, required: Fields = (), check: bool = False, data=None) -> Records:
    """The rows of ``source`` (a file, a saved folder or ``hf://...``), each with the
    ``required`` fields, else a ValueError naming the source, the row and the field; with
    ``data`` (the spec's data section) their values also of the kind each holds (text, chat
    messages, ...). ``check``: a JSON-lines file is first read line by line, so that a bad
    line is named (the drivers check the user's files so before any worker starts; Arrow's
    reader would take text that is not UTF-8)."""
    source = str(source)
    jsonl = Path(source).suffix == ".jsonl"
    kinds = field_kinds(data) if data is not None else {}
    if check and jsonl:
        check_jsonl(source, required, kinds)
    try:
        dataset = _load(source)
        problem = _missing(dataset, required) or _mistyped(dataset, required, kinds)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        if jsonl:
            check_jsonl(source, required, kinds)  # names the line when it is one
        raise ValueError(f"{source}: {problem}")
    return Records(dataset, source)


def _keys(required: Fields) -> list[str]:
    return [k for want in required for k in (want if isinstance(want, tuple) else (want,))]


def _mistyped(dataset, required: Fields, kinds: dict) -> str | None:
    """A required column whose type is not its field's kind, with its first row that has a value."""
    for key in _keys(required):
        if key in kinds and key in dataset.column_names:
            kind, field = kinds[key]
            _, of_type, what = KINDS[kind]
            if not of_type(dataset.features.arrow_schema.field(key).type):
                column = dataset[key]
                row = next(i for i, v in enumerate(column) if v is not None)
                return f"row {row + 1}: {_wrong(key, column[row], what, field)}"
    return None


def _wrong(key: str, value, what: str, field: str) -> str:
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{key!r} is {shown}; expected {what} ({field}: set it to the field that holds that)"


def _load(source: str):
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors become ours, in one line
    hub = HUB.match(source)
    path = Path(source)
    try:
        if hub:
            return datasets.load_dataset(hub["repo"], hub["config"], split=hub["split"] or "train")
        if source.startswith("hf://"):
            raise ValueError("not a Hub dataset name; write hf://ORG/NAME, hf://ORG/NAME:CONFIG or "
                             "hf://ORG/NAME:CONFIG/SPLIT")
        if path.is_dir():
            if not any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
                raise ValueError("not a dataset folder (none of the files datasets.save_to_disk writes); give a "
                                 "data file or such a folder")
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(f"holds the splits {sorted(loaded)} and no 'train'; give the split's "
                                     f"folder ({path}/{sorted(loaded)[0]})")
                loaded = loaded["train"]
            return loaded
        if not path.is_file():
            raise ValueError("not found; give a JSON-lines, JSON, parquet or CSV file, a datasets.save_to_disk "
                             "folder, or hf://ORG/NAME")
        if path.suffix not in FORMATS:
            raise ValueError(f"unknown format {path.suffix or '(no suffix)'!r}; use one of "
                             f"{', '.join(FORMATS)} or a datasets.save_to_disk folder")
        if path.stat().st_size == 0:
            raise ValueError("no records")
        return datasets.load_dataset(FORMATS[path.suffix], data_files=str(path), split="train")
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets, pyarrow and the hub raise many kinds: one line says which
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"cannot load it ({type(exc).__name__}: {first})") from None


def _missing(dataset, required: Fields) -> str | None:
    """What a dataset lacks of ``required``: a column, or a row without a value in it."""
    import pyarrow.compute as pc

    if len(dataset) == 0:
        return "no records"
    have = set(dataset.column_names)
    for want in required:
        options = want if isinstance(want, tuple) else (want,)
        present = [k for k in options if k in have]
        if not present:
            names = " or ".join(repr(k) for k in options)
            return (f"no field {names}; set data.*_key in the spec to the names your data uses (it has "
                    f"{sorted(have)})")
        table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
        nulls = None
        for k in present:
            col = pc.is_null(table.column(k))
            nulls = col if nulls is None else pc.and_(nulls, col)
        first = pc.index(nulls, True).as_py()
        if first >= 0:
            names = " or ".join(repr(k) for k in present)
            return f"row {first + 1}: no value for {names}"
    return None


def check_jsonl(path: str | Path, required: Fields = (), kinds: dict | None = None) -> None:
    """Check a JSON-lines file line by line (read as a stream), naming the first bad line:
    JSON objects with the ``required`` fields, each of its kind (``field_kinds``)."""
    kinds = kinds or {}
    typed = [(k, *kinds[k]) for k in _keys(required) if k in kinds]
    count = 0
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start} of the line); save the file "
                                 "as UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object (one record per line), got "
                                 f"{type(rec).__name__} {line.strip()[:40]}")
            missing = [k if isinstance(k, str) else " or ".join(k) for k in required
                       if all(rec.get(o) is None for o in ((k,) if isinstance(k, str) else k))]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing key(s) {missing}; set data.*_key in the "
                                 f"spec to the names your file uses (it has {sorted(rec)})")
            for key, kind, field in typed:
                if rec.get(key) is not None and not KINDS[kind][0](rec[key]):
                    raise ValueError(f"{path}:{lineno}: {_wrong(key, rec[key], KINDS[kind][2], field)}")
            count += 1
    if not count:
        raise ValueError(f"{path}: no records")


def prompt_of(record: dict, data) -> str | list[dict]:
    """A row's prompt: its chat messages (``data.messages_key``) when it has them, else its
    prompt text (``data.prompt_key``)."""
    return record[data.messages_key] if data.messages_key in record else record[data.prompt_key]


def prompt_text(record: dict, data) -> str:
    """What reward functions and verifiers see of a row's prompt: its text, or the content of
    its conversation's last user turn."""
    if data.messages_key not in record:
        return record[data.prompt_key]
    return next((m["content"] for m in reversed(record[data.messages_key]) if m["role"] == "user"), "")


def prompt_answer(data) -> Fields:
    """The fields a row of prompts with reference answers needs (RL, rounds, evaluation)."""
    return (data.prompt_key, data.messages_key), data.answer_key


def sft_fields(data) -> Fields:
    """An SFT row: a conversation, or a prompt and its response."""
    return (data.prompt_key, data.messages_key), (data.response_key, data.messages_key)


def sft_example(tokenizer, record: dict, data) -> tuple[list[int], list[bool]]:
    """An SFT row's token ids and which of them train (``tokenize_sft``)."""
    if data.messages_key in record:
        return tokenize_sft(tokenizer, record[data.messages_key], None, data.apply_chat_template, data.max_length)
    return tokenize_sft(tokenizer, record[data.prompt_key], record[data.response_key], data.apply_chat_template,
                        data.max_length)


def format_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool) -> str:
    """The text the model continues: a prompt string, or a conversation up to its last user
    turn (a final assistant turn, the reference answer, is left out), in the chat template
    with the generation prompt, or the plain string when ``apply_chat_template`` is off."""
    if isinstance(prompt, str):
        if not apply_chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif not apply_chat_template:
        raise ValueError("data.apply_chat_template: false, but the rows are chat messages, which only a chat "
                         "template can render; turn it on")
    if prompt and prompt[-1].get("role") == "assistant":
        prompt = prompt[:-1]
    return render_chat(tokenizer, prompt, add_generation_prompt=True)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                         "set data.chat_template (a Jinja template, or the path of a .jinja file), or "
                         "data.apply_chat_template: false for plain-text prompts")
    return tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                         tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_sft(tokenizer, prompt: str | list[dict], response: str | None, apply_chat_template: bool,
                 max_length: int) -> tuple[list[int], list[bool]]:
    """Token ids of an SFT example and which of them the loss trains on: prompt + response +
    eos (the response's tokens), or a conversation (``response`` None) in the chat template,
    each assistant turn's tokens (with the template's end-of-turn) and nothing else."""
    if isinstance(prompt, list) and response is None:
        ids, trained = _conversation(tokenizer, prompt)
    else:
        text = format_prompt(tokenizer, prompt, apply_chat_template)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, trained = prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids)
    return ids[:max_length], trained[:max_length]


def _conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Each turn's tokens are what the template adds for it: the text of the conversation up to
    the turn minus the text before it (the template must render a conversation as the
    rendering of its first turns followed by more)."""
    ids: list[int] = []
    trained: list[bool] = []
    text = ""
    for i, m in enumerate(messages):
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=m["role"] == "assistant") if i else ""
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(text) or not upto.startswith(before):
            raise ValueError("the chat template does not render a conversation as its first turns followed by the "
                             "next, so the assistant turns cannot be told apart; set data.chat_template")
        for piece, is_assistant in ((before[len(text):], False), (upto[len(before):], m["role"] == "assistant")):
            new = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += new
            trained += [is_assistant] * len(new)
        text = upto
    return ids, trained


def write_jsonl(path: str | Path, rows: list[dict]) -> str:
    """One JSON object per line, written atomically (temp name, then rename); returns the path."""
    return str(write_text(path, "".join(json.dumps(r) + "\n" for r in rows)))


def sample_indices(num_records: int, seed: int, start: int, count: int, shuffle: bool = True) -> list[int]:
    """Global sample positions [start, start+count) mapped to record indices: each epoch a
    seeded permutation, or (``shuffle=False``, ``data.shuffle``) the records in file order."""
    if not shuffle:
        return [pos % num_records for pos in range(start, start + count)]
    out = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, num_records)
        perm = _epoch_permutation(num_records, seed, epoch)
        out.append(int(perm[offset]))
    return out


def row_share(num_rows: int, num_parts: int, part: int) -> slice:
    """Part ``part`` of ``num_rows`` rows split over ``num_parts`` as evenly as possible (later
    parts get the larger shares): the one rule by which ranks and engines divide a batch."""
    return slice(part * num_rows // num_parts, (part + 1) * num_rows // num_parts)


_perm_cache: dict[tuple[int, int, int], torch.Tensor] = {}


def _epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        if len(_perm_cache) > 4:
            _perm_cache.clear()
        _perm_cache[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return _perm_cache[key]


def pad_batch(seqs: list[list[int]], pad_id: int, trained: list[list[bool]] | None = None):
    """Right-padded ``input_ids``, ``attention_mask`` and loss ``labels`` (-100 = no loss).

    Labels keep the tokens ``trained`` marks (the responses, the assistant turns; all
    tokens when it is None) and mask the rest and the padding.
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids = torch.tensor(s)
        input_ids[i, : len(s)] = ids
        attention_mask[i, : len(s)] = 1
        keep = torch.tensor(trained[i], dtype=torch.bool) if trained else torch.ones(len(s), dtype=torch.bool)
        labels[i, : len(s)] = torch.where(keep, ids, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
