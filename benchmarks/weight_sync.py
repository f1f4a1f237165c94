"""Weight-sync bandwidth next to this machine's memcpy (or the GPU's device copy), two suites.

``--suite transports``: a trainer rank (DeepSpeed, fp32) pushes its full weights into one vLLM
engine through each transport, by bucket size, with engines in both CPU modes: 'dense' (a
sync ends in copies) and 'packed' (every changed linear is repacked by oneDNN after the copy).

``--suite senders``: sliced against gathered (rank 0 gathers each module and sends it whole)
for two 2-rank trainers: AutoTP 2 into one engine (each rank sends its own slices), and two
data-parallel replicas into two engines (each replica feeds one engine at once). The two
layouts alternate, --repeats rounds, so both see the same machine; each row gives the bytes
every trainer rank moved.

Figures are medians of --repeats syncs after a first that allocates. memcpy is a warm copy of
the same number of bytes in a trainer process, measured in the same run. Prints JSON lines;
the last holds the headline figures.

``--suite lora``: a LoRA-trained policy (``model.lora``, rank --lora-rank) into a vLLM engine that
serves its adapters (``rollout.lora_sync: adapter``: each sync moves the adapters) and into one
that takes merged weights (``merged``: each sync moves every weight), over shm; then each engine's
generation speed on the same prompts (the adapters cost compute on every token). The two
alternate, --repeats rounds.

``--suite delta``: a bf16 trainer (SFT, --steps real optimizer steps at each --lrs learning rate)
into a bf16 vLLM engine over each of --transports (default shm, ipc, broadcast, files; a sender
each, kept across the steps), each step synced twice per transport: a delta sync
(``rollout.delta_sync``: only the elements that changed since what that sender sent; shm and a
CPU's ipc sync whole all the same) and a full one of the same weights, in turn first (the first
sync after a step is the slower). Per learning rate and transport: the changed fraction, bytes
and seconds of each (medians over the steps).

  .venv/bin/python benchmarks/weight_sync.py [--suite transports|senders|lora|delta] [--size 50m] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile


def _memcpy(_worker, nbytes: int, repeats: int) -> float:
    from elasticrl import backend

    return backend.device_copy_gbps(nbytes, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="transports", choices=("transports", "senders", "lora", "delta"))
    ap.add_argument("--size", default="50m", help="embedded world model preset")
    ap.add_argument("--buckets", default="16,64,256", help="bucket sizes in MiB (transports)")
    ap.add_argument("--transports", default=None, help="default: shm,shm_staged,broadcast,files for the "
                    "transports suite, shm,ipc,broadcast for senders (ipc runs over /dev/shm on CPU)")
    ap.add_argument("--modes", default="dense,packed", help="CPU engine modes to measure (transports)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=16, help="adapter rank (lora)")
    ap.add_argument("--lrs", default="1e-6,8e-5", help="learning rates (delta; 8e-5: examples/tiny_grpo.yaml's)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate (delta)")
    ap.add_argument("--cpu-mode", default="auto", choices=("auto", "dense", "packed"),
                    help="rollout.cpu_mode of the engine (delta; packed repacks every linear after a sync)")
    args = ap.parse_args()
    if args.suite == "senders":
        return senders(args)
    if args.suite == "lora":
        return lora(args)
    if args.suite == "delta":
        return delta(args)
    args.transports = args.transports or "shm,shm_staged,broadcast,files"

    from elasticrl import backend
    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    # one GPU: the trainer and the engine share it, as in the hybrid engine (then only ipc applies:
    # NCCL refuses two ranks on one device)
    share = 0.5 if len(backend.gpus()) == 1 else 1.0
    spec = load_spec({}, [f"world.model_size={args.size}", "model.dtype=fp32", "train.num_ranks=1",
                          "train.zero_stage=0", "train.micro_batch_size=4", "train.global_batch_size=4",
                          "rollout.max_model_len=64", "rollout.gpu_memory_utilization=0.4"])
    paths = resolve_paths(spec)
    files_dir = tempfile.mkdtemp(prefix="erl-bench-")
    results = []
    with ray_session(RaySpec(num_cpus=4)):
        trainer = RoleGroup("trainer", SFTWorker, 1, spec_to_dict(spec), paths, gpus_per_rank=share)
        trainer.setup(10)
        nbytes = trainer.call("__ray_call__", lambda w: sum(p.numel() * p.element_size()
                                                            for p in w.engine.module.parameters()))[0]
        memcpy = trainer.call("__ray_call__", lambda w: _memcpy(w, nbytes, 7))[0]
        print(json.dumps({"measure": "memcpy", "gbytes": nbytes / 1e9, "gbps": round(memcpy, 3)}), flush=True)
        for mode in ["gpu"] if backend.has_gpu() else args.modes.split(","):
            rspec = load_spec(spec_to_dict(spec), [] if mode == "gpu" else [f"rollout.cpu_mode={mode}"]).rollout
            pool = RolloutPool(paths["model"], rspec, "fp32", seed=0,
                               where={"gpus_per_rank": share, "cpus_per_rank": 1} if backend.has_gpu() else None)
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
    for mode in ["gpu"] if backend.has_gpu() else args.modes.split(","):
        for transport in args.transports.split(","):
            rows = [r for r in results if r["mode"] == mode and r["transport"] == transport]
            if rows:
                top = max(rows, key=lambda r: r["gbps"])
                headline[f"{mode}/{transport}_gbps"] = top["gbps"]
                headline[f"{mode}/{transport}_ratio"] = top["ratio_to_memcpy"]
    print(json.dumps(headline))
    os.system(f"rm -rf {files_dir}")


def senders(args) -> None:
    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    base = [f"world.model_size={args.size}", "model.dtype=fp32", "train.num_ranks=2", "train.micro_batch_size=4",
            "train.global_batch_size=8", "rollout.max_model_len=64", "rollout.cpu_mode=dense"]
    trainers = {"autotp2_to_1_engine": (["train.tp_size=2", "train.zero_stage=1"], 1),
                "2_replicas_to_2_engines": (["train.zero_stage=2"], 2)}
    headline = {"benchmark": "weight_sync_senders"}
    with ray_session(RaySpec(num_cpus=8)):
        for kind, (extra, num_engines) in trainers.items():
            spec = load_spec({}, base + extra + [f"rollout.num_engines={num_engines}"])
            paths = resolve_paths(spec)
            pool = RolloutPool(paths["model"], spec.rollout, "fp32", seed=0)
            trainer = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), paths)
            trainer.setup(10)
            full = trainer.call("__ray_call__", lambda w: sum(
                p.numel() * p.element_size() for p in w.engine.module.parameters()))
            memcpy = trainer.call("__ray_call__", lambda w, n=max(full): _memcpy(w, n, 7))[0]
            rates: dict[tuple, list] = {}
            moved: dict[tuple, list] = {}
            version = 0
            for _ in range(args.repeats):  # the layouts alternate: both see the same machine
                for transport in (args.transports or "shm,ipc,broadcast").split(","):
                    for layout in ("gathered", "sliced"):
                        trainer.call("attach_rollout", pool.engines, pool.infos, transport, 64, None, layout)
                        for _ in range(2):  # the first allocates buffers and maps arenas: not counted
                            version += 1
                            stats = trainer.call("sync_weights", version)[0]
                        trainer.call("detach_rollout")
                        assert stats["sync/layout"] == layout
                        rates.setdefault((transport, layout), []).append(stats["sync/gbps"])
                        moved[(transport, layout)] = stats["sync/sent_gbytes_by_rank"]
            for (transport, layout), r in rates.items():
                gbps = statistics.median(r)
                print(json.dumps({"measure": "sync", "trainer": kind, "transport": transport, "layout": layout,
                                  "gbps": round(gbps, 3), "ratio_to_memcpy": round(gbps / memcpy, 3),
                                  "gbytes_by_rank": [round(g, 4) for g in moved[(transport, layout)]],
                                  "rank_bytes_held": [round(f / 1e9, 4) for f in full]}), flush=True)
            for transport in (args.transports or "shm,ipc,broadcast").split(","):
                ratio = statistics.median(rates[(transport, "sliced")]) / statistics.median(
                    rates[(transport, "gathered")])
                headline[f"{kind}/{transport}_sliced_over_gathered"] = round(ratio, 2)
            headline[f"{kind}/memcpy_gbps"] = round(memcpy, 3)
            trainer.shutdown()
            pool.shutdown()
    print(json.dumps(headline))


def lora(args) -> None:
    import time

    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    spec = load_spec({}, [f"world.model_size={args.size}", "model.dtype=fp32", "train.num_ranks=1",
                          "train.zero_stage=0", "train.micro_batch_size=4", "train.global_batch_size=4",
                          f"model.lora.rank={args.lora_rank}", "rollout.max_model_len=128",
                          "rollout.lora_sync=adapter"])
    paths = resolve_paths(spec)
    prompts = [[1, 4 + i % 50, 5 + i % 7, 6] for i in range(64)]
    sampling = {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True}
    sync: dict[str, list] = {"adapter": [], "merged": []}
    speed: dict[str, list] = {"adapter": [], "merged": []}
    with ray_session(RaySpec(num_cpus=4)):
        trainer = RoleGroup("trainer", SFTWorker, 1, spec_to_dict(spec), paths)
        trainer.setup(10)
        trainer.call("train_step", 0)  # adapters that are not zero
        pools = {"adapter": RolloutPool(paths["model"], spec.rollout, "fp32", seed=0, lora_rank=args.lora_rank),
                 "merged": RolloutPool(paths["model"], spec.rollout, "fp32", seed=0)}
        version = 0
        for _ in range(args.repeats):  # the two alternate: both see the same machine
            for how, pool in pools.items():
                trainer.call("attach_rollout", pool.engines, pool.infos, "shm", 64, None, "auto", how == "adapter")
                for _ in range(2):  # the first allocates buffers and maps arenas: not counted
                    version += 1
                    stats = trainer.call("sync_weights", version)[0]
                trainer.call("detach_rollout")
                sync[how].append(stats)
                t0 = time.time()
                tokens = sum(len(r.token_ids) for r in pool.generate(prompts, sampling))
                speed[how].append(tokens / (time.time() - t0))
        for pool in pools.values():
            pool.shutdown()
        trainer.shutdown()
    headline = {"benchmark": "weight_sync_lora", "size": args.size, "lora_rank": args.lora_rank}
    for how in ("adapter", "merged"):
        row = {"measure": "lora", "lora_sync": how, "gbytes": round(sync[how][-1]["sync/gbytes"], 6),
               "layout": sync[how][-1]["sync/layout"],
               "seconds": round(statistics.median(s["sync/seconds"] for s in sync[how]), 4),
               "tokens_per_s": round(statistics.median(speed[how]), 1)}
        print(json.dumps(row), flush=True)
        headline.update({f"{how}/{k}": row[k] for k in ("gbytes", "seconds", "tokens_per_s")})
    print(json.dumps(headline))



def _use(w, transport: str):
    """Make the trainer rank's sender for ``transport`` the current one (each keeps what it sent)."""
    w.core.senders = getattr(w.core, "senders", {})
    if w.core.sender is not None:
        w.core.senders[w.core.sender.transport] = w.core.sender
    w.core.sender = w.core.senders.get(transport)
    return w.core.sender is not None


def _sync(w, transport: str, version: int, delta: bool) -> dict:
    _use(w, transport)
    w.core.sender.delta = delta
    return w.sync_weights(version)


def _delta_row(rows: list[tuple[dict, dict]]) -> dict:
    """Medians over (delta sync, full sync) stats; changed_fraction None where the transport
    syncs whole (shm, a CPU's ipc: rollout.delta_sync)."""
    def median(k: int, key: str) -> float:
        return statistics.median(pair[k][key] for pair in rows)
    whole = any("sync/delta_fraction" not in d for d, _ in rows)
    return {"changed_fraction": None if whole else round(median(0, "sync/delta_fraction"), 5),
            "full_bytes": round(median(1, "sync/gbytes") * 1e9), "delta_bytes": round(median(0, "sync/gbytes") * 1e9),
            "full_s": round(median(1, "sync/seconds"), 4), "delta_s": round(median(0, "sync/seconds"), 4)}


def delta(args) -> None:
    import tempfile

    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.rollout.pool import RolloutPool
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    transports = (args.transports or "shm,ipc,broadcast,files").split(",")
    results = []
    with ray_session(RaySpec(num_cpus=4)):
        for lr in (float(x) for x in args.lrs.split(",")):
            spec = load_spec({}, [f"world.model_size={args.size}", "model.dtype=bf16", "train.num_ranks=1",
                                  "train.micro_batch_size=8", "train.global_batch_size=8", f"train.lr={lr}",
                                  "train.warmup_ratio=0", "rollout.max_model_len=64", "rollout.delta_sync=true",
                                  f"rollout.cpu_mode={args.cpu_mode}"])
            paths = resolve_paths(spec)
            pool = RolloutPool(paths["model"], spec.rollout, "bf16", seed=0)
            trainer = RoleGroup("trainer", SFTWorker, 1, spec_to_dict(spec), paths)
            trainer.setup(args.steps + 1)
            version, rows = 0, {t: [] for t in transports}
            for t in transports:  # a sender each, kept: the first sync maps the engine or sends whole
                trainer.call("__ray_call__", _use, t)
                trainer.call("attach_rollout", pool.engines, pool.infos, t, 64, tempfile.mkdtemp())
                trainer.call("__ray_call__", _sync, t, version := version + 1, True)
            for step in range(args.steps):
                trainer.call("train_step", step)
                for t in transports:  # each delta against what that sender sent the step before
                    pair = {}
                    for kind in (True, False) if step % 2 == 0 else (False, True):  # first after a step in turn
                        pair[kind] = trainer.call("__ray_call__", _sync, t, version := version + 1, kind)[0]
                    d, f = pair[True], pair[False]
                    rows[t].append((d, f))
                    print(json.dumps({"lr": lr, "step": step + 1, "transport": t, **_delta_row([(d, f)])}), flush=True)
            trainer.shutdown()
            pool.shutdown()
            results += [{"lr": lr, "transport": t, **_delta_row(rows[t])} for t in transports]
    print(json.dumps({"benchmark": "weight_sync_delta", "size": args.size, "cpu_mode": args.cpu_mode,
                      "results": results}))


if __name__ == "__main__":
    main()
