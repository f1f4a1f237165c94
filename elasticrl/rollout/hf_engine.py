"""A transformers ``generate`` engine with the vLLM engine's interface.

Only for machines where vLLM cannot be installed (``rollout.backend: hf``, or ``auto``
without vLLM): it is several times slower, batches without paging, and receives weights
whole (shm_staged, broadcast and files; shm stages too): writing slices needs vLLM's loaders' copy plans.
"""
from __future__ import annotations

import time

import torch

from elasticrl import backend
from elasticrl.rollout.engine import SAMPLING_KEYS, SyncGate
from elasticrl.rollout.sample import Sample
from elasticrl.weights import receive, transports


class HFRolloutEngine:
    def __init__(self, model_path: str, tp_size: int, dtype: str, seed: int, max_model_len: int,
                 cpu_mode: str, cpu_sleep: str, gpu_memory_utilization: float, kv_cache_gib: float,
                 trust_remote_code: bool, lora_rank: int = 0, quantization: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lora_rank or quantization:
            raise ValueError("the transformers engine takes merged weights (rollout.lora_sync: merged)")
        if tp_size != 1:
            raise ValueError("rollout.tp_size: the transformers fallback engine has no tensor parallelism; use 1")
        t0 = time.time()
        self.dtype = backend.resolve_dtype(dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32 if self.dtype == "fp32" else torch.bfloat16,
            trust_remote_code=trust_remote_code, use_safetensors=True).to(backend.current_device()).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.params = dict(self.model.named_parameters())
        self.max_model_len = max_model_len
        self.seed = seed
        self.gate = SyncGate()
        self.start_seconds = time.time() - t0

    def info(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "version": self.gate.version, "start_seconds": self.start_seconds, "tp_size": 1,
                "dtype": self.dtype, "mode": "hf"}

    def busy(self) -> float:
        return self.gate.busy_s

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: dict, seeds: list[int] | None = None) -> list[Sample]:
        """As the vLLM engine's; ``generate`` samples a batch from one generator, so only the
        first prompt's seed is used (samples depend on the batch, unlike vLLM's)."""
        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"sampling: unknown setting(s) {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}")
        return self.gate.run(lambda: self._generate(prompts, sampling, seeds))[0]

    def _generate(self, prompts, sampling, seeds):
        n = sampling.get("n", 1)
        temperature = sampling.get("temperature", 1.0)
        if seeds:
            torch.manual_seed(seeds[0])
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        device = backend.current_device()
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)  # n rows per prompt
        kwargs = dict(do_sample=temperature > 0, max_new_tokens=sampling.get("max_tokens", 16), pad_token_id=pad,
                      return_dict_in_generate=True, output_scores=True,
                      eos_token_id=None if sampling.get("ignore_eos") else eos,
                      min_new_tokens=sampling.get("min_tokens", 0))
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k", 0))
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        new = out.sequences[:, width:]
        # the scores after temperature, top-k and top-p: the distribution sampled, as vLLM reports
        logp = torch.stack(out.scores, 1).float().log_softmax(-1)
        results = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            finish = "length"
            if eos in tokens and not sampling.get("ignore_eos"):
                tokens = tokens[: tokens.index(eos) + 1]
                finish = "stop"
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            stops = [s for s in sampling.get("stop") or [] if s in text]
            if stops:  # as vLLM: generation ends at the token that completes a stop string
                end = next(k for k in range(1, len(tokens) + 1)
                           if any(s in self.tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stops))
                tokens, finish = tokens[:end], "stop"
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                text = text[: min(text.index(s) for s in stops if s in text)]
            results.append(Sample(row // n, tokens, [logp[row, t, tok].item() for t, tok in enumerate(tokens)], text,
                                  finish, self.gate.version))
        return results

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> tuple[list[list[float]], int]:
        def run():
            out = []
            for s in sequences:
                logits = self.model(torch.tensor([s], device=backend.current_device())).logits[0].float()
                lp = logits.log_softmax(-1)
                out.append([lp[t - 1, s[t]].item() for t in range(1, len(s))])
            return out
        return self.gate.run(run)

    # --- weights: the transports' receivers, this actor as their one worker -------------
    def erl_land(self, weights, message: dict) -> int:
        if message["kind"] == "adapter":
            raise ValueError("weight sync: the transformers engine takes merged weights, not adapters")
        for name, t in weights:
            if name not in self.params:
                raise ValueError(f"weight sync: {name!r} is not a parameter of the rollout model")
            self.params[name].data.copy_(t)
        return receive.nbytes_of(weights)

    def erl_params(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def erl_plans(self) -> None:
        return None  # nothing plans where transformers' parameters take a tensor: whole tensors only

    def erl_rank(self) -> int:
        return 0

    def erl_device(self) -> torch.device:
        return backend.current_device()

    def begin_sync(self) -> int:
        self.gate.begin()
        return 1

    def finish_sync(self, version: int) -> None:
        self.gate.finish(version)

    def copy_plans(self) -> list[dict]:
        return [{"plans": {}, "unplanned": ["(transformers engine)"]}]

    def weights(self, transport: str, method: str, *args) -> list:
        """As the vLLM engine's: this actor is its only worker."""
        return [transports.receiver(self, transport, method, args)]

    def sleep(self) -> dict:
        return {"slept": "kept", "seconds": 0.0}

    def wake(self, tags: list[str] | None = None) -> dict:
        return {"seconds": 0.0}

    def shutdown(self) -> None:
        transports.release_receivers(self)
