"""The job spec: one typed tree, every field with a default and a one-line doc.

The docs live next to the fields (``doc(...)``) so that ``elasticrl spec --help`` and the
docs/spec.md's reference are generated from the same place the loader validates against.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS
from elasticrl.spec.presets import PRESETS


def doc(text: str, default=None, *, factory=None, min=None, max=None, exclusive_min=False):
    """A dataclass field carrying its documentation and numeric bounds."""
    meta = {"doc": text, "min": min, "max": max, "exclusive_min": exclusive_min}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class WorldSpec:
    """The embedded tiny world: model, tokenizer and data the project builds itself."""

    task: Literal["arithmetic", "calculator", "reasoning"] = doc(
        "Toy task the synthetic data teaches: 'arithmetic'; 'calculator', the same with multiplication up to "
        "max_operand (too hard for the tiny model alone) and a calculator tool it learns to call "
        "(elasticrl.world.calculator; examples/tiny_agent.yaml); 'reasoning', counting up in steps worked line "
        "by line, answers of hundreds to thousands of tokens (elasticrl.world.reasoning; "
        "examples/tiny_reasoning.yaml).", "arithmetic")
    model_size: Literal[tuple(PRESETS)] = doc(
        "Preset size of the tiny Llama (parameters).", "2m")
    max_operand: int = doc("Largest operand of the arithmetic problems.", 30, min=1, max=999)
    operators: str = doc("Operators drawn for problems, a subset of '+-*'.", "+-")
    num_train: int = doc("Number of training problems generated.", 20000, min=1)
    num_eval: int = doc("Number of held-out evaluation problems generated.", 256, min=1)
    seed: int = doc("Seed of the world: same seed, same bytes on every machine.", 0, min=0, max=2 ** 32 - 1)
    tool_demos: float = doc("Task calculator: the share of SFT rows that call the calculator (the others answer "
                            "directly).", 0.2, min=0, max=1)


@dataclass
class LoraSpec:
    """Low-rank adapters (peft's LoRA) on a frozen base: only they train, checkpoint and export."""

    rank: int = doc("Adapter rank r; 0 trains every weight of the model.", 0, min=0)
    alpha: float = doc("Adapter scale numerator: an adapter adds alpha / r x B A to its layer's weight.", 16.0,
                       min=0, exclusive_min=True)
    dropout: float = doc("Dropout on an adapter's input while training.", 0.0, min=0, max=1)
    target_modules: list[str] = doc("Names of the linear layers that get adapters; ['all-linear']: every linear "
                                    "layer but the output head.", factory=lambda: ["all-linear"])
    quantize: Literal["none", "nf4"] = doc(
        "'nf4': QLoRA, the frozen base held in 4 bits (bitsandbytes NF4, double-quantized; its CPU backend runs "
        "here too) at train.zero_stage 0-2; the reference is that 4-bit base. Merged syncs send it dequantized "
        "(the trainer's own weights); served adapters (GPUs) run on vLLM's bitsandbytes base.", "none")


@dataclass
class ModelSpec:
    path: Optional[str] = doc(
        "Hugging Face model folder to start from, or a Hub id ORG/NAME (resolved once, before any worker, "
        "through huggingface_hub's cache: HF_HOME, HF_HUB_OFFLINE, HF_TOKEN; safetensors weights only); null "
        "uses the embedded tiny model.", None)
    revision: Optional[str] = doc("Hub revision (branch, tag or commit) of a model.path given by Hub id; null: "
                                  "main.", None)
    dtype: Literal["auto", "bf16", "fp32"] = doc(
        "Training precision; 'auto' picks bf16 on GPUs and on CPUs with AVX512-BF16/AMX, fp32 "
        "elsewhere (CPU bf16 without them is ~50x slower than fp32).", "auto")
    trust_remote_code: bool = doc(
        "Let transformers run code shipped with the model. Off unless you trust its source.", False)
    gradient_checkpointing: bool = doc("Recompute activations in backward to save memory.", False)
    lora: LoraSpec = doc("LoRA adapters (model.lora.rank > 0) on the frozen model, for sft, rm, prm, dpo, kto and the "
                         "RL algorithms (the actor and a PPO critic; a value head trains whole; the reference is the "
                         "base, the model with its adapters off): final/ is a peft adapter folder. conditional_sft "
                         "and the rounds algorithms refuse them for now.",
                         factory=LoraSpec)


@dataclass
class DataSpec:
    train: Optional[str] = doc(
        "Training examples: a JSON-lines, JSON, parquet or CSV file, a datasets.save_to_disk folder, or a Hub "
        "dataset hf://ORG/NAME[:CONFIG][/SPLIT]; null uses the embedded tiny world's data.", None)
    eval: Optional[str] = doc(
        "Held-out prompts with answers, in any form data.train takes; null uses the embedded ones.", None)
    prompt_key: str = doc("Field of a row's prompt text.", "prompt")
    messages_key: str = doc("Field of a row's chat messages ([{role, content}, ...]); a row that has it is a "
                            "conversation: RL prompts it up to its last user turn, SFT trains on its assistant "
                            "turns only. Either this or data.prompt_key per row.", "messages")
    chat_template: Optional[str] = doc("A Jinja chat template (or the path of a .jinja file) used instead of the "
                                       "tokenizer's own; needed for a model whose tokenizer has none.", None)
    shuffle: bool = doc("Draw the training records in a seeded order, a new one each epoch (false: in the "
                        "file's order, epoch after epoch).", True)
    response_key: str = doc("Key of the target response in each JSON line (SFT).", "response")
    answer_key: str = doc("Key of the reference answer in eval lines.", "answer")
    chosen_key: str = doc("Key of the preferred response in preference lines (rm, dpo).", "chosen")
    rejected_key: str = doc("Key of the dispreferred response in preference lines (rm, dpo).", "rejected")
    label_key: str = doc("Key of the desirable (true) / undesirable (false) flag in unpaired lines (kto).",
                         "label")
    margin_key: str = doc("rm: key of a pair's optional margin, how much more the chosen response should "
                          "score (Llama 2); a line without it has margin 0.", "margin")
    steps_key: str = doc("prm: key of a solution's list of steps (strings).", "steps")
    step_labels_key: str = doc("prm: key of the steps' labels, one per step: 1 on track, 0 wrong, or a soft "
                               "label in between.", "labels")
    step_marker: str = doc("prm: the token written after every step, where the head reads the step's score; "
                           "must be one token of the model's tokenizer.", "\n")
    apply_chat_template: bool = doc("Wrap prompt strings in the tokenizer's chat template (conversations always "
                                    "are).", True)
    max_length: int = doc("Longest tokenised example; longer ones are truncated.", 64, min=2)
    packing: bool = doc("Lay the sequences of a micro-batch end to end (no padding; position ids restart at "
                        "each), in every trainer (SFT, reward models, preference, the RL roles' forwards); the "
                        "padded computation's losses and gradients.", False)


@dataclass
class TrainSpec:
    num_ranks: int = doc("Data-parallel training ranks (Ray actors, one per GPU on GPUs). On a machine without "
                         "GPUs `elasticrl run` makes it 1 when the spec does not set it (one rank with every "
                         "core).", 2, min=1)
    micro_batch_size: int = doc("Examples per rank per forward/backward.", 16, min=1)
    global_batch_size: int = doc(
        "Examples per optimizer step over all ranks; must be a multiple of "
        "micro_batch_size * num_ranks / tp_size (the rest is gradient accumulation).", 64, min=1)
    max_tokens_per_micro_batch: int = doc(
        "Token budget of a micro-batch; 0 counts micro-batches in rows (micro_batch_size). Set, each mini-batch's "
        "rows go to the data-parallel ranks balanced by tokens and each rank's are cut into micro-batches of at "
        "most this many tokens (rows x longest padded, their sum with data.packing; a longer row alone), as many "
        "on every rank; the loss and gradients are the row-counted run's (docs/long-sequences.md). Also cuts the "
        "experience passes (log-probs, values, rewards).", 0, min=0)
    max_steps: int = doc("Optimizer steps to run; 0 derives it from num_epochs.", 0, min=0)
    num_epochs: float = doc("Passes over the training data when max_steps is 0.", 1.0,
                            min=0, exclusive_min=True)
    lr: float = doc("Peak learning rate.", 1e-3, min=0, exclusive_min=True)
    min_lr_ratio: float = doc("Cosine decay ends at lr * min_lr_ratio.", 0.1, min=0, max=1)
    warmup_ratio: float = doc("Fraction of steps spent in linear warm-up.", 0.03, min=0, max=1)
    weight_decay: float = doc("AdamW weight decay.", 0.0, min=0)
    adam_betas: tuple[float, float] = doc("AdamW betas.", factory=lambda: (0.9, 0.95))
    grad_clip: float = doc("Clip the global gradient norm to this; 0 disables.", 1.0, min=0)
    zero_stage: Literal[0, 1, 2, 3] = doc("DeepSpeed ZeRO stage.", 2)
    offload_optimizer: bool = doc("Keep optimizer states in CPU memory (ZeRO 1-3).", False)
    offload_params: bool = doc("Keep parameters in CPU memory (ZeRO 3 only).", False)
    tp_size: int = doc("DeepSpeed AutoTP tensor-parallel size (divides num_ranks).", 1, min=1)
    sp_size: int = doc("Sequence-parallel size (divides num_ranks): that many ranks train each micro-batch, each "
                       "on a slice of its positions, attention trading slices for heads (DeepSpeed's Ulysses); a "
                       "rank keeps about 1/sp_size of the activations. RL's actor and critic (docs/long-sequences.md).",
                       1, min=1)
    threads: int = doc("CPU threads of each trainer rank and of the frozen models' ranks (reference, reward). "
                       "0: on a machine without GPUs `elasticrl run` sets it (the cores over the ranks; see "
                       "`plan/cpu.py`), elsewhere one per rank as Ray gives.", 0, min=0)
    comm_timeout_s: int = doc("Seconds a collective may wait before the run fails.", 600, min=1)


@dataclass
class RolloutSpec:
    backend: Literal["auto", "vllm", "hf"] = doc(
        "Rollout engine: vLLM; 'hf' is the transformers generate fallback for machines without "
        "vLLM ('auto' falls back to it only when vLLM is missing, with a warning).", "auto")
    num_engines: int = doc("vLLM engines generating in parallel (each a Ray actor); on a machine without GPUs "
                           "`elasticrl run` sets it when the spec does not (one per core, as memory allows).", 1,
                           min=1)
    tp_size: int = doc("Tensor-parallel size of each engine (GPUs, or CPU processes, per engine).", 1, min=1)
    cpus_per_engine: int = doc("CPU threads per engine on CPU machines (`elasticrl run` sets it with the engine "
                               "count: the cores over the engines).", 1, min=1)
    max_model_len: int = doc("Longest prompt + completion an engine accepts, in tokens.", 512, min=8)
    kv_cache_gib: float = doc("KV-cache size of a CPU engine, GiB (vLLM would otherwise take most free memory); "
                              "`elasticrl run` sizes it when the spec does not: the engine's share of a step's "
                              "sequences at rollout.max_model_len (or of an evaluation's, if more), plus a "
                              "quarter.", 1.0, min=0, exclusive_min=True)
    gpu_memory_utilization: float = doc("Share of GPU memory a GPU engine may use.", 0.5, min=0, max=1,
                                        exclusive_min=True)
    cpu_mode: Literal["auto", "dense", "packed"] = doc(
        "How a CPU engine computes linears: 'packed' (vLLM's oneDNN-packed weights, repacked once per "
        "weight sync) or 'dense' (plain weights: syncs ~4x faster, decoding 12-25% slower on AVX2); "
        "'auto' = packed.", "auto")
    cpu_sleep: Literal["keep", "restart"] = doc(
        "vLLM's CPU build cannot sleep: 'keep' leaves the engine resident during training, "
        "'restart' shuts it down and starts it again (the next weight sync restores the weights).",
        "keep")
    weight_sync: str = doc(
        "Transport of weights into the engines, a module of elasticrl/weights/transports: 'shm' (CPU) and "
        "'ipc' (CUDA IPC) write straight into same-node engines' parameters, 'broadcast' sends buckets over "
        "a gloo/NCCL group, all three slice to slice (each trainer rank sends its AutoTP slice, replicas "
        "feed different engines); 'shm_staged' goes through staging buffers, 'files' sharded safetensors; "
        "'auto' picks shm on one CPU node, ipc on one GPU node, else broadcast.", "auto")
    lora_sync: Literal["auto", "adapter", "merged"] = doc(
        "With model.lora: 'adapter' sends only the adapters each sync and vLLM engines serve them as LoRA "
        "(their base weights stay as loaded); 'merged' sends full weights with the adapters merged in "
        "(W + alpha / r x B A), which the engines use like any weights (the transformers engine always "
        "takes them merged). 'auto': adapter on GPUs, merged on CPU engines (vLLM's CPU LoRA kernels "
        "generated 2.3x slower than merged weights, benchmarks/weight_sync.py --suite lora).", "auto")
    bucket_mb: int = doc("Bytes per weight-sync bucket, in MiB (one collective or load per bucket).", 64, min=1)
    delta_sync: bool = doc("Send only the 8-byte words of weights that changed, compared bit for bit in the "
                           "engines' dtype with what this sender last sent (a copy of what each trainer rank sends, "
                           "kept where its weights live; the first sync after a start, a restart or a failed sync "
                           "goes whole), where bytes cost more than finding them: over broadcast (sliced), files, "
                           "and ipc between GPUs. shm and a CPU's ipc are one node's memory copies, cheaper than "
                           "the comparison: they sync whole, as do gathered broadcast and shm_staged. A tensor "
                           "whose change would take as many bytes as itself goes whole; sync/delta_fraction tells "
                           "the share of elements sent as changed.", False)
    max_restarts: int = doc("Engines the job may start again after one died or hung (elasticity L2: its "
                            "prompts go to the live engines, a replacement joins at a step boundary).", 3, min=0)
    hang_factor: float = doc("An engine that takes longer on its prompts than this many times (1 s + the time "
                             "the generation rate measured so far gives them at max tokens each) is taken for "
                             "hung and replaced.", 8.0, min=1)
    environment: Optional[str] = doc(
        "Multi-turn episodes: an environment class (package.module:Class, one instance per episode, in "
        "rewards.workers processes of its own; elasticrl.envs:ToolEnvironment answers tool calls with "
        "rollout.tools) or an http(s) URL serving one (elasticrl.envs.RemoteEnvironment), which answers each "
        "model turn with the next observation (docs/agents.md); null: one completion per prompt.", None)
    tools: list[str] = doc("Tools offered to the model (package.module:function; a type-hinted function with a "
                           "Google-style docstring, its JSON schema from both), besides the environment's own.",
                           factory=list)
    tool_parser: str = doc("How tool calls are read from the model's text: 'hermes' (<tool_call>{\"name\", "
                           "\"arguments\"}</tool_call>, Hermes and Qwen templates) or package.module:function "
                           "(text -> [{name, arguments}]).", "hermes")
    tool_timeout_s: float = doc("A tool call running longer is stopped and answered with an error; a remote "
                                "environment's request running longer is retried.", 10.0, min=0, exclusive_min=True)
    environment_retries: int = doc("Retries of a remote environment's request after a timeout, a lost connection "
                                   "or an HTTP 5xx.", 3, min=0)
    environment_timeout_s: float = doc("An environment process that gives no answer for this long is killed "
                                       "(its episodes end, truncated) and started again.", 120.0, min=0,
                                       exclusive_min=True)


@dataclass
class RLSpec:
    """Settings of the RL trainers (ppo, grpo, reinforce++, rloo); the paper's PPO tricks are options."""

    advantage: Literal[("auto", *ADVANTAGE_ESTIMATORS)] = doc(
        "Advantage estimator; 'auto' follows the algorithm (ppo: gae, grpo: grpo, rloo: rloo, "
        "reinforce++: reinforce++_baseline).", "auto")
    prompts_per_step: int = doc("Prompts rolled out per step.", 32, min=1)
    samples_per_prompt: int = doc("Completions per prompt (n); group estimators need >= 2.", 8, min=1)
    max_new_tokens: int = doc("Longest completion (an episode's turn), in tokens.", 16, min=1)
    max_turns: int = doc("With rollout.environment: model turns per episode at most (truncated past it).", 4, min=1)
    max_episode_tokens: int = doc("With rollout.environment: the model's and the observations' tokens of an episode "
                                  "at most (truncated before a turn that could pass it); 0: rollout.max_model_len.",
                                  0, min=0)
    temperature: float = doc(
        "Sampling temperature of rollouts. The trainer's log-probs (PPO ratio, KL, importance weights) are "
        "taken at the same temperature, as vLLM's returned log-probs are (of the distribution it sampled from: "
        "after temperature, top_k and top_p).", 1.0, min=0)
    top_p: float = doc("Nucleus sampling of rollouts.", 1.0, min=0, max=1, exclusive_min=True)
    top_k: int = doc("Top-k sampling of rollouts; 0 disables.", 0, min=0)
    min_tokens: int = doc("Shortest completion, in tokens (no end-of-sequence before).", 0, min=0)
    ignore_eos: bool = doc("Generate max_new_tokens tokens whatever the model says (benchmarks, fault tests).",
                           False)
    stop: list[str] = doc("Strings that end a completion (rollouts, rounds and evaluation): the tokens up to the "
                          "one that completed the string are trained on, the rewards see the text before it.",
                          factory=list)
    num_steps: int = doc("RL steps (rollout + update) to run.", 100, min=1)
    epochs: int = doc("Passes over each rollout batch (PPO epochs).", 1, min=1)
    clip_low: float = doc("PPO ratio clip below 1 (1 - clip_low).", 0.2, min=0)
    clip_high: float = doc("PPO ratio clip above 1 (1 + clip_high); > clip_low is DAPO's clip-higher.", 0.2, min=0)
    dual_clip: Optional[float] = doc("Dual-clip bound c > 1 for negative advantages; null disables.", None)
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = doc(
        "How per-token losses become one number (seq_sum_norm is Dr. GRPO's).", "token_mean")
    kl_coef: float = doc("KL coefficient to the reference model; 0 skips the reference entirely.", 0.0, min=0)
    kl_estimator: Literal["k1", "k2", "k3"] = doc("KL estimator (k3 is unbiased and non-negative).", "k1")
    kl_mode: Literal["reward", "loss"] = doc(
        "'reward': a per-token penalty in the reward, which every estimator's advantages carry (the group "
        "estimators add its return from each token to the group advantage); 'loss': a loss term (the GRPO "
        "paper's).", "reward")
    entropy_coef: float = doc("Entropy bonus coefficient.", 0.0, min=0)
    gamma: float = doc("Discount over tokens.", 1.0, min=0, max=1)
    lam: float = doc("GAE lambda.", 0.95, min=0, max=1)
    normalize_reward: bool = doc("Normalise rewards by their running mean/std (a PPO trick).", False)
    reward_clip: Optional[float] = doc("Clip (normalised) rewards to [-c, c]; null disables.", None)
    whiten_advantages: Literal["auto", "on", "off"] = doc(
        "Whiten advantages with statistics over the whole batch; 'auto': on for gae and reinforce++.", "auto")
    ptx_coef: float = doc("Weight of a pretraining (SFT) loss term on the world's SFT data (PPO-ptx).", 0.0, min=0)
    freeze_actor_steps: int = doc("Steps during which only the critic learns (PPO warm-up trick).", 0, min=0)
    dynamic_sampling: bool = doc("Drop prompt groups whose rewards do not vary (no learning signal).", False)
    dynamic_sampling_max_draws: int = doc(
        "With rl.dynamic_sampling: while a step holds fewer than rl.prompts_per_step groups whose rewards vary, "
        "draw rl.prompts_per_step more prompts, up to this many draws in all (DAPO's refill; rl/prompts_drawn "
        "counts them); 1 never refills, the batch shrinks to the groups kept.", 1, min=1)
    importance_ratio: Literal["token", "sequence"] = doc(
        "The PPO ratio per token, or per response ('sequence': GSPO's geometric mean of its token ratios, "
        "clipped as one; use it with seq_mean_token_mean and clips near 3e-4/4e-4).", "token")
    overlong_filter: bool = doc("DAPO's overlong filtering: a response cut at rl.max_new_tokens (no end of text) "
                                "leaves the loss; its reward still counts in its group's baseline.", False)
    overlong_buffer: int = doc("DAPO's soft overlong punishment: over the last N tokens before rl.max_new_tokens "
                               "the reward falls linearly, to -rl.overlong_penalty at the limit; 0 disables.", 0,
                               min=0)
    overlong_penalty: float = doc("The soft overlong punishment at rl.max_new_tokens (see rl.overlong_buffer).", 1.0,
                                  min=0)
    async_rollout: bool = doc("Overlap the rollout of step t+1 with the training of step t.", False)
    fully_async: bool = doc(
        "With rl.async_rollout: the engines generate continuously from a queue of prompt groups, a step trains "
        "on the first rl.prompts_per_step groups that finished, weight updates reach samples in flight between "
        "rounds of rl.chunk_tokens tokens, and each token keeps the weight version that produced it (no batch "
        "waits for its longest sample; checkpoints hold the samples in flight). With rollout.environment the "
        "samples are episodes, a turn spanning rounds and the environment stepping as each turn ends.", False)
    chunk_tokens: int = doc("rl.fully_async: tokens a sample gains per round, between which weight updates land.",
                            32, min=1)
    fully_async_rounds: Literal["until_ready", "until_trained"] = doc(
        "rl.fully_async: how long the rounds run while the trainers train. 'until_ready': until the next batch is "
        "ready, so the rounds of a step depend on the samples only and a run, resumed or not, repeats exactly; "
        "'until_trained': also until the trainers finish, so the engines do not idle, but the rounds depend on "
        "the clock and runs do not repeat bit for bit.", "until_ready")
    old_logprobs: Literal["auto", "forward"] = doc(
        "The policy's log-probs of the rollouts before the update (the PPO ratio's denominator; with async "
        "rollouts decoupled PPO's proximal policy). 'auto': when one update is made from the weights that would "
        "score them (rl.epochs 1, one mini-batch per rollout batch, no KL in the reward) they are the log-probs "
        "the update computes, so that forward pass is skipped (the ratio is 1 by construction; `kl` is then the "
        "mean over micro-batches); 'forward': always computed.", "auto")
    max_staleness: int = doc("Async: most weight versions a batch (rl.fully_async: a token) may lag the policy it "
                             "trains; a fully async sample with an older token starts over.", 1, min=1)
    is_correction: Literal["auto", "none", "tis", "mis", "seq_mask"] = doc(
        "Weighting of each token by rho = exp(trainer's log-prob before the update - the engine's): 'tis' "
        "min(rho, rl.is_threshold); 'mis' rho inside [rl.is_threshold_low, rl.is_threshold], else weight 0 (the "
        "token still counts in a token mean's denominator); 'seq_mask' weight 0 for every token of a response "
        "whose geometric-mean rho is outside that range; "
        "'auto': tis with async rollouts or on GPUs (whose kernels differ from the trainer's), else none. "
        "is/* and mismatch/kl are reported in every mode.", "auto")
    is_threshold: float = doc("Upper threshold of rl.is_correction (tis's cap).", 2.0, min=1)
    is_threshold_low: float = doc("Lower threshold of rl.is_correction mis and seq_mask.", 0.5, min=0, max=1)
    eval_samples: int = doc("k of pass@k at evaluation (sampled at the rollout temperature).", 4, min=1)


@dataclass
class PreferenceSpec:
    """Settings of the preference trainers (dpo, kto); a frozen reference anchors both."""

    beta: float = doc("Strength of the tie to the reference (the beta of DPO, IPO and KTO).", 0.1,
                      min=0, exclusive_min=True)
    loss: Literal["sigmoid", "ipo"] = doc("dpo: 'sigmoid' is DPO, 'ipo' is IPO.", "sigmoid")
    label_smoothing: float = doc("dpo: assumed probability that a pair's label is wrong (conservative DPO, "
                                 "cDPO); 0 is plain DPO.", 0.0, min=0, max=0.5)
    nll_coef: float = doc("dpo, iterative_dpo: weight of the chosen response's per-token NLL added to the loss "
                          "(iterative reasoning preference optimisation); 0 is plain DPO.", 0.0, min=0)
    reference: Literal["colocated", "precomputed"] = doc(
        "Reference log-probs: from a frozen copy held by each rank, or computed once before training "
        "(then the copy is freed).", "colocated")
    desirable_weight: float = doc("kto: weight of desirable examples.", 1.0, min=0)
    undesirable_weight: float = doc("kto: weight of undesirable examples.", 1.0, min=0)


@dataclass
class RoundsSpec:
    """Rounds of generate -> score -> fine-tune (rejection_sampling, iterative_dpo); sampling
    follows rl.samples_per_prompt, rl.temperature, rl.top_p, rl.top_k and rl.max_new_tokens."""

    num_rounds: int = doc("Rounds of generate, score, fine-tune.", 3, min=1)
    prompts_per_round: int = doc("Prompts sampled each round.", 256, min=1)
    steps_per_round: int = doc("Optimizer steps on each round's data.", 20, min=1)
    min_reward: float = doc("rejection_sampling: a prompt's best completion is kept only at this reward or more.",
                            0.5)


@dataclass
class ConditionalSpec:
    """Conditional SFT (SteerLM style): attribute scores written in front of each prompt."""

    attributes_key: str = doc("Key of each line's attribute scores (a JSON object) in data.train.", "attributes")
    eval_attributes: str = doc("Attributes asked for when evaluating held-out prompts, as name:value,...",
                               "quality:1")
    compare_attributes: str = doc("Also evaluate the final model with these attributes (the gap shows it follows "
                                  "them); empty skips.", "quality:0")


# The built-in verifiers (rewards.verifiers implements each by this name).
VERIFIERS = ("integer", "math", "exact", "regex", "json_schema", "last_integer")


@dataclass
class RewardFunctionSpec:
    path: str = doc("Import path package.module:function of fn(prompt, completion, answer) -> float; "
                    "'verifier' is the job's verifier (rewards.verifier), 1 for a right answer, 0 for a wrong one.",
                    "verifier")
    weight: float = doc("Weight in the summed reward.", 1.0)


@dataclass
class RewardModelSpec:
    path: str = doc("Folder of a reward model (a sequence-classification head, e.g. from algorithm: rm), or its "
                    "Hub id ORG/NAME (as model.path).", "")
    weight: float = doc("Weight in the summed reward.", 1.0)


@dataclass
class RemoteRewardSpec:
    url: str = doc("HTTP endpoint taking {prompts, completions, answers}, answering {rewards}.", "")
    weight: float = doc("Weight in the summed reward.", 1.0)
    timeout_s: float = doc("Seconds per request before a retry.", 30.0, min=0, exclusive_min=True)
    retries: int = doc("Retries after a timeout, connection error or HTTP 5xx.", 3, min=0)


@dataclass
class RewardsSpec:
    functions: list[RewardFunctionSpec] = doc(
        "Python reward functions, summed with their weights.", factory=lambda: [RewardFunctionSpec()])
    models: list[RewardModelSpec] = doc("Reward models (each a Ray role), summed with their weights.",
                                        factory=list)
    remote: list[RemoteRewardSpec] = doc("Remote HTTP rewards, summed with their weights.", factory=list)
    verifier: str = doc("What judges an answer right, for the default reward and every accuracy figure: 'integer' "
                        "(the tiny task's first-integer match), 'last_integer' (a worked chain's last number), 'math' "
                        "(math-verify, boxed answers first), 'exact', 'regex' (the answer is a pattern), 'json_schema' "
                        "(the answer is a schema the completion must satisfy), or package.module:function; 'auto': "
                        "integer on the embedded data (last_integer on its reasoning task), math on yours.",
                        "auto")
    workers: int = doc("Processes the reward functions and the verifier score a batch in, side by side.", 2, min=1)
    timeout_s: float = doc("Seconds one reward-function call may take (it runs in a process of its own; one "
                           "that hangs is stopped and the call counts as an error).", 10.0, min=0, exclusive_min=True)
    on_error: Literal["fail", "zero", "drop_sample"] = doc(
        "A reward source that raises, times out, or gives a non-number or non-finite value: 'fail' ends the run; "
        "'zero' scores that sample 0 from that source; 'drop_sample' leaves the sample out of training. Every "
        "error counts in reward/errors.", "zero")
    max_consecutive_errors: int = doc("With 'zero' or 'drop_sample', this many samples in a row without a score "
                                      "from one source end the run (a failed request to an endpoint, or a reward "
                                      "model's failed batch, is an error for each of its samples); 0 never does.",
                                      8, min=0)


@dataclass
class CriticSpec:
    path: Optional[str] = doc(
        "Critic initialisation (a folder, or a Hub id as model.path); null uses the first reward model (a PPO "
        "trick), else the policy.", None)
    lr: float = doc("Critic learning rate (higher than the actor's, a PPO trick).", 1e-3, min=0,
                    exclusive_min=True)
    value_clip: Optional[float] = doc("Clip of the value loss; null disables.", 0.2)
    num_ranks: int = doc("Data-parallel ranks of the critic.", 1, min=1)


@dataclass
class PlacementSpec:
    colocate: Literal["none", "actor_ref", "critic_reward", "actor_ref+critic_reward", "all"] = doc(
        "Which roles share devices: actor with reference, critic with reward models, both pairs, or "
        "everything including the rollout engines (the hybrid engine).", "none")
    offload_idle: bool = doc("Move what idles to host memory between phases: the frozen roles' weights "
                             "(reference, reward), and the actor's and critic's gradients and optimizer state "
                             "through rollout and experience (no effect on CPU; the planner sets it when memory "
                             "needs it).", False)
    reference: Literal["role", "in_actor"] = doc(
        "Where an RL job's reference (rl.kl_coef > 0, no LoRA) runs: 'role', ranks of its own (with "
        "train.zero_stage 3, its weights sharded over them); 'in_actor', a frozen copy in each actor rank's "
        "process (no process of its own: one import of the stack and one start-up less). elasticrl run on a "
        "machine without GPUs picks in_actor.", "role")
    reference_ranks: int = doc("Ranks of the reference model; 0 = as many as the actor. With "
                               "train.zero_stage 3 its weights are sharded over them.", 0, min=0)
    reward_ranks: int = doc("Ranks of each reward model; with train.zero_stage 3 its weights are sharded "
                            "over them.", 1, min=1)
    pools: Literal["any", "per_role"] = doc(
        "Which Ray nodes host which roles: 'any' (one machine: elasticrl run); 'per_role' puts each "
        "placement group of model roles on the nodes of its own app role (actor, critic, reference, reward, "
        "rollout, or colocated roles joined: actor-reference, critic-reward, all), as elasticrl launch "
        "starts them.", "any")


@dataclass
class InitSpec:
    sft_steps: int = doc(
        "Warm start: when model.path is null, first fine-tune the embedded model on the world's SFT data "
        "for this many steps (cached by its settings) and start the job from it; 0 starts from the raw model.",
        0, min=0)
    sft_lr: float = doc("Learning rate of the warm-start SFT.", 1e-3, min=0, exclusive_min=True)
    rm_steps: int = doc(
        "PPO without reward models: first train a Bradley-Terry reward model on the world's preference "
        "pairs for this many steps (from the warm start; cached) and use it as the reward.", 0, min=0)
    rm_lr: float = doc("Learning rate of that reward model.", 5e-4, min=0, exclusive_min=True)


@dataclass
class EvalSpec:
    enabled: bool = doc("Evaluate on held-out prompts at all (false: never, not even at the start or the end; "
                        "for benchmarks and throwaway runs).", True)
    every_steps: int = doc("Evaluate held-out prompts every N steps (and at the start and the end); 0 only at "
                           "the start and the end.",
                           100, min=0)
    num_prompts: int = doc("Held-out prompts per evaluation (0 = all).", 256, min=0)
    max_new_tokens: int = doc("Longest greedy answer generated at evaluation.", 8, min=1)


@dataclass
class LogSpec:
    every_steps: int = doc("Write a metrics.jsonl line every N steps.", 10, min=1)
    progress_bar: bool = doc("Show a progress bar on the console.", True)
    tensorboard: bool = doc("Write TensorBoard event files into OUTPUT/tensorboard (the metrics, the resolved spec "
                            "and the environment).", True)
    wandb: Optional[str] = doc("Weights & Biases project to log to as well; null: none.", None)
    wandb_mode: Literal["online", "offline"] = doc("'offline' writes the W&B run into OUTPUT/wandb for `wandb "
                                                   "sync` later; 'online' needs WANDB_API_KEY or `wandb login`.",
                                                   "online")


@dataclass
class CheckpointSpec:
    every_steps: int = doc("Save a resumable checkpoint every N steps; 0 disables.", 0, min=0)
    keep: int = doc("How many recent checkpoints to keep.", 2, min=1)
    resume: Optional[str] = doc(
        "'auto' resumes from the newest checkpoint in the output folder, a path resumes from "
        "that checkpoint, null starts fresh.", "auto")
    background: bool = doc("Write checkpoints in the background: a step that checkpoints waits only while each rank "
                           "copies its pieces to host memory; the next checkpoint waits for the previous one's "
                           "writes. false: each checkpoint is written before training goes on.", True)


@dataclass
class FaultSpec:
    """Trainer recovery in the job (elasticity L3) and the watchdog on every role's calls."""

    max_restarts: int = doc("Times the trained roles (actor, critic) may be re-formed after a rank died or hung; "
                            "they resume from the newest checkpoint (checkpoint.every_steps) or the start.", 3, min=0)
    hang_factor: float = doc("A call on a role that takes this many times longer than the longest of its kind "
                             "so far, plus fault.min_deadline_s, is taken for a hang.", 5.0, min=1)
    min_deadline_s: float = doc("Seconds added to every watchdog deadline (scheduling noise).", 10.0, min=0,
                                exclusive_min=True)
    memory_copy_steps: int = doc("Every this many steps each actor and critic rank hands a copy of its state (its "
                                 "checkpoint pieces) to a keeper process on the node of its next rank on another "
                                 "node (on one node, a process of its own); a recovery starts from the newest of it "
                                 "and the checkpoints, so fewer steps are redone. Costs three checkpoints' size of "
                                 "host memory (each rank's buffer, the keepers' two newest copies) and each rank's "
                                 "copy time (docs/resume.md, Sharded state). 0: off.", 0, min=0)
    place_timeout_s: float = doc("Seconds a re-formed actor or critic waits for its ranks to be placed before it "
                                 "re-forms on fewer (as many as the live nodes hold, keeping the global batch "
                                 "through gradient accumulation; a node that died is seen at once), and a "
                                 "re-formed reference or reward model waits for room, such as a node joining its "
                                 "app role (`elasticrl scale --join HANDLE --role NAME`).", 60.0, min=1)


@dataclass
class ExportSpec:
    enabled: bool = doc("Write the final model as a Hugging Face folder (OUTPUT/final).", True)
    max_shard_size_mb: int = doc("Largest safetensors shard, in MB.", 2000, min=1)
    merge: bool = doc("With model.lora: also write the model with its adapters merged into the base weights, a "
                      "plain Hugging Face folder (OUTPUT/final/merged), next to the adapter folder final/.", False)


@dataclass
class RaySpec:
    address: str = doc("'local' starts a private Ray; an address joins that cluster.", "local")
    num_cpus: Optional[int] = doc("CPUs Ray may use for a local cluster; null = all.", None, min=1)


@dataclass
class JobSpec:
    """One job: ``algorithm`` picks the trainer, the rest configures it."""

    algorithm: Literal[tuple(ALGORITHMS)] = doc(
        "Which trainer runs the job.", "sft")
    seed: int = doc("Seed of model init, data order and sampling.", 1234, min=0, max=2 ** 32 - 1)
    world: WorldSpec = doc("The embedded tiny world.", factory=WorldSpec)
    model: ModelSpec = doc("The model trained.", factory=ModelSpec)
    data: DataSpec = doc("Training and evaluation data.", factory=DataSpec)
    train: TrainSpec = doc("Optimisation and parallelism.", factory=TrainSpec)
    rollout: RolloutSpec = doc("vLLM rollout engines.", factory=RolloutSpec)
    rl: RLSpec = doc("RL trainers.", factory=RLSpec)
    preference: PreferenceSpec = doc("Preference trainers (dpo, kto, iterative_dpo).", factory=PreferenceSpec)
    conditional: ConditionalSpec = doc("Conditional SFT (conditional_sft).", factory=ConditionalSpec)
    rounds: RoundsSpec = doc("Generate-score-train rounds (rejection_sampling, iterative_dpo).", factory=RoundsSpec)
    rewards: RewardsSpec = doc("Where rewards come from.", factory=RewardsSpec)
    critic: CriticSpec = doc("The critic (ppo).", factory=CriticSpec)
    placement: PlacementSpec = doc("Colocation and offload of roles.", factory=PlacementSpec)
    init: InitSpec = doc("Warm start before RL.", factory=InitSpec)
    eval: EvalSpec = doc("Held-out evaluation.", factory=EvalSpec)
    log: LogSpec = doc("Metrics and console output.", factory=LogSpec)
    checkpoint: CheckpointSpec = doc("Resumable checkpoints.", factory=CheckpointSpec)
    fault: FaultSpec = doc("Surviving failures while running.", factory=FaultSpec)
    export: ExportSpec = doc("Final Hugging Face export.", factory=ExportSpec)
    ray: RaySpec = doc("Where the job's Ray runs.", factory=RaySpec)
