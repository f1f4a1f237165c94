"""Fit a job's roles to a GPU inventory: ranks per role, ZeRO stage and offload, colocation,
vLLM tensor-parallel size and engine count, micro-batch size.

Every candidate placement is checked with the memory model (``memory.py``) phase by phase
(rollout, experience, train): roles that share GPUs add up. Among the placements that fit,
the planner keeps the one with the lowest estimated step time, a ranking heuristic built
from FLOPs per phase (generation 2 P per token at a decode efficiency, forward passes 2 P,
training 6 P, slowed by checkpointing and offload) divided by the GPUs each phase gets.

Fields the user sets in the spec (or with ``--set``) are pinned: the planner only checks
them. Everything it decides comes back as ``--set`` overrides, so a plan is a spec.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from elasticrl.plan.arch import Arch, arch_of
from elasticrl.plan.memory import (
    ADAM_BYTES,
    CONTEXT_BYTES,
    GB,
    HALF,
    TrainConfig,
    engine_need,
    engine_role,
    frozen_role,
    layer_activation_bytes,
    state_copies,
    train_activations,
    trained_role,
)
from elasticrl.plan.roles import COLOCATION, is_rl, job_roles
from elasticrl.spec.algorithms import ALGORITHMS
from elasticrl.spec.rules import lora_refusal
from elasticrl.spec.schema import JobSpec

PLANNED = ("train.num_ranks", "train.zero_stage", "train.offload_optimizer", "train.offload_params",
           "train.micro_batch_size", "model.gradient_checkpointing", "critic.num_ranks", "placement.colocate",
           "placement.offload_idle", "placement.reference_ranks", "placement.reward_ranks",
           "rollout.num_engines", "rollout.tp_size", "rollout.gpu_memory_utilization", "rollout.max_model_len",
           "train.max_tokens_per_micro_batch", "train.sp_size")
PHASES = ("rollout", "experience", "train")
USABLE = 0.95            # share of a GPU's memory the plan may fill
ENGINE_UTILIZATION = 0.9  # vLLM's share of a GPU it has alone
CONCURRENT = 8           # full-length sequences an engine must hold in its KV cache at least
DECODE_EFFICIENCY = 0.1  # decode is memory-bound: ~10 % of the FLOP rate of training
COMMON_GPU_GB = (16, 24, 32, 40, 48, 80, 96, 141, 192)
LONG = 1024              # rl.max_new_tokens from which generations are long: micro-batches cut by tokens


class PlanError(ValueError):
    """No placement fits; the message gives the reason and the smallest change that fits."""


@dataclass(frozen=True)
class Inventory:
    gpus: int
    gpu_mem_gb: float
    nodes: int = 1
    host_mem_gb: float | None = None  # per node; unchecked when unknown

    def __post_init__(self):
        """Each figure as the command line's flag would give it, refused in one line."""
        checks = (("--gpus", self.gpus, "an integer >= 1", isinstance(self.gpus, int) and self.gpus >= 1),
                  ("--gpu-mem", self.gpu_mem_gb, "a number of GB > 0", math.isfinite(self.gpu_mem_gb) and
                   self.gpu_mem_gb > 0),
                  ("--nodes", self.nodes, f"an integer >= 1 that divides --gpus ({self.gpus})",
                   isinstance(self.nodes, int) and self.nodes >= 1 and self.gpus % self.nodes == 0),
                  ("--host-mem", self.host_mem_gb, "a number of GB > 0", self.host_mem_gb is None or
                   (math.isfinite(self.host_mem_gb) and self.host_mem_gb > 0)))
        for flag, value, expected, ok in checks:
            if not ok:
                raise PlanError(f"{flag}: expected {expected}, got {value:g}")

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass
class Plan:
    algorithm: str
    arch: Arch
    inventory: Inventory
    settings: dict                      # spec field -> value, every PLANNED field of this job
    roles: dict                         # role -> {"ranks", "gpus", "memory": {phase: bytes}, "host", "group"}
    groups: dict                        # placement group (its app role's name) -> {"roles", "peak", "phase"}
    host_bytes: float
    step_time: float
    pinned: list = field(default_factory=list)
    lengths: list = field(default_factory=list)  # what the plan gives long sequences: lines for the console

    def overrides(self) -> list[str]:
        return as_overrides({k: v for k, v in self.settings.items() if k not in self.pinned})


def as_overrides(settings: dict) -> list[str]:
    """Planned field values as ``--set`` overrides (a plan is a spec)."""
    return [f"{k}={_yaml(v)}" for k, v in settings.items()]


def _yaml(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pow2(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(max(1, limit))) + 1)]


def _choices(path: str, pinned: dict, default: list) -> list:
    return [pinned[path]] if path in pinned else default


@dataclass
class _Job:
    spec: JobSpec
    arch: Arch
    roles: dict
    inv: Inventory
    pinned: dict
    seq: int
    tokens: float          # tokens through the model per step (prompts x samples x seq)
    gen_tokens: float
    reward_models: int
    params: float
    adapters: int = 0      # LoRA: the adapters' parameters of each trained model; 0 trains every weight


def plan_job(spec: JobSpec, inventory: Inventory, pinned: dict | None = None) -> Plan:
    """The fastest placement that fits; ``pinned``: field -> value the user fixed."""
    pinned = {k: v for k, v in (pinned or {}).items() if k in PLANNED}
    if inventory.gpus < 1 or inventory.nodes < 1 or inventory.gpus % inventory.nodes:
        raise PlanError(f"--gpus {inventory.gpus} must be a positive multiple of --nodes {inventory.nodes}")
    job = _job(spec, inventory, pinned)
    best = _search(job)
    if best is None:
        raise PlanError(_explain(spec, inventory, pinned, job))
    return best


def fits(spec: JobSpec, inventory: Inventory, pinned: dict) -> bool:
    return _search(_job(spec, inventory, pinned)) is not None


def _job(spec: JobSpec, inventory: Inventory, pinned: dict) -> _Job:
    arch = arch_of(spec.model.path, spec.world.model_size)
    rl_job, alg = is_rl(spec), ALGORITHMS[spec.algorithm]
    seq = spec.data.max_length + (spec.rl.max_new_tokens if rl_job else 0)
    per_step = spec.rl.prompts_per_step * spec.rl.samples_per_prompt if rl_job else \
        spec.train.global_batch_size * alg.sequences
    gen = per_step * spec.rl.max_new_tokens if rl_job else 0.0
    if alg.family == "rounds":  # a round's sampling, spread over its training steps
        r = spec.rounds
        gen = r.prompts_per_round * spec.rl.samples_per_prompt * spec.rl.max_new_tokens / r.steps_per_round
    roles, lora = job_roles(spec), spec.model.lora
    return _Job(spec, arch, {r: x.head for r, x in roles.items()}, inventory, pinned, seq,
                per_step * seq * spec.rl.epochs, gen, roles["reward"].copies if "reward" in roles else 1, arch.params(),
                arch.lora_params(lora.rank, lora.target_modules))


def _trained(job: _Job, role: str) -> int:
    """Parameters that train in ``role`` under LoRA (a critic's value head trains whole); 0: all."""
    return job.adapters + (job.arch.hidden if role == "critic" else 0) if job.adapters else 0


def _train_configs(job: _Job) -> list[tuple[TrainConfig, float]]:
    """(config without micro-batch, slow-down factor) for each allowed ZeRO/offload/checkpointing."""
    out, quantized = [], job.spec.model.lora.quantize != "none"
    for stage, opt, par, ckpt, sp in itertools.product(
            _choices("train.zero_stage", job.pinned, [2, 3]), _choices("train.offload_optimizer", job.pinned,
                                                                       [False, True]),
            _choices("train.offload_params", job.pinned, [False, True]),
            _choices("model.gradient_checkpointing", job.pinned, [False, True]),
            _choices("train.sp_size", job.pinned, _sp_sizes(job))):
        if (par and stage != 3) or (opt and stage == 0) or (quantized and stage == 3):
            continue
        slow = (1.33 if ckpt else 1.0) * (1.3 if opt else 1.0) * (2.0 if par else 1.0) * (1.1 if stage == 3 else 1.0) \
            * 1.12 ** math.log2(sp)
        out.append((TrainConfig(stage, opt, par, 0, ckpt, job.spec.train.tp_size, quantized=quantized, sp=sp), slow))
    return out


def _sp_sizes(job: _Job) -> list[int]:
    """Sequence-parallel sizes for an RL job's actor and critic (not with tensor parallelism or
    packing), dividing the heads; each doubling's all-to-alls cost about a tenth more of the update
    (the 1.12 a doubling in ``_train_configs``), so a plan slices sequences where it needs to."""
    t, spec = job.spec.train, job.spec
    if not is_rl(spec) or t.tp_size > 1 or spec.data.packing:
        return [1]
    return [s for s in (1, 2, 4, 8) if job.arch.heads % s == 0 and s <= job.inv.gpus]


def _micro_batches(job: _Job, ranks: int) -> list[int]:
    t = job.spec.train
    cands = _choices("train.micro_batch_size", job.pinned, _pow2(t.micro_batch_size)[::-1])
    return [m for m in cands if _whole_batches(t.global_batch_size, m, ranks, t.tp_size)]


def _whole_batches(global_batch: int, micro_batch: int, ranks: int, tp_size: int = 1) -> bool:
    """``ranks`` keep the global batch: whole micro-batches on every data-parallel rank."""
    return ranks % tp_size == 0 and global_batch % (micro_batch * (ranks // tp_size)) == 0


def fewer_ranks(spec: JobSpec, role: str, at_most: int) -> int | None:
    """The most ranks, at most ``at_most``, that the trained ``role`` ('actor' or 'critic') can
    re-form on with the same global batch (gradient accumulation makes up the ranks lost);
    None when none can. For the elastic re-forming of ``trainers.rl.recover``."""
    t = spec.train
    for ranks in range(at_most, 0, -1):
        if role == "critic":  # the critic takes micro-batches of its whole share when it must
            if t.global_batch_size % ranks == 0:
                return ranks
        elif _whole_batches(t.global_batch_size, t.micro_batch_size, ranks, t.tp_size):
            return ranks
    return None


def _layouts(job: _Job):
    """Candidate (colocate, ranks per role, engines, tp) that fit the GPU count."""
    n, per_node, r, pin = job.inv.gpus, job.inv.per_node, job.roles, job.pinned
    if "rollout" not in r:
        for actor in _choices("train.num_ranks", pin, _pow2(n)):
            if actor <= n and actor % job.spec.train.tp_size == 0:
                if "reference" in r:  # dpo, kto: the frozen reference lives in each trainer rank (in_trainer)
                    yield "actor_ref", {"actor": actor, "reference": actor}, 0, 0
                else:
                    yield "none", {"actor": actor}, 0, 0
        return
    tps = [t for t in _choices("rollout.tp_size", pin, _pow2(per_node)) if job.arch.heads % t == 0 and t <= per_node]
    colocs = _choices("placement.colocate", pin, ["none", "actor_ref", "critic_reward", "actor_ref+critic_reward",
                                                  "all"])
    if ALGORITHMS[job.spec.algorithm].family == "rounds":  # trainer and engines apart; a reference in the trainer
        colocs = ["actor_ref" if "reference" in r else "none"]
    for coloc, actor in itertools.product(colocs, _choices("train.num_ranks", pin, _pow2(n))):
        if actor % job.spec.train.tp_size:
            continue
        ref_with_actor = coloc in ("actor_ref", "actor_ref+critic_reward", "all")
        rew_with_critic = coloc in ("critic_reward", "actor_ref+critic_reward", "all") and "critic" in r
        for critic in (_choices("critic.num_ranks", pin, _pow2(n)) if "critic" in r else [0]):
            refs = [0] if "reference" not in r else [actor] if ref_with_actor else \
                _choices("placement.reference_ranks", pin, _pow2(actor))
            rews = [0] if "reward" not in r else [critic] if rew_with_critic else \
                _choices("placement.reward_ranks", pin, _pow2(max(critic, 1) if "critic" in r else actor))
            for ref, rew in itertools.product(refs, rews):
                ranks = {"actor": actor, "critic": critic, "reference": ref, "reward": rew}
                if coloc == "all":
                    if any(v not in (0, actor) for v in ranks.values()) or actor > n:
                        continue
                    for tp in tps:
                        if actor % tp == 0 and _choices("rollout.num_engines", pin, [actor // tp])[0] == actor // tp:
                            yield coloc, ranks, actor // tp, tp
                    continue
                used = (actor if ref_with_actor else actor + ref) + \
                    (critic if rew_with_critic else critic + rew * job.reward_models)
                for tp in tps:
                    engines = _choices("rollout.num_engines", pin, [(n - used) // tp])[0]
                    if engines >= 1 and used + engines * tp <= n:
                        yield coloc, ranks, engines, tp


def _search(job: _Job) -> Plan | None:
    """Candidates in order of estimated step time; the first that fits in memory wins."""
    if _obstacle(job):
        return None
    idle_opts = _choices("placement.offload_idle", job.pinned, [False, True] if "rollout" in job.roles else [False])
    configs = _train_configs(job)
    mbs_of: dict[int, list[int]] = {}
    queue = []
    for li, (coloc, ranks, engines, tp) in enumerate(_layouts(job)):
        fixed, train = _step_time(job, ranks, engines, tp)
        for n in {ranks["actor"], ranks.get("critic") or ranks["actor"]}:
            mbs_of.setdefault(n, _micro_batches(job, n))
        critic_ok = set(mbs_of[ranks.get("critic") or ranks["actor"]])
        for mbs in mbs_of[ranks["actor"]]:
            if mbs not in critic_ok:
                continue
            small = max(1.0, (4096 / (mbs * job.seq)) ** 0.5)
            for ci, (_, slow) in enumerate(configs):
                queue.append((round(fixed + train * slow * small, 9), -mbs, sum(ranks.values()), li, ci))
    queue.sort()
    layouts = list(_layouts(job))
    for key, neg_mbs, _, li, ci in queue:
        coloc, ranks, engines, tp = layouts[li]
        cfg = dataclasses.replace(configs[ci][0], micro_batch=-neg_mbs)
        for idle in idle_opts:
            plan = _evaluate(job, cfg, coloc, ranks, engines, tp, idle)
            if plan is not None:
                plan.step_time = key
                return plan
    return None


def _evaluate(job: _Job, cfg: TrainConfig, coloc: str, ranks: dict, engines: int, tp: int,
              offload_idle: bool) -> Plan | None:
    a, inv = job.arch, job.inv
    gpu = inv.gpu_mem_gb * GB
    trained = [ranks[r] for r in ("actor", "critic") if r in job.roles]
    if any(n % cfg.sp for n in trained) or not all(_whole_batches(job.spec.train.global_batch_size, cfg.micro_batch,
                                                                   n // cfg.sp) for n in trained if n >= cfg.sp):
        return None  # sequence-parallel groups must fill the ranks and keep whole micro-batches
    mem: dict[str, dict] = {}
    for role, head in job.roles.items():
        if role in ("actor", "critic"):
            mem[role] = trained_role(a, head, ranks[role], dataclasses.replace(cfg, adapters=_trained(job, role)),
                                     job.seq, offload_idle)
        elif role in ("reference", "reward"):
            mem[role] = frozen_role(a, head, ranks[role], cfg.zero_stage == 3, offload_idle, cfg.micro_batch,
                                    job.seq)
    groups = _groups(coloc, job.roles)
    # several reward models share their GPUs when colocated with the critic, else get their own
    copies = {r: job.reward_models if r == "reward" and len(m) > 1 else 1 for m in groups.values() for r in m}
    util = ENGINE_UTILIZATION
    if "rollout" in job.roles:
        seqs_per_engine = job.tokens / job.spec.rl.epochs / job.seq / engines
        need = engine_need(a, tp, job.seq, int(min(CONCURRENT, max(1, seqs_per_engine))))
        if coloc == "all":
            others = sum(mem[r]["rollout"] * copies[r] for r in mem)
            util = _choices("rollout.gpu_memory_utilization", job.pinned, [(USABLE * gpu - others) / gpu])[0]
        else:
            util = _choices("rollout.gpu_memory_utilization", job.pinned, [ENGINE_UTILIZATION])[0]
        if util * gpu < need:
            return None
        mem["rollout"] = engine_role(a, tp, job.seq, CONCURRENT, util, gpu, sleeps=coloc == "all")
        ranks = {**ranks, "rollout": engines * tp}
    group_info = {}
    for name, members in groups.items():
        peak, phase = max((sum(mem[r][ph] * copies[r] for r in members), ph) for ph in PHASES)
        if peak > USABLE * gpu + 1:
            return None
        group_info[name] = {"roles": members, "peak": peak, "phase": phase}
    host = {r: m["host"] * ranks[r] * (job.reward_models if r == "reward" else 1) for r, m in mem.items()}
    ck, fault = job.spec.checkpoint, job.spec.fault
    copied = state_copies(bool(ck.every_steps and ck.background), bool(fault.memory_copy_steps))
    for role, head in job.roles.items():
        if role in ("actor", "critic"):
            host[role] += copied * ADAM_BYTES * (_trained(job, role) or a.params(head))
    if inv.host_mem_gb is not None and sum(host.values()) > inv.host_mem_gb * GB * inv.nodes:
        return None
    settings = _settings(job, cfg, coloc, ranks, engines, tp, offload_idle, util)
    role_rows = {}
    for r in job.roles:
        group = next(g for g, m in groups.items() if r in m)
        apart = job.reward_models if r == "reward" and len(groups[group]) == 1 else 1  # own GPUs each
        role_rows[r] = {"ranks": ranks[r], "gpus": ranks[r] * apart, "memory": mem[r], "host": host[r],
                        "group": group}
    return Plan(job.spec.algorithm, a, inv, settings, role_rows, group_info, sum(host.values()), 0.0,
                sorted(job.pinned), _lengths(job, cfg, tp, util * gpu, settings))


def _lengths(job: _Job, cfg: TrainConfig, tp: int, engine_bytes: float, settings: dict) -> list[str]:
    """The plan by length: the longest sequence, the activations a token costs a trained rank
    (a layer's whole set without checkpointing, its input with), the micro-batch's token budget
    and its activations, and how many full-length sequences an engine's KV cache holds."""
    a, seq = job.arch, job.seq
    per_token = layer_activation_bytes(a, 1, 1, cfg.tp)
    tokens = settings.get("train.max_tokens_per_micro_batch") or cfg.micro_batch * seq
    lines = [f"sequences: up to {seq} tokens (prompt {job.spec.data.max_length}"
             + (f" + generation {job.spec.rl.max_new_tokens})" if is_rl(job.spec) else ")"),
             f"activations: {a.layers * per_token / 1e6:.2f} MB a token over {a.layers} layers, "
             f"{(a.layers * HALF * a.hidden + per_token) / 1e6:.2f} MB with checkpointing; a micro-batch of {tokens} "
             "tokens"
             + (" (train.max_tokens_per_micro_batch)" if "train.max_tokens_per_micro_batch" in settings else "")
             + f": {train_activations(a, 1, -(-tokens // cfg.sp), cfg.checkpointing, 'lm', cfg.tp) / GB:.1f} GB a "
             f"rank with the logits{', checkpointed' if cfg.checkpointing else ''}"
             + (f", each of {cfg.sp} sequence-parallel ranks holding 1/{cfg.sp} of every sequence (train.sp_size)"
                if cfg.sp > 1 else "; no sequence parallelism")]
    if "rollout" in job.roles:
        kv = engine_bytes - HALF * a.params() / tp - CONTEXT_BYTES
        per_seq = seq * a.kv_bytes_per_token() / tp
        lines.append(f"KV cache: {kv / GB:.1f} GB per engine GPU, {int(kv // per_seq)} sequences of {seq} tokens at "
                     f"once ({per_seq / GB:.2f} GB each at tensor-parallel {tp})")
    return lines


def _groups(coloc: str, roles: dict) -> dict[str, list[str]]:
    out, seen = {}, set()
    for members in COLOCATION[coloc]:
        present = [r for r in members if r in roles]
        if present:  # named as its app role (plan.roles.app_roles)
            out["all" if coloc == "all" else "-".join(present)] = present
            seen |= set(present)
    for r in roles:
        if r not in seen:
            out[r] = [r]
    return out


def _step_time(job: _Job, ranks: dict, engines: int, tp: int) -> tuple[float, float]:
    """Relative step time as (fixed, train): FLOPs per phase over the GPUs doing it (phases
    run one after another). ``train`` is multiplied by the configuration's slow-down
    (checkpointing, offload) and by that of micro-batches under ~4k tokens, which leave a
    GPU under-used."""
    p, t = job.params, job.tokens
    fixed = train = 0.0
    if "rollout" in job.roles:
        fixed += 2 * p * job.gen_tokens / (engines * tp * DECODE_EFFICIENCY) + 2 * p * t / ranks["actor"]
    for role in ("reference", "reward", "critic"):
        if role in job.roles:
            fixed += 2 * p * t / ranks[role] * (job.reward_models if role == "reward" else 1)
    for role in ("actor", "critic"):
        if role in job.roles:
            train += 6 * p * t / ranks[role]
    return fixed / 1e15, train / 1e15


def _settings(job, cfg, coloc, ranks, engines, tp, offload_idle, util) -> dict:
    s = {"train.num_ranks": ranks["actor"], "train.zero_stage": cfg.zero_stage,
         "train.offload_optimizer": cfg.offload_optimizer, "train.offload_params": cfg.offload_params,
         "train.micro_batch_size": cfg.micro_batch, "model.gradient_checkpointing": cfg.checkpointing}
    if cfg.sp > 1 or "train.sp_size" in job.pinned:
        s["train.sp_size"] = cfg.sp
    if is_rl(job.spec) and job.spec.rl.max_new_tokens >= LONG:
        # long generations vary in length: cut micro-batches by the tokens the memory model gave
        # room for (a micro-batch's rows at full length), so short ones share a micro-batch
        s["train.max_tokens_per_micro_batch"] = _choices("train.max_tokens_per_micro_batch", job.pinned,
                                                         [cfg.micro_batch * job.seq])[0]
    if "rollout" in job.roles:
        s.update({"placement.colocate": coloc, "placement.offload_idle": offload_idle,
                  "rollout.num_engines": engines, "rollout.tp_size": tp,
                  "rollout.gpu_memory_utilization": round(util, 3),
                  "rollout.max_model_len": _choices("rollout.max_model_len", job.pinned, [job.seq])[0]})
    if "critic" in job.roles:
        s["critic.num_ranks"] = ranks["critic"]
    if "reference" in job.roles and is_rl(job.spec):  # dpo, kto: the reference is in the trainer
        s["placement.reference_ranks"] = ranks["reference"]
    if "reward" in job.roles:
        s["placement.reward_ranks"] = ranks["reward"]
    return s


def _explain(spec: JobSpec, inv: Inventory, pinned: dict, job: _Job) -> str:
    """Why nothing fits, and the smallest change that would."""
    a = job.arch
    reason = _obstacle(job) or "the roles do not fit together on this many GPUs (a role needs GPUs of its own " \
        "unless colocated)"
    fixes = []
    unbounded = Inventory(inv.gpus, inv.gpu_mem_gb, inv.nodes)
    if inv.host_mem_gb is not None and not _obstacle(job) and fits(spec, unbounded, pinned):
        need = plan_job(spec, unbounded, pinned).host_bytes / GB / inv.nodes
        reason = (f"the GPUs fit it only with states offloaded to host memory, {need:.0f} GB per node in the "
                  f"fastest such placement, and the host has {inv.host_mem_gb:g} GB")
        lora = _with_lora(spec)
        if lora is not None and fits(lora, inv, pinned):
            fixes.append("LoRA (model.lora.rank: 16: adapters train on the frozen base, which is the reference)")
    if pinned and fits(spec, inv, {}):
        binding = [k for k in sorted(pinned)  # a long enough engine context constrains nothing
                   if not (k == "rollout.max_model_len" and pinned[k] >= job.seq)]
        fixes.append("unpin " + ", ".join(binding) + " and let the planner choose")
    more = _fewest_gpus(spec, inv, pinned)
    if more:
        fixes.append(f"{more} GPUs of {inv.gpu_mem_gb:g} GB ({more // inv.per_node} node(s) of {inv.per_node})")
    bigger = next((gb for gb in COMMON_GPU_GB if gb > inv.gpu_mem_gb and
                   fits(spec, Inventory(inv.gpus, gb, inv.nodes, inv.host_mem_gb), pinned)), None)
    if bigger:
        fixes.append(f"{inv.gpus} GPUs of {bigger} GB")
    size = f"{a.params() / 1e9:.1f}B" if a.params() >= 1e9 else f"{a.params() / 1e6:.1f}M"
    return (f"no placement of this {spec.algorithm} job ({size} parameters) fits {inv.gpus} x {inv.gpu_mem_gb:g} GB: "
            f"{reason}. Smallest change that fits: {' or '.join(fixes) if fixes else 'none found up to 64x the GPUs'}")


def _with_lora(spec: JobSpec) -> JobSpec | None:
    """The job with rank-16 LoRA adapters, where it has none and could."""
    lora = dataclasses.replace(spec, model=dataclasses.replace(
        spec.model, lora=dataclasses.replace(spec.model.lora, rank=16)))
    return None if spec.model.lora.rank or lora_refusal(lora) else lora


def _fewest_gpus(spec: JobSpec, inv: Inventory, pinned: dict) -> int | None:
    """Fewest GPUs (whole nodes of the same size) that fit: doubling, then bisection."""
    def ok(nodes: int) -> bool:
        return fits(spec, Inventory(nodes * inv.per_node, inv.gpu_mem_gb, nodes, inv.host_mem_gb), pinned)

    lo, hi = inv.nodes, inv.nodes * 2
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > 64 * inv.nodes:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi * inv.per_node


def _obstacle(job: _Job) -> str | None:
    """A role that cannot fit even alone and at its leanest: the reason, else None."""
    a, inv = job.arch, job.inv
    gpu = USABLE * inv.gpu_mem_gb * GB
    if "rollout" in job.roles:
        tps = [t for t in _pow2(inv.per_node) if a.heads % t == 0]
        need = engine_need(a, tps[-1], job.seq, 1)
        if need > gpu:
            return (f"a vLLM engine needs {need / GB:.1f} GB per GPU even at tensor-parallel size {tps[-1]} "
                    f"(the most GPUs of one node that divide {a.heads} heads)")
    quantized = job.spec.model.lora.quantize != "none"  # ZeRO-2 at most
    sp = job.pinned.get("train.sp_size", max(_sp_sizes(job)))
    leanest = TrainConfig(2 if quantized else 3, True, not quantized, 1, True, job.spec.train.tp_size,
                          quantized=quantized, sp=sp)
    for role in ("actor", "critic"):
        if role in job.roles:
            m = trained_role(a, job.roles[role], inv.gpus, dataclasses.replace(leanest, adapters=_trained(job, role)),
                             job.seq)
            if m["train"] > gpu:
                lean = "ZeRO-2 (a 4-bit base)" if quantized else "ZeRO-3, parameter"
                return (f"the {role} alone needs {m['train'] / GB:.1f} GB per GPU in training even with {lean} "
                        f"and optimizer offload, checkpointing, micro-batch 1"
                        + (f" and sequence-parallel size {sp}" if sp > 1 else "") + f" on all {inv.gpus} GPUs")
    return None


def render(plan: Plan) -> str:
    """The plan as a table for the console."""
    a, inv = plan.arch, plan.inventory
    w = max(len("placement group"), *(len(g) for g in plan.groups)) + 2
    lines = [f"plan: {plan.algorithm}, {a.params() / 1e9:.2f}B parameters, {inv.gpus} x {inv.gpu_mem_gb:g} GB GPU "
             f"on {inv.nodes} node(s)", "",
             f"{'role':10} {'GPUs':>5}  {'placement group':{w}} GB/GPU {'rollout':>8} {'experience':>10} {'train':>7}"]
    for role, r in plan.roles.items():
        m = r["memory"]
        lines.append(f"{role:10} {r['ranks']:>5}  {r['group']:{w}}        {m['rollout'] / GB:>8.1f} "
                     f"{m['experience'] / GB:>10.1f} {m['train'] / GB:>7.1f}")
    lines.append("")
    lines.append(f"{'placement group':{w}} {'peak GB/GPU':>11}  phase  (limit {USABLE * inv.gpu_mem_gb:.1f})")
    for name, g in plan.groups.items():
        lines.append(f"{name:{w}} {g['peak'] / GB:>11.1f}  {g['phase']}")
    lines.append(f"\nhost memory for offloaded states: {plan.host_bytes / GB:.0f} GB in all")
    lines += plan.lengths
    lines.append("settings: " + " ".join(f"{k}={_yaml(v)}" + (" (pinned)" if k in plan.pinned else "")
                                         for k, v in plan.settings.items()))
    return "\n".join(lines)
