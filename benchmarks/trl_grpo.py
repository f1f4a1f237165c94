"""TRL's side of benchmarks/rl_step.py, run in benchmarks/.trl-venv (benchmarks/trl_env.sh).

TRL's GRPOTrainer on the model folder and prompts it is given, with the numbers of
benchmarks/rl_step.yaml: 16 prompts x 4 completions of exactly 128 tokens (no end of
sequence; ``--tokens`` and ``--batch`` change them for benchmarks/long_cot.py), KL 0.04
(TRL's k3) to a frozen reference, one AdamW step per 64 completions,
HF generate. Prints one JSON line per step: its seconds, the seconds inside generate, the
completion tokens, and the time since this process started.

  benchmarks/.trl-venv/bin/python benchmarks/trl_grpo.py MODEL PROMPTS.jsonl --steps 3 --dtype bf16
"""
from __future__ import annotations

import argparse
import json
import time

T0 = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts", help="JSON lines with 'prompt' (the text the engines see) and 'answer'")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="/tmp/trl-grpo")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens, exactly (benchmarks/long_cot.py)")
    ap.add_argument("--batch", type=int, default=64, help="completions a step (4 per prompt), one AdamW step")
    args = ap.parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(ln) for ln in open(args.prompts)]
    tok = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    timing = {"generate": 0.0, "tokens": 0}
    generate = model.generate

    def timed_generate(*a, **kw):
        t = time.time()
        out = generate(*a, **kw)
        timing["generate"] += time.time() - t
        return out

    model.generate = timed_generate

    def exact_answer(prompts, completions, answer, **_):
        timing["tokens"] += sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in completions)
        return [1.0 if c.strip().split("\n")[0].strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t = time.time()
            timing.update(generate=0.0, tokens=0)

        def on_step_end(self, _args, state, *_, **__):
            print(json.dumps({"step": state.global_step, "seconds": time.time() - self.t,
                              "generate": timing["generate"], "completion_tokens": timing["tokens"],
                              "since_start": time.time() - T0}), flush=True)

        def on_log(self, _args, state, _control, logs=None, **__):
            print(json.dumps({"log": logs or {}}), flush=True)

    cfg = GRPOConfig(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch,
                     gradient_accumulation_steps=1, num_generations=4, max_completion_length=args.tokens,
                     generation_kwargs={"min_new_tokens": args.tokens}, beta=0.04, learning_rate=1e-6,
                     lr_scheduler_type="constant", warmup_steps=0, temperature=1.0, use_cpu=True,
                     bf16=args.dtype == "bf16", gradient_checkpointing=False, shuffle_dataset=False,
                     logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=1234)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Steps()])
    trainer.train()


if __name__ == "__main__":
    main()
