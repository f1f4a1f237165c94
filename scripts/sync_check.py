"""The weights layer's sliced transports between plain torch processes: no Ray, vLLM or DeepSpeed.

T sender processes hold AutoTP slices of a Llama-shaped model (q/k/v/gate/up cut by rows,
o/down by columns, the head by vocabulary rows, the rest whole); T' receiver processes lay
their parameters out as vLLM's tensor-parallel workers do (q/k/v fused into qkv and gate/up
into gate_up, each part cut by rows; o/down by columns; embedding and head by vocabulary
rows; norms whole), described by copy plans like those vLLM's loaders record. Each transport
moves the slices with the project's own code (``elasticrl.weights.slices``, ``receive``,
``group``, the transports' senders and receivers) and every receiver checks its parameters
bit-exact against the slices cut from the full tensors here (``--delta``: after a second sync
that sends only what an update changed). Transports: ``p2p`` (a gloo or NCCL group, point to point), ``ipc``
(buckets in the senders' own buffers that the receivers map: CUDA IPC on a GPU, /dev/shm on
CPU; a message and an answer per bucket, as Ray carries them in the product) and ``arena`` (the
receivers' parameters in one /dev/shm buffer the senders write into; CPU only). Figures:
GB/s per transport against this process's copy bandwidth.

  python scripts/sync_check.py [--device cpu|cuda] [--senders 2] [--receivers 1,2,4] [--hidden 512]
Prints JSON lines; exits non-zero when a receiver's weights differ.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elasticrl import backend  # noqa: E402
from elasticrl.weights import receive, shm, slices  # noqa: E402
from elasticrl.weights.group import new_group  # noqa: E402
from elasticrl.weights.plan import Arena  # noqa: E402
from elasticrl.weights.transports.broadcast import Outbox, receive_sliced  # noqa: E402
from elasticrl.weights.transports.ipc import SharedOutbox  # noqa: E402
from elasticrl.weights.transports.shm import write_piece  # noqa: E402

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def model_shapes(hidden: int, layers: int, vocab: int, heads: int, kv_heads: int) -> dict[str, tuple]:
    head_dim, inter = hidden // heads, 4 * hidden
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _kind(name: str) -> str:
    if any(f".{c}." in name for c in COLUMN):
        return "column"
    if ".o_proj." in name or ".down_proj." in name:
        return "row"
    return "vocab" if "embed_tokens" in name or "lm_head" in name else "whole"


def trainer_layouts(shapes: dict, tp: int) -> dict[str, slices.Layout]:
    """AutoTP's training cuts: column-parallel rows, row-parallel columns, the head's vocabulary rows."""
    out = {}
    for name, shape in shapes.items():
        kind = _kind(name)
        if kind == "whole" or name.startswith("model.embed_tokens"):
            out[name] = slices.Layout(shape)
            continue
        dim = 1 if kind == "row" else 0
        out[name] = slices.Layout(shape, dim, tuple([shape[dim] // tp] * tp))
    return out


def vllm_worker(shapes: dict, rank: int, tp: int):
    """(parameter shapes, copy plans) of one vLLM-style tensor-parallel worker."""
    params: dict[str, tuple] = {}
    plans: dict[str, list] = {}
    for name, shape in shapes.items():
        kind, module = _kind(name), name.rsplit(".", 2)[-2]
        target = name.replace(module, FUSED[module][0]) if module in FUSED else name
        if kind == "row":
            cols = shape[1] // tp
            params[target] = (shape[0], cols)
            plans[name] = [(target, 0, [shape[0], cols], [cols, 1], rank * cols, [shape[0], cols], [shape[1], 1])]
        elif kind == "whole":
            params[target] = shape
            plans[name] = [(target, 0, list(shape), [1], 0, list(shape), [1])]
        else:  # rows, appended to the fused parameter's earlier parts
            rows, start = shape[0] // tp, params.get(target, (0,))[0]
            params[target] = (start + rows, shape[1])
            plans[name] = [(target, start * shape[1] * 4, [rows, shape[1]], [shape[1], 1], rank * rows * shape[1],
                            [rows, shape[1]], [shape[1], 1])]
    names = list(params)
    return [params[n] for n in names], {
        name: [("copy", names.index(t), off, ds, dst, "float32", so, ss, st) for t, off, ds, dst, so, ss, st in cs]
        for name, cs in plans.items()}


def full_tensors(shapes: dict, changed: bool = False) -> dict[str, torch.Tensor]:
    """The model's full tensors; ``changed``: after an update that moved every 97th element of
    each (what ``--delta``'s second sync sends)."""
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    if changed:
        for t in full.values():
            t.view(-1)[::97] += 1.0
    return full


def _sender(rank: int, args, port: int, arenas_info, queues, results) -> None:
    device = _device(args, rank)
    shapes = model_shapes(args.hidden, args.layers, args.vocab, args.heads, args.kv_heads)
    layouts = trainer_layouts(shapes, args.senders)
    versions = [full_tensors(shapes, changed) for changed in ((False, True) if args.delta else (False,))]
    syncs = [{n: _cut(full[n], layouts[n], rank).to(device) for n in shapes} for full in versions]
    pieces = _pieces(shapes, layouts, args)
    bucket = args.bucket_mb * 2**20
    group = None
    if args.transport == "p2p":
        group = new_group("127.0.0.1", port, rank, args.senders + args.receivers, backend_name(args), 300)
        boxes = [Outbox(group, args.senders + w, pieces[w][rank], bucket, device)
                 for w in range(args.receivers)]
        group.barrier().wait()
    elif args.transport == "ipc":  # the sender's buffers, a message per bucket, as Ray carries them
        inboxes, acks = queues

        def load(worker, sender, slot, handle, bucket_, counts=None):
            inboxes[worker].put((sender, slot, handle, bucket_, counts))
            return worker

        boxes = [SharedOutbox(load, rank, w, pieces[w][rank], bucket, device,
                                     wait=lambda worker, k=rank: acks[k][worker].get(timeout=300))
                 for w in range(args.receivers)]
        results.put(("ready", rank, 0, 0.0))
        _wait_file(args, "go")
    else:
        arenas = [Arena(shm.attach(path, nbytes), offsets) for path, nbytes, offsets in arenas_info]
        results.put(("ready", rank, 0, 0.0))
        _wait_file(args, "go")
    for local in syncs:  # with --delta, the second sends what changed since the first (what it counts)
        t0 = time.perf_counter()
        sent, delta = 0, slices.Delta() if args.delta else None
        for name, t in local.items():
            for w in range(args.receivers):
                for piece in pieces[w][rank]:
                    if piece.name == name:
                        sent += write_piece(arenas[w], piece, t) if args.transport == "arena" else \
                            boxes[w].put(piece, t, delta)
        if args.transport == "ipc":
            for box in boxes:
                box.finish()
    if args.transport == "ipc":
        for box in boxes:
            inboxes[box.worker].put(None)  # this sender is done
    backend.synchronize()
    if group is not None:
        group.barrier().wait()
    results.put(("sender", rank, sent, time.perf_counter() - t0))
    if args.transport == "ipc":
        _wait_file(args, "exit")  # the receivers map this process's buffers until they are checked
        for box in boxes:
            box.close()


def _receiver(rank: int, args, port: int, arena_queue, queues, results) -> None:
    device = _device(args, args.senders + rank)
    shapes = model_shapes(args.hidden, args.layers, args.vocab, args.heads, args.kv_heads)
    layouts = trainer_layouts(shapes, args.senders)
    param_shapes, _ = vllm_worker(shapes, rank, args.receivers)
    pieces = _pieces(shapes, layouts, args)
    params = [torch.zeros(s, device=device) for s in param_shapes]
    if args.transport == "p2p":
        group = new_group("127.0.0.1", port, args.senders + rank, args.senders + args.receivers, backend_name(args),
                          300)
        schedule = slices.receive_order(dict(enumerate(pieces[rank])), {n: i for i, n in enumerate(shapes)},
                                        args.bucket_mb * 2**20)
        group.barrier().wait()
        for _ in range(2 if args.delta else 1):
            receive_sliced(group, params, schedule, delta=args.delta)
        backend.synchronize()
        group.barrier().wait()
    elif args.transport == "ipc":  # what the engine's worker does (transports/ipc.py's Receiver.load_pieces)
        inboxes, acks = queues
        mapped, done = {}, 0
        while done < args.senders:
            message = inboxes[rank].get(timeout=300)
            if message is None:
                done += 1
                continue
            sender, slot, handle, bucket, counts = message
            if mapped.get((sender, slot), (None,))[0] != handle:
                mapped[(sender, slot)] = (handle, shm.open_shared(handle))
            receive.copy_pieces(params, mapped[(sender, slot)][1], bucket, counts)
            backend.synchronize()
            acks[sender][rank].put(True)
    else:
        offsets, total = [], 0
        for shape in param_shapes:
            offsets.append(total)
            total += shm.aligned(torch.Size(shape).numel() * 4)
        path, buf = shm.create(total, "check")
        arena_queue.put((rank, (path, total, offsets)))
        params = [shm.view(buf, o, torch.float32, tuple(s)) for o, s in zip(offsets, param_shapes)]
        _wait_file(args, "done")
        shm.release(path)
    want = _expected(shapes, rank, args.receivers, param_shapes, args.delta)
    bad = [i for i, (p, w) in enumerate(zip(params, want)) if not torch.equal(p.cpu(), w)]
    results.put(("receiver", rank, len(bad), 0.0))
    _wait_file(args, "exit")


def _expected(shapes: dict, rank: int, tp: int, param_shapes: list, changed: bool) -> list[torch.Tensor]:
    """The worker's parameters cut from the full tensors directly, by the vLLM layout."""
    full = full_tensors(shapes, changed)
    out: dict[str, list] = {}
    for name, t in full.items():
        kind, module = _kind(name), name.rsplit(".", 2)[-2]
        if kind in ("column", "vocab"):
            n = t.shape[0] // tp
            target = name.replace(module, FUSED[module][0]) if module in FUSED else name
            out.setdefault(target, []).append(t[rank * n:(rank + 1) * n])
        elif kind == "row":
            n = t.shape[1] // tp
            out[name] = [t[:, rank * n:(rank + 1) * n]]
        else:
            out[name] = [t]
    return [torch.cat(parts) for parts in out.values()]


def _pieces(shapes, layouts, args) -> list[list[list]]:
    load = [0] * args.senders
    return [slices.worker_pieces(vllm_worker(shapes, w, args.receivers)[1], layouts, args.senders, load)
            for w in range(args.receivers)]


def _cut(t: torch.Tensor, layout: slices.Layout, rank: int) -> torch.Tensor:
    box = layout.box(rank)
    for dim, (lo, hi) in enumerate(box):
        t = t.narrow(dim, lo, hi - lo)
    return t.contiguous()


def _device(args, index: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    backend.set_local_device(index % len(backend.gpus()))
    return backend.current_device()


def backend_name(args) -> str:
    return "gloo" if args.device == "cpu" else "nccl"


def _wait_file(args, name: str) -> None:
    path = Path(args.flags) / name
    while not path.exists():
        time.sleep(0.005)


def run(args) -> dict:
    """One transport with fresh processes; returns its figures."""
    import tempfile

    # a fork server that imported what this script imports (torch, elasticrl) once: each process
    # of each layout is forked from it in milliseconds, with no CUDA context to inherit. By
    # name: Python 3.11's server imports neither "__main__" nor anything from the script's folder
    # (it is given no path), and each process imported torch itself (1.2-2.5 s a process here)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "elasticrl.backend", "elasticrl.weights.group",
                                "elasticrl.weights.plan", "elasticrl.weights.receive", "elasticrl.weights.shm",
                                "elasticrl.weights.slices"])
    results, arena_queue = ctx.Queue(), ctx.Queue()
    queues = ([ctx.Queue() for _ in range(args.receivers)],
              [[ctx.Queue() for _ in range(args.receivers)] for _ in range(args.senders)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.flags = tempfile.mkdtemp(prefix="erl-sync-check-")
    procs, arenas_info = [], None
    try:
        for r in range(args.receivers):
            procs.append(ctx.Process(target=_receiver, args=(r, args, port, arena_queue, queues, results)))
            procs[-1].start()
        if args.transport == "arena":
            got = dict(arena_queue.get(timeout=300) for _ in range(args.receivers))
            arenas_info = [got[r] for r in range(args.receivers)]
        for k in range(args.senders):
            procs.append(ctx.Process(target=_sender, args=(k, args, port, arenas_info, queues, results)))
            procs[-1].start()
        rows = []
        if args.transport != "p2p":  # the senders start together, once every process is up
            rows = [results.get(timeout=300) for _ in range(args.senders)]
            (Path(args.flags) / "go").touch()
        while len([r for r in rows if r[0] == "sender"]) < args.senders:
            rows.append(results.get(timeout=600))
        (Path(args.flags) / "done").touch()
        while len([r for r in rows if r[0] == "receiver"]) < args.receivers:
            rows.append(results.get(timeout=600))
        (Path(args.flags) / "exit").touch()
        for p in procs:
            p.join(timeout=120)
    finally:  # a failed layout leaves neither its processes nor its go/done/exit flags
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(args.flags, ignore_errors=True)
    sent = [r[2] for r in sorted(x for x in rows if x[0] == "sender")]
    seconds = max(r[3] for r in rows if r[0] == "sender")
    bad = sum(r[2] for r in rows if r[0] == "receiver")
    return {"transport": args.transport, "senders": args.senders, "receivers": args.receivers,
            "bytes_by_sender": sent, "seconds": round(seconds, 5), "gbps": round(sum(sent) / 1e9 / seconds, 3),
            "bit_exact": bad == 0, "exit_codes": [p.exitcode for p in procs]}


def deepspeed_step(args) -> int:
    """Three ZeRO-1 AdamW steps of a 4-layer MLP of width --hidden in one process; the loss must fall."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(args.hidden, args.hidden),
                                                               torch.nn.GELU())])
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config={"train_micro_batch_size_per_gpu": 64, "zero_optimization": {"stage": 1},
                                              "bf16": {"enabled": args.device != "cpu"}})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, args.hidden, generator=g).to(engine.device)
    dtype = next(engine.module.parameters()).dtype
    losses, times = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        loss = (engine(x.to(dtype)).float() ** 2).mean()
        engine.backward(loss)
        engine.step()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    print(json.dumps({"deepspeed_step": deepspeed.__version__, "device": str(engine.device),
                      "losses": [round(v, 5) for v in losses], "seconds": [round(t, 4) for t in times]}))
    return 0 if losses[-1] < losses[0] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if backend.has_gpu() else "cpu")
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--receivers", default="1,2,4")
    ap.add_argument("--transports", default=None, help="p2p (a gloo/NCCL group), ipc (the senders' shared "
                    "buffers: CUDA IPC, /dev/shm on CPU), arena (the receivers' /dev/shm arenas, CPU only); "
                    "default: all that apply")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--delta", action="store_true", help="sync twice, the second as a delta (rollout.delta_sync) "
                    "of an update that moved every 97th element, over p2p and ipc; figures are the second's")
    ap.add_argument("--deepspeed-step", action="store_true", help="instead: time DeepSpeed training steps of a "
                    "plain torch model on this device (bare GPU machines that carry its wheel)")
    args = ap.parse_args(argv)
    if args.deepspeed_step:
        return deepspeed_step(args)
    shapes = model_shapes(args.hidden, args.layers, args.vocab, args.heads, args.kv_heads)
    nbytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    if args.device != "cpu":
        backend.set_local_device(0)
    copy = backend.device_copy_gbps(nbytes)
    print(json.dumps({"measure": "copy", "device": args.device, "gbytes": round(nbytes / 1e9, 4),
                      "gbps": round(copy, 3)}), flush=True)
    ok = True
    arena = "" if args.delta else ",arena"  # a delta is a payload sent (the arenas are written whole)
    for transport in (args.transports or ("p2p,ipc" + arena if args.device == "cpu" else "p2p,ipc")).split(","):
        for receivers in (int(r) for r in args.receivers.split(",")):
            if transport == "p2p" and args.device != "cpu" and len(backend.gpus()) < args.senders + receivers:
                print(json.dumps({"transport": transport, "receivers": receivers, "skipped": "NCCL wants a GPU "
                                  f"per process: {args.senders + receivers} processes, {len(backend.gpus())} GPUs"}))
                continue
            row = {**run(argparse.Namespace(**{**vars(args), "transport": transport, "receivers": receivers})),
                   **({"delta": True} if args.delta else {})}
            row["ratio_to_copy"] = round(row["gbps"] / copy, 3)
            ok &= row["bit_exact"] and set(row["exit_codes"]) == {0}
            print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
