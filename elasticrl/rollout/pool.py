"""N rollout engines as one elastic pool: a batch is split over the live engines and the
results merged in order, whatever engine dies meanwhile; and what rollouts sample with (the
spec's settings, seeded per step and prompt)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray

from elasticrl import backend
from elasticrl.cluster import RoleError, RoleGroup
from elasticrl.cluster.group import root_cause
from elasticrl.data.records import row_share
from elasticrl.rollout.engine import RolloutEngine
from elasticrl.rollout.hf_engine import HFRolloutEngine
from elasticrl.rollout.sample import Sample
from elasticrl.spec import JobSpec
from elasticrl.spec.schema import RolloutSpec

log = logging.getLogger(__name__)


def engine_class(requested: str):
    return RolloutEngine if backend.uses_vllm(requested) else HFRolloutEngine


def rollout_seed(seed: int, step: int) -> int:
    """The seed of step (or round) ``step``'s rollouts; each prompt's comes from it."""
    return seed + (step + 1) * 1_000_003


def prompt_seed(seed: int, prompt_index: int, samples_per_prompt: int) -> int:
    """The seed of a batch's prompt ``prompt_index``: vLLM draws its n samples from seeds
    seed, seed+1, ..., so a prompt's samples depend neither on the batch, nor on the other
    prompts, nor on which engine serves it."""
    return seed + prompt_index * samples_per_prompt


def sampling_params(spec: JobSpec, step: int | None, max_tokens: int | None = None) -> dict:
    """SamplingParams fields of sampled rollouts: rl.samples_per_prompt completions per prompt at
    rl.temperature, rl.top_p and rl.top_k (rl.min_tokens, rl.ignore_eos, rl.stop), seeded for
    step ``step`` (None: the run's own seed, which evaluation uses so that every evaluation
    draws alike)."""
    rl = spec.rl
    return {"n": rl.samples_per_prompt, "temperature": rl.temperature, "top_p": rl.top_p,
            "max_tokens": max_tokens or rl.max_new_tokens, **({"top_k": rl.top_k} if rl.top_k else {}),
            **({"min_tokens": rl.min_tokens} if rl.min_tokens else {}),
            **({"ignore_eos": True} if rl.ignore_eos else {}), **({"stop": list(rl.stop)} if rl.stop else {}),
            "seed": spec.seed if step is None else rollout_seed(spec.seed, step)}


@dataclass
class Work:
    """One rollout request as the pool tracks it: its prompts (the work items, by index), what
    they sample with, and which engine is generating which items since when."""

    prompts: list[list[int]]
    sampling: dict                                 # SamplingParams fields, without the seed
    seeds: list[int] | None                        # one per prompt (``prompt_seed``), or None
    parts: dict = field(default_factory=dict)      # ref -> (engine slot, item indices, start time)
    done: dict = field(default_factory=dict)       # item index -> its completions


class RolloutPool:
    """The rollout engines as one elastic pool (elasticity L2). A request is split into work
    items (its prompts) over the live engines; an engine that dies, or stops answering past a
    deadline from the generation rate measured so far (``rollout.hang_factor`` times the
    time its items would take at that rate), is dropped and its unfinished items go to the
    live ones, so every step ends with each sample exactly once, and, each prompt being
    seeded, with the samples it would have had. A replacement starts in the background
    (``rollout.max_restarts``) on the dead engine's bundle, and ``admit`` lets it in at a step
    boundary, where the trainer re-attaches its weight sender (``changed``)."""

    def __init__(self, model_path: str, spec: RolloutSpec, dtype: str, seed: int, trust_remote_code: bool = False,
                 where: dict | None = None, wait: bool = True, lora_rank: int = 0, lora_quantize: str = "none"):
        """``where``: the RoleGroup placement options (``cluster.Placement.options('rollout')``);
        by default each engine gets its own devices. ``wait=False``: return while the engines
        start (the caller builds its other roles meanwhile) and call ``ready`` before use.
        ``lora_rank``: the policy trains LoRA adapters of this rank, which vLLM engines serve as
        adapters under ``rollout.lora_sync`` adapter (auto: on GPUs), else they get merged weights;
        served adapters on a 4-bit base (``lora_quantize``) run on vLLM's bitsandbytes loading of it."""
        self.spec = spec
        adapters = spec.lora_sync == "adapter" or (spec.lora_sync == "auto" and backend.has_gpu())
        self.lora_rank = lora_rank if adapters and backend.uses_vllm(spec.backend) else 0
        env = backend.rollout_env(spec.tp_size, spec.cpus_per_engine)
        where = where or {"gpus_per_rank": spec.tp_size, "cpus_per_rank": spec.cpus_per_engine}
        self.group = RoleGroup(
            "rollout", engine_class(spec.backend), spec.num_engines, model_path, spec.tp_size, dtype, seed,
            spec.max_model_len, spec.cpu_mode, spec.cpu_sleep, spec.gpu_memory_utilization, spec.kv_cache_gib,
            trust_remote_code, self.lora_rank, "bitsandbytes" if self.lora_rank and lora_quantize != "none" else None,
            **where,
            # Threads let generation wait while a weight sync is in progress (see engine.py).
            actor_options={"max_concurrency": 4, "runtime_env": {"env_vars": env}})
        self._info_refs = [a.info.remote() for a in self.group.actors]
        self._infos: dict[int, dict] = {}
        self.live: list[int] = []                # engine slots that serve
        self.starting: dict[int, tuple] = {}     # slot -> (its info() ref, start time) of replacements
        self.restarts_left = spec.max_restarts
        self.deaths = 0
        self.changed = False                     # the live engines changed since the sender attached
        self.events: list[str] = []              # what happened, for the driver's console
        self.step: int | None = None             # the step being rolled out (for the events)
        self._rate = 0.0                         # tokens per second of one engine, measured
        self._sender = None                      # (trainer group, attach_rollout's arguments)
        self.version = 0                         # the weight version the engines hold
        self._busy = None                        # (time, slot -> busy seconds) at the last ``stats``
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the engines started (their ``info``); raises the first one's failure."""
        if self._info_refs:
            self._infos = dict(enumerate(self.group._get(self._info_refs, method="info")))
            self.live, self._info_refs = sorted(self._infos), []

    @property
    def engines(self) -> list:
        return [self.group.actors[i] for i in self.live]

    @property
    def infos(self) -> list[dict]:
        return [self._infos[i] for i in self.live]

    def _dispatch(self, work: Work, items: list[int]) -> None:
        if not self.live:
            self._await_replacement()
        for k, slot in enumerate(self.live):
            share = items[row_share(len(items), len(self.live), k)]
            if share:
                ref = self.group.actors[slot].generate.remote(
                    [work.prompts[i] for i in share], work.sampling,
                    None if work.seeds is None else [work.seeds[i] for i in share])
                work.parts[ref] = (slot, share, time.time())

    def submit(self, prompts: list[list[int]], sampling: dict) -> Work:
        """Start generating; ``collect`` the returned work later (async rollouts). A ``seed``
        in ``sampling`` seeds each prompt by ``prompt_seed``; ``seeds`` gives each its own."""
        seed, n, seeds = sampling.get("seed"), sampling.get("n", 1), sampling.get("seeds")
        if seeds is None and seed is not None:
            seeds = [prompt_seed(seed, j, n) for j in range(len(prompts))]
        work = Work(prompts, {k: v for k, v in sampling.items() if k not in ("seed", "seeds")}, seeds)
        self._dispatch(work, list(range(len(prompts))))
        return work

    def collect(self, work: Work) -> list[Sample]:
        """Completions of every prompt (``n`` each), ordered by prompt, each with its index;
        items of an engine that dies or hangs meanwhile are generated again elsewhere."""
        while work.parts:
            ready, _ = ray.wait(list(work.parts), num_returns=1, timeout=self._wait_s(work))
            if not ready:  # past the deadline: the slowest engine stopped answering
                ref = min(work.parts, key=lambda r: work.parts[r][2])
                slot, items, t0 = work.parts.pop(ref)
                self._lost(slot, f"stopped answering ({time.time() - t0:.0f} s on {len(items)} prompt(s), "
                                 f"{self.spec.hang_factor:g}x what the measured rate allows)")
                self._dispatch(work, items)
                continue
            slot, items, t0 = work.parts.pop(ready[0])
            try:
                out = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the engine's process is gone
                if slot in self.live:
                    self._lost(slot, f"died ({type(exc).__name__})")
                self._dispatch(work, items)
                continue
            except Exception as exc:  # an error of the request itself: every engine would fail it
                raise RoleError(f"rollout engine {slot} failed: {root_cause(exc)}") from exc
            seconds = time.time() - t0
            tokens = sum(len(r.token_ids) for r in out)
            if seconds > 0 and tokens:
                self._rate = max(self._rate * 0.8, tokens / seconds)  # a slow call is not a slower engine
            for r in out:
                r.prompt_index = items[r.prompt_index]
                work.done.setdefault(r.prompt_index, []).append(r)
        return [r for i in sorted(work.done) for r in work.done[i]]

    def _await_replacement(self) -> None:
        """No engine serves: wait for a replacement, then admit it with the current weights
        (the trainer is idle while the driver collects rollouts)."""
        if self.starting and self._sender is not None:
            ray.wait([ref for ref, _ in self.starting.values()], num_returns=1)
            self.sync(self.version)
        if not self.live:
            raise RoleError(f"rollout: every engine died{self._at()} and none could be restarted "
                            f"(rollout.max_restarts: {self.spec.max_restarts})")

    def _wait_s(self, work: Work) -> float | None:
        """Seconds until the first part's deadline (None: no rate measured yet, no deadline)."""
        if not self._rate:
            return None
        n, tokens = work.sampling.get("n", 1), work.sampling.get("max_tokens", 16)
        deadlines = [t0 + self.spec.hang_factor * (1.0 + len(items) * n * tokens / self._rate)
                     for _, items, t0 in work.parts.values()]
        return max(0.0, min(deadlines) - time.time())

    def _at(self) -> str:
        return "" if self.step is None else f" at step {self.step}"

    def _lost(self, slot: int, why: str) -> None:
        """Drop engine ``slot``; start its replacement while restarts are left."""
        self.live.remove(slot)
        self.deaths += 1
        self.changed = True
        line = f"rollout engine {slot} {why}{self._at()}; its prompts go to engine(s) {self.live or 'none'}"
        if self.restarts_left > 0:
            self.restarts_left -= 1
            actor = self.group.replace(slot)
            self.starting[slot] = (actor.info.remote(), time.time())
            line += "; a replacement is starting"
        self._event(line)

    def _event(self, line: str) -> None:
        self.events.append(line)
        log.warning(line)

    def admit(self) -> bool:
        """Let the replacements that are up serve (call it at a step boundary); True when the
        live engines changed since the last call, and the weight sender must re-attach."""
        for slot, (ref, t0) in list(self.starting.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self.starting[slot]
            try:
                self._infos[slot] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - any failure to start: the slot stays empty, said once
                self._event(f"rollout engine {slot}: its replacement failed to start ({type(exc).__name__})")
                continue
            self.live = sorted(self.live + [slot])
            self.changed = True
            self._event(f"rollout engine {slot} up in {time.time() - t0:.1f} s; it serves from the next "
                        f"rollout on{self._at().replace(' at', ', after')}")
        changed, self.changed = self.changed, False
        return changed

    # --- the trainer's weights into the live engines ----------------------------------------
    def attach(self, trainer, transport: str, bucket_mb: int, files_dir: str) -> str:
        """Give the trainer's ranks (a RoleGroup) a weight sender into the live engines."""
        self._sender = (trainer, transport, bucket_mb, files_dir, "auto", bool(self.lora_rank))
        return trainer.call("attach_rollout", self.engines, self.infos, *self._sender[1:])[0]

    def detach(self) -> None:
        self._sender[0].call("detach_rollout")

    def sync(self, version: int) -> dict:
        """The trainer's weights into every live engine as ``version``, after admitting the
        replacements that are up; the sender re-attaches when the live engines changed, and
        an engine that dies during the sync is dropped and the sync done again without it."""
        trainer, self.version = self._sender[0], version
        if self.admit():
            self._reattach()
        try:
            return trainer.call("sync_weights", version)[0]
        except RoleError:
            if not self.prune():
                raise
        self.admit()  # what came up meanwhile joins the retry
        self._reattach()
        return trainer.call("sync_weights", version)[0]

    def _reattach(self) -> None:
        """A new weight sender over the live engines (they changed)."""
        trainer = self._sender[0]
        trainer.call("detach_rollout")
        trainer.call("attach_rollout", self.engines, self.infos, *self._sender[1:])

    def prune(self) -> bool:
        """Drop the engines whose process is gone; True when there were some."""
        before = len(self.live)
        for slot in list(self.live):
            try:
                ray.get(self.group.actors[slot].info.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                self._lost(slot, f"died ({type(exc).__name__})")
        return len(self.live) < before

    def scale_to(self, engines: int) -> None:
        """Grow or shrink the pool to ``engines`` (``elasticrl scale``): new engines start in the
        background and serve once admitted; the ones removed (starting ones first, then the
        newest) stop at once, their unfinished prompts going to the others."""
        have = len(self.live) + len(self.starting)
        for _ in range(max(0, engines - have)):
            free = ray.available_resources()
            short = [f"{k} {v:g} (free {free.get(k, 0):g})" for k, v in self.group.bundle.items()
                     if free.get(k, 0) < v] if self.group.bundle else []
            slot = self.group.add()
            self.starting[slot] = (self.group.actors[slot].info.remote(), time.time())
            self._event(f"rollout engine {slot} starting{self._at().replace(' at', ' after')} (asked: {engines})"
                        + (f"; it waits for room in the cluster: it needs {', '.join(short)}" if short else ""))
        for _ in range(max(0, have - engines)):
            slot = max(self.starting) if self.starting else self.live[-1]
            if slot in self.starting:
                del self.starting[slot]
            else:
                self.live.remove(slot)
                self.changed = True
            ray.kill(self.group.actors[slot], no_restart=True)
            self._event(f"rollout engine {slot} removed{self._at().replace(' at', ' after')} (asked: {engines})")

    def stats(self) -> dict:
        """The pool's figures since the last call: live engines, deaths, and the share of the
        live engines' time they spent neither generating nor scoring (``rollout/engine_idle``)."""
        refs = {self.group.actors[slot].busy.remote(): slot for slot in self.live}
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        now, busy = time.time(), {}
        for ref in answered:
            try:
                busy[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # a dead engine (or, not answering, a hung one) is the next rollout's to find
        was, self._busy = self._busy, (now, busy)
        out = {"rollout/engines": len(self.live), "fault/engine_deaths": self.deaths}
        if was is not None and busy:
            spent = sum(max(0.0, b - was[1].get(slot, 0.0)) for slot, b in busy.items())
            out["rollout/engine_idle"] = max(0.0, 1.0 - spent / (len(busy) * max(now - was[0], 1e-9)))
        return out

    def generate(self, prompts: list[list[int]], sampling: dict) -> list[Sample]:
        return self.collect(self.submit(prompts, sampling))

    def score(self, sequences: list[list[int]]) -> tuple[list[list[float]], list[int]]:
        n = len(self.live)
        chunks = [sequences[row_share(len(sequences), n, k)] for k in range(n)]
        parts = self.group._get([e.score.remote(c) for e, c in zip(self.engines, chunks) if c])
        return [lp for part, _ in parts for lp in part], [v for _, v in parts]

    def call(self, method: str, *args) -> list:
        """``method`` on every live engine, results in order."""
        return self.group._get([getattr(e, method).remote(*args) for e in self.engines], ranks=self.live)

    def shutdown(self) -> None:
        try:
            self.call("shutdown")
        finally:
            self.group.shutdown()
