"""Every RL algorithm on the tiny world with the same budget: held-out accuracy before and after.

Each variant is `elasticrl run examples/tiny_grpo.yaml` (the embedded arithmetic world, the
demo's cached SFT warm start, the job's verifier as the reward) with the same steps, prompts,
samples, learning rate and evaluation, changed only in what makes the algorithm (the
settings column of the table). PPO is `examples/tiny_ppo.yaml`, the same job with a critic
(from the policy: no reward model, the verifier is its reward too) and the demo's KL-free
setting, so every variant learns from the same signal. Each seed is a run of its own from
that seed's warm start (`seed` sets the warm start, the prompts' order and every rollout's
sampling). One run at a time on this machine; each prints a line as it ends, and the last
lines are the table (Markdown) and the same figures as JSON, with the CPU and the dtype.

  .venv/bin/python benchmarks/algorithms.py [--steps 360] [--seeds 1234,7] [--only grpo,ppo] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elasticrl.run_folder import metric_rows

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny_grpo.yaml"
SPECS = {"ppo": ROOT / "examples" / "tiny_ppo.yaml"}  # the variants that are not SPEC's job

# name -> (what it is, its --set overrides on top of the shared budget)
VARIANTS = {
    "ppo": ("PPO: GAE on a critic (from the policy), the verifier as reward", []),
    "grpo": ("GRPO: group-normalised advantages", ["algorithm=grpo"]),
    "dr_grpo": ("Dr. GRPO: group mean baseline, no std, sum over tokens normalised by a constant",
                ["algorithm=grpo", "rl.advantage=dr_grpo", "rl.loss_aggregation=seq_sum_norm"]),
    "rloo": ("RLOO: leave-one-out baseline", ["algorithm=rloo"]),
    "reinforce++": ("REINFORCE++: batch-whitened returns, no group baseline",
                    ["algorithm=reinforce++", "rl.advantage=reinforce++"]),
    "reinforce++_baseline": ("REINFORCE++ with the group mean as baseline", ["algorithm=reinforce++"]),
    "dapo": ("DAPO: clip-higher, dynamic sampling with refills, token-level loss, overlong shaping",
             ["algorithm=grpo", "rl.clip_high=0.28", "rl.dynamic_sampling=true", "rl.dynamic_sampling_max_draws=3",
              "rl.loss_aggregation=token_mean", "rl.overlong_buffer=2", "rl.overlong_filter=true"]),
    "gspo": ("GSPO: the sequence's geometric-mean ratio, clipped as one",
             ["algorithm=grpo", "rl.importance_ratio=sequence", "rl.loss_aggregation=seq_mean_token_mean",
              "rl.clip_low=3e-4", "rl.clip_high=4e-4"]),
}


def budget(steps: int, dtype: str, seed: int) -> list[str]:
    """What every variant shares: the demo's job, its length ``steps``, evaluated at the
    start, every 40 steps and the end."""
    return [f"rl.num_steps={steps}", f"eval.every_steps={min(40, steps)}", "eval.num_prompts=256",
            "rl.eval_samples=4", "log.progress_bar=false", f"model.dtype={dtype}", "checkpoint.every_steps=0",
            f"seed={seed}"]


def run(name: str, steps: int, dtype: str, seed: int, out: Path) -> dict:
    sets = budget(steps, dtype, seed) + VARIANTS[name][1]
    t0 = time.time()
    folder = out / f"{name}-{seed}"
    cmd = [sys.executable, "-m", "elasticrl.cli", "run", str(SPECS.get(name, SPEC)), "--output", str(folder)]
    proc = subprocess.run(cmd + [x for kv in sets for x in ("--set", kv)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        return {"algorithm": name, "seed": seed, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = metric_rows(folder)
    evals = [r for r in rows if "eval/accuracy" in r]
    steps_s = [r["time/step"] for r in rows if "time/step" in r]
    first, last = evals[0], evals[-1]
    return {"algorithm": name, "seed": seed, "accuracy_before": first["eval/accuracy"],
            "accuracy_after": last["eval/accuracy"],
            "gain_points": round(100 * (last["eval/accuracy"] - first["eval/accuracy"]), 1),
            "curve": [round(100 * r["eval/accuracy"], 1) for r in evals],
            "pass@4_before": first.get("eval/pass@4"), "pass@4_after": last.get("eval/pass@4"),
            "s_per_step": round(statistics.median(steps_s), 2), "wall_s": round(time.time() - t0, 1),
            "steps": last["step"]}


def table(results: list[dict]) -> str:
    """One line per variant: each seed's held-out accuracy and pass@4, the mean gain, s/step."""
    lines = ["| algorithm | settings | held-out accuracy, per seed (start -> end) | mean gain | "
             "pass@4, per seed | s/step |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["algorithm"] for r in results):
        runs = [r for r in results if r["algorithm"] == name]
        settings = ", ".join(f"`{kv}`" for kv in VARIANTS[name][1]) or "`examples/tiny_ppo.yaml`"
        bad = [r for r in runs if "error" in r]
        if bad:
            lines.append(f"| {name} | {settings} | failed (seed {bad[0]['seed']}): {bad[0]['error']} | | | |")
            continue
        acc = "; ".join(f"{100 * r['accuracy_before']:.1f} -> {100 * r['accuracy_after']:.1f} %" for r in runs)
        p4 = "; ".join(f"{100 * r['pass@4_before']:.1f} -> {100 * r['pass@4_after']:.1f} %" for r in runs)
        gain = statistics.mean(r["gain_points"] for r in runs)
        lines.append(f"| {name} | {settings} | {acc} | {gain:+.1f} | {p4} | "
                     f"{statistics.median(r['s_per_step'] for r in runs):.2f} |")
    return "\n".join(lines)


def machine(dtype: str) -> dict:
    """The CPU (or GPU) the table was measured on and the dtype its runs resolved."""
    from elasticrl import backend

    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")),
                 platform.processor())
    kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX2" if " avx2" in flags else "other"
    return {"cpu": model, "cpu_kind": kind, "cores": len(os.sched_getaffinity(0)),
            "gpus": [n for n, _ in backend.gpus()], "dtype": backend.resolve_dtype(dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=360, help="RL steps a run (the demo's length)")
    ap.add_argument("--seeds", default="1234,7", help="comma-separated seeds; a run per variant and seed")
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--output", default="", help="keep the runs here (default: a temp folder)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"--only: unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    where = machine(args.dtype)
    print(json.dumps(where), flush=True)
    with tempfile.TemporaryDirectory(prefix="erl-algorithms-") as tmp:
        out = Path(args.output or tmp)
        results = []
        for name in names:
            for seed in seeds:
                results.append(run(name, args.steps, args.dtype, seed, out))
                print(json.dumps(results[-1]), flush=True)
    print(table(results))
    print(json.dumps({"steps": args.steps, "seeds": seeds, **where, "results": results}))


if __name__ == "__main__":
    main()
