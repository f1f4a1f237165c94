"""An RL run's roles and what its steps share: every role placed (``Roles``: the engines,
the trained and frozen models, re-formed when one of their ranks is lost), the state carried
from step to step (``Run``), and what keeps the run going: its checkpoints, resume, the
in-memory copy and the recovery of a lost trainer rank (elasticity L3) or frozen-model rank.
The step itself is ``trainers.rl``."""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elasticrl import backend
from elasticrl import run_folder as rf
from elasticrl.algorithms.normalize import RunningMoments
from elasticrl.cluster import Placement, RoleError, RoleGroup, Unplaceable
from elasticrl.cluster.group import where
from elasticrl.data.records import Records, format_prompt, prompt_of
from elasticrl.engine import checkpoint as ckpt
from elasticrl.engine.checkpoint import Resume, list_checkpoints
from elasticrl.plan.planner import fewer_ranks
from elasticrl.rewards.sources import RewardSources
from elasticrl.rollout.pool import RolloutPool
from elasticrl.rollout.sample import Sample
from elasticrl.rollout.sources import InStep
from elasticrl.spec import JobSpec, spec_to_dict
from elasticrl.trainers.batch import Experience
from elasticrl.trainers.copies import PeerCopies
from elasticrl.trainers.loop import Cadence, Checkpoints, MetricsLog, Progress
from elasticrl.trainers.rl_workers import ActorWorker, CriticWorker, FrozenWorker

log = logging.getLogger(__name__)
PHASES = ("rollout", "experience", "train", "sync")


def critic_train(spec: JobSpec, ranks: int | None = None) -> dict:
    """The critic's own train settings: its rank count (``ranks``: fewer than the spec's, after
    a node was lost), and the actor's micro-batch unless that does not divide its share of a
    mini-batch (then the whole share, with a warning)."""
    t, ranks = spec.train, ranks or spec.critic.num_ranks
    mbs = t.micro_batch_size
    if t.global_batch_size % (mbs * ranks):
        mbs = t.global_batch_size // ranks
        log.warning("train.micro_batch_size: %d does not divide the critic's share of a mini-batch "
                    "(train.global_batch_size %d over critic.num_ranks %d); the critic uses micro-batches of %d",
                    t.micro_batch_size, t.global_batch_size, ranks, mbs)
    return {"num_ranks": ranks, "tp_size": 1, "global_batch_size": t.global_batch_size, "micro_batch_size": mbs}


class Roles:
    """Every role of the job, placed by ``cluster.Placement`` (``placement.colocate``)."""

    def __init__(self, spec: JobSpec, paths: dict[str, str], total_updates: int, resume: Resume = Resume()):
        """``resume``: a checkpoint the actor and the critic continue from."""
        d = spec_to_dict(spec)
        self.spec, self.dict, self.paths, self.total_updates = spec, d, paths, total_updates
        self.placement = p = Placement(spec)
        if spec.placement.offload_idle and not backend.has_gpu():
            log.warning("placement.offload_idle: ignored without GPUs (frozen models stay in host memory anyway)")
        self.groups: list[RoleGroup] = []
        self.actor = self.critic = None
        self.setups: dict[str, dict] = {}  # role -> its rank 0's set-up figures (import_s, load_s)
        t0 = time.time()
        # the engines start first and load while the trained and frozen roles are built
        self.pool = RolloutPool(paths["model"], spec.rollout, spec.model.dtype, spec.seed,
                                spec.model.trust_remote_code, where=p.options("rollout"), wait=False,
                                lora_rank=spec.model.lora.rank, lora_quantize=spec.model.lora.quantize)
        self.groups.append(self.pool.group)
        # the frozen roles load while the trained ones are built
        self.reference, self.rewards, frozen = None, [], []
        if "reference" in p.roles and not p.roles["reference"].in_trainer:
            self.reference = self._frozen("reference")
            frozen.append(("reference", self.reference.setup(wait=False)))
        for i, m in enumerate(spec.rewards.models):
            g = self._frozen(f"reward{i}")
            frozen.append((f"reward{i}", g.setup(wait=False)))
            self.rewards.append((g, m.weight))
        self.form_trained(resume)
        for name, wait in frozen:
            self.setups[name] = wait()[0]
        t_models = time.time()
        self.pool.ready()
        engine = self.pool.infos[0] if self.pool.live else {}
        self.setups["rollout"] = {"import_s": engine.get("import_seconds", 0.0), "load_s": engine.get("start_seconds")}
        self.startup = {"models_s": round(t_models - t0, 1), "roles_s": round(time.time() - t0, 1),
                        **{f"{role}/{k}": round(v, 1) for role, got in self.setups.items()
                           for k, v in got.items() if k.endswith("_s") and v is not None}}

    def form_trained(self, resume: Resume, elastic: bool = False) -> None:
        """The trained roles, the actor and (ppo) the critic, from ``resume``'s checkpoint or
        the start model; called again after one of their ranks was lost (``elastic``), which
        tears the old groups down first (the engines, the reference and the rewards stay up)
        and re-forms each on fewer ranks when its own can no longer be placed."""
        spec, d, p = self.spec, self.dict, self.placement
        for g in (self.actor, self.critic):
            if g is not None:
                self.groups.remove(g)
                g.shutdown()
        self.actor = self._add(self.trained_groups("actor", elastic, lambda ranks, timeout: p.group(
            "actor", ActorWorker, d, self.paths["model"], ranks=ranks, place_timeout_s=timeout)))
        if spec.rl.ptx_coef > 0:
            self.actor.call("set_ptx_data", self.paths["sft"])
        self.setups["actor"] = self.actor.setup(self.total_updates, resume=resume.role("actor"))[0]
        if "critic" in p.roles:
            init = spec.critic.path or (spec.rewards.models[0].path if spec.rewards.models else self.paths["model"])
            self.critic = self._add(self.trained_groups("critic", elastic, lambda ranks, timeout: p.group(
                "critic", CriticWorker, d, init, critic_train(spec, ranks), spec.critic.lr, ranks=ranks,
                place_timeout_s=timeout)))
            self.setups["critic"] = self.critic.setup(self.total_updates, resume=resume.role("critic"))[0]

    def reform_frozen(self, name: str) -> str:
        """Build the frozen role ``name`` (``reference``, or ``rewardI``) again from its folder after
        one of its ranks was lost; the trained roles and the engines stay as they are. Its ranks
        go where its placement allows (its app role's nodes: one left, or one that joins it),
        waiting ``fault.place_timeout_s`` for one. Returns the Ray node(s) it now runs on."""
        old = next(g for g in self.groups if g.role == name)
        self.groups.remove(old)
        old.shutdown()
        g = self._frozen(name, place_timeout_s=self.spec.fault.place_timeout_s, await_nodes=True)
        if name == "reference":
            self.reference = g
        else:
            i = int(name.removeprefix("reward"))
            self.rewards[i] = (g, self.rewards[i][1])
        g.setup()
        return ", ".join(sorted(set(g.call("__ray_call__", where))))

    def trained_groups(self, role: str, elastic: bool, make) -> RoleGroup:
        """``make(ranks, place_timeout_s)`` at the job's rank count; when ``elastic`` and those no
        longer fit (a node is gone), at the most ranks the planner keeps the global batch with."""
        ranks = self.placement.roles[role].ranks
        if not elastic or role in self.placement.shared:  # colocated: its bundles are shared
            return make(ranks, 300)
        while True:
            try:
                return make(ranks, self.spec.fault.place_timeout_s)
            except Unplaceable as exc:
                fewer = fewer_ranks(self.spec, role, min(ranks - 1, exc.room if exc.room is not None else ranks))
                if not fewer:
                    raise
                print(f"{exc}; re-forming {role} on {fewer} rank(s)", file=sys.stderr, flush=True)
                ranks = fewer

    def threads(self) -> dict[str, int]:
        """Role -> CPU threads its rank 0 computes with (``train.threads``)."""
        return {g.role: g.call_rank(0, "threads") for g in self.groups if g is not self.pool.group}

    def layout(self) -> dict[str, str]:
        """Role -> id of the placement group it runs on (colocated roles share one)."""
        return {g.role: g.pg.id.hex()[:12] for g in self.groups}

    def _frozen(self, name: str, **options) -> RoleGroup:
        """The group of frozen role ``name`` (``reference``, or ``rewardI``: reward model I),
        added to the job's; ``options`` go to ``RoleGroup``."""
        idle = self.spec.placement.offload_idle
        if name == "reference":
            return self._add(self.placement.group("reference", FrozenWorker, self.dict, self.paths["model"],
                                                  "reference", idle, **options))
        model = self.spec.rewards.models[int(name.removeprefix("reward"))]
        return self._add(self.placement.group("reward", FrozenWorker, self.dict, model.path, "reward", idle,
                                              name=name, **options))

    def _add(self, group: RoleGroup) -> RoleGroup:
        self.groups.append(group)
        return group

    def shutdown(self) -> None:
        for g in reversed(self.groups):
            try:
                if g is self.pool.group:
                    self.pool.shutdown()
                else:
                    g.shutdown()
            except Exception as exc:  # noqa: BLE001 - keep tearing down the others
                log.warning("shutting down %s: %s", g.role, exc)
        self.placement.remove()


# --- the run and its step ---------------------------------------------------------------
@dataclass
class Run:
    """What the steps of an RL run share and carry from one to the next."""

    spec: JobSpec                                    # the job's (with a trained reward model filled in)
    roles: Roles
    rewards: RewardSources
    tokenizer: object
    prompts: Records
    prompt_ids: Encoded
    evals: Records
    eval_ids: list[list[int]]
    output: Path
    asked: JobSpec | None = None                     # the spec as the user gave it, which checkpoints record
    metrics: MetricsLog | None = None
    progress: Progress | None = None
    moments: RunningMoments = field(default_factory=RunningMoments)
    version: int = 0                                 # weight version in the engines
    totals: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    checkpoints: Checkpoints | None = None           # the run's checkpoints (set once the metrics are)
    saved_at: float = field(default_factory=time.time)  # when the newest checkpoint was written (or the start)
    restarts: int = 0                                # times the trained roles were re-formed (L3)
    reforms: int = 0                                 # times a frozen role (reference, reward model) was rebuilt
    recoveries: list = field(default_factory=list)   # one dict per re-forming: what, when, how long
    scale_seen: float = 0.0                          # when the last `elasticrl scale` request applied was asked
    envs: object = None                              # the environment processes (rollout.environment), or None
    seconds_lost: float = 0.0                        # to failures: the work redone and the recoveries
    copies: PeerCopies = field(default_factory=PeerCopies)  # the in-memory copy: fault.memory_copy_steps
    source: InStep | None = None                     # where the samples come from (rollout.sources)
    pss_gb: float | None = None                      # the process tree's PSS after the run's first step

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.spec, self.spec.rl.num_steps)


@dataclass
class Step:
    """One step's data as it moves through the phases."""

    step: int
    indices: list[int]                    # the prompts' record indices
    results: list[Sample]                 # completions, n per prompt, in prompt order
    generated: int = 0                    # tokens the engines generated for them
    batch: Experience | None = None       # tensors for the trainers (None: nothing to train on)
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    sync: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


@contextlib.contextmanager
def timed(s: Step, phase: str):
    t0 = time.time()
    yield
    s.seconds[phase] = s.seconds.get(phase, 0.0) + time.time() - t0


class Encoded:
    """The token ids of a dataset's prompts (``data``'s prompt, in the chat template where it
    asks), encoded when asked for (a large dataset is not tokenised up front, nor held in memory)."""

    def __init__(self, records, data, tokenizer):
        self.records, self.data, self.tokenizer = records, data, tokenizer

    def __getitem__(self, i: int) -> list[int]:
        text = format_prompt(self.tokenizer, prompt_of(self.records[i], self.data), self.data.apply_chat_template)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def resume_state(run: Run, resume: Resume) -> int:
    """What the driver carries between steps, from a checkpoint (the actor and the critic
    started from it already); returns the step to continue from."""
    state = resume.state
    run.version = state["version"]
    run.moments.mean, run.moments.var, run.moments.count = state["reward_moments"]
    run.source.restore(state)
    return state["step"]


def recover(run: Run, exc: RoleError, step: int) -> int:
    """Elasticity L3: a rank of the actor or the critic died or hung during step ``step``
    (0-based). Re-form both from the newest checkpoint (the start model without one), bring
    the driver's state and the metrics back to it, sync its weights into the engines, and
    return the step to continue from; the steps redone repeat (same data, same seeds). Any
    other failure, or one past ``fault.max_restarts``, ends the run as before."""
    spec, roles = run.spec, run.roles
    if not exc.lost or exc.role not in ("actor", "critic") or run.restarts >= spec.fault.max_restarts:
        raise exc
    t0 = time.time()
    run.restarts += 1
    run.source.drop()  # rolled out on weights the restored roles never had
    run.checkpoints.salvage()  # a checkpoint the ranks were writing is one if they all finished it
    found = list_checkpoints(run.output / rf.CHECKPOINTS)
    source = "the newest checkpoint" if found else "the start"
    copies = run.copies
    if copies.step is not None and (not found or copies.step > found[-1][0]):  # newer: it becomes a checkpoint
        if run.checkpoints.adopt(copies.step, copies.state, copies.write):
            found, source = list_checkpoints(run.output / rf.CHECKPOINTS), "the in-memory copy"
        copies.drop()
    resume = ckpt.resume_from(found[-1][1]) if found else Resume()
    roles.form_trained(resume, elastic=True)
    if resume.folder is None:
        run.version, run.moments, start = 0, RunningMoments(), 0
        run.source.restore(None)
    else:
        start = resume_state(run, resume)
    run.metrics.close()
    run.metrics = MetricsLog(run.output, run.asked, resume_step=start)
    roles.pool.attach(roles.actor, spec.rollout.weight_sync, spec.rollout.bucket_mb, str(run.output / rf.WEIGHTS))
    roles.pool.sync(run.version)
    run.seconds_lost += time.time() - run.saved_at
    run.saved_at = time.time()
    run.recoveries.append({"what": exc.what, "step": step + 1, "from_step": start, "from": source,
                           "ranks": roles.actor.num_ranks, "seconds": round(time.time() - t0, 1),
                           "recovered_at": time.time()})
    print(f"{exc.what} at step {step + 1}; recovered in {time.time() - t0:.1f} s from step {start} ({source}) on "
          f"{roles.actor.num_ranks} rank(s) ({run.restarts} of fault.max_restarts {spec.fault.max_restarts})",
          file=sys.stderr, flush=True)
    return start


def score_again_after_frozen_loss(run: Run, s, exc: RoleError, before: tuple) -> None:
    """A rank of the reference or of a reward model was lost while step ``s`` was scored: that
    role alone is built again and the scoring starts over from the same samples, with the
    driver's state as it was before (``before``: prompts drawn, reward moments, the step's
    prompts and samples); the trained roles and the engines go on untouched. Anything else,
    or one past ``fault.max_restarts``, ends the run."""
    spec = run.spec
    frozen = exc.role == "reference" or (exc.role or "").startswith("reward")
    if not (exc.lost and frozen) or run.reforms >= spec.fault.max_restarts:
        raise exc
    t0 = time.time()
    run.reforms += 1
    print(f"{exc.what} at step {s.step + 1}; re-forming {exc.role} (waiting up to fault.place_timeout_s "
          f"{spec.fault.place_timeout_s:.0f} s for room for it)", file=sys.stderr, flush=True)
    nodes = run.roles.reform_frozen(exc.role)
    run.source.order.drawn, moments, s.indices, s.results, s.generated = before
    run.moments = copy.deepcopy(moments)
    seconds = time.time() - t0
    run.recoveries.append({"what": exc.what, "step": s.step + 1, "role": exc.role, "nodes": nodes,
                           "seconds": round(seconds, 1), "recovered_at": time.time()})
    # (`elasticrl status` counts these lines: launch.submit._told)
    print(f"{exc.role} re-formed on {nodes} in {seconds:.1f} s; scoring step {s.step + 1} again ({run.reforms} "
          f"of fault.max_restarts {spec.fault.max_restarts})", file=sys.stderr, flush=True)


def before_scoring(run: Run, s) -> tuple:
    """What ``score_again_after_frozen_loss`` restores."""
    return run.source.order.drawn, copy.deepcopy(run.moments), list(s.indices), list(s.results), s.generated


def trained_groups(roles: Roles) -> dict:
    return {"actor": roles.actor, **({"critic": roles.critic} if roles.critic else {})}


def driver_state(run: Run, step: int) -> dict:
    """What the driver carries between steps, as a checkpoint records it (``_resume`` reads it)."""
    m = run.moments
    return {**run.source.state(), "version": run.version, "reward_moments": [m.mean, m.var, m.count]}


def save(run: Run, step: int) -> None:
    run.checkpoints.save(trained_groups(run.roles), step, driver_state(run, step))
    run.saved_at = time.time()  # the copy stays until the checkpoint is committed (recover takes the newer)


def startup_line(up: dict, threads: dict) -> str:
    """The run's start-up figures (``Roles.startup`` and when Ray and the roles were up) as it
    prints them, each role's (``actor/import_s`` ...) in turn."""
    per_role: dict[str, list[str]] = {}
    for key, v in up.items():
        if "/" in key:
            role, what = key.split("/")
            per_role.setdefault(role, []).append(f"{what.removesuffix('_s').replace('_', ' ')} {v}")
    return (f"start-up: launch -> Ray up {up['launch_to_ray_s']} s, every role up at {up['launch_to_roles_s']} s "
            f"({up['roles_s']} s; " + ", ".join(f"{role} {' + '.join(parts)}" for role, parts in per_role.items())
            + "); CPU threads per rank: " + ", ".join(f"{r} {n}" for r, n in threads.items()))
