"""`elasticrl doctor`: passes on this machine with the tiny job, and fails with the fix for
each thing a user gets wrong before a long run."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import EXAMPLES, run_cli, run_clis


def _lines(out: str) -> dict[str, tuple[str, str]]:
    """check -> (status, detail) from the report."""
    found = {}
    for line in out.splitlines():
        status, _, rest = line.partition("  ")
        check, _, detail = rest.strip().partition("  ")
        found[check.strip()] = (status.strip(), detail.strip())
    return found


def test_doctor_passes_the_tiny_job_here(tmp_path):
    res = run_cli("doctor", str(EXAMPLES / "tiny_grpo.yaml"), "--output", str(tmp_path / "run"))
    found = _lines(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(found) == {"packages", "platform", "collective", "ports", "model", "data", "output", "shared memory",
                          "memory fit"}
    assert all(status in ("ok", "warn") for status, _ in found.values()), res.stdout
    assert found["collective"] == ("ok", "gloo all-reduce between two processes: 1 + 2 = 3")
    assert not (tmp_path / "run").exists()  # checking the output folder makes nothing


def test_doctor_fails_naming_the_fix_for_each_mistake(tmp_path):
    import pandas as pd

    big = tmp_path / "big"  # a 70B config: its weights cannot fit this machine's /dev/shm
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                                                 "num_attention_heads": 64, "num_key_value_heads": 8,
                                                 "intermediate_size": 28672, "vocab_size": 128256}))
    pd.DataFrame([{"prompt": "1+1="}]).to_parquet(tmp_path / "no_answer.parquet")
    (tmp_path / "a_file").write_text("")
    res, on_proc = run_clis(
        ["doctor", str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"model.path={big}",
         "--set", f"data.train={tmp_path / 'no_answer.parquet'}", "--output", str(tmp_path / "a_file" / "run")],
        # /proc takes no files, even from root
        ["doctor", str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"model.path={tmp_path / 'missing'}",
         "--output", "/proc/elasticrl-run"])
    found = _lines(res.stdout)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: 5 check(s) failed")
    assert found["model"] == ("fail", f"model.path: {big} has no weights (no *.safetensors)")
    assert found["data"] == ("fail", f"data.train: {tmp_path / 'no_answer.parquet'}: no field 'answer'; set data.*_key "
                                     "in the spec to the names your data uses (it has ['prompt'])")
    assert found["output"] == ("fail", f"--output {tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file; "
                                       "fix: give a folder")
    assert found["shared memory"][0] == "fail" and "fix: enlarge it" in found["shared memory"][1]
    assert found["memory fit"][0] == "fail"

    found = _lines(on_proc.stdout)
    assert found["output"][0] == "fail" and found["output"][1].startswith("--output /proc/elasticrl-run: /proc is not "
                                                                         "writable")
    assert on_proc.returncode == 1 and found["model"] == (
        "fail", f"model.path: {tmp_path / 'missing'} has no config.json; give a Hugging Face model folder")
    assert found["shared memory"][0] == "warn"  # what depends on the model's size is not guessed



def test_doctor_names_heads_that_vllms_cpu_attention_cannot_compute(tmp_path):
    """A model whose heads have 16 values: vLLM's CPU attention has no kernel for them, so the
    check says so (and the fix) instead of the engines failing after Ray started."""
    import shutil

    import pytest

    from elasticrl import backend
    from elasticrl.doctor import Problem, _model
    from elasticrl.spec import load_spec
    from elasticrl.world.build import world_paths

    if backend.has_gpu() or not backend.uses_vllm("auto"):
        pytest.skip("vLLM's CPU attention is what refuses such heads")
    folder = tmp_path / "model"
    shutil.copytree(world_paths(load_spec(EXAMPLES / "tiny_grpo.yaml").world)["model"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    with pytest.raises(Problem, match=r"^rollout.backend: vLLM's CPU attention takes heads of 32, 64, .* values, and "
                                      r"this model's heads have 16 \(.*/config.json\); set rollout.backend: hf"):
        _model(load_spec(EXAMPLES / "tiny_grpo.yaml", [f"model.path={folder}"]))
    assert _model(load_spec(EXAMPLES / "tiny_grpo.yaml", [f"model.path={folder}", "rollout.backend=hf"]))



def test_tree_memory_divides_a_shared_page_between_its_mappers_in_pss_and_walks_the_tree():
    """Two children map one 64 MiB file in /dev/shm and touch every page, a third touches 64 MiB
    of its own: the three count alike in RSS, but in PSS each mapper 32 MiB less than the
    owner (the shared pages divided between two), and this process's tree holds all three."""
    import subprocess
    import sys

    from elasticrl.backend import tree_memory

    mib = 2**20
    shared = Path("/dev/shm") / f"erl-test-pss-{os.getpid()}"
    shared.write_bytes(b"\1" * (64 * mib))
    touch = "s = sum(m[i] for i in range(0, len(m), 4096)); print('ready', flush=True); time.sleep(60)"
    mapper = "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); " + touch
    owner = "import sys, time; m = bytearray(b'\\1') * (64 * 2**20); " + touch
    before = tree_memory()
    kids = [subprocess.Popen([sys.executable, "-c", code, str(shared)], stdout=subprocess.PIPE, text=True)
            for code in (mapper, mapper, owner)]
    try:
        assert all(k.stdout.readline().strip() == "ready" for k in kids)
        each = [tree_memory(k.pid) for k in kids]
        after = tree_memory()
    finally:
        for k in kids:
            k.kill()
            k.wait()
        shared.unlink()
    for m in each[:2]:
        assert abs(m["rss"] - each[2]["rss"]) < 4 * mib, each
        assert abs(each[2]["pss"] - m["pss"] - 32 * mib) < 4 * mib, each
    assert after["rss"] - before["rss"] > 3 * 64 * mib and after["pss"] - before["pss"] > 2 * 64 * mib


def test_modules_skipped_hides_a_module_from_imports_inside_the_block_only():
    """What an engine's vLLM import runs under (inductor's lowering skipped): inside, importing
    the module fails as a missing one does; after, it imports; one already imported stays."""
    import subprocess
    import sys

    code = ("import sys\nfrom elasticrl.backend import modules_skipped\n"
            "with modules_skipped(['wave', 'json']):\n"
            "    try:\n        import wave\n        print('imported')\n"
            "    except ImportError:\n        print('absent')\n"
            "    import json\n    print('json', json.dumps(1))\n"
            "import wave\nprint('after', wave.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split("\n")[:3] == ["absent", "json 1", "after wave"], out.stdout + out.stderr
