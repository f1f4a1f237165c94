"""Fully asynchronous rollouts (``rl.fully_async``): the engines generate without waiting for a
batch, a weight update reaches the samples in flight between rounds, and every token keeps the
weight version that produced it.

The driver keeps a queue of prompt groups (``rl.prompts_per_step`` times ``rl.max_staleness``
+ 1 of them, ``rl.samples_per_prompt`` samples each). Generation goes in rounds: each round
extends every unfinished sample by up to ``rl.chunk_tokens`` tokens (its prompt plus its tokens
so far, one request per sample through the elastic pool), so a sync that lands between two
rounds takes effect mid-sequence, and an engine lost in a round hands its samples, tokens so
far, to the others. A step trains on the first ``rl.prompts_per_step`` groups that finished (in
the order they were drawn): a batch no longer waits for the longest sample of its prompts,
which go on into later batches. A token may lag the trained policy by ``rl.max_staleness``
versions; a sample with an older token starts over (``rl/regenerated`` counts them). With an
environment the samples are episodes (``episodes.StreamTurns``): a round extends each within its
turn, and a turn that ends steps the episode's environment.

Rounds run while the trainers train (``segment``), until the next batch is ready: how many is
decided by the samples, not the clock, and each request is seeded by the sample, its life and
its length, so a run, and one resumed from a checkpoint of its queue (``state``), is repeatable
(``rl.fully_async_rounds: until_trained`` goes on until the trainers finish: no idle engine,
but the clock decides).
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import asdict, dataclass, field

from elasticrl.rollout.episodes import Conversation, episode_sample
from elasticrl.rollout.sample import Sample


@dataclass
class Item(Conversation):
    """One sample of a prompt group, as far as it got. An episode's (rollout.environment:
    ``StreamTurns``) tokens hold the model's and the observations' after its prompt (mask True on
    the model's), logprobs and versions the model's; a plain sample leaves the conversation's
    other fields empty."""

    group: int                 # the group's number in the run's draw order
    record: int                # its prompt's record index
    j: int                     # which of the group's samples
    life: int = 0              # times it started over (too stale)
    versions: list[int] = field(default_factory=list)  # per token: the weight version that produced it
    turn: list[int] = field(default_factory=list)      # an episode's: the model's tokens of the turn under way

    def start_over(self) -> None:
        self.__dict__.update(Item(self.group, self.record, self.j, life=self.life + 1).__dict__)


class Stream:
    """The queue of groups in flight, and the rounds that advance it (module docstring)."""

    EMPTY = {"items": [], "groups": 0, "regenerated": 0, "rounds": 0}  # the ``state`` of a new stream

    def __init__(self, spec, prompt_ids, decode, episodes=None):
        """``prompt_ids``: record index -> token ids; ``decode``: token ids -> text;
        ``episodes``: a ``StreamTurns`` when the samples are episodes."""
        rl = spec.rl
        self.rl, self.seed, self.prompt_ids, self.decode = rl, spec.seed, prompt_ids, decode
        self.episodes = episodes
        self.capacity = rl.prompts_per_step * (rl.max_staleness + 1)
        self.items: list[Item] = []
        self.ids: dict[int, list[int]] = {}  # record -> prompt ids, encoded by the driver's thread
        self.groups = 0            # groups admitted so far
        self.regenerated = 0       # samples started over since the last batch
        self.rounds = 0            # rounds since the last batch
        self.trained = threading.Event()  # set when the trainers finished the step (``segment``)
        self.halted = threading.Event()   # set when a recovery drops what the rounds make

    # --- the queue ----------------------------------------------------------------------
    def fill(self, draw) -> None:
        """Admit groups while the queue has room; ``draw()`` gives the next prompts' record indices."""
        while len({i.group for i in self.items}) + self.rl.prompts_per_step <= self.capacity:
            for record in draw():
                self.items += [Item(self.groups, record, j) for j in range(self.rl.samples_per_prompt)]
                self.ids.setdefault(record, self.prompt_ids[record])
                self.groups += 1

    def _finished_groups(self, version: int) -> list[int]:
        """Groups whose samples all finished, none with a token older than ``version`` allows."""
        groups: dict[int, bool] = {}
        for i in self.items:
            fresh = not i.versions or min(i.versions) >= version - self.rl.max_staleness
            groups[i.group] = groups.get(i.group, True) and i.finish is not None and fresh
        return [g for g, done in groups.items() if done]

    def ready(self, version: int) -> bool:
        """Whether a batch trained at weight version ``version`` can be taken."""
        return len(self._finished_groups(version)) >= self.rl.prompts_per_step

    def expire(self, version: int) -> None:
        """Samples with a token more than rl.max_staleness versions behind ``version`` start over."""
        for i in self.items:
            if i.versions and min(i.versions) < version - self.rl.max_staleness:
                i.start_over()
                self.regenerated += 1

    def take(self, version: int) -> tuple[list[int], list[Sample], dict]:
        """The batch trained at ``version``: the first rl.prompts_per_step finished groups' records,
        their samples (in group order, n each), and the stream's figures since the last batch."""
        chosen = self._finished_groups(version)[: self.rl.prompts_per_step]
        order = {g: k for k, g in enumerate(chosen)}
        taken = sorted((i for i in self.items if i.group in order), key=lambda i: (order[i.group], i.j))
        self.items = [i for i in self.items if i.group not in order]
        self.ids = {i.record: self.ids[i.record] for i in self.items}
        records = [next(i.record for i in taken if i.group == g) for g in chosen]
        talk = self.episodes
        samples = [episode_sample(order[i.group], i, min(i.versions, default=version), i.versions) if talk else
                   Sample(order[i.group], i.tokens, i.logprobs, self.decode(i.tokens), i.finish, min(i.versions),
                          versions=i.versions) for i in taken]
        lags = [version - v for i in taken for v in i.versions]
        info = {**(talk.taken(taken) if talk else {}),
                "rollout/rounds": self.rounds, "rl/regenerated": self.regenerated,
                "rollout/carried": sum(1 for i in self.items if i.tokens),
                "rl/versions_per_sample": sum(len(set(i.versions)) for i in taken) / len(taken),
                "rl/token_staleness_max": max(lags, default=0),
                **{f"rl/token_staleness/{k}": lags.count(k) / len(lags) for k in sorted(set(lags))}}
        self.regenerated = self.rounds = 0
        return records, samples, info

    # --- the rounds ---------------------------------------------------------------------
    def round(self, pool) -> None:
        """Every unfinished sample one chunk further, on the engines' current weights."""
        rl, talk = self.rl, self.episodes
        todo = [i for i in self.items if i.finish is None]
        if talk:
            todo = talk.live(todo, rl.max_new_tokens)
        if not todo:
            return
        prompts = [(i.prompt_ids if talk else self.ids[i.record]) + i.tokens for i in todo]
        seeds = [zlib.crc32(f"{self.seed}/{i.group}/{i.j}/{i.life}/{len(i.tokens)}".encode()) for i in todo]
        sampling = {"n": 1, "temperature": rl.temperature, "top_p": rl.top_p,
                    **({"top_k": rl.top_k} if rl.top_k else {}), **({"ignore_eos": True} if rl.ignore_eos else {})}
        # one request per chunk length (the samples' room left, and min_tokens still owed)
        # (an episode's budgets are its turn's)
        made = [len(i.turn) if talk else len(i.tokens) for i in todo]
        shapes: dict[tuple, list[int]] = {}
        for k, i in enumerate(todo):
            room = min(rl.chunk_tokens, rl.max_new_tokens - made[k])
            shapes.setdefault((room, max(0, min(rl.min_tokens - made[k], room))), []).append(k)
        ended = []
        for (room, least), ks in shapes.items():
            out = pool.generate([prompts[k] for k in ks], {**sampling, "max_tokens": room,
                                                           **({"min_tokens": least} if least else {}),
                                                           "seeds": [seeds[k] for k in ks]})
            for r in out:
                k = ks[r.prompt_index]
                i = todo[k]
                i.tokens += r.token_ids
                i.logprobs += r.logprobs
                i.versions += [r.weight_version] * len(r.token_ids)
                if talk:
                    i.turn += r.token_ids
                    i.mask += [True] * len(r.token_ids)
                if r.finish_reason == "stop" or made[k] + len(r.token_ids) >= rl.max_new_tokens:
                    ended.append((i, "stop" if r.finish_reason == "stop" else "length"))
        if talk:
            talk.turns_ended(ended)
        else:
            for i, reason in ended:
                i.finish = reason
        self.rounds += 1

    def arm(self) -> None:
        """Before a ``segment`` starts: its step's trainers have not finished, nothing is halted."""
        self.trained.clear()
        self.halted.clear()

    def segment(self, pool, version: int) -> None:
        """Rounds while the trainers train: at least one, until a batch trained at ``version``
        (the weights after this update) is ready, and (rl.fully_async_rounds until_trained)
        until ``trained`` is set, while samples are left unfinished; none after ``halted``."""
        clock = self.rl.fully_async_rounds == "until_trained"
        self.round(pool)
        while any(i.finish is None for i in self.items) and not self.halted.is_set() and (
                not self.ready(version) or (clock and not self.trained.is_set())):
            self.round(pool)

    # --- checkpoints --------------------------------------------------------------------
    def state(self) -> dict:
        return {"items": [asdict(i) for i in self.items], "groups": self.groups,
                "regenerated": self.regenerated, "rounds": self.rounds}

    def restore(self, state: dict) -> None:
        self.items = [Item(**i) for i in state["items"]]
        self.ids = {i.record: self.prompt_ids[i.record] for i in self.items}
        self.groups, self.regenerated, self.rounds = state["groups"], state["regenerated"], state["rounds"]
        for i in self.episodes.replay(self.items) if self.episodes else ():
            i.start_over()  # its environment answered otherwise than before
            self.regenerated += 1
