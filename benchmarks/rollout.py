"""Rollout throughput: vLLM (its CPU build here) against transformers ``generate``, or
(``--against vllm``) elasticrl's rollout engine against bare vLLM.

Same model (the embedded 20M-parameter Llama unless --model), same prompts, same sampling
(temperature 1, fixed length: eos ignored), same thread count, one run. With ``--against
vllm`` both sides get the engine arguments elasticrl uses (``backend.rollout_kwargs``) and
the same per-prompt seeds; elasticrl's side is a one-engine ``RolloutPool`` (a Ray actor that
also returns each token's log-prob), bare vLLM runs in this process; the two alternate.
Prints one JSON line per measurement; the last line holds the headline ratios.

  .venv/bin/python benchmarks/rollout.py [--against hf|vllm] [--threads 2] [--prompts 64] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded 20m world model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--samples", default="1,4", help="values of n (samples per prompt) to measure")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    ap.add_argument("--against", default="hf", choices=("hf", "vllm"))
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      VLLM_LOGGING_LEVEL="WARNING")
    if args.against == "vllm":
        return against_vllm(args)
    import torch

    torch.set_num_threads(args.threads)
    from elasticrl.spec.schema import WorldSpec
    from elasticrl.world import world_paths

    model = args.model or str(world_paths(WorldSpec(model_size="20m"))["model"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{i % 50}+{(7 * i) % 50}="}], tokenize=False,
                                     add_generation_prompt=True) for i in range(args.prompts)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    ns = [int(n) for n in args.samples.split(",")]
    rows = {}
    for n in ns:
        rows[("hf", n)] = _median([_hf(hf, tok, prompts, n, args.new_tokens) for _ in range(args.repeats)])
    del hf
    from vllm import LLM, SamplingParams

    from elasticrl import backend

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              worker_extension_cls="elasticrl.rollout.worker_ext.WeightReceiver")
    # vLLM as it ships (oneDNN-packed linears), then as elasticrl runs it on this CPU.
    modes = ["vllm"] + (["vllm-dense"] if not backend.has_gpu() else [])  # packed is vLLM's own
    for mode in modes:
        if mode != "vllm":
            llm.collective_rpc("erl_prepare", args=(model, mode.split("-")[1]))
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        for n in ns:
            sp = SamplingParams(n=n, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
            runs = []
            for _ in range(args.repeats):
                t0 = time.time()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
                seconds = time.time() - t0
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
                runs.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
            rows[(mode, n)] = _median(runs)
    for (engine, n), r in rows.items():
        print(json.dumps({"engine": engine, "n": n, "params": params, "threads": args.threads, **r}))
    headline = {"benchmark": "rollout", "params": params, "threads": args.threads, "prompts": args.prompts,
                "new_tokens": args.new_tokens}
    for n in ns:
        hf_rate = rows[("hf", n)]["tokens_per_s"]
        headline[f"hf_tok_s_n{n}"] = round(hf_rate, 1)
        for mode in modes:
            headline[f"{mode}_tok_s_n{n}"] = round(rows[(mode, n)]["tokens_per_s"], 1)
            headline[f"{mode}_vs_hf_n{n}"] = round(rows[(mode, n)]["tokens_per_s"] / hf_rate, 2)
    print(json.dumps(headline))


def against_vllm(args) -> None:
    from vllm import LLM, SamplingParams

    from elasticrl import backend
    from elasticrl.cluster.session import ray_session
    from elasticrl.models import load_tokenizer
    from elasticrl.rollout.pool import RolloutPool, prompt_seed
    from elasticrl.spec import load_spec
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.sft import resolve_paths

    spec = load_spec({}, ["world.model_size=20m", "rollout.max_model_len=256", "rollout.cpu_mode=packed",
                          f"rollout.cpus_per_engine={args.threads}", "rollout.gpu_memory_utilization=0.4"])
    model = args.model or resolve_paths(spec)["model"]
    tok = load_tokenizer(model)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{i % 50}+{(7 * i) % 50}="}], tokenize=False,
                                     add_generation_prompt=True) for i in range(args.prompts)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ns = [int(n) for n in args.samples.split(",")]
    rows: dict[tuple, list] = {}
    dtype = backend.resolve_dtype(spec.model.dtype)
    with ray_session(RaySpec(num_cpus=8)):
        pool = RolloutPool(model, spec.rollout, dtype, seed=0)
        llm = LLM(model=model, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], seed=0,
                  max_model_len=spec.rollout.max_model_len, load_format="safetensors",
                  **backend.rollout_kwargs(spec.rollout.gpu_memory_utilization, spec.rollout.kv_cache_gib,
                                          spec.rollout.max_model_len))
        warm = {"n": 1, "temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
        pool.generate(prompts[:4], warm)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(**warm), use_tqdm=False)
        for _ in range(args.repeats):  # the two sides alternate
            for n in ns:
                sampling = {"n": n, "temperature": 1.0, "max_tokens": args.new_tokens, "ignore_eos": True}
                t0 = time.time()
                out = pool.generate(prompts, {**sampling, "seed": 0})
                rows.setdefault(("elasticrl", n), []).append(_rate(sum(len(c.token_ids) for c in out), t0))
                params = [SamplingParams(**sampling, seed=prompt_seed(0, j, n), logprobs=0)
                          for j in range(len(prompts))]
                t0 = time.time()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
                rows.setdefault(("vllm", n), []).append(_rate(tokens, t0))
        pool.shutdown()
    headline = {"benchmark": "rollout_vs_vllm", "prompts": args.prompts, "new_tokens": args.new_tokens,
                "device": "gpu" if backend.has_gpu() else "cpu"}
    for (engine, n), runs in rows.items():
        r = _median(runs)
        print(json.dumps({"engine": engine, "n": n, **r}))
        headline[f"{engine}_tok_s_n{n}"] = round(r["tokens_per_s"], 1)
    for n in ns:
        ours, bare = headline[f"elasticrl_tok_s_n{n}"], headline[f"vllm_tok_s_n{n}"]
        headline[f"elasticrl_over_vllm_n{n}"] = round(ours / bare, 3)
    print(json.dumps(headline))


def _rate(tokens: int, t0: float) -> dict:
    seconds = time.time() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _median(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**runs[len(runs) // 2], "runs_tok_s": [round(r["tokens_per_s"], 1) for r in runs]}


def _hf(model, tok, prompts, n, new_tokens) -> dict:
    import torch

    torch.manual_seed(0)
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")  # left padding (tokenizer default)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=True, pad_token_id=tok.pad_token_id)  # warm-up
        t0 = time.time()
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                             temperature=1.0, top_k=0, num_return_sequences=n, pad_token_id=tok.pad_token_id)
        seconds = time.time() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


if __name__ == "__main__":
    main()
