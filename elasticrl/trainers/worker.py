"""One base for the rank workers of every trained role (OpenRLHF's ``BaseModelActor``): a Ray
actor holding one rank's DeepSpeed engine (``engine.rank.TrainRank``) and answering what
every driver asks of any trained rank: set-up, checkpoints and the in-memory copy, the
export, the weight sync into the rollout engines, its threads, and ``placement.offload_idle``.
A worker (SFT, preference, reward model, actor, critic) adds only its data and its steps."""
from __future__ import annotations

import time

import ray
import torch

from elasticrl import backend
from elasticrl.engine.rank import TrainRank
from elasticrl.spec import load_spec

# what a trainer rank's set-up imports (backend.import_heavy)
TRAINER_IMPORTS = ("deepspeed", "transformers.models.auto.modeling_auto")


class RankWorker:
    kind = "causal"  # or "value": a scalar head on the model (critic, reward models)

    def __init__(self, spec: dict, model_path: str, train_overrides: dict | None = None, lr: float | None = None):
        """``train_overrides``: this role's own train settings (the critic's ranks and batch
        split); ``lr``: its own learning rate."""
        self.spec = load_spec(spec)
        self.model_path = model_path
        self.train = self.spec.train if not train_overrides else load_spec(
            spec, [f"train.{k}={v}" for k, v in train_overrides.items()]).train
        self.lr = lr

    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        """Join the role's process group and build the engine (from ``resume``'s checkpoint
        folder of this role, or the model)."""
        imported, t0 = backend.import_heavy(*TRAINER_IMPORTS), time.time()
        self.core = TrainRank(self.spec, self.train, self.model_path, rank, world_size, addr, port, total_steps,
                              lr=self.lr, kind=self.kind, resume=resume)
        self.rank = rank
        return {"dtype": self.core.dtype, "import_s": imported, "load_s": time.time() - t0}

    def threads(self): return torch.get_num_threads()
    def save(self, folder, background=False): return self.core.save(folder, background)
    def saved(self, wait=True): return self.core.saved(wait)
    def node_id(self): return ray.get_runtime_context().get_node_id()

    def copy_to(self, keepers: list, role: str, step: int) -> None:
        """Hand this rank's state of step ``step`` (what ``save`` writes) to its keeper
        (``trainers.copies``), and return once it holds it."""
        ray.get(keepers[self.rank].put.remote(role, self.rank, step, self.core.snapshot()))

    def export(self, folder): self.core.export(folder)
    def attach_rollout(self, *args): return self.core.attach_rollout(*args)
    def sync_weights(self, version): return self.core.sync_weights(version)
    def detach_rollout(self): self.core.detach_rollout()

    def idle_states(self, on_host: bool) -> None:
        """``placement.offload_idle`` on GPUs: gradients and optimizer state (moments and master
        weights) to host memory after the update, back before the next; the 16-bit weights stay
        for experience and the weight sync."""
        if not (self.spec.placement.offload_idle and backend.has_gpu()):
            return
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as T

        if on_host:
            self.core.engine.offload_states(include=[T.optim_states, T.hp_params, T.lp_grads,
                                                     T.contiguous_grad_buffer], device=OffloadDeviceEnum.cpu)
        else:
            self.core.engine.reload_states()
