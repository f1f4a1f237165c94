"""Load model folders in vLLM (CPU build here) one after another, greedy-decode the same
prompts with each, print JSON: a list per folder. A peft adapter folder (adapter_config.json)
is served as a LoRA adapter on the base its config names. A plain folder after a plain one
is read by the same engine (vLLM's `reload_weights` from its path: vLLM's loader reads its
files, without a new engine's ~4 s); the first is loaded whole, its config included. A reload
fails the probe where vLLM says a weight was not loaded (its loader only warns there), or
where the engine's weights did not change while the folder's tensors did (or the reverse).

Run as a script in its own process: in-process vLLM takes over torch's thread settings and
joins an existing torch.distributed world, which a test process must not inherit.
"""
import json
import logging
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _folder_digest(folder: str) -> str:
    """SHA-256 of the tensors in ``folder``'s safetensors files, by name."""
    import hashlib

    from elasticrl.weights.shards import load_sharded

    tensors, h = load_sharded(folder), hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].float().numpy().tobytes())
    return h.hexdigest()


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(prompts_json: str, *models: str) -> None:
    import gc

    from elasticrl import backend
    from elasticrl.rollout.engine import lora_rank_bucket

    with backend.heavy_imports():  # every collection vLLM asks for would scan its modules (~0.4 s each)
        from vllm import LLM, SamplingParams
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    results, llm, last = [], None, None  # last: the tensors' digest of the plain folder llm serves
    for model in models:
        adapter = os.path.join(model, "adapter_config.json")
        lora = json.load(open(adapter)) if os.path.isfile(adapter) else None
        digest = None if lora else _folder_digest(model)
        if last is not None and not lora:
            was, warned = llm.collective_rpc("erl_state_dict", kwargs={"digest": True})[0], _Warnings()
            logging.getLogger("vllm").addHandler(warned)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
            logging.getLogger("vllm").removeHandler(warned)
            llm.reset_prefix_cache()  # the prompts' cached keys and values are the last folder's
            missing = [w for w in warned.lines if "not loaded" in w]
            now = llm.collective_rpc("erl_state_dict", kwargs={"digest": True})[0]
            changed, differs = now != was, digest != last
            if missing or changed != differs:
                sys.exit(f"{model}: reloaded wrong ({missing or ''} the engine changed: {changed}, "
                         f"the folder differs: {differs})")
        else:
            if llm is not None:
                del llm
                gc.collect()
                cleanup_dist_env_and_memory()  # the next LLM starts its own
            served = {"enable_lora": True, "max_lora_rank": lora_rank_bucket(lora["r"])} if lora else {}
            llm = LLM(model=lora["base_model_name_or_path"] if lora else model, dtype="float32",
                      enforce_eager=True, seed=0, max_model_len=128, **served,
                      worker_extension_cls="elasticrl.rollout.worker_ext.WeightReceiver")  # its digests
        last = digest
        outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(prompts_json)], params,
                            lora_request=LoRARequest("trained", 1, model) if lora else None)
        results.append([{"token_ids": list(o.outputs[0].token_ids),
                         "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                         "text": o.outputs[0].text} for o in outs])
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
