"""Conditional SFT (SteerLM style): fine-tune on responses of every quality, each prompt
carrying its response's attribute scores, then generate with the scores you ask for.

Variant: the attributes are written in front of the prompt as ``[name:value,...] `` (names
sorted), and plain SFT trains on that (``algorithm: sft``'s loss and ranks). Lines of
``data.train`` hold the prompt, the response and ``conditional.attributes_key`` (a JSON
object of scores); without ``data.train``, the tiny world's SFT answers and the chosen
answers of its preference pairs score ``quality:1`` and the rejected near misses
``quality:0``. Held-out
prompts are evaluated with ``conditional.eval_attributes``, and at the end also with
``conditional.compare_attributes``: the gap shows the model follows the condition.

Run it:
  CPU:          elasticrl run examples/tiny_conditional_sft.yaml --output runs/csft
  workstation:  the same with --set train.num_ranks=4
"""
from __future__ import annotations

import json
from pathlib import Path

from elasticrl import run_folder as rf
from elasticrl.data.records import read_records, write_jsonl
from elasticrl.spec import JobSpec
from elasticrl.spec.rules import parse_attributes
from elasticrl.trainers.loop import check_user_files, data_paths
from elasticrl.world import world_paths


def condition(prompt: str, attributes: dict) -> str:
    return "[" + ",".join(f"{k}:{attributes[k]}" for k in sorted(attributes)) + "] " + prompt


def conditioned_data(spec: JobSpec, folder: Path) -> tuple[str, str, str]:
    """Training lines with their attributes in the prompt, and the eval prompts under the
    requested and the compared attributes: three JSON-lines files in ``folder``."""
    d, c = spec.data, spec.conditional
    if d.train is None:
        world = world_paths(spec.world)  # the world's right answers score quality 1, its near misses 0
        pairs = read_records(world["preference"], (d.prompt_key, d.chosen_key, d.rejected_key))
        sft = read_records(world["sft"], (d.prompt_key, d.response_key))
        train = [{d.prompt_key: condition(x[d.prompt_key], {"quality": 1}), d.response_key: x[d.response_key]}
                 for x in sft]
        train += [{d.prompt_key: condition(p[d.prompt_key], {"quality": q}), d.response_key: p[key]}
                  for p in pairs for key, q in ((d.chosen_key, 1), (d.rejected_key, 0))]
    else:
        lines = read_records(d.train, (d.prompt_key, d.response_key, c.attributes_key), check=True)
        for i, line in enumerate(lines):
            if not isinstance(line[c.attributes_key], dict):
                raise ValueError(f"{d.train}: line {i + 1}: {c.attributes_key!r} must be a JSON object of scores")
        train = [{d.prompt_key: condition(x[d.prompt_key], x[c.attributes_key]), d.response_key: x[d.response_key]}
                 for x in lines]
    evals = read_records(data_paths(spec, "sft", "eval")["eval"], (d.prompt_key, d.answer_key))
    want = parse_attributes(c.eval_attributes, "conditional.eval_attributes")
    other = parse_attributes(c.compare_attributes, "conditional.compare_attributes")
    return (write_jsonl(folder / "train.jsonl", train),
            write_jsonl(folder / "eval.jsonl", [{**e, d.prompt_key: condition(e[d.prompt_key], want)} for e in evals]),
            write_jsonl(folder / "compare.jsonl",
                        [{**e, d.prompt_key: condition(e[d.prompt_key], other)} for e in evals]))


def run_conditional(spec: JobSpec, output: Path) -> dict:
    from elasticrl.models.evaluate import greedy_accuracy
    from elasticrl.models.load import load_causal_lm, load_tokenizer
    from elasticrl.trainers.sft import train_sft

    d = spec.data
    check_user_files(spec, (d.prompt_key, d.response_key, spec.conditional.attributes_key),
                     (d.prompt_key, d.answer_key))
    train, evals, compare = conditioned_data(spec, output / "conditional")
    summary = train_sft(spec, output, {"train": train, "eval": evals})
    if spec.conditional.compare_attributes and spec.export.enabled:
        # the same held-out prompts asked for the compared attributes, on the exported model
        model = load_causal_lm(output / rf.FINAL, spec.model.trust_remote_code)
        tok = load_tokenizer(output / rf.FINAL, spec.model.trust_remote_code)
        records = read_records(compare, (d.prompt_key, d.answer_key))[: spec.eval.num_prompts or None]
        correct, total = greedy_accuracy(model, tok, records, spec,
                                         max_new_tokens=spec.eval.max_new_tokens, dp_rank=0, dp_size=1,
                                         synced=False, device="cpu")
        summary["compare_accuracy"] = correct / max(1, total)
        with open(output / rf.METRICS, "a") as f:
            f.write(json.dumps({"step": summary["steps"], "eval/compare_accuracy": summary["compare_accuracy"]}) + "\n")
    return summary
