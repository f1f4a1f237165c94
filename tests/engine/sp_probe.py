"""One rank of tests/engine/test_sequence.py's check: the tiny world's actor (LoRA adapters, ZeRO-2)
and critic (ZeRO-3, gradient checkpointing) on ``WORLD`` ranks at sequence-parallel size
``WORLD``, in one process group, each train one step on two rows of 2,048 and 1,512 tokens
(fp32, SDPA attention), having first measured the bytes its training forward keeps for backward
(saved tensors, each storage once). Rank 0 prints one line: PROBE {"actor": .., "critic": ..}.

  python -m tests.engine.sp_probe RANK WORLD PORT
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.environ.update(LOCAL_RANK="0", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    import torch

    from elasticrl.engine import sequence
    from elasticrl.engine.rank import TrainRank
    from elasticrl.models.load import token_values
    from elasticrl.spec import load_spec, spec_to_dict
    from elasticrl.trainers.batch import pack
    from elasticrl.trainers.rl_workers import ActorWorker, CriticWorker
    from elasticrl.world import world_paths
    from tests.conftest import EXAMPLES

    base = ["model.dtype=fp32", f"train.num_ranks={world}", f"critic.num_ranks={world}", f"train.sp_size={world}",
            "train.global_batch_size=2", "train.micro_batch_size=2", "rl.kl_coef=0.05", "rl.kl_mode=loss",
            "rl.entropy_coef=0.01", "rl.max_new_tokens=2048", "train.warmup_ratio=0", "train.lr=1e-3"]
    specs = {"actor": load_spec(EXAMPLES / "tiny_ppo.yaml", base + ["model.lora.rank=8", "model.lora.alpha=16"]),
             "critic": load_spec(EXAMPLES / "tiny_ppo.yaml", base + ["train.zero_stage=3",
                                                                     "model.gradient_checkpointing=true"])}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 100, (12,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(6, 100, (n,), generator=g).tolist() for n in (2048 - 12, 1500)]
    batch = pack(prompts, responses, 0)
    shape = batch.response_mask.shape
    batch.old_logprobs = -torch.rand(shape, generator=g) * 6
    batch.ref_logprobs = -torch.rand(shape, generator=g) * 6
    batch.advantages = torch.randn(shape, generator=g)
    batch.old_values, batch.returns = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    model = str(world_paths(specs["actor"].world)["model"])
    figures = {}
    for role, worker_class in (("actor", ActorWorker), ("critic", CriticWorker)):
        torch.manual_seed(0)
        worker = worker_class(spec_to_dict(specs[role]), model)
        if role == "actor":
            worker.setup(rank, world, "127.0.0.1", port, 1)
        else:  # the actor's process group serves the critic too
            worker.core = TrainRank(worker.spec, worker.train, model, rank, world, "127.0.0.1", port, 1,
                                    kind="value", init_dist=False)
        core = worker.core
        if world == 1:  # the kernel sequence parallelism runs (eager attention would keep every score)
            core.engine.module.set_attn_implementation("sdpa")
        core.engine.train()
        # measured on the same path whole or sliced: the rows unmasked (right padding, causal), so
        # that only the slicing differs (the masked whole forward keeps SDPA's attention weights)
        mb, positions = sequence.slice_rows(batch, core.sp_rank, world)
        seen, saved = set(), [0]

        def keep(t, seen=seen, saved=saved):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                saved[0] += t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), sequence.sliced(world > 1):
            if role == "actor":
                kept = worker._logits(mb, positions=positions)
            else:
                kept = token_values(core.engine.module, mb.input_ids, mb.attention_mask, False, positions)
        del kept
        out = type(worker).train(worker, batch, 0)  # (the instance's `train` is its TrainSpec; Ray calls the method)
        params = torch.cat([p.detach().double().flatten() for p in core.engine.module.parameters()])
        got = {k: out[k] for k in ("policy_loss_sum", "kl_loss_sum", "entropy", "grad_norm", "value_loss_sum")
               if k in out}
        if "value_loss_sum" in got:  # each rank's is its slices' share (the driver sums the ranks')
            got["value_loss_sum"] = core.sequence_sum([got["value_loss_sum"]])[0]
        got.update(saved_gb=saved[0] / 1e9, param_sum=params.sum().item(), param_sq=params.square().sum().item())
        figures[role] = got
    if rank == 0:
        print("PROBE " + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
