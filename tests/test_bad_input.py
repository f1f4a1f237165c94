"""Bad input, table-driven: each case is what a user could type or hand over. Each must end
with its exit code and one line (``error: ...``) naming the field or the file, no traceback,
before any worker starts, and leave nothing in a fresh output folder. The commands run in
this process (the real typer app, as ``elasticrl`` runs it) to keep the suite to seconds."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES

GRPO, DPO, SFT, RM = (str(EXAMPLES / f"tiny_{n}.yaml") for n in ("grpo", "dpo", "sft", "rm"))
GOOD_RL = '{"prompt": "1+1=", "answer": "2"}\n'
GOOD_PAIR = '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'


def _file(name: str, content: str | bytes):
    """A setup step: write ``content`` to tmp/NAME; the case's args name it as {NAME}."""
    def make(tmp: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def _checkpoint(files: dict[str, str | bytes]):
    def make(tmp: Path) -> None:
        for name, content in files.items():
            _file(f"ckpt/{name}", content)(tmp)
    return make


def _offline_hub(tmp: Path) -> dict:
    """A setup step: an empty Hugging Face cache under tmp/hf, offline (the environment it returns)."""
    return {"HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1"}


def _model(**changes: str | bytes | None):
    """A setup step: tmp/model, a copy of the tiny world's model folder with files changed
    (bytes or text, or a function giving them), cut to half their size (``"half"``) or removed
    (None)."""
    def make(tmp: Path) -> None:
        import shutil

        from elasticrl.spec import load_spec
        from elasticrl.world.build import world_paths

        folder = tmp / "model"
        shutil.copytree(world_paths(load_spec(GRPO).world)["model"], folder)
        for name, content in changes.items():
            content = content() if callable(content) else content
            path = folder / name.replace("__", ".")
            if content is None:
                path.unlink()
            elif content == "half":
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            else:
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def _with_head_dim(head_dim: int) -> str:
    """The tiny world's model config with heads of ``head_dim`` values."""
    from elasticrl.spec import load_spec
    from elasticrl.world.build import world_paths

    config = json.loads((world_paths(load_spec(GRPO).world)["model"] / "config.json").read_text())
    return json.dumps({**config, "head_dim": head_dim})


STATE = json.dumps({"format": 3, "step": 2, "spec": {}})
INDEX = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
# (id, setup steps, command line ({tmp} is the case's folder), exit code, what the line must say)
def _running(tmp: Path) -> None:
    """An output folder as a running job has it: its spec (1 rollout engine), no finished.json."""
    (tmp / "run").mkdir()
    shutil.copy(GRPO, tmp / "run" / "spec.yaml")


def _no_slurm(tmp: Path) -> dict:
    """A PATH (an empty folder) without Slurm's commands."""
    (tmp / "bin").mkdir()
    return {"PATH": str(tmp / "bin")}


def _no_kube_config(tmp: Path) -> dict:
    """An empty kube config: no cluster to reach."""
    (tmp / "kubeconfig").write_text("")
    return {"KUBECONFIG": str(tmp / "kubeconfig")}


CASES = [
    # the spec file itself
    ("spec-missing", [], ["run", "{tmp}/nope.yaml"], 2, "{tmp}/nope.yaml not found"),
    ("spec-is-a-folder", [_file("d/x", "")], ["run", "{tmp}/d"], 2, "{tmp}/d is a folder"),
    ("spec-binary", [_file("s.yaml", b"\x89PNG\r\n\x1a\n\x00\x92")], ["run", "{tmp}/s.yaml"], 2, "not a text file"),
    ("spec-empty", [_file("s.yaml", "# nothing\n")], ["run", "{tmp}/s.yaml"], 2, "{tmp}/s.yaml: the spec is empty"),
    ("spec-bad-yaml", [_file("s.yaml", "train: [1,\n")], ["run", "{tmp}/s.yaml"], 2, "not valid YAML"),
    ("spec-duplicate-key", [_file("s.yaml", "algorithm: sft\nseed: 1\nseed: 2\n")], ["run", "{tmp}/s.yaml"], 2,
     "line 3, column 1: not valid YAML (field 'seed' is written twice (first at line 2)"),
    ("spec-a-list", [_file("s.yaml", "- algorithm: sft\n")], ["run", "{tmp}/s.yaml"], 2,
     "the top level must be a mapping"),
    ("field-typo", [], ["run", GRPO, "--set", "trian.lr=1"], 2, "trian: unknown field; did you mean 'train'?"),
    ("nested-typo", [], ["run", GRPO, "--set", "train.lrr=1"], 2, "train.lrr: unknown field; did you mean 'lr'?"),
    ("algorithm-typo", [], ["run", GRPO, "--set", "algorithm=grop"], 2, "did you mean 'grpo'?"),
    # the transports are the modules of elasticrl/weights/transports (a new one is a new module)
    ("transport-typo", [], ["run", GRPO, "--set", "rollout.weight_sync=broadcst"], 2,
     "rollout.weight_sync: unknown transport 'broadcst' (did you mean 'broadcast'?); choose auto or one of "
     "broadcast, files, ipc, shm, shm_staged"),
    ("token-budget-dpo", [], ["run", DPO, "--set",
                              "train.max_tokens_per_micro_batch=512"], 2,
     "train.max_tokens_per_micro_batch: dpo's micro-batches are counted in rows"),
    ("sequence-parallel-packed", [], ["run", GRPO, "--set", "train.sp_size=2", "--set", "train.num_ranks=2", "--set",
                                      "data.packing=true"], 2,
     "train.sp_size: slices padded rows; packed rows need their block masks whole: set data.packing: false"),
    ("lr-nan", [], ["run", GRPO, "--set", "train.lr=.nan"], 2, "train.lr: expected a finite number > 0, got nan"),
    ("lr-inf", [], ["run", GRPO, "--set", "train.lr=.inf"], 2, "train.lr: expected a finite number"),
    ("lr-negative", [], ["run", GRPO, "--set", "train.lr=-1e-3"], 2, "train.lr: expected a number > 0"),
    ("seed-huge", [], ["run", GRPO, "--set", "seed=100000000000000000000000000"], 2,
     "seed: expected an integer in [0, 4294967295]"),
    ("seed-negative", [], ["run", GRPO, "--set", "seed=-1"], 2, "seed: expected an integer in [0, 4294967295]"),
    ("int-is-bool", [], ["run", GRPO, "--set", "train.micro_batch_size=true"], 2, "train.micro_batch_size"),
    ("int-is-text", [], ["run", GRPO, "--set", "rl.num_steps=ten"], 2, "rl.num_steps: expected a positive integer"),
    ("section-is-list", [], ["run", GRPO, "--set", "train=[1, 2]"], 2, "train: expected a section"),
    ("batch-not-a-multiple", [], ["run", GRPO, "--set", "train.global_batch_size=7"], 2, "train.global_batch_size"),
    ("tp-not-dividing", [], ["run", GRPO, "--set", "train.tp_size=3"], 2, "train.tp_size: must divide"),
    ("offload-without-zero3", [], ["run", GRPO, "--set", "train.offload_params=true", "--set",
                                   "train.zero_stage=2"], 2, "train.offload_params: needs train.zero_stage: 3"),
    ("lora-with-iterative-dpo", [], ["run", DPO, "--set", "algorithm=iterative_dpo", "--set", "model.lora.rank=8"], 2,
     "model.lora.rank: adapters do not train with iterative_dpo yet (sft, rm, prm, dpo, kto, grpo, ppo, reinforce++, "
     "rloo take them); set model.lora.rank: 0 to train every weight"),
    ("lora-under-autotp", [], ["run", SFT, "--set", "model.lora.rank=8", "--set", "train.tp_size=2"], 2,
     "model.lora.rank: adapters do not train under AutoTP; set train.tp_size: 1"),
    ("lora-rank-negative", [], ["run", SFT, "--set", "model.lora.rank=-1"], 2, "model.lora.rank: expected"),
    ("temperature-zero", [], ["run", GRPO, "--set", "rl.temperature=0"], 2, "rl.temperature"),
    ("min-tokens-too-many", [], ["run", GRPO, "--set", "rl.min_tokens=999"], 2, "rl.min_tokens: 999 is more than"),
    ("model-path-missing", [], ["run", GRPO, "--set", "model.path={tmp}/no-model"], 2, "model.path: {tmp}/no-model"),
    ("model-hub-id-unknown", [_offline_hub], ["run", GRPO, "--set", "model.path=acme/no-such-model"], 2,
     "model.path: 'acme/no-such-model' is neither a folder here nor in the Hugging Face cache ({tmp}/hf/hub), and "
     "the Hub is not reachable (HF_HUB_OFFLINE is set); download it where it is (huggingface-cli download "
     "acme/no-such-model)"),
    ("data-missing", [], ["run", GRPO, "--set", "data.train={tmp}/none.jsonl"], 2,
     "data.train: {tmp}/none.jsonl not found; give a data file"),
    ("reward-not-a-path", [], ["run", GRPO, "--set", "rewards.functions=[{path: mymod.score}]"], 2,
     "rewards.functions[0].path: 'mymod.score' is not an import path"),
    ("reward-not-importable", [], ["run", GRPO, "--set", "rewards.functions=[{path: 'no_such_mod:score'}]"], 2,
     "rewards.functions[0].path: cannot import 'no_such_mod:score'"),
    ("reward-url", [], ["run", GRPO, "--set", "rewards.remote=[{url: 'ftp://x'}]"], 2, "rewards.remote[0].url"),
    ("reward-model-missing", [], ["run", GRPO, "--set", "rewards.models=[{path: '{tmp}/rm'}]"], 2,
     "rewards.models[0].path"),
    ("on-error-typo", [], ["run", GRPO, "--set", "rewards.on_error=skip"], 2,
     "rewards.on_error: expected one of 'fail', 'zero', 'drop_sample'"),
    ("reward-timeout-zero", [], ["run", GRPO, "--set", "rewards.timeout_s=0"], 2, "rewards.timeout_s"),
    ("set-without-value", [], ["run", GRPO, "--set", "train.lr"], 2, "--set 'train.lr': expected FIELD.PATH=VALUE"),
    ("set-into-a-leaf", [], ["run", GRPO, "--set", "seed.x=1"], 2,
     "seed: --set 'seed.x=1': this field is not a section"),
    # the output folder
    ("output-is-a-file", [_file("out", "mine\n")], ["run", GRPO], 2, "--output {tmp}/out is a file"),
    ("output-under-a-file", [_file("f", "mine\n")], ["run", GRPO, "--output", "{tmp}/f/run"], 2,
     "--output {tmp}/f/run: Not a directory"),
    # data files: named with their line, before Ray starts
    ("rl-data-bare-number", [_file("d.jsonl", GOOD_RL + "5\n")], ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2,
     "{tmp}/d.jsonl:2: expected a JSON object (one record per line), got int 5"),
    ("rl-data-not-utf8", [_file("d.jsonl", GOOD_RL.encode() + b'{"prompt": "\xff"}\n')],
     ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2, "{tmp}/d.jsonl:2: not UTF-8 text"),
    ("rl-data-bad-json", [_file("d.jsonl", "{prompt: 1}\n")], ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2,
     "{tmp}/d.jsonl:1: not valid JSON"),
    ("rl-data-missing-key", [_file("d.jsonl", '{"question": "1+1="}\n')],
     ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2,
     "{tmp}/d.jsonl:1: missing key(s) ['prompt or messages', 'answer']"),
    ("rl-eval-empty", [_file("e.jsonl", "\n\n")], ["run", GRPO, "--set", "data.eval={tmp}/e.jsonl"], 2,
     "{tmp}/e.jsonl: no records"),
    ("dpo-data-bare-list", [_file("p.jsonl", GOOD_PAIR + "[1, 2]\n")],
     ["run", DPO, "--set", "data.train={tmp}/p.jsonl"],
     2, "{tmp}/p.jsonl:2: expected a JSON object"),
    ("dpo-eval-missing-key", [_file("p.jsonl", '{"prompt": "1+1=", "chosen": "2"}\n')],
     ["run", DPO, "--set", "data.eval={tmp}/p.jsonl"], 2, "{tmp}/p.jsonl:1: missing key(s) ['rejected']"),
    ("sft-data-not-utf8", [_file("s.jsonl", b'{"prompt": "a", "response": "\xc3"}\n')],
     ["run", SFT, "--set", "data.train={tmp}/s.jsonl"], 2, "{tmp}/s.jsonl:1: not UTF-8 text"),
    ("rm-data-bare-string", [_file("r.jsonl", '"a pair"\n')], ["run", RM, "--set", "data.train={tmp}/r.jsonl"], 2,
     "{tmp}/r.jsonl:1: expected a JSON object"),
    ("data-unknown-format", [_file("d.txt", "1+1=\n")], ["run", GRPO, "--set", "data.train={tmp}/d.txt"], 2,
     "{tmp}/d.txt: unknown format '.txt'; use one of .jsonl, .json, .parquet, .csv or a datasets.save_to_disk folder"),
    ("data-folder-not-a-dataset", [_file("folder/x.txt", "")], ["run", GRPO, "--set", "data.train={tmp}/folder"], 2,
     "data.train: {tmp}/folder: not a dataset folder"),
    ("rl-data-prompt-a-number", [_file("d.jsonl", GOOD_RL + '{"prompt": 5, "answer": "2"}\n')],
     ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2,
     "data.train: {tmp}/d.jsonl:2: 'prompt' is 5; expected text (data.prompt_key"),
    ("rl-data-messages-a-number", [_file("d.jsonl", '{"messages": 3, "answer": "2"}\n')],
     ["run", GRPO, "--set", "data.train={tmp}/d.jsonl"], 2,
     "data.train: {tmp}/d.jsonl:1: 'messages' is 3; expected a list of chat messages ({role, content}) "
     "(data.messages_key"),
    ("sft-eval-csv-prompt-numbers", [_file("e.csv", "prompt,answer\n5,2\n")],
     ["run", SFT, "--set", "data.eval={tmp}/e.csv"], 2,
     "data.eval: {tmp}/e.csv: row 1: 'prompt' is 5; expected text (data.prompt_key"),
    ("dpo-data-chosen-a-list", [_file("p.jsonl", '{"prompt": "1+1=", "chosen": ["2"], "rejected": "3"}\n')],
     ["run", DPO, "--set", "data.train={tmp}/p.jsonl"], 2,
     "data.train: {tmp}/p.jsonl:1: 'chosen' is [\"2\"]; expected text (data.chosen_key"),
    ("reward-raises-on-import", [], ["run", GRPO, "--set", "rewards.functions=[{path: 'tests.rewards.broken:score'}]"],
     2, "rewards.functions[0].path: cannot import 'tests.rewards.broken:score': importing tests.rewards.broken raised "
        "TypeError: string indices must be integers"),
    ("plan-model-config-not-json", [_model(config__json='{"hidden_size": 256, "num_hidden_layers": }')],
     ["plan", GRPO, "--gpus", "1", "--gpu-mem", "24", "--set", "model.path={tmp}/model"], 2,
     "{tmp}/model/config.json: not valid JSON (Expecting value, line 1)"),
    ("model-heads-vllm-cpu-lacks", [_model(config__json=lambda: _with_head_dim(16))],
     ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "rollout.backend: vLLM's CPU attention takes heads of 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 values, "
     "and this model's heads have 16 ({tmp}/model/config.json); set rollout.backend: hf"),
    ("chat-rows-without-template", [_file("c.jsonl", '{"messages": [{"role": "user", "content": "1+1="}], '
                                                     '"answer": "2"}\n')],
     ["run", GRPO, "--set", "data.train={tmp}/c.jsonl", "--set", "data.apply_chat_template=false"], 2,
     "data.apply_chat_template: false, but the rows are chat messages"),
    ("verifier-typo", [], ["run", GRPO, "--set", "rewards.verifier=maths"], 2,
     "rewards.verifier: 'maths' is neither a verifier"),
    ("overlong-buffer-too-long", [], ["run", GRPO, "--set", "rl.overlong_buffer=99"], 2,
     "rl.overlong_buffer: 99 is more than rl.max_new_tokens"),
    ("refill-with-async", [], ["run", GRPO, "--set", "rl.dynamic_sampling_max_draws=3", "--set",
                               "rl.async_rollout=true"], 2, "rl.dynamic_sampling_max_draws: refills draw prompts"),
    ("fully-async-alone", [], ["run", GRPO, "--set", "rl.fully_async=true"], 2,
     "rl.fully_async: is a mode of async rollouts; set rl.async_rollout: true as well"),
    ("fully-async-with-stop", [], ["run", GRPO, "--set", "rl.fully_async=true", "--set", "rl.async_rollout=true",
                                   "--set", "rl.stop=['.']"], 2, "rl.fully_async: generates in rounds of"),
    ("wandb-online-without-key", [], ["run", GRPO, "--set", "log.wandb=myproject"], 2,
     "log.wandb: logging to W&B online needs a key"),
    # checkpoints to resume
    ("resume-not-a-checkpoint", [_file("ckpt/x.txt", "")], ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2,
     "checkpoint.resume: {tmp}/ckpt is not a checkpoint folder (no trainer_state.json)"),
    ("resume-corrupt-state", [_checkpoint({"trainer_state.json": "{\"step\": 2,"})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2, "{tmp}/ckpt/trainer_state.json: not valid JSON"),
    ("resume-state-not-utf8", [_checkpoint({"trainer_state.json": b'{"step": "\xff"}'})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2,
     "{tmp}/ckpt/trainer_state.json: not valid JSON (not UTF-8 text)"),
    ("resume-state-without-step", [_checkpoint({"trainer_state.json": "[1, 2]"})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2, "{tmp}/ckpt/trainer_state.json: not a trainer state"),
    ("model-config-not-utf8", [_model(config__json=b'{"a": "\xfe"}')], ["run", GRPO, "--set", "model.path={tmp}/model"],
     2, "model.path: {tmp}/model/config.json: not valid JSON"),
    ("resume-holds-a-pickle", [_checkpoint({"trainer_state.json": STATE, "actor/optim.pt": b"\x80\x04K\x01."})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2,
     "checkpoint.resume: {tmp}/ckpt/actor/optim.pt is not a file elasticrl writes"),
    ("resume-older-format", [_checkpoint({"trainer_state.json": json.dumps({"step": 2, "spec": {}})})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2, "is of checkpoint format 1"),
    # model folders, before any worker loads them
    ("model-no-config", [_model(config__json=None)], ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "model.path: {tmp}/model has no config.json"),
    ("model-bad-config", [_model(config__json="{\"hidden_size\": ")], ["run", GRPO, "--set", "model.path={tmp}/model"],
     2, "model.path: {tmp}/model/config.json: not valid JSON"),
    ("model-no-weights", [_model(model__safetensors=None)], ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "model.path: {tmp}/model has no weights (no *.safetensors)"),
    ("model-pickled-weights", [_model(model__safetensors=None, pytorch_model__bin=b"\x80\x04K\x01.")],
     ["run", GRPO, "--set", "model.path={tmp}/model"], 2, "holds only pickled weights (pytorch_model.bin)"),
    ("model-cut-short", [_model(model__safetensors="half")], ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "model.path: {tmp}/model/model.safetensors is cut short"),
    ("model-not-safetensors", [_model(model__safetensors=b"\x10\x00\x00\x00\x00\x00\x00\x00not json here!!!")],
     ["run", GRPO, "--set", "model.path={tmp}/model"], 2, "model.safetensors: not a safetensors file"),
    ("model-shard-missing", [_model(model__safetensors__index__json=INDEX)],
     ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "model.path: {tmp}/model lacks model-00001-of-00002.safetensors, named in model.safetensors.index.json "
     "(and 1 more)"),
    ("model-bad-tokenizer", [_model(tokenizer__json="{not json")], ["run", GRPO, "--set", "model.path={tmp}/model"], 2,
     "model.path: {tmp}/model: the tokenizer does not load"),
    ("critic-no-weights", [_model(model__safetensors=None)], ["run", str(EXAMPLES / "tiny_ppo.yaml"), "--set",
                                                              "critic.path={tmp}/model"], 2,
     "critic.path: {tmp}/model has no weights"),
    ("rollout-tp-too-big", [], ["run", GRPO, "--set", "rollout.tp_size=64"], 2,
     "rollout.tp_size: 64 does not divide the model's 4 attention heads and 2 key-value heads (the tiny 2m model); "
     "use one of [1, 2, 4]"),
    ("train-tp-kv-heads", [], ["run", GRPO, "--set", "train.num_ranks=4", "--set", "train.tp_size=4"], 2,
     "train.tp_size: 4 does not divide the model's 4 attention heads and 2 key-value heads"),
    ("resume-without-weights", [_checkpoint({"trainer_state.json": STATE, "actor/engine_state.json": "{}",
                                             "actor/config.json": "{}"})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2, "checkpoint.resume: {tmp}/ckpt/actor has no weights"),
    ("resume-without-a-role", [_checkpoint({"trainer_state.json": STATE})],
     ["run", GRPO, "--set", "checkpoint.resume={tmp}/ckpt"], 2, "{tmp}/ckpt holds no trained role (actor/)"),
    # the planner's figures
    ("plan-gpu-mem-negative", [], ["plan", GRPO, "--gpus", "4", "--gpu-mem", "-5"], 2,
     "--gpu-mem: expected a number of GB > 0, got -5"),
    ("plan-nodes-not-dividing", [], ["plan", GRPO, "--gpus", "4", "--gpu-mem", "24", "--nodes", "3"], 2,
     "--nodes: expected an integer >= 1 that divides --gpus (4), got 3"),
    ("plan-gpus-zero", [], ["plan", GRPO, "--gpus", "0", "--gpu-mem", "24"], 2, "--gpus: expected an integer >= 1"),
    ("launch-gpu-mem-zero", [], ["launch", GRPO, "--dryrun", "--gpus", "2", "--gpu-mem", "0"], 2,
     "--gpu-mem: expected a number of GB > 0"),
    ("scale-no-run", [], ["scale", "{tmp}/no-run", "--engines", "2"], 2, "{tmp}/no-run"),
    ("scale-join-not-slurm", [_running], ["scale", "{tmp}/run", "--engines", "2", "--join", "local_cwd://t/elasticrl-x"],
     2, "--join: only a Slurm app takes nodes while it runs, got local_cwd://t/elasticrl-x"),
    ("scale-join-no-head", [_running], ["scale", "{tmp}/run", "--engines", "2", "--join", "slurm://torchx/987654321"],
     2, "--join: no running head of slurm://torchx/987654321 published its address"),
    ("scale-join-no-more", [_running], ["scale", "{tmp}/run", "--engines", "1", "--join", "slurm://torchx/1"], 2,
     "--join: a node is for more engines: ask for more than the 1 the job has"),
    # a scheduler that does not answer: one line, not TorchX's trace (a Slurm that answers with an
    # error: in test_launch's Slurm test, where Slurm is installed)
    ("cancel-no-slurm", [_no_slurm], ["cancel", "slurm://torchx/7"], 2, "slurm: sacct is not on this machine's PATH"),
    ("logs-no-such-app", [], ["logs", "local_cwd://s/gone"], 2, "local_cwd://s/gone: no such app (a local_cwd app"),
    ("status-no-such-app", [], ["status", "local_cwd://s/gone"], 2, "local_cwd://s/gone: no such app (a local_cwd app"),
    ("status-kubernetes-id", [], ["status", "kubernetes://default/job"], 2, "(kubernetes: APP_ID is NAMESPACE:NAME)"),
    ("launch-no-kube-cluster", [_no_kube_config], ["launch", GRPO, "-s", "kubernetes", "-o", "{tmp}/out"], 1,
     "kubernetes: LocationValueError: No host specified.; check that this machine reaches the cluster"),
]


@pytest.mark.parametrize("case, setup, args, code, says", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_naming_it(case, setup, args, code, says, tmp_path, capsys, monkeypatch):
    from elasticrl.cli import app

    for step in setup:
        for name, value in (step(tmp_path) or {}).items():  # a step may give the environment too
            monkeypatch.setenv(name, value)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if args[0] == "run" and "--output" not in args:
        args += ["--output", str(tmp_path / "out")]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        app(args, prog_name="elasticrl")
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert exit_.value.code == code, out.err
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert "Traceback" not in out.err + out.out
    assert says.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    # nothing half-written: the case's folder holds what it held before
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_suite_is_at_least_forty_cases_of_distinct_kinds():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_a_spec_field_error_never_starts_a_worker(tmp_path, capsys):
    """A bad reward path is found before Ray: no Ray temp folder of this process appears."""
    from elasticrl.cli import app
    from elasticrl.files import OWNER_MARK

    mine = lambda: [p for p in Path("/tmp").glob("erl-ray-*")  # noqa: E731
                    if (p / OWNER_MARK).is_file() and (p / OWNER_MARK).read_text().split()[0] == str(os.getpid())]
    with pytest.raises(SystemExit):
        app(["run", GRPO, "--output", str(tmp_path / "o"), "--set", "rewards.functions=[{path: 'no_mod:f'}]"],
            prog_name="elasticrl")
    assert mine() == [] and "cannot import" in capsys.readouterr().err


def test_a_run_into_a_folder_another_run_writes_is_refused_until_that_run_is_gone(tmp_path, capsys):
    """Two runs on one --output would interleave their checkpoints and metrics: the second is
    refused in one line while the first lives, and the folder is free once it is SIGKILLed."""
    import signal
    import subprocess
    import sys

    from elasticrl.cli import app
    from elasticrl.files import claim_output

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom elasticrl.files import claim_output\n"
                               f"c = claim_output({str(out)!r})\nprint(c is not None, flush=True)\ntime.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"  # the first run's claim (as run_spec takes it)
        with pytest.raises(SystemExit) as exit_:
            app(["run", GRPO, "--output", str(out)], prog_name="elasticrl")
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err == (f"error: --output {out}: another elasticrl run on this machine "
                                                 "writes there; let it end (or stop it), or give another --output")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    mine = claim_output(out)  # the kernel freed the dead run's claim
    assert mine is not None
    mine.close()
