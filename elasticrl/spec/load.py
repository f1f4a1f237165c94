"""Load a job spec from YAML, apply ``--set`` overrides, validate into the typed tree.

Every error names the field path and what would fix it, e.g.
``train.micro_batch_size: expected an integer >= 1, got -1``.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from elasticrl.spec.schema import JobSpec


class SpecError(ValueError):
    """A job spec the loader refuses; ``str()`` is a one-line message for the user."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


def load_spec(source: str | os.PathLike | dict | None = None, overrides: list[str] = ()) -> JobSpec:
    """Build a validated ``JobSpec`` from a YAML file (or dict) plus ``a.b=c`` overrides."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = source
    else:
        raw = _read_yaml(Path(source))
    for item in overrides:
        _apply_override(raw, item)
    spec = _convert(JobSpec, raw, "")
    _check_cross_fields(spec)
    return spec


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise SpecError("", f"spec file {path} not found; pass the path of a YAML job spec "
                            "(see examples/)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError("", f"{path}: the top level must be a mapping of fields, got "
                            f"{type(raw).__name__}")
    return raw


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SpecError("", f"--set {item!r}: expected FIELD.PATH=VALUE, e.g. train.lr=3e-4")
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(".".join(parts[: i + 1]), f"--set {item!r}: this field is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = text


def _type_name(tp) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _convert(tp, value: Any, path: str, meta: dict | None = None) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _convert_section(tp, value, path)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, path, meta)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        shown = ", ".join(repr(c) for c in choices)
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise SpecError(path, f"expected one of {shown}, got {value!r}{extra}")
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise SpecError(path, f"expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]", meta) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"expected {_bounded('an integer', meta)}, got {value!r}")
        return _check_bounds(value, path, meta, "an integer")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"expected {_bounded('a number', meta)}, got {value!r}")
        return _check_bounds(float(value), path, meta, "a number")
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"spec field {path} has an unsupported type {tp!r}")  # a schema bug


def _bounded(kind: str, meta: dict | None) -> str:
    if not meta:
        return kind
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        if kind == "an integer" and lo == 1:
            return "a positive integer"
        return f"{kind} {'>' if meta.get('exclusive_min') else '>='} {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def _check_bounds(value, path, meta, kind):
    if meta:
        lo, hi = meta.get("min"), meta.get("max")
        too_low = lo is not None and (value <= lo if meta.get("exclusive_min") else value < lo)
        if too_low or (hi is not None and value > hi):
            raise SpecError(path, f"expected {_bounded(kind, meta)}, got {value!r}")
    return value


def _convert_section(cls, value: Any, path: str):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise SpecError(path, f"expected a section (mapping of fields), got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            sub = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(fields)}"
            raise SpecError(sub, f"unknown field; {hint}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], sub, dict(f.metadata))
        elif dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _convert_section(hints[name], {}, sub)
    return cls(**kwargs)


def _check_cross_fields(spec: JobSpec) -> None:
    t = spec.train
    if t.num_ranks % t.tp_size:
        raise SpecError("train.tp_size", f"must divide train.num_ranks ({t.num_ranks}), got {t.tp_size}")
    dp = t.num_ranks // t.tp_size
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise SpecError("train.global_batch_size",
                        f"must be a multiple of micro_batch_size x data-parallel ranks = {per_step}, "
                        f"got {t.global_batch_size}; try {max(per_step, t.global_batch_size // per_step * per_step)}")
    if t.offload_params and t.zero_stage != 3:
        raise SpecError("train.offload_params", "needs train.zero_stage: 3 (ZeRO-1/2 keep full "
                                                "parameters on every rank)")
    if t.offload_optimizer and t.zero_stage == 0:
        raise SpecError("train.offload_optimizer", "needs train.zero_stage >= 1")
    bad_ops = set(spec.world.operators) - set("+-*")
    if not spec.world.operators or bad_ops:
        raise SpecError("world.operators", f"expected a non-empty subset of '+-*', got {spec.world.operators!r}")
    if spec.model.path is not None and not Path(spec.model.path).is_dir():
        raise SpecError("model.path", f"{spec.model.path} is not a folder; give a Hugging Face model "
                                      "folder or null for the embedded tiny model")
    for name in ("train", "eval"):
        p = getattr(spec.data, name)
        if p is not None and not Path(p).is_file():
            raise SpecError(f"data.{name}", f"file {p} not found; give a JSON-lines file or null for "
                                            "the embedded data")


def spec_to_dict(spec) -> dict:
    out = {}
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        out[f.name] = spec_to_dict(v) if dataclasses.is_dataclass(v) else (list(v) if isinstance(v, tuple) else v)
    return out


def dump_spec(spec: JobSpec, path: Path) -> None:
    """Write the resolved spec (defaults filled in) atomically: temp file, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(spec_to_dict(spec), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def describe(cls=JobSpec, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, default, doc) for every leaf field: the spec reference."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], path + ".")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        shown = yaml.safe_dump(list(default) if isinstance(default, tuple) else default,
                               default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((path, shown, f.metadata.get("doc", "")))
    return rows
