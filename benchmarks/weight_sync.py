"""Weight-sync bandwidth: every transport, by bucket size, next to this machine's memcpy.

A trainer rank (DeepSpeed, fp32) pushes its full weights into one vLLM engine through each
transport; figures are medians of --repeats syncs. memcpy is a warm tensor copy of the same
number of bytes in the trainer's process, measured in the same run. Engines run in both CPU
modes: 'dense' (a sync ends in copies) and 'packed' (every changed linear is repacked by
oneDNN after the copy). Prints JSON lines; the last one holds the headline figures.

  .venv/bin/python benchmarks/weight_sync.py [--size 50m] [--buckets 16,64,256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _memcpy(_worker, nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="50m", help="embedded world model preset")
    ap.add_argument("--buckets", default="16,64,256", help="bucket sizes in MiB")
    ap.add_argument("--transports", default="shm,shm_staged,broadcast,files")
    ap.add_argument("--modes", default="dense,packed", help="CPU engine modes to measure")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    spec = load_spec({}, [f"world.model_size={args.size}", "model.dtype=fp32", "train.num_ranks=1",
                          "train.zero_stage=0", "train.micro_batch_size=4", "train.global_batch_size=4",
                          "rollout.max_model_len=64"])
    paths = resolve_paths(spec)
    files_dir = tempfile.mkdtemp(prefix="erl-bench-")
    results = []
    with ray_session(RaySpec(num_cpus=4)):
        trainer = RoleGroup("trainer", SFTWorker, 1, spec_to_dict(spec), paths)
        trainer.setup(10)
        nbytes = trainer.call("__ray_call__", lambda w: sum(p.numel() * p.element_size()
                                                            for p in w.engine.module.parameters()))[0]
        memcpy = trainer.call("__ray_call__", lambda w: _memcpy(w, nbytes, 7))[0]
        print(json.dumps({"measure": "memcpy", "gbytes": nbytes / 1e9, "gbps": round(memcpy, 3)}), flush=True)
        for mode in args.modes.split(","):
            rspec = load_spec(spec_to_dict(spec), [f"rollout.cpu_mode={mode}"]).rollout
            pool = RolloutPool(paths["model"], rspec, "fp32", seed=0)
            version = 0
            for transport in args.transports.split(","):
                for bucket in (int(b) for b in args.buckets.split(",")):
                    trainer.call("attach_rollout", pool.engines, pool.infos, transport, bucket, files_dir)
                    stats = []
                    for _ in range(args.repeats + 1):  # the first sync allocates buffers: not counted
                        version += 1
                        stats.append(trainer.call("sync_weights", version)[0])
                    trainer.call("detach_rollout")
                    gbps = statistics.median(s["sync/gbps"] for s in stats[1:])
                    row = {"measure": "sync", "mode": mode, "transport": transport, "bucket_mb": bucket,
                           "gbytes": round(stats[-1]["sync/gbytes"], 4), "gbps": round(gbps, 3),
                           "seconds": round(statistics.median(s["sync/seconds"] for s in stats[1:]), 4),
                           "ratio_to_memcpy": round(gbps / memcpy, 3)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            pool.shutdown()
        trainer.shutdown()
    best = max(results, key=lambda r: r["gbps"])
    headline = {"benchmark": "weight_sync", "gbytes": round(nbytes / 1e9, 4), "memcpy_gbps": round(memcpy, 3),
                "best": {k: best[k] for k in ("mode", "transport", "bucket_mb", "gbps", "ratio_to_memcpy")}}
    for mode in args.modes.split(","):
        for transport in args.transports.split(","):
            rows = [r for r in results if r["mode"] == mode and r["transport"] == transport]
            if rows:
                top = max(rows, key=lambda r: r["gbps"])
                headline[f"{mode}/{transport}_gbps"] = top["gbps"]
                headline[f"{mode}/{transport}_ratio"] = top["ratio_to_memcpy"]
    print(json.dumps(headline))
    os.system(f"rm -rf {files_dir}")


if __name__ == "__main__":
    main()
