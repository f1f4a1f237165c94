"""Checkpoints of a ZeRO-3 actor, sharded (every rank saves and loads its own pieces) next to the
old layout (every tensor gathered whole into rank 0, which writes; every rank reads whole
tensors back), on the same model in the same run, at 1, 2 and 4 ranks.

For each rank count and layout: seconds to save (blocking: until training could go on;
total: until the files are written; for the gathered layout the two are one; sync_save_s: the
sharded layout written before training goes on, checkpoint.background false), seconds to
load, the bytes the busiest rank wrote, and the largest increase of any rank's peak resident
memory during the save and during the load (VmHWM from /proc, reset before each through
/proc/self/clear_refs). Prints JSON lines; the last is the headline object.

  .venv/bin/python benchmarks/checkpoint.py [--size 50m] [--ranks 1,2,4]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def _rss() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _measured(fn):
    """Run ``fn`` with the peak resident memory reset first; (its result, the peak's increase,
    its seconds: the reset and the reading are not timed)."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss()[0]
    t0 = time.time()
    out = fn()
    seconds = time.time() - t0
    return out, _rss()[1] - before, seconds


def _gathered_save(worker, folder: str) -> int:
    """The old path: every tensor gathered whole into rank 0, which writes them."""
    import torch.distributed as dist

    from elasticrl.engine.state import full_state
    from elasticrl.weights.shards import save_sharded

    weights, moments = full_state(worker.core.engine)
    if dist.get_rank() != 0:
        return 0
    save_sharded({**weights, **moments}, folder, 2 * 2**30)
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def _gathered_load(worker, folder: str) -> None:
    """The old path: every rank reads each whole tensor and keeps its partition."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from elasticrl.engine import state
    from elasticrl.weights.shards import iter_tensors

    engine = worker.core.engine
    state.init_adam_states(engine, 1.0)
    params = dict(engine.module.named_parameters())
    for name, t in iter_tensors(folder):
        key, _, pname = name.partition(".") if name.startswith("exp_avg") else (None, "", name)
        if key is None:
            safe_set_full_fp32_param(params[pname], t)
        else:
            safe_set_full_optimizer_state(params[pname], t, key)


def _op(worker, what: str, folder: str):
    """One measured operation on this rank: (seconds, peak increase, bytes written)."""
    import torch.distributed as dist

    from elasticrl.engine import state

    dist.barrier()
    engine, written = worker.core.engine, 0
    if what == "sharded_save":
        written, peak, seconds = _measured(lambda: state.save_engine(engine, folder))
    elif what == "staged":  # a background save: blocking while staging into host memory, then the write
        buffer = state.stage_engine(engine).buffer  # a run's later checkpoints reuse the first one's buffer
        staged, peak, seconds = _measured(lambda: state.stage_engine(engine, reuse=buffer))
        t0 = time.time()
        written = state.write_staged(staged, folder)
        dist.barrier()
        return seconds, peak, written, seconds + time.time() - t0
    elif what == "sharded_load":
        _, peak, seconds = _measured(lambda: state.load_engine(engine, folder))
    elif what == "gathered_save":
        written, peak, seconds = _measured(lambda: _gathered_save(worker, folder))
    else:
        _, peak, seconds = _measured(lambda: _gathered_load(worker, folder))
    dist.barrier()
    return seconds, peak, written, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="50m", help="embedded world model preset")
    ap.add_argument("--ranks", default="1,2,4")
    args = ap.parse_args()

    from elasticrl.cluster import RoleGroup
    from elasticrl.cluster.session import ray_session
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import SFTWorker, resolve_paths

    results, params = [], 0
    ranks_list = [int(r) for r in args.ranks.split(",")]
    with ray_session(RaySpec(num_cpus=max(ranks_list))):
        for ranks in ranks_list:
            spec = load_spec({}, [f"world.model_size={args.size}", "model.dtype=fp32", f"train.num_ranks={ranks}",
                                  "train.zero_stage=3", "train.micro_batch_size=1",
                                  f"train.global_batch_size={ranks}", "train.threads=1"])
            group = RoleGroup("trainer", SFTWorker, ranks, spec_to_dict(spec), resolve_paths(spec))
            try:
                group.setup(10)
                group.call("train_step", 0)  # the moments exist
                params = group.call("__ray_call__", lambda w: sum(p.ds_numel for p in w.engine.module.parameters()))[0]
                root = Path(tempfile.mkdtemp(prefix="erl-bench-ckpt-"))
                figures = {}
                for what in ("gathered_save", "sharded_save", "staged", "gathered_load", "sharded_load"):
                    folder = root / {"gathered_load": "gathered_save", "sharded_load": "sharded_save"}.get(what, what)
                    folder.mkdir(exist_ok=True)
                    out = group.call("__ray_call__", lambda w, what=what, f=str(folder): _op(w, what, f))
                    figures[what] = {"seconds": max(o[0] for o in out), "peak": max(o[1] for o in out),
                                     "written": max(o[2] for o in out), "total": max(o[3] for o in out)}
                    print(json.dumps({"ranks": ranks, "op": what, **figures[what]}), flush=True)
                shutil.rmtree(root, ignore_errors=True)
            finally:
                group.shutdown()
            for layout in ("gathered", "sharded"):
                save, load = figures[f"{layout}_save"], figures[f"{layout}_load"]
                background = figures["staged"] if layout == "sharded" else save  # the gathered path blocks
                peak = max(save["peak"], background["peak"], load["peak"])
                results.append({"ranks": ranks, "layout": layout, "save_s": round(background["total"], 3),
                                "blocking_s": round(background["seconds"], 3), "sync_save_s": round(save["seconds"], 3),
                                "load_s": round(load["seconds"], 3), "peak_increase_gb_max_rank": round(peak / 1e9, 3),
                                "bytes_written_max_rank": save["written"]})
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"benchmark": "checkpoint", "params": params, "results": results}))


if __name__ == "__main__":
    main()
