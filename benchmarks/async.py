"""Sync, whole-batch async and fully async RL side by side on this machine.

The long-tail workload (benchmarks/async.yaml): GRPO on a random-weight model whose
completion lengths are geometric up to a 448-token cap, so a synchronous batch waits for
its longest sample. The three modes run the same spec one after the other (``--rounds``
times, alternating the order); each prints its trained tokens per second (the completion
tokens in the loss over the steps between the first and the last, per second of those steps), the share of
the engine's time it neither generated nor scored (``rollout/engine_idle``), the share of
the trainer's it waited for rollouts (``time/rollout`` over ``time/step``) and the staleness
of the tokens it trained on. ``--world`` also runs the tiny world's GRPO (warm-started, with
held-out evaluation 4 times; ``--only-world``: those alone) in each mode and prints held-out accuracy against
wall-clock time, and when each mode first reached the sync run's final accuracy. The last
line is one JSON object.

  .venv/bin/python benchmarks/async.py [--rounds 3] [--steps 12] [--world] [--set KEY=VALUE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from elasticrl.run_folder import metric_rows

ROOT = Path(__file__).resolve().parent.parent
MODES = {"sync": ["rl.async_rollout=false"],
         "batch_async": ["rl.async_rollout=true"],
         "fully_async": ["rl.async_rollout=true", "rl.fully_async=true", "rl.fully_async_rounds=until_trained"],
         # the repeatable variant: a step's rounds stop once its next batch is ready
         "fully_async_until_ready": ["rl.async_rollout=true", "rl.fully_async=true"]}


def _run(spec: Path, sets: list[str], out: Path) -> list[dict]:
    cmd = [str(ROOT / ".venv/bin/elasticrl"), "run", str(spec), "--output", str(out)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return metric_rows(out)


def _long_tail(rows: list[dict], samples: int) -> dict:
    """The steady state: the steps after the first (start-up, no overlap yet) and before the last
    (after which no batch is rolled out ahead)."""
    last = max(r["step"] for r in rows)
    steps = [r for r in rows if 2 <= r["step"] < last]
    seconds = sum(r["time/step"] for r in steps)
    tokens = sum(r["response_length"] * samples for r in steps)
    lags: dict[int, float] = {}
    for r in steps:
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in r.items() if k.startswith("rl/token_staleness/")} \
            or {r["rl/staleness"]: 1.0}
        for k, v in hist.items():
            lags[k] = lags.get(k, 0.0) + v / len(steps)
    return {"tokens_per_s": round(tokens / seconds, 1),
            "engine_idle": round(statistics.mean(r["rollout/engine_idle"] for r in steps), 3),
            "trainer_idle": round(sum(r["time/rollout"] for r in steps) / seconds, 3),
            "s_per_step": round(seconds / len(steps), 2), "tokens_per_step": round(tokens / len(steps)),
            "staleness": {k: round(v, 3) for k, v in sorted(lags.items())},
            "regenerated_per_step": round(statistics.mean(r.get("rl/regenerated", 0) for r in steps), 1)}


def _world(rows: list[dict]) -> list[tuple[float, float]]:
    """(seconds since the first step began, held-out accuracy) at each evaluation."""
    t, out = 0.0, []
    for r in sorted(rows, key=lambda r: r["step"]):
        t += r.get("time/step", 0.0)  # evaluation is not in it: the same for every mode
        if "eval/accuracy" in r:
            out.append((round(t, 1), r["eval/accuracy"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", action="store_true", help="also the tiny world's held-out accuracy against time")
    ap.add_argument("--only-world", action="store_true", help="the tiny world's runs alone")
    ap.add_argument("--world-steps", type=int, default=40)
    ap.add_argument("--world-evals", type=int, default=4, help="held-out evaluations over a world run")
    ap.add_argument("--set", action="append", default=[], help="a spec override for every run (KEY=VALUE)")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes, comma-separated (sync first)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    samples = 4 * 4  # rl.prompts_per_step x rl.samples_per_prompt of async.yaml
    tail: dict[str, list] = {m: [] for m in modes}
    world: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="erl-async-") as tmp:
        for rnd in range(args.rounds):
            order = modes if rnd % 2 == 0 else list(reversed(modes))
            for mode in order:
                print(f"round {rnd + 1}, {mode}: load average {os.getloadavg()[0]:.2f}", flush=True)
                if args.only_world:
                    args.world = True
                else:
                    sets = MODES[mode] + [f"rl.num_steps={args.steps}", *args.set]
                    rows = _run(ROOT / "benchmarks" / "async.yaml", sets, Path(tmp) / f"tail-{mode}-{rnd}")
                    tail[mode].append(_long_tail(rows, samples))
                    print(f"  long tail: {json.dumps(tail[mode][-1])}", flush=True)
                if args.world:
                    rows = _run(ROOT / "examples" / "tiny_grpo.yaml", MODES[mode] + [
                        f"rl.num_steps={args.world_steps}",
                        f"eval.every_steps={max(1, args.world_steps // args.world_evals)}",
                        "log.progress_bar=false", "checkpoint.every_steps=0"],
                        Path(tmp) / f"world-{mode}-{rnd}")
                    world[mode].append(_world(rows))
                    print(f"  tiny world (s, held-out accuracy): {world[mode][-1]}", flush=True)
    result: dict = {"benchmark": "async"}
    if not args.only_world:
        med = {m: {k: statistics.median(r[k] for r in runs) for k in ("tokens_per_s", "engine_idle", "trainer_idle")}
               for m, runs in tail.items()}
        result.update(modes=med, fully_async_over_sync=round(med["fully_async"]["tokens_per_s"]
                                                              / med["sync"]["tokens_per_s"], 2))
    if args.world:
        reach = {}
        for m, runs in world.items():
            times = []
            for k, curve in enumerate(runs):
                target = world["sync"][k][-1][1]
                times.append(next((t for t, acc in curve if acc >= target), None))
            reach[m] = times
        sync_time = [w[-1][0] for w in world["sync"]]
        result["world"] = {"reached_sync_final_s": reach, "sync_total_s": sync_time,
                           "final_accuracy": {m: [w[-1][1] for w in runs] for m, runs in world.items()}}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
