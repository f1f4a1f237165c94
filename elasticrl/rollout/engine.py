"""One vLLM engine in a Ray actor: generate, score, receive weights, sleep and wake.

The engine is stateless apart from its weights and their version, so it can be restarted
and re-synced at any time. The log-probs it returns with each completion are those of the
distribution the token was sampled from (vLLM's ``processed_logprobs``: after temperature,
top-k and top-p), which with top_k 0 and top_p 1 is softmax(logits / temperature), the
trainer's; ``score`` returns raw log-probs (temperature 1). A weight sync is atomic from the engine's view: generation
waits while a sync is in progress, and every completion carries the version it was
generated with.

vLLM's CPU build has no sleep mode. On CPU ``sleep`` either keeps the engine resident
(``cpu_sleep: keep``, the default; logged once with the memory it keeps) or shuts it down
and ``wake`` starts it again (``cpu_sleep: restart``; the next sync brings the weights).

An engine built with ``lora_rank`` serves a LoRA-trained policy as vLLM's LoRA: its base weights
are the model folder's for good, each sync brings the adapters, and every request uses them.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from elasticrl import backend
from elasticrl.rollout.sample import Sample

log = logging.getLogger(__name__)

SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_tokens", "stop", "min_tokens", "stop_token_ids",
                 "ignore_eos"}


class RolloutEngine:
    def __init__(self, model_path: str, tp_size: int, dtype: str, seed: int, max_model_len: int,
                 cpu_mode: str, cpu_sleep: str, gpu_memory_utilization: float, kv_cache_gib: float,
                 trust_remote_code: bool, lora_rank: int = 0, quantization: str | None = None):
        """``quantization``: vLLM's way of loading a base that trains in 4 bits under served adapters."""
        self.model_path = model_path
        self.lora_rank, self.quantization = lora_rank, quantization
        self.args = dict(tp_size=tp_size, dtype=backend.resolve_dtype(dtype), seed=seed, max_model_len=max_model_len,
                         gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
                         trust_remote_code=trust_remote_code)
        self.cpu_mode = backend.cpu_rollout_mode(cpu_mode)
        self.cpu_sleep = cpu_sleep
        self.gate = SyncGate()
        # the actor serves calls in threads (max_concurrency): one collective_rpc at a time
        # (``_rpc``); vLLM's client of a multiprocess engine (TP > 1) is a ZeroMQ socket that
        # aborts the process when two threads send at once. Callers that need an order keep it.
        self._rpc_lock = threading.Lock()
        self.asleep: set[str] = set()  # on a GPU: what of vLLM's memory sleeps
        self.incarnation = 0  # bumps at every (re)start: senders re-attach to new buffers
        self.llm = None
        self._start()

    def _start(self) -> None:
        t0 = time.time()
        # vLLM patches inductor's lowering at import, for graphs it compiles; CPU engines run
        # eager and never lower: ~1 s of each engine's start (a vLLM that needs it imports it)
        skipped = () if backend.has_gpu() else ("torch._inductor.lowering",)
        backend.quiet_vllm()
        try:
            with backend.heavy_imports(), backend.modules_skipped(skipped):
                from vllm import LLM
        except ImportError:
            with backend.heavy_imports():
                from vllm import LLM

        a = self.args
        self.import_seconds, t0 = time.time() - t0, time.time()
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": lora_rank_bucket(self.lora_rank),
                **({"quantization": self.quantization} if self.quantization else {})} if self.lora_rank else {}
        self.llm = LLM(model=self.model_path, tensor_parallel_size=a["tp_size"], dtype=_VLLM_DTYPE[a["dtype"]],
                       # a restarted engine must not replay the samples of its first life
                       seed=a["seed"] + 1000 * self.incarnation, max_model_len=a["max_model_len"],
                       trust_remote_code=a["trust_remote_code"],
                       worker_extension_cls="elasticrl.rollout.worker_ext.WeightReceiver",
                       load_format="safetensors",  # never a pickled checkpoint
                       use_tqdm_on_load=False,
                       # the sampled tokens' log-probs under the distribution they were drawn from
                       # (after temperature, top-k, top-p), as the trainer scores them
                       logprobs_mode="processed_logprobs",
                       # An engine's TP workers live on its node, as processes of this actor
                       # (inside Ray, vLLM would otherwise pick its Ray executor).
                       distributed_executor_backend="mp" if a["tp_size"] > 1 else None,
                       **lora, **backend.rollout_kwargs(a["gpu_memory_utilization"], a["kv_cache_gib"],
                                                        a["max_model_len"]))
        self.prepared = self._rpc(  # served adapters leave the base weights as loaded
            "erl_prepare", args=(self.model_path, "lora" if self.lora_rank else self.cpu_mode))[0]
        self.start_seconds = time.time() - t0
        self.incarnation += 1

    def _rpc(self, method: str, args: tuple = ()) -> list:
        """``method`` on every worker of the engine (``worker_ext``), one call at a time."""
        with self._rpc_lock:
            return self.llm.collective_rpc(method, args=args)

    def info(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "version": self.gate.version, "start_seconds": self.start_seconds,
                "import_seconds": self.import_seconds, "tp_size": self.args["tp_size"],
                "dtype": self.args["dtype"], **self.prepared}

    # --- generation ---------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: dict, seeds: list[int] | None = None) -> list[Sample]:
        """Completions for token-id prompts; ``sampling`` holds SamplingParams fields, ``seeds``
        one seed per prompt (``pool.prompt_seed``) or None for unseeded sampling."""
        from vllm import SamplingParams

        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"sampling: unknown setting(s) {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}")
        params = [SamplingParams(**sampling, seed=None if seeds is None else seeds[i], logprobs=0)
                  for i in range(len(prompts))]
        self.wake()  # the KV cache, when the hybrid loop woke only the weights for a sync
        outs, version = self.gate.run(lambda: self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self._adapter()))
        results = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                results.append(Sample(i, list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                                      c.text, c.finish_reason, version))
        return results

    def busy(self) -> float:
        return self.gate.busy_s

    def score(self, sequences: list[list[int]]) -> tuple[list[list[float]], int]:
        """log p(token_t | tokens_<t) for t >= 1 of each sequence, and the weight version."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        self.wake()
        outs, version = self.gate.run(lambda: self.llm.generate(
            [{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False, lora_request=self._adapter()))
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])]
                for o, s in zip(outs, sequences)], version

    def _adapter(self):
        """The trained adapter's request once a sync brought it (before, the base is the policy:
        a new adapter adds nothing); its path only names the base (the tensors came by sync)."""
        from vllm.lora.request import LoRARequest

        from elasticrl.rollout.worker_ext import ADAPTER_ID

        return LoRARequest("elasticrl", ADAPTER_ID, self.model_path) if self.lora_rank and self.gate.version else None

    # --- weights ------------------------------------------------------------------------
    def begin_sync(self) -> int:
        """Block generation until ``finish_sync``; returns the engine's incarnation."""
        self.gate.begin()
        return self.incarnation

    def finish_sync(self, version: int) -> None:
        self._rpc("erl_finish")
        # Cached prefixes hold keys/values of the old weights (FACTS: off by up to 4.9 nats).
        self.llm.reset_prefix_cache()
        self.gate.finish(version)

    def copy_plans(self) -> list[dict]:
        """Per worker, in tensor-parallel rank order: where each checkpoint tensor lands in it.
        Every trainer rank asks at once: the first records them, the others get them."""
        return self._rpc("erl_copy_plans", args=(self.model_path,))

    def weights(self, transport: str, method: str, *args) -> list:
        """``method`` of every worker's receiver of ``transport`` (``weights.transports``): each
        worker's answer, in tensor-parallel rank order."""
        return self._rpc("erl_weights", args=(transport, method, args))

    def worker_weights(self, digest: bool = False) -> list[dict]:
        return self._rpc("erl_state_dict", args=(digest,))

    # --- hybrid engine ------------------------------------------------------------------
    def sleep(self) -> dict:
        t0 = time.time()
        if backend.has_gpu():
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
            return {"slept": "vllm_sleep", "seconds": time.time() - t0}
        if self.cpu_sleep == "restart":
            self._shutdown()
            return {"slept": "restart", "seconds": time.time() - t0}
        if not getattr(self, "_warned_sleep", False):
            log.warning("vLLM's CPU build has no sleep mode: rollout engine keeps %.2f GiB resident during "
                        "training (set rollout.cpu_sleep: restart to free it at a restart cost)", _rss_gib())
            self._warned_sleep = True
        return {"slept": "kept", "seconds": 0.0, "rss_gib": _rss_gib()}

    def wake(self, tags: list[str] | None = None) -> dict:
        """Wake what slept; on a GPU ``tags`` wakes a part (vLLM's "weights" or "kv_cache"): the
        hybrid loop wakes the weights for the sync and the KV cache comes back with the next
        rollout, so the trainer's memory and both never overlap."""
        t0 = time.time()
        if backend.has_gpu():
            wanted = self.asleep & set(tags or self.asleep)
            if wanted:
                self.llm.wake_up(tags=sorted(wanted))
                self.asleep -= wanted
        elif self.llm is None:
            self._start()  # weights are those of model_path until the next sync
            self.gate.version = 0
        return {"seconds": time.time() - t0}

    def _shutdown(self) -> None:
        if self.llm is None:
            return
        self._rpc("erl_release_all")
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # multi-process engines hang at exit without it
        self.llm = None
        import gc

        gc.collect()

    def shutdown(self) -> None:
        """Before the pool ends this process: an in-process engine only gives back its
        shared-memory buffers (vLLM's teardown, set off by dropping the engine, runs three full
        collections and frees nothing that the process's end does not)."""
        if self.args["tp_size"] == 1 and self.llm is not None:
            self._rpc("erl_release_all")
        else:
            self._shutdown()


class SyncGate:
    """Generation and weight syncs exclude each other; completions carry the version."""

    def __init__(self):
        self.version = 0
        self._cond = threading.Condition()
        self._syncing = False
        self._busy = False
        self.busy_s = 0.0  # seconds spent generating or scoring (the pool's engine idle share)

    def run(self, fn):
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing and not self._busy)
            self._busy = True
            version = self.version
        t0 = time.time()
        try:
            return fn(), version
        finally:
            with self._cond:
                self.busy_s += time.time() - t0
                self._busy = False
                self._cond.notify_all()

    def begin(self) -> None:
        """Hold generation for a sync (again, when a sync that failed on another engine left
        this one holding: syncs come from one sender, one at a time)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            self._syncing = True

    def finish(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._syncing = False
            self._cond.notify_all()


_VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def lora_rank_bucket(r: int) -> int:
    """The least of the ranks vLLM sizes its LoRA buffers for that holds ``r``."""
    return next(k for k in (1, 8, 16, 32, 64, 128, 256, 320, 512) if k >= r)


def _rss_gib() -> float:
    with open(f"/proc/{os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0
