"""Every RL algorithm on the tiny world with the same budget: held-out accuracy before and after.

Each variant is `elasticrl run examples/tiny_grpo.yaml` (the embedded arithmetic world, the
demo's cached SFT warm start, the job's verifier as the reward) with the same steps, prompts,
samples, learning rate and evaluation, changed only in what makes the algorithm. PPO is
`examples/tiny_ppo.yaml`, the same job with a critic (from the policy: no reward model, the
verifier is its reward too) and the demo's KL-free setting, so every variant learns from the
same signal. One after the other on this machine; each prints a line as it ends, and the last
lines are the table (Markdown) and the same figures as JSON.

  .venv/bin/python benchmarks/algorithms.py [--steps 120] [--only grpo,ppo] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def budget(steps: int, dtype: str) -> list[str]:
    """What every variant shares: the demo's job, shortened to ``steps`` with evaluations at
    the start, the middle and the end."""
    return [f"rl.num_steps={steps}", f"eval.every_steps={max(1, steps // 2)}", "eval.num_prompts=256",
            "rl.eval_samples=4", "log.progress_bar=false", f"model.dtype={dtype}", "checkpoint.every_steps=0"]


def run(name: str, steps: int, dtype: str, out: Path) -> dict:
    sets = budget(steps, dtype) + VARIANTS[name][1]
    t0 = time.time()
    cmd = [sys.executable, "-m", "elasticrl.cli", "run", str(SPECS.get(name, SPEC)), "--output", str(out / name)]
    proc = subprocess.run(cmd + [x for kv in sets for x in ("--set", kv)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        return {"algorithm": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(ln) for ln in (out / name / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps_s = [r["time/step"] for r in rows if "time/step" in r]
    first, last = evals[0], evals[-1]
    return {"algorithm": name, "accuracy_before": first["eval/accuracy"], "accuracy_after": last["eval/accuracy"],
            "gain_points": round(100 * (last["eval/accuracy"] - first["eval/accuracy"]), 1),
            "pass@4_before": first.get("eval/pass@4"), "pass@4_after": last.get("eval/pass@4"),
            "s_per_step": round(statistics.median(steps_s), 2), "wall_s": round(time.time() - t0, 1),
            "steps": last["step"]}


def table(results: list[dict]) -> str:
    lines = ["| algorithm | held-out accuracy (start -> end) | pass@4 (start -> end) | s/step |", "|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | failed: {r['error']} | | |")
            continue
        lines.append(f"| {r['algorithm']} | {100 * r['accuracy_before']:.1f} % -> {100 * r['accuracy_after']:.1f} % "
                     f"({r['gain_points']:+.1f}) | {100 * r['pass@4_before']:.1f} % -> {100 * r['pass@4_after']:.1f} % "
                     f"| {r['s_per_step']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--output", default="", help="keep the runs here (default: a temp folder)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"--only: unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="erl-algorithms-") as tmp:
        out = Path(args.output or tmp)
        results = []
        for name in names:
            results.append(run(name, args.steps, args.dtype, out))
            print(json.dumps(results[-1]), flush=True)
    print(table(results))
    print(json.dumps({"steps": args.steps, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
