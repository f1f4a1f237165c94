"""An SFT export loads in vLLM's CPU build, which agrees with transformers on it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticrl.spec import load_spec
from elasticrl.trainers.sft import run_sft

pytestmark = pytest.mark.slow


def test_sft_export_loads_in_transformers_and_vllm(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = load_spec({}, ["model.dtype=fp32", "log.progress_bar=false", "eval.enabled=false",
                          "eval.num_prompts=16", "train.max_steps=3", "checkpoint.resume=null"])
    run_sft(spec, tmp_path)
    final = tmp_path / "final"
    tok = AutoTokenizer.from_pretrained(final)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in ("12+7=", "30-4=", "5+5=")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_probe.py")), str(final),
                           json.dumps(prompts)], capture_output=True, text=True, timeout=400, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[0][len("RESULT "):])

    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    for prompt, res in zip(prompts, results):
        assert res["token_ids"], res
        seq = torch.tensor([prompt + res["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(seq).logits[0].float(), -1)
        hf_lp = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(res["token_ids"])]
        # vLLM's greedy token is transformers' argmax, with the same log-probability.
        hf_greedy = [int(logp[len(prompt) - 1 + i].argmax()) for i in range(len(res["token_ids"]))]
        assert res["token_ids"] == hf_greedy
        torch.testing.assert_close(torch.tensor(res["logprobs"]), torch.tensor(hf_lp), atol=1e-4, rtol=0)
