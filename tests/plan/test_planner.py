"""The planner and its memory model: published figures, the paper's placements, refusals."""
from __future__ import annotations

import json

import pytest

from elasticrl.plan import Inventory, PlanError, plan_job, render
from elasticrl.plan.arch import KNOWN, arch_of
from elasticrl.plan.memory import CONTEXT_BYTES, GB, NF4, TrainConfig, engine_need, model_states, trained_role
from elasticrl.plan.planner import USABLE, fewer_ranks
from elasticrl.spec import explicit_fields, load_spec, read_raw
from tests.conftest import EXAMPLES, run_cli


def _plan(path, inventory, *overrides):
    raw = read_raw(path, list(overrides))
    return plan_job(load_spec(raw, check_paths=False), inventory, explicit_fields(raw))


def test_zero_paper_model_states_for_7_5b_on_64_gpus():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12.
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        m = model_states(7.5e9, 64, stage)
        assert (m["params"] + m["grads"] + m["optimizer"]) / GB == pytest.approx(gb, abs=0.06), stage


def test_offload_moves_optimizer_states_and_gradients_to_the_host():
    m = model_states(7.5e9, 8, 3, offload_optimizer=True, offload_params=True)
    assert m["params"] == 0 and m["optimizer"] == 0 and m["grads"] == 2 * 5e8  # one reduce bucket
    assert m["host"] == pytest.approx((12 + 2) * 7.5e9 / 8 + 2 * 7.5e9 / 8)


def test_an_idle_trained_role_keeps_only_its_16_bit_weights_through_rollout():
    # 7B actor, ZeRO-1 on 8 GPUs: 2P weights, 2P gradients, 12P/8 Adam state (ZeRO, Section 5).
    # offload_idle moves the gradients and the optimizer state out from the end of an update
    # to the start of the next: rollout holds 2P + context, the host gets 2P + 12P/8.
    a, cfg = KNOWN["llama-2-7b"], TrainConfig(1, False, False, 1, True, 1)
    p = a.params()
    kept = trained_role(a, "lm", 8, cfg, 1024)
    idle = trained_role(a, "lm", 8, cfg, 1024, offload_idle=True)
    assert kept["rollout"] == pytest.approx(2 * p + 2 * p + 12 * p / 8 + CONTEXT_BYTES)
    assert idle["rollout"] == pytest.approx(2 * p + CONTEXT_BYTES)
    assert idle["host"] == pytest.approx(2 * p + 12 * p / 8) and idle["train"] == kept["train"]
    assert kept["experience"] - idle["experience"] == pytest.approx(2 * p + 12 * p / 8)


@pytest.mark.parametrize("name, billions", [("llama-2-7b", 6.74), ("llama-2-13b", 13.02),
                                            ("codellama-34b", 33.74), ("llama-2-70b", 68.98)])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert KNOWN[name].params() / 1e9 == pytest.approx(billions, abs=0.005)


def test_kv_cache_per_token_matches_the_published_sizes():
    assert KNOWN["llama-2-7b"].kv_bytes_per_token() == 512 * 1024      # 0.5 MiB: 2 x 32 x 4096 x 2 B
    assert KNOWN["llama-2-70b"].kv_bytes_per_token() == 320 * 1024     # grouped-query: 8 KV heads
    # the 7B engine on one GPU: 13.5 GB of weights + 8 x 2048 tokens x 0.5 MiB + 1 GB
    assert engine_need(KNOWN["llama-2-7b"], 1, 2048, 8) / GB == pytest.approx(13.48 + 8.59 + 1.0, abs=0.01)


def test_architecture_from_a_folder_a_cached_hub_id_a_known_name_or_the_tiny_world(tmp_path, monkeypatch):
    config = json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True})
    (tmp_path / "config.json").write_text(config)
    a = arch_of(str(tmp_path), "2m")
    assert (a.kv_heads, a.tied) == (4, True)
    assert a.params() == 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    # a Hub id: its snapshot in the Hugging Face cache (refs/main names it), never downloaded
    repo = tmp_path / "hf" / "hub" / "models--acme--Llama-2-7b-small"
    (repo / "snapshots" / ("ab" * 20)).mkdir(parents=True)
    (repo / "snapshots" / ("ab" * 20) / "config.json").write_text(config)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert arch_of("acme/Llama-2-7b-small", "2m") == a  # not the known llama-2-7b its name starts with
    assert arch_of("/models/Llama-2-70b-sft", "2m") == KNOWN["llama-2-70b"]
    assert arch_of("meta-llama/Llama-2-7b-hf", "2m") == KNOWN["llama-2-7b"]
    assert arch_of(None, "2m").hidden == 256
    with pytest.raises(ValueError, match="model.path: 'mystery-9b' is neither"):
        arch_of("mystery-9b", "2m")


def _check_fits(plan):
    for name, group in plan.groups.items():
        assert group["peak"] <= USABLE * plan.inventory.gpu_mem_gb * GB + 1, name
        # a group's peak is the sum of its roles' memory in its worst phase
        assert group["peak"] == pytest.approx(max(sum(plan.roles[r]["memory"][ph] for r in group["roles"])
                                                  for ph in ("rollout", "experience", "train")))


def test_7b_ppo_fits_four_rtx4090_and_70b_fits_32_a100_without_editing_the_spec():
    small = _plan(EXAMPLES / "ppo_7b.yaml", Inventory(4, 24))
    big = _plan(EXAMPLES / "ppo_70b.yaml", Inventory(32, 80, 4))
    for plan, gpus in ((small, 4), (big, 32)):
        _check_fits(plan)
        assert set(plan.roles) == {"actor", "critic", "reference", "reward", "rollout"}
        # every placement group's GPUs add up to at most the inventory
        widths = {r["group"]: r["ranks"] for r in plan.roles.values()}
        assert sum(widths.values()) <= gpus
    assert small.settings["rollout.tp_size"] * small.settings["rollout.num_engines"] <= 4
    # 70B weights do not fit one 80 GB GPU: the engines must be tensor-parallel
    assert big.settings["rollout.tp_size"] >= 2
    # the overrides realise the plan as a spec: every planned field comes out as planned
    spec = load_spec(read_raw(EXAMPLES / "ppo_7b.yaml", small.overrides()), check_paths=False)
    for path, value in small.settings.items():
        section, name = path.split(".")
        assert getattr(getattr(spec, section), name) == value, path


# The OpenRLHF paper's Table 3 (A800-80G, 8 per node, Adam offload on every model).
TABLE3 = [("llama-2-7b", 16, 4, 4, 2, 2, 4, 1), ("llama-2-13b", 32, 8, 8, 4, 4, 8, 1),
          ("codellama-34b", 32, 8, 8, 4, 4, 4, 2), ("llama-2-70b", 32, 4, 4, 4, 4, 4, 4)]


@pytest.mark.parametrize("model, gpus, actor, critic, ref, reward, engines, tp", TABLE3)
def test_the_papers_table_3_placements_are_feasible(model, gpus, actor, critic, ref, reward, engines, tp):
    pins = [f"model.path=/models/{model}-sft", f"rewards.models=[{{path: /models/{model}-rm}}]",
            f"train.num_ranks={actor}", f"critic.num_ranks={critic}", f"placement.reference_ranks={ref}",
            f"placement.reward_ranks={reward}", f"rollout.num_engines={engines}", f"rollout.tp_size={tp}",
            "train.offload_optimizer=true", "placement.colocate=none"]
    plan = _plan(EXAMPLES / "ppo_7b.yaml", Inventory(gpus, 80, gpus // 8), *pins)
    _check_fits(plan)
    assert sum(r["ranks"] for r in plan.roles.values()) == gpus
    # ZeRO-2 keeps the full bf16 weights on every rank: 2 B x 33.7B = 67 GB for 34B (76 GB usable,
    # before gradients and activations), 138 GB for 70B; the planner must shard them there, and
    # only there (ZeRO-3 is the slower choice where ZeRO-2 fits: 13.5 GB for 7B, 26 GB for 13B)
    assert plan.settings["train.zero_stage"] == (3 if model in ("codellama-34b", "llama-2-70b") else 2)


def test_70b_ppo_on_four_24gb_gpus_is_refused_with_the_reason_and_a_fix():
    with pytest.raises(PlanError) as err:
        _plan(EXAMPLES / "ppo_70b.yaml", Inventory(4, 24))
    msg = str(err.value)
    assert "69.0B parameters" in msg and "a vLLM engine needs 35.7 GB per GPU" in msg
    assert "Smallest change that fits: 4 GPUs of 96 GB" in msg


def test_a_pin_that_cannot_fit_is_named_in_the_fix():
    with pytest.raises(PlanError, match=r"unpin placement.colocate, train.num_ranks and let the planner choose"):
        _plan(EXAMPLES / "ppo_7b.yaml", Inventory(4, 24), "placement.colocate=none", "train.num_ranks=2")


def test_the_tiny_grpo_job_plans_on_two_small_gpus():
    plan = _plan(EXAMPLES / "tiny_grpo.yaml", Inventory(2, 8))
    assert set(plan.roles) == {"actor", "rollout"}
    _check_fits(plan)


def test_plan_cli_prints_the_table_and_refuses_with_exit_2():
    ok = run_cli("plan", "examples/ppo_7b.yaml", "--gpus", "4", "--gpu-mem", "24", timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "placement group" in ok.stdout and "run it with: --set train.num_ranks=" in ok.stdout
    bad = run_cli("plan", "examples/ppo_70b.yaml", "--gpus", "4", "--gpu-mem", "24", timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: examples/ppo_70b.yaml: no placement")
    assert "Traceback" not in bad.stderr


def test_fewer_ranks_keeps_the_global_batch_in_whole_micro_batches():
    def spec(**train):
        sets = [f"train.{k}={v}" for k, v in train.items()]
        return load_spec(read_raw(EXAMPLES / "tiny_grpo.yaml", sets), check_paths=False)

    # 128 = 64 x dp x accumulation: 3 ranks cannot (192 > 128), 2 (accumulation 1) and 1 (2) can
    s = spec(global_batch_size=128, micro_batch_size=64, num_ranks=2)
    assert [fewer_ranks(s, "actor", n) for n in (3, 2, 1)] == [2, 2, 1]
    # tensor-parallel pairs: 6 ranks are dp 3 (128 % 48 != 0), 4 are dp 2 (128 % 32 == 0); 1 is no pair
    s = spec(global_batch_size=128, micro_batch_size=16, num_ranks=8, tp_size=2)
    assert (fewer_ranks(s, "actor", 7), fewer_ranks(s, "actor", 1)) == (4, None)
    # the critic takes whole shares: 64 over 7, 6 or 5 ranks does not split, over 4 it does
    s = spec(global_batch_size=64, micro_batch_size=32, num_ranks=1)
    assert (fewer_ranks(s, "critic", 7), fewer_ranks(s, "actor", 7)) == (4, 2)


def test_host_memory_counts_the_checkpoints_staging_and_the_in_memory_copy():
    """7B PPO on 4 x 24 GB: a background checkpoint stages each rank's pieces of the fp32 masters
    and Adam moments in host memory (12 bytes a parameter of the actor and the critic, summed
    over their ranks); the in-memory copy three times as much (each rank's buffer, and its keeper's
    newest copy and the one the next reuses); a synchronous checkpoint adds nothing."""
    inv = Inventory(4, 24)
    base = _plan(EXAMPLES / "ppo_7b.yaml", inv, "checkpoint.every_steps=0")
    spec = load_spec(read_raw(EXAMPLES / "ppo_7b.yaml"), check_paths=False)
    trained = sum(arch_of(spec.model.path, spec.world.model_size).params(h) for h in ("lm", "value"))
    staged = _plan(EXAMPLES / "ppo_7b.yaml", inv, "checkpoint.every_steps=10")
    both = _plan(EXAMPLES / "ppo_7b.yaml", inv, "checkpoint.every_steps=10", "fault.memory_copy_steps=1")
    sync = _plan(EXAMPLES / "ppo_7b.yaml", inv, "checkpoint.every_steps=10", "checkpoint.background=false")
    assert staged.host_bytes - base.host_bytes == pytest.approx(12 * trained)
    assert both.host_bytes - base.host_bytes == pytest.approx(48 * trained)
    assert sync.host_bytes == base.host_bytes
    assert trained / 1e9 > 13  # the actor and the critic: two 7B models, so 160 GB of staging


def test_lora_adapter_counts_are_peft_s_published_ones():
    """r x (in + out) per adapted linear: Llama-2-7B (h 4096, I 11008, 32 layers) at r = 16 on
    all seven linears: 16 x 32 x (9 x 4096 + 2 x 4096 + 3 x 11008) = 39,976,960, the count peft
    prints for it; at r = 8 on q_proj and v_proj: 8 x 32 x 4 x 4096 = 4,194,304 (the LoRA
    paper's setting, and peft's printout)."""
    a = KNOWN["llama-2-7b"]
    assert a.lora_params(16, ["all-linear"]) == 39_976_960
    assert a.lora_params(8, ["q_proj", "v_proj"]) == 4_194_304


def test_lora_trains_only_the_adapters_states_on_a_frozen_16_bit_base():
    """7B actor with r = 16 adapters (A = 39,976,960), ZeRO-2 on 4 GPUs: the base's 2P bytes whole
    on each rank (ZeRO-2 does not shard weights) plus the adapters' 2A, their gradients 2A / 4
    and Adam states 12A / 4 (nothing for the frozen base); ZeRO-3 shards the base too: 2P / 4."""
    a = KNOWN["llama-2-7b"]
    p, A = a.params(), 39_976_960
    full = trained_role(a, "lm", 4, TrainConfig(2, False, False, 1, True, 1), 1024)
    lora = trained_role(a, "lm", 4, TrainConfig(2, False, False, 1, True, 1, A), 1024)
    states = 2 * p + 2 * A + 2 * A / 4 + 12 * A / 4
    assert lora["rollout"] == pytest.approx(states + CONTEXT_BYTES)
    assert full["rollout"] - lora["rollout"] == pytest.approx((2 + 12) * p / 4 - (2 + 12) * A / 4 - 2 * A)
    assert lora["train"] - lora["rollout"] == pytest.approx(full["train"] - full["rollout"])  # same activations
    sharded = trained_role(a, "lm", 4, TrainConfig(3, False, False, 1, True, 1, A), 1024)
    assert sharded["rollout"] == pytest.approx(2 * p / 4 + (2 + 2 + 12) * A / 4 + CONTEXT_BYTES)
    # QLoRA: the base in NF4, 4 bits a weight plus an 8-bit scale per 64 weights and an fp32 scale
    # of those per 256 blocks: 0.5 + 1 / 64 + 4 / 16384 = 0.5159 bytes; the adapters' states as above
    quantized = trained_role(a, "lm", 4, TrainConfig(2, False, False, 1, True, 1, A, quantized=True), 1024)
    assert quantized["rollout"] - lora["rollout"] == pytest.approx((NF4 - 2) * p)
    assert NF4 == pytest.approx(0.5 + 1 / 64 + 4 / 16384, abs=2e-4)


def test_the_workstation_plans_lora_and_refuses_a_full_7b_ppo_for_its_host_memory():
    """4 x 24 GB with 128 GB of RAM: full 7B PPO fits the GPUs only by offloading states (more
    host memory than there is): refused, naming host memory and LoRA; PPO with LoRA on the 7B
    and GRPO with LoRA on an 8B plan without offloading optimizer states, and without a
    reference role."""
    inv = Inventory(4, 24, 1, 128)
    with pytest.raises(PlanError, match=r"the GPUs fit it only with states offloaded to host memory, \d+ GB per "
                                        r"node .* the host has 128 GB\. Smallest change that fits: LoRA"):
        _plan(EXAMPLES / "ppo_7b.yaml", inv)
    for example in ("ppo_lora_7b.yaml", "grpo_lora_8b.yaml"):
        plan = _plan(EXAMPLES / example, inv)
        assert plan.settings["train.offload_optimizer"] is False and plan.settings["train.offload_params"] is False
        assert "reference" not in plan.roles and plan.host_bytes <= 128 * GB, example


def test_7b_dapo_with_8k_generations_is_planned_by_length_on_a_workstation_and_a_cluster():
    """examples/dapo_7b_8k.yaml (1K prompts + 8K generations: 9,216-token sequences). On 4 x 24
    GB: ZeRO-3 with the optimizer offloaded and one full-length sequence's tokens a micro-batch
    (9,216), sliced over 4 sequence-parallel ranks without checkpointing (3.41 MB a token: 34 h
    bytes x 28 layers, plus fp32 logits of 8 x 152,064 bytes, 1.2 MB: 42.6 GB whole, 10.7 GB a
    rank), the engines' context at 9,216 tokens; on 32 x 80 GB the same budget whole, without
    checkpointing (42.7 GB) or slicing. On 1 x 16 GB it is refused with the figure and the
    smallest change."""
    work = _plan(EXAMPLES / "dapo_7b_8k.yaml", Inventory(4, 24, host_mem_gb=256))
    s = work.settings
    assert (s["train.max_tokens_per_micro_batch"], s["rollout.max_model_len"], s["train.sp_size"]) == (9216, 9216, 4)
    assert not s["model.gradient_checkpointing"] and s["train.zero_stage"] == 3 and s["train.offload_optimizer"]
    assert "a micro-batch of 9216 tokens (train.max_tokens_per_micro_batch): 10.7 GB a rank" in render(work)
    cluster = _plan(EXAMPLES / "dapo_7b_8k.yaml", Inventory(32, 80, nodes=4))
    assert cluster.settings["train.max_tokens_per_micro_batch"] == 9216 and "train.sp_size" not in cluster.settings
    assert not cluster.settings["model.gradient_checkpointing"] and cluster.settings["rollout.tp_size"] == 1
    assert "3.41 MB a token over 28 layers" in render(cluster) and "76 sequences of 9216 tokens" in render(cluster)
    assert "42.7 GB a rank" in render(cluster)
    with pytest.raises(PlanError, match=r"a vLLM engine needs 16.8 GB per GPU .* Smallest change that fits: 1 GPUs "
                                        r"of 24 GB"):
        _plan(EXAMPLES / "dapo_7b_8k.yaml", Inventory(1, 16))
