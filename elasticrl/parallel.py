"""How the ranks of a trained role divide their work: their data-parallel and AutoTP
coordinates (DeepSpeed's process groups) and which parameters AutoTP cut, along which
dimension. Both the engine (checkpoints, batches) and the weights layer (slice-to-slice
sync) ask here, so neither imports the other for it."""
from __future__ import annotations


def data_parallel_info(tp_size: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of this process; tensor-parallel peers share a dp_rank."""
    import torch.distributed as dist

    if tp_size > 1:
        from deepspeed.utils import groups

        return groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
    return dist.get_rank(), dist.get_world_size()


def tensor_parallel_rank(tp_size: int) -> int:
    """This process's AutoTP rank (0 without AutoTP)."""
    if tp_size <= 1:
        return 0
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_rank()


def autotp_cuts(engine) -> dict[int, tuple]:
    """id(parameter) -> (its AutoTP layer, the dimension AutoTP cut it along, or None for a
    fused parameter whose parts are cut apart) for every parameter AutoTP sliced."""
    if engine.autotp_size() <= 1:
        return {}
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    out = {}
    for module in engine.module.modules():
        if getattr(module, "_partition_sizes", None) is None or not getattr(module, "is_tp_parallel", False):
            continue
        for p in module.parameters(recurse=False):
            meta = getattr(p, DS_AUTOTP_UC_META, None) or {}
            if meta.get("replicated") or meta.get("partition_dim") is None:
                continue
            out[id(p)] = (module, None if meta.get("sub_param_sizes") else meta["partition_dim"])
    return out
