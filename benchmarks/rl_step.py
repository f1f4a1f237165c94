"""One GRPO step, elasticrl against TRL's GRPOTrainer, side by side on this machine.

The workload is benchmarks/rl_step.yaml (a 44M-parameter Llama of the tiny world, 16
prompts x 4 completions of exactly 128 tokens, KL 0.04 k3 as a loss, one AdamW step per 64
completions) for both: elasticrl with its own layout (`elasticrl run`, nothing hand-set),
TRL in its own environment (benchmarks/trl_env.sh, then benchmarks/trl_grpo.py) on the
same model folder and prompt texts. Runs alternate, `--rounds` each; every run prints the
load average before it, s/step of the steps after the first (median), per phase where the
framework tells, launch -> end of step 1, peak memory summed over the run's processes (resident,
and proportional: PSS divides a shared page between the processes that map it), and
the completion tokens per step (the same work is checked: 64 x 128 on both sides). Each
framework runs twice a round: timed, then with its memory sampled twice a second (reading
the smaps of elasticrl's ~20 processes costs ~0.05-0.1 CPU-s a sample, ~4 CPU-s over a run:
on two cores it slowed the start it would time; TRL's one process costs a tenth of that). The last
line holds the ratios and the compute floor (the step's matmul FLOPs at the matmul rate
measured here, at 2048-square and at the step's own shapes).

  bash benchmarks/trl_env.sh            # once
  .venv/bin/python benchmarks/rl_step.py [--rounds 3] [--steps 4] [--dtype bf16|fp32] [--before KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from elasticrl.backend import tree_memory
from elasticrl.run_folder import METRICS

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "benchmarks" / "rl_step.yaml"
TRL_PYTHON = ROOT / "benchmarks" / ".trl-venv" / "bin" / "python"


def _run(cmd: list[str], first_step, memory: bool) -> dict:
    """Run ``cmd``; ``first_step(line)`` tells whether step 1 has ended, from a line of its output
    (or, called with None twice a second, from its files). With ``memory`` the process tree's
    memory is sampled twice a second, which costs CPU (below); without, the peaks are 0."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, peak, first = [], {"rss": 0, "pss": 0}, None

    def read():
        nonlocal first
        for line in proc.stdout:
            out.append(line)
            if first is None and first_step(line):
                first = time.time() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        if memory:
            now = tree_memory(proc.pid)
            peak = {k: max(v, now[k]) for k, v in peak.items()}
        if first is None and first_step(None):
            first = time.time() - t0
        time.sleep(0.5)
    reader.join(10)
    if proc.returncode:
        sys.exit(f"{cmd[:3]} failed ({proc.returncode}):\n" + "".join(out[-30:]))
    return {"wall": time.time() - t0, "first_step_s": first, "peak_gb": peak["rss"] / 1e9,
            "peak_pss_gb": peak["pss"] / 1e9, "out": out}


def _elasticrl(args, model_dir: Path, sets: list[str], memory: bool, spec: Path = SPEC) -> dict:
    out = Path(tempfile.mkdtemp(prefix="rl-step-"))
    metrics = out / "run" / METRICS

    def step1(line):  # metrics.jsonl gets step 1's row when it ends
        return line is None and metrics.is_file() and '"step": 1,' in metrics.read_text()

    r = _run([str(ROOT / ".venv/bin/elasticrl"), "run", str(spec), "--output", str(out / "run"), "--set",
              f"rl.num_steps={args.steps}", "--set", f"model.dtype={args.dtype}",
              *(x for kv in sets for x in ("--set", kv))], step1, memory)
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    steps = [x for x in rows if x["step"] > 1]
    return {"framework": "elasticrl", "s_per_step": statistics.median(x["time/step"] for x in steps),
            **{k: statistics.median(x[f"time/{k}"] for x in steps) for k in ("rollout", "experience", "train", "sync")},
            "completion_tokens": [round(x["response_length"] * args.batch) for x in rows if x["step"] > 0],
            "first_step_s": r["first_step_s"], "peak_gb": r["peak_gb"], "peak_pss_gb": r["peak_pss_gb"]}


def _trl(args, model_dir: Path, prompts: Path, memory: bool, extra: tuple[str, ...] = ()) -> dict:
    """``extra``: trl_grpo.py's own flags (its completion tokens and batch)."""
    r = _run([str(TRL_PYTHON), str(ROOT / "benchmarks/trl_grpo.py"), str(model_dir), str(prompts), "--steps",
              str(args.steps), "--dtype", args.dtype, *extra],
             lambda line: line is not None and line.startswith('{"step": 1,'), memory)
    recs = [json.loads(ln) for ln in r["out"] if ln.startswith('{"')]  # ours; TRL prints dicts too
    steps = [x for x in recs if "step" in x and x["step"] > 1]
    logs = [x["log"] for x in recs if "log" in x and "completions/mean_length" in x["log"]]
    return {"framework": "trl", "s_per_step": statistics.median(x["seconds"] for x in steps),
            "rollout": statistics.median(x["generate"] for x in steps),
            "rest": statistics.median(x["seconds"] - x["generate"] for x in steps),
            "completion_tokens": [round(x["completions/mean_length"] * args.batch) for x in logs],
            "first_step_s": r["first_step_s"], "peak_gb": r["peak_gb"], "peak_pss_gb": r["peak_pss_gb"]}


def _one(name: str, args, model_dir: Path, prompts: Path, memory: bool) -> dict:
    if name == "trl":
        return _trl(args, model_dir, prompts, memory)
    return _elasticrl(args, model_dir, args.before if name == "elasticrl_before" else [], memory)


def _matmul_tflops(dtype, shapes: list[tuple[int, int, int]], threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        t = time.perf_counter()
        reps = 3
        for _ in range(reps):
            a @ b
        seconds += time.perf_counter() - t
        flops += 2 * m * k * n * reps
    return flops / seconds / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is not in s/step")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--before", action="append", default=[], metavar="KEY=VALUE",
                    help="also run elasticrl with these overrides (a layout as it was before a change), interleaved")
    args = ap.parse_args()
    args.batch = 64
    if not TRL_PYTHON.is_file():
        sys.exit("TRL's environment is missing: bash benchmarks/trl_env.sh")
    import torch

    from elasticrl.data.records import format_prompt, read_records
    from elasticrl.models import load_tokenizer
    from elasticrl.spec import load_spec
    from elasticrl.world import world_paths

    spec = load_spec(SPEC)
    paths = world_paths(spec.world)  # builds the 44M world once
    model_dir = paths["model"]
    tok = load_tokenizer(str(model_dir))
    records = read_records(str(paths["rl_prompts"]), ("prompt", "answer"))
    n = spec.rl.prompts_per_step * args.steps
    prompts = Path(tempfile.mkdtemp(prefix="rl-step-")) / "prompts.jsonl"
    texts = [format_prompt(tok, r["prompt"], spec.data.apply_chat_template) for r in records[:n]]
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": r["answer"]}) + "\n" for t, r in zip(texts, records)))
    names = ["trl", "elasticrl"] + (["elasticrl_before"] if args.before else [])
    results: dict[str, list] = {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            load = os.getloadavg()[0]
            res, mem = _one(name, args, model_dir, prompts, False), _one(name, args, model_dir, prompts, True)
            res.update(peak_gb=mem["peak_gb"], peak_pss_gb=mem["peak_pss_gb"], framework=name, round=rnd + 1,
                       dtype=args.dtype, load_before=round(load, 2))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
            results[name].append(res)
    # the step's matmul work: generation 2 P per token, reference forward 2 P, train 6 P, per token
    from safetensors.torch import load_file

    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    prompt_tokens = statistics.mean(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    seqs, new = spec.rl.prompts_per_step * spec.rl.samples_per_prompt, spec.rl.max_new_tokens
    flops = 2 * params * seqs * new + (2 + 6) * params * seqs * (prompt_tokens + new)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    square = _matmul_tflops(dtype, [(2048, 2048, 2048)], 2)
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, rows = cfg["hidden_size"], cfg["intermediate_size"], seqs * int(prompt_tokens + new)
    own = _matmul_tflops(dtype, [(rows, h, h), (rows, h, inter), (rows, inter, h)], 2)
    med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in results.items()}
    print(json.dumps({"summary": True, "dtype": args.dtype, "s_per_step": med,
                      "speedup_vs_trl": round(med["trl"] / med["elasticrl"], 2),
                      "first_step_s": {k: statistics.median(r["first_step_s"] for r in v) for k, v in results.items()},
                      "first_step_over_trl": round(statistics.median(r["first_step_s"] for r in results["elasticrl"])
                                                   / statistics.median(r["first_step_s"] for r in results["trl"]), 2),
                      "peak_gb": {k: max(r["peak_gb"] for r in v) for k, v in results.items()},
                      "peak_pss_gb": {k: max(r["peak_pss_gb"] for r in v) for k, v in results.items()},
                      "pss_over_trl": round(max(r["peak_pss_gb"] for r in results["elasticrl"])
                                            / max(r["peak_pss_gb"] for r in results["trl"]), 2),
                      "step_tflop": round(flops / 1e12, 2), "matmul_tflops_2048": round(square, 3),
                      "matmul_tflops_step_shapes": round(own, 3),
                      "floor_s": round(flops / 1e12 / square, 2),
                      "elasticrl_over_floor": round(med["elasticrl"] / (flops / 1e12 / square), 1)}), flush=True)


if __name__ == "__main__":
    main()
