"""Copy plans: where each checkpoint tensor lands in a vLLM worker's parameters.

vLLM's loaders fuse (q/k/v, gate/up) and slice (tensor parallelism, vocabulary padding)
with ``narrow`` views and a final ``copy_``. Running ``load_weights`` once per tensor under
a dispatch mode that records every ``copy_`` (and skips it) yields those views exactly:
destination offset/shape/strides in the worker's parameters, source offset/shape/strides in the
checkpoint tensor. Replaying them is the same load without vLLM in the loop.

A destination is named by the worker's parameter (its index in ``named_parameters``) and a
byte offset inside it, so a plan holds wherever the parameters live: in a shared-memory arena
(``shm``), in device memory opened by another process (``ipc``), or where vLLM put them
(the sliced ``broadcast``, whose receiver replays the copies itself).
"""
from __future__ import annotations

import bisect

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Copy = tuple[str, int, int, list[int], list[int], str, float, list[int], list[int]]
# (kind, dst parameter index, dst byte offset in it, dst shape, dst strides, dst dtype, src elem
#  offset or fill value, src shape, src strides); kind is "copy" (from the tensor) or "fill" (a
#  constant, e.g. the zeroed padding rows of a vocabulary shard).


class _Recorder(TorchDispatchMode):
    def __init__(self, probe: torch.Tensor, params: list[torch.Tensor]):
        super().__init__()
        self.probe_ptr = probe.untyped_storage().data_ptr()
        # parameters by address: a write lands in the one whose bytes hold its first element
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i) for i, p in enumerate(params))
        self.starts = [s[0] for s in spans]
        self.spans = spans
        self.copies: list[Copy] = []
        self.plannable = True

    def _param(self, t: torch.Tensor):
        k = bisect.bisect_right(self.starts, t.data_ptr()) - 1
        if k >= 0 and t.data_ptr() < self.spans[k][1]:
            return self.spans[k][2], t.data_ptr() - self.spans[k][0]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            where = self._param(dst)
            if where is None or src.untyped_storage().data_ptr() != self.probe_ptr:
                self.plannable = False  # the loader transformed the tensor: not a pure view copy
                return dst
            self.copies.append(("copy", *where, *_dst(dst), src.storage_offset(), list(src.shape), list(src.stride())))
            return dst
        written = [a for a in args[:1] if isinstance(a, torch.Tensor) and self._param(a) is not None]
        if not (getattr(func, "_schema", None) is not None and func._schema.is_mutable and written):
            return func(*args, **kwargs)
        if func is torch.ops.aten.fill_.Scalar:
            if args[0].numel():
                self.copies.append(("fill", *self._param(args[0]), *_dst(args[0]), float(args[1]), [], []))
            return args[0]
        self.plannable = False  # another in-place write into the weights
        return args[0]


def _dst(t: torch.Tensor) -> tuple:
    return list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")


def record_copy_plans(model, model_path: str) -> tuple[dict[str, list[Copy]], list[str]]:
    """Plans for every tensor of the checkpoint at ``model_path``; names without one are
    listed apart (the sender then falls back to a staged load for the whole sync)."""
    from safetensors import safe_open

    from elasticrl.weights.shards import shard_files

    plans, unplanned = {}, []
    params = [p for _, p in model.named_parameters()]
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
                rec = _Recorder(probe, params)
                with rec:
                    model.load_weights([(name, probe)])
                if rec.plannable and rec.copies:
                    plans[name] = rec.copies
                else:
                    unplanned.append(name)
    return plans, unplanned


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def replay(plans: list[Copy], src: torch.Tensor, arena: "Arena") -> int:
    """Write ``src`` into a worker's parameters per its plan; the bytes written."""
    written = 0
    for kind, param, dst_off, dst_shape, dst_stride, dtype, src_off, src_shape, src_stride in plans:
        dst = arena.view(param, dst_off, dst_shape, dst_stride, dtype)
        if kind == "fill":
            dst.fill_(src_off)
        else:
            # as_strided offsets are absolute in the storage, and trainer tensors are often
            # views into a flat buffer (DeepSpeed's ZeRO partitions).
            dst.copy_(src.as_strided(src_shape, src_stride, src.storage_offset() + int(src_off)))
        written += dst.numel() * dst.element_size()
    return written


class Arena:
    """A worker's parameters as one buffer another process mapped (shared memory, or device
    memory opened over CUDA IPC), with each parameter's byte offset in it."""

    def __init__(self, buffer: torch.Tensor, offsets: list[int]):
        from elasticrl.weights.shm import DTYPES

        self.typed = {name: buffer.view(dt) for name, dt in DTYPES.items()}
        self.offsets = offsets

    def view(self, param: int, offset: int, shape, strides, dtype: str) -> torch.Tensor:
        typed = self.typed[dtype]
        return typed.as_strided(shape, strides, (self.offsets[param] + offset) // typed.element_size())

