"""Copy plans: where each checkpoint tensor lands in a vLLM worker's parameters.

vLLM's loaders fuse (q/k/v, gate/up) and slice (tensor parallelism, vocabulary padding)
with ``narrow`` views and a final ``copy_``. Running ``load_weights`` once per tensor under
a dispatch mode that records every ``copy_`` (and skips it) yields those views exactly:
destination offset/shape/strides in the worker's arena, source offset/shape/strides in the
checkpoint tensor. Replaying them is the same load without vLLM in the loop.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Copy = tuple[str, int, list[int], list[int], str, float, list[int], list[int]]
# (kind, dst byte offset in arena, dst shape, dst strides, dst dtype, src elem offset or fill
#  value, src shape, src strides); kind is "copy" (from the tensor) or "fill" (a constant,
#  e.g. the zeroed padding rows of a vocabulary shard).


class _Recorder(TorchDispatchMode):
    def __init__(self, probe: torch.Tensor, arena: torch.Tensor):
        super().__init__()
        self.probe_ptr = probe.untyped_storage().data_ptr()
        self.arena_ptr = arena.untyped_storage().data_ptr()
        self.copies: list[Copy] = []
        self.plannable = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.untyped_storage().data_ptr() != self.arena_ptr or \
                    src.untyped_storage().data_ptr() != self.probe_ptr:
                self.plannable = False  # the loader transformed the tensor: not a pure view copy
                return dst
            self.copies.append(("copy", *_dst(dst), src.storage_offset(), list(src.shape), list(src.stride())))
            return dst
        writes_arena = getattr(func, "_schema", None) is not None and func._schema.is_mutable and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.arena_ptr for a in args)
        if not writes_arena:
            return func(*args, **kwargs)
        if func is torch.ops.aten.fill_.Scalar and args[0].untyped_storage().data_ptr() == self.arena_ptr:
            if args[0].numel():
                self.copies.append(("fill", *_dst(args[0]), float(args[1]), [], []))
            return args[0]
        self.plannable = False  # another in-place write into the weights
        return args[0]


def _dst(t: torch.Tensor) -> tuple:
    return t.storage_offset() * t.element_size(), list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")


def record_copy_plans(model, model_path: str, arena: torch.Tensor) -> tuple[dict[str, list[Copy]], list[str]]:
    """Plans for every tensor of the checkpoint at ``model_path``; names without one are
    listed apart (the sender then falls back to a staged load for the whole sync)."""
    from safetensors import safe_open

    from elasticrl.weights.shards import shard_files

    plans, unplanned = {}, []
    # a second name of one parameter (a head tied to the embeddings) needs no plan: it is never
    # sent, the trainer's parameters list a tied tensor once, under its first name
    first: dict[int, str] = {}
    aliases = {n for n, p in model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}
    for path in shard_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in aliases:
                    continue
                sl = f.get_slice(name)
                probe = torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()])
                rec = _Recorder(probe, arena)
                with rec:
                    model.load_weights([(name, probe)])
                if rec.plannable and rec.copies:
                    plans[name] = rec.copies
                else:
                    unplanned.append(name)
    return plans, unplanned


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def replay(plans: list[Copy], src: torch.Tensor, arenas: dict[str, torch.Tensor]) -> int:
    """Write ``src`` into a worker arena per its plan; ``arenas`` maps dtype -> typed view."""
    written = 0
    for kind, dst_off, dst_shape, dst_stride, dtype, src_off, src_shape, src_stride in plans:
        typed = arenas[dtype]
        dst = typed.as_strided(dst_shape, dst_stride, dst_off // typed.element_size())
        if kind == "fill":
            dst.fill_(src_off)
        else:
            # as_strided offsets are absolute in the storage, and trainer tensors are often
            # views into a flat buffer (DeepSpeed's ZeRO partitions).
            dst.copy_(src.as_strided(src_shape, src_stride, src.storage_offset() + int(src_off)))
        written += dst.numel() * dst.element_size()
    return written
