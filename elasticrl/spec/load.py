"""Load a job spec from YAML, apply ``--set`` overrides, validate into the typed tree.

Every error names the field path and what would fix it, e.g.
``train.micro_batch_size: expected an integer >= 1, got -1``.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from elasticrl.files import write_text
from elasticrl.spec import hub
from elasticrl.spec.rules import SpecError, check_rules
from elasticrl.spec.schema import JobSpec


def load_spec(source: str | os.PathLike | dict | None = None, overrides: list[str] = (),
              check_paths: bool = True) -> JobSpec:
    """Build a validated ``JobSpec`` from a YAML file (or dict) plus ``a.b=c`` overrides.
    ``check_paths=False`` skips the checks that model and data paths exist here (planning a
    job for another machine)."""
    spec = _convert(JobSpec, read_raw(source, overrides), "")
    if check_paths:  # where the job runs: models named by Hub id become folders of the Hub cache
        spec = hub.resolve(spec)
    check_rules(spec, check_paths)
    if spec.rewards.verifier == "auto":  # resolved once, so a trainer that swaps the data keeps the user's
        verifier = "math" if spec.data.train else "last_integer" if spec.world.task == "reasoning" else "integer"
        spec = dataclasses.replace(spec, rewards=dataclasses.replace(spec.rewards, verifier=verifier))
    return spec


def read_raw(source: str | os.PathLike | dict | None = None, overrides: list[str] = ()) -> dict:
    """The user's own fields (YAML plus overrides), before defaults and validation."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raw = _read_yaml(Path(source))
    for item in overrides:
        _apply_override(raw, item)
    return raw


def explicit_fields(raw: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every leaf the user wrote (what the planner must not change)."""
    out = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(explicit_fields(value, path + "."))
        else:
            out[path] = value
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"field {key!r} is written twice (first at line {seen[key] + 1}); keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise SpecError("", f"spec file {path} {what}; pass the path of a YAML job spec (see examples/)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"{path}: not a text file (byte {exc.start} is not UTF-8); pass a YAML job spec") from None
    except OSError as exc:
        raise SpecError("", f"{path}: cannot read it ({exc.strerror})") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        raise SpecError("", f"{path}: the spec is empty; write at least the algorithm (algorithm: grpo), "
                            "see examples/")
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
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise SpecError(path, f"expected a list, got {value!r}")
        return [_convert(item, v, f"{path}[{i}]", meta) for i, v in enumerate(value)]
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
        _check_bounds(value, path, meta, "an integer")
        if abs(value) >= 2 ** 63:
            raise SpecError(path, f"expected an integer of at most 63 bits, got {value}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"expected {_bounded('a number', meta)}, got {value!r}")
        if not math.isfinite(value):
            raise SpecError(path, f"expected {_bounded('a finite number', meta)}, got {value!r}")
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


def spec_to_dict(spec) -> dict:
    def plain(v):
        if dataclasses.is_dataclass(v):
            return spec_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return {f.name: plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def dump_spec(spec: JobSpec, path: Path) -> None:
    """Write the resolved spec (defaults filled in) atomically: temp file, then rename."""
    write_text(path, yaml.safe_dump(spec_to_dict(spec), sort_keys=False))


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
        default = spec_to_dict(default) if dataclasses.is_dataclass(default) else default
        if isinstance(default, (list, tuple)):
            default = [spec_to_dict(d) if dataclasses.is_dataclass(d) else d for d in default]
        if isinstance(default, str) and not default.isprintable():  # "\n" as YAML writes it in a spec
            shown = json.dumps(default)
        else:
            shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        rows.append((path, shown, f.metadata.get("doc", "")))
    return rows
