"""Seconds per GRPO step by generation length, elasticrl beside TRL: the shape of the 2025
OpenRLHF paper's Table 1 (DAPO step time at 1K-8K tokens) at this machine's scale.

The workload is benchmarks/rl_step.yaml's GRPO step on a smaller model and batch, at each length
in ``--tokens``: the tiny world's ``--model-size`` Llama (2M parameters by default), 8 prompts x 4
completions of exactly N new tokens (no end of sequence), KL 0.04 (k3) as a loss, one AdamW
step per 32 completions; elasticrl with its own layout (`elasticrl run`), TRL's GRPOTrainer in
its own environment (benchmarks/trl_env.sh) on the same model folder and prompt texts. At each
length the two run in turn (the order alternating between lengths), each twice: timed, then with
its memory sampled (peak PSS over its processes). s/step is the median of the steps after the
first. The last line is one JSON object:
{"benchmark": "long_cot", "results": [{"tokens", "elasticrl_s", "trl_s", "elasticrl_pss_gb", "trl_pss_gb"}, ...]}

  bash benchmarks/trl_env.sh            # once
  .venv/bin/python benchmarks/long_cot.py [--tokens 256 512 1024 2048] [--steps 3] [--dtype bf16|fp32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step import SPEC, TRL_PYTHON, _elasticrl, _trl  # noqa: E402

PROMPTS, SAMPLES = 8, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--steps", type=int, default=3, help="steps per run; the first is not in s/step")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--model-size", default="2m", help="a preset of the tiny world (elasticrl/spec/presets.py)")
    args = ap.parse_args()
    args.batch = PROMPTS * SAMPLES
    if not TRL_PYTHON.is_file():
        sys.exit("TRL's environment is missing: bash benchmarks/trl_env.sh")
    from elasticrl.data.records import format_prompt, read_records
    from elasticrl.models import load_tokenizer
    from elasticrl.spec import load_spec
    from elasticrl.world import world_paths

    shape = [f"world.model_size={args.model_size}", f"rl.prompts_per_step={PROMPTS}",
             f"rl.samples_per_prompt={SAMPLES}", f"train.global_batch_size={args.batch}"]
    spec = load_spec(SPEC, shape)
    paths = world_paths(spec.world)
    model_dir, tok = paths["model"], load_tokenizer(str(paths["model"]))
    records = read_records(str(paths["rl_prompts"]), ("prompt", "answer"))[:PROMPTS * args.steps]
    texts = [format_prompt(tok, r["prompt"], spec.data.apply_chat_template) for r in records]
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    prompts = Path(tempfile.mkdtemp(prefix="long-cot-")) / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": r["answer"]}) + "\n" for t, r in zip(texts, records)))
    results = []
    for i, n in enumerate(args.tokens):
        sets = shape + [f"rl.max_new_tokens={n}", f"rl.min_tokens={n}", f"rollout.max_model_len={n + longest + 8}"]
        row = {"tokens": n}
        for name in ("trl", "elasticrl") if i % 2 == 0 else ("elasticrl", "trl"):
            load = os.getloadavg()[0]
            if name == "trl":
                extra = ("--tokens", str(n), "--batch", str(args.batch))
                timed, mem = (_trl(args, model_dir, prompts, m, extra) for m in (False, True))
            else:
                timed, mem = (_elasticrl(args, model_dir, sets, m) for m in (False, True))
            row.update({f"{name}_s": round(timed["s_per_step"], 2), f"{name}_pss_gb": round(mem["peak_pss_gb"], 2),
                        f"{name}_tokens": timed["completion_tokens"], f"{name}_load_before": round(load, 2)})
            if name == "elasticrl":
                row["elasticrl_phases_s"] = {k: round(timed[k], 2) for k in ("rollout", "experience", "train", "sync")}
            else:
                row["trl_phases_s"] = {k: round(timed[k], 2) for k in ("rollout", "rest")}
        row["speedup"] = round(row["trl_s"] / row["elasticrl_s"], 2)
        row["pss_ratio"] = round(row["elasticrl_pss_gb"] / row["trl_pss_gb"], 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    keep = ("tokens", "elasticrl_s", "trl_s", "elasticrl_pss_gb", "trl_pss_gb", "speedup", "pss_ratio")
    print(json.dumps({"benchmark": "long_cot", "dtype": args.dtype, "model_size": args.model_size,
                      "completions": args.batch, "results": [{k: r[k] for k in keep} for r in results]}), flush=True)


if __name__ == "__main__":
    main()
