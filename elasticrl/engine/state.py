"""A trained model's state, saved by every rank in parallel and loaded at any layout, pickle-free.

Each rank writes only what it holds: its ZeRO-3 partitions, or (ZeRO-1/2, bf16) the fragments
of the fp32 masters and Adam moments its optimizer partition owns, or (no ZeRO wrapper) an
even share of the replicated tensors; under AutoTP each rank holds a slice of the cut
parameters (the replicated ones are saved by tensor-parallel rank 0's group). No process
ever holds a whole fp32 tensor of the model. A piece is a rectangle of a whole tensor's 2-D
view (rows = its first dimension, columns = the rest): a flat range of a rank's local slice
is at most three such rectangles. ``pieces-rankNNNNN.safetensors`` holds a rank's pieces,
with its list of (tensor, rows, columns) as JSON in the file's header; ``engine_state.json``
(written last) holds the optimizer step, the schedule, the counters and the whole shapes.

Any world size, ZeRO stage and tensor-parallel size loads it: each rank reads, through
safetensors' slices, only the byte ranges of the pieces that overlap what it holds, and
nothing goes through ``torch.load``. ``full_state`` (every tensor gathered whole on rank 0)
is kept only as the reference the tests and ``benchmarks/checkpoint.py`` compare against.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from elasticrl import backend, parallel
from elasticrl.data.records import row_share
from elasticrl.files import write_text
from elasticrl.weights.shards import safetensors_buffer, write_safetensors

ENGINE_STATE = "engine_state.json"
PIECES = "pieces-rank{:05d}.safetensors"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _inner_optimizer(engine):
    """The torch optimizer that holds the states (ZeRO and bf16 wrap it)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _wrapped(param) -> bool:
    """Whether DeepSpeed keeps the fp32 master apart (ZeRO-1/2/3, bf16): its full value is then a
    collective (a rank whose partition holds none of it still takes part)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _grid(shape) -> tuple[int, int]:
    """A tensor's 2-D view: (first dimension, the rest)."""
    shape = tuple(shape)
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def _rects(start: int, stop: int, cols: int):
    """The flat range [start, stop) of a (rows, cols) grid as rectangles: (row0, row1, col0,
    col1, flat start, flat stop), at most three (a partial row, whole rows, a partial row)."""
    while start < stop:
        r, c = divmod(start, cols)
        if c or stop - start < cols:  # a partial row
            end = min(stop, (r + 1) * cols)
            yield r, r + 1, c, c + end - start, start, end
        else:
            rows = (stop - start) // cols
            end = start + rows * cols
            yield r, r + rows, 0, cols, start, end
        start = end


@dataclass
class Held:
    """What this rank holds of one whole tensor: ``flat``, elements [start, start + numel) of
    its local slice's flat view, a (rows, cols) grid placed at (row0, col0) in the whole's."""

    name: str
    shape: tuple          # the whole tensor's
    flat: torch.Tensor    # writable view of the rank's elements
    start: int
    cols: int             # of the local slice's grid
    row0: int = 0
    col0: int = 0

    def rects(self):
        """(whole rows, whole cols, flat slice of ``flat``) of each rectangle held."""
        for r0, r1, c0, c1, a, b in _rects(self.start, self.start + self.flat.numel(), self.cols):
            yield (self.row0 + r0, self.row0 + r1), (self.col0 + c0, self.col0 + c1), slice(a - self.start,
                                                                                             b - self.start)


def trained(module):
    """(name, parameter) of what trains: every parameter, or under LoRA the adapters (the frozen
    base is the model folder's, never in a checkpoint or an export)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _held(engine, saving: bool, moments: bool):
    """Held pieces of every parameter's fp32 master and (``moments``) Adam moments on this
    rank. ``saving``: replicated copies appear once (a tensor-parallel peer's and a ZeRO-0
    data-parallel peer's share); loading, each rank takes everything it holds."""
    opt, inner = engine.optimizer, _inner_optimizer(engine)
    sliced = tp_slices(engine)
    tp_rank = parallel.tensor_parallel_rank(engine.autotp_size())
    dp_rank, dp_size = parallel.data_parallel_info(engine.autotp_size())
    for name, p in trained(engine.module):
        local = tuple(getattr(p, "ds_shape", p.shape))
        whole, row0, col0 = list(local), 0, 0
        if id(p) in sliced:
            layer, dim = sliced[id(p)]
            offset = sum(layer._partition_sizes[:layer.tp_index])
            whole[dim] = sum(layer._partition_sizes)
            row0, col0 = (offset, 0) if dim == 0 else (0, offset)
        elif saving and tp_rank:
            continue
        numel, cols = math.prod(local), _grid(local)[1]
        for key in (None, *(_ADAM_KEYS if moments else ())):
            if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition of the flat parameter
                size = p.partition_numel()
                start = opt._get_param_partition_rank(p) * size
                part = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)[0]
                flat = part[:max(0, min(size, numel - start))]
            elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2, bf16: the fragment this rank's partition owns
                if p._hp_mapping is None:
                    continue
                start, flat = p._hp_mapping.lp_fragment_address.start, p._hp_mapping.get_hp_fragment(key)
            else:  # the module's parameter is the master, replicated over data-parallel ranks
                full = (p.data if key is None else inner.state[p][key]).view(-1)
                share = row_share(numel, dp_size, dp_rank) if saving else slice(0, numel)
                start, flat = share.start, full[share]
            if flat.numel():
                yield Held(name if key is None else f"{key}.{name}", tuple(whole), flat, start, cols, row0, col0)


def _stepped(engine) -> bool:
    return any(len(s) for s in _inner_optimizer(engine).state.values())


@dataclass
class Staged:
    """A rank's pieces copied into one host buffer (pinned on a GPU) at a step's end, to be
    written while training goes on; rank 0's also carries the engine's counters."""

    rank: int
    tensors: list          # (key, tensor): views of one host buffer, or of the live tensors
    metadata: dict
    engine_state: dict | None
    buffer: torch.Tensor | None = None  # the host buffer, for the next save to reuse


def stage_engine(engine, copy: bool = True, reuse: torch.Tensor | None = None) -> Staged:
    """What this rank holds of the fp32 masters and moments, copied into host memory (into
    ``reuse``, the previous save's buffer, when it has the size: its pages are warm), or, not
    ``copy``, as views of the live tensors, to be written before training goes on. Local: no
    collective, so ranks stage and go on independently."""
    moments = _stepped(engine)
    if moments:
        _link_states(engine)
    engine_state = None
    if dist.get_rank() == 0:
        inner, sched = _inner_optimizer(engine), engine.lr_scheduler
        steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
        engine_state = {"world_size": dist.get_world_size(), "tp_size": engine.autotp_size(), "moments": moments,
                        "optimizer_step": steps[0] if steps else 0.0,
                        "scheduler": {"last_epoch": sched.last_epoch, "step_count": sched._step_count,
                                      "last_lr": sched.get_last_lr()},
                        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                        "skipped_steps": engine.skipped_steps}
    return stage(dist.get_rank(), list(_held(engine, saving=True, moments=moments)), engine_state, copy, reuse)


def stage(rank: int, held: list[Held], engine_state: dict | None = None, copy: bool = True,
          reuse: torch.Tensor | None = None) -> Staged:
    """``held``'s rectangles copied into one host buffer (pinned on a GPU; ``reuse`` when it
    has the size), or (not ``copy``) as views of the held tensors, with the list that names them."""
    pinned = copy and backend.has_gpu()
    size = sum(h.flat.numel() for h in held) if copy else 0
    buf = reuse if reuse is not None and reuse.numel() == size else \
        torch.empty(size, dtype=torch.float32, pin_memory=pinned)
    tensors, pieces, shapes, used = [], [], {}, 0
    for h in held:
        shapes[h.name] = list(h.shape)
        for rows, cols, part in h.rects():
            n = part.stop - part.start
            if copy:
                buf[used:used + n].copy_(h.flat[part], non_blocking=pinned)
            piece = buf[used:used + n] if copy else h.flat[part]
            tensors.append((str(len(pieces)), piece.view(rows[1] - rows[0], cols[1] - cols[0])))
            pieces.append([h.name, *rows, *cols])
            used += n
    if pinned:
        backend.synchronize()
    return Staged(rank, tensors, {"pieces": json.dumps(pieces), "shapes": json.dumps(shapes)}, engine_state,
                  buf if copy else None)


def write_staged(staged: Staged, folder: str | Path) -> int:
    """Write staged pieces into ``folder`` (which exists); returns the bytes written. Each file
    appears whole or not at all, so the folder is complete once every rank's is there."""
    folder = Path(folder)
    written = write_safetensors(folder / PIECES.format(staged.rank), staged.tensors, staged.metadata)
    if staged.engine_state is not None:
        write_text(folder / ENGINE_STATE, json.dumps(staged.engine_state, indent=2))
    return written


def staged_files(staged: Staged, reuse: torch.Tensor | None = None) -> dict:
    """What ``write_staged`` writes, built in memory: {file name: bytes, or the pieces file as
    one uint8 tensor (``reuse``: the previous one, when it has the size)}."""
    out = {PIECES.format(staged.rank): safetensors_buffer(staged.tensors, staged.metadata, reuse)}
    if staged.engine_state is not None:
        out[ENGINE_STATE] = json.dumps(staged.engine_state, indent=2).encode()
    return out


def save_engine(engine, folder: str | Path) -> int:
    """This rank's share of the engine's state into ``folder``, now (no staging copy)."""
    return write_staged(stage_engine(engine, copy=False), folder)


class Pieces:
    """The pieces of a saved folder, read by byte range: ``fill`` copies into a held range."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        world = json.loads((folder / ENGINE_STATE).read_text()).get("world_size")
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"{folder / ENGINE_STATE}: no world_size; the checkpoint is damaged: resume from "
                             "another (checkpoint.resume: PATH) or start fresh (checkpoint.resume: null)")
        self.files, self.shapes, self.where = [], {}, {}
        for rank in range(world):
            path = folder / PIECES.format(rank)
            if not path.is_file():
                raise ValueError(f"{folder}: {path.name} is missing; the checkpoint is incomplete: resume from "
                                 "another (checkpoint.resume: PATH) or start fresh (checkpoint.resume: null)")
            f = safe_open(str(path), framework="pt")
            self.files.append(f)
            meta = f.metadata()
            self.shapes.update(json.loads(meta["shapes"]))
            for i, (name, r0, r1, c0, c1) in enumerate(json.loads(meta["pieces"])):
                self.where.setdefault(name, []).append((f, str(i), r0, r1, c0, c1))
        self.folder = folder

    def fill(self, held: Held) -> None:
        if held.name not in self.where:
            raise ValueError(f"{self.folder}: the checkpoint has no {held.name!r}; it was written for another model")
        if list(held.shape) != self.shapes[held.name]:
            raise ValueError(f"{self.folder}: {held.name!r} is {self.shapes[held.name]} in the checkpoint and "
                             f"{list(held.shape)} in the model; it was written for another model")
        for (r0, r1), (c0, c1), part in held.rects():
            dst, got = held.flat[part].view(r1 - r0, c1 - c0), 0
            for f, key, pr0, pr1, pc0, pc1 in self.where[held.name]:
                a, b, c, d = max(r0, pr0), min(r1, pr1), max(c0, pc0), min(c1, pc1)
                if a < b and c < d:
                    dst[a - r0:b - r0, c - c0:d - c0] = f.get_slice(key)[a - pr0:b - pr0, c - pc0:d - pc0]
                    got += (b - a) * (d - c)
            if got != dst.numel():
                raise ValueError(f"{self.folder}: the pieces of {held.name!r} do not cover it; the checkpoint is "
                                 "damaged: resume from another or start fresh (checkpoint.resume: null)")

    def whole(self, name: str) -> torch.Tensor:
        """One tensor whole (tests, tools; a training rank never calls it)."""
        shape = self.shapes[name]
        out = torch.empty(_grid(shape), dtype=torch.float32)
        self.fill(Held(name, tuple(shape), out.view(-1), 0, out.shape[1]))
        return out.view(shape)


def whole_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every saved tensor whole, by name (``exp_avg.NAME`` for a moment): for tests and tools."""
    pieces = Pieces(folder)
    return {name: pieces.whole(name) for name in sorted(pieces.shapes)}


def load_engine(engine, folder: str | Path) -> None:
    """Restore what ``save_engine`` wrote into a freshly built engine (of any layout): each rank
    reads the byte ranges it holds, then the 16-bit weights follow the masters."""
    folder = Path(folder)
    state = json.loads((folder / ENGINE_STATE).read_text())
    inner = _inner_optimizer(engine)
    if state["moments"]:
        init_adam_states(engine, state["optimizer_step"])
    pieces = Pieces(folder)
    with torch.no_grad():
        for held in _held(engine, saving=False, moments=state["moments"]):
            pieces.fill(held)
        if hasattr(engine.optimizer, "update_lp_params"):  # ZeRO-1/2, bf16: gather the masters into the weights
            engine.optimizer.update_lp_params()
        for _, p in trained(engine.module):
            if hasattr(p, "ds_id"):  # ZeRO-3: this rank's weight partition from its master
                p.ds_tensor.data.copy_(engine.optimizer._get_fp32_opt_state_partition(p, False)[0])
    sched = engine.lr_scheduler
    sched.last_epoch = state["scheduler"]["last_epoch"]
    sched._step_count = state["scheduler"]["step_count"]
    sched._last_lr = list(state["scheduler"]["last_lr"])
    for group, lr in zip(inner.param_groups, sched._last_lr):
        group["lr"] = lr
    engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]


def full_state(engine) -> tuple[dict, dict]:
    """(weights, moments) by parameter name, gathered whole on rank 0 (empty elsewhere): the old
    gather-to-one-process layout, kept as the tests' and the benchmark's reference. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    inner = _inner_optimizer(engine)
    stepped = _stepped(engine)
    if stepped:
        _link_states(engine)
    sliced = tp_slices(engine)
    weights, moments = {}, {}
    for name, p in trained(engine.module):
        for key in (None, *(_ADAM_KEYS if stepped else ())):
            if _wrapped(p):
                t = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
            else:
                t = p.detach().float() if key is None else inner.state[p][key]
            if id(p) in sliced:
                layer, dim = sliced[id(p)]
                t = layer._all_gather_shards(t.to(p.device).contiguous(), layer._partition_sizes, dim)
            if dist.get_rank() == 0:
                (weights if key is None else moments)[name if key is None else f"{key}.{name}"] = \
                    t.detach().cpu().clone()
    return weights, moments


def tp_slices(engine) -> dict[int, tuple]:
    """id(parameter) -> (its AutoTP layer, the dimension AutoTP cut it along), for the
    parameters each tensor-parallel rank holds a slice of (none without AutoTP)."""
    cuts = parallel.autotp_cuts(engine)
    for module, dim in cuts.values():
        if dim is None:  # fused projections (q, k and v in one weight) slice each part
            raise NotImplementedError(f"checkpoints of AutoTP-sliced fused parameters ({type(module).__name__}) "
                                      "are not supported yet; checkpoint at train.tp_size: 1")
    for p in engine.module.parameters():
        if id(p) in cuts and cuts[id(p)][1] == 1 and p.dim() != 2:
            raise NotImplementedError(f"checkpoints of a {p.dim()}-D parameter AutoTP cut along dimension 1 are "
                                      "not supported; checkpoint at train.tp_size: 1")
    return cuts


def saved_world_size(folder: str | Path) -> int:
    return json.loads((Path(folder) / ENGINE_STATE).read_text())["world_size"]


def init_adam_states(engine, step: float) -> None:
    """Create AdamW's per-parameter state as its first step would (zeros, then overwritten
    by the saved moments), so the partitions the moments load into exist."""
    inner = _inner_optimizer(engine)
    # ZeRO-3 hands its flat fp32 partitions to the torch optimizer only for the length of a step
    flat = [p for g in inner.param_groups for p in g["params"]] + list(
        getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))
    for p in flat:
        if not inner.state.get(p):
            inner.state[p] = {"step": torch.tensor(step, dtype=torch.float32),
                              "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                              "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        else:
            inner.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
    _link_states(engine)


def _link_states(engine) -> None:
    """Point ZeRO-1/2's and bf16's per-parameter fragments at the optimizer states. DeepSpeed
    links them once, right after the first step of the first parameter group, when the other
    groups' states do not exist yet (their fragments stay empty): link them again."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
