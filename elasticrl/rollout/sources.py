"""Where an RL step's samples come from: one source per rollout mode, each with single-turn
completions or multi-turn episodes (``Completions``, ``Episodes``), behind the small protocol
the step asks (``trainers.rl`` knows no mode):

- ``next(step, version)``: the step's prompts (record indices), samples and figures;
- ``more(step)``: another draw of prompts, rolled out now (dynamic sampling tops a batch up);
- ``weights_changing()``: before a sync, what rolls out in the background ends on the old weights;
- ``state()`` and ``restore(state)``: the data position (and queue) a checkpoint records;
- ``drop()``: a recovery forgets what was rolled out on weights the restored roles never had.

The modes, and ``rollout_source`` the one place that picks among them: ``InStep``
(``rl.async_rollout`` off), ``Ahead`` (``rl.async_rollout``: up to ``rl.max_staleness`` batches
rolled out ahead on the current weights, one with episodes) and ``FullyAsync``
(``rl.fully_async``: the queue of ``stream.Stream``).
"""
from __future__ import annotations

import copy
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

from elasticrl.data.records import sample_indices
from elasticrl.rollout.episodes import StreamTurns, run_episodes
from elasticrl.rollout.pool import sampling_params
from elasticrl.rollout.sample import Sample
from elasticrl.rollout.stream import Stream

EPISODES_SHOWN = 4  # evaluation episodes written out whole each evaluation


def in_background(fn, *args) -> Future:
    """``fn(*args)`` in a thread of its own; the future answers (or raises) what it did."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


class PromptOrder:
    """The run's prompts in its sample order (``data.shuffle``), ``rl.prompts_per_step`` at a
    time; ``drawn`` (the prompts handed out so far) is the data position."""

    def __init__(self, spec, num_records: int):
        self.spec, self.num_records, self.drawn = spec, num_records, 0

    def draw(self) -> list[int]:
        k = self.spec.rl.prompts_per_step
        idx = sample_indices(self.num_records, self.spec.seed, self.drawn, k, self.spec.data.shuffle)
        self.drawn += k
        return idx


class Completions:
    """Single-turn samples: a completion per request, through the engines' pool."""

    def __init__(self, pool, prompt_ids):
        self.pool, self.prompt_ids = pool, prompt_ids
        self.shown: list[Sample] = []

    def start(self, idx: list[int], sampling: dict):
        """The requests queued in the pool; the engines finish them on the weights they began with."""
        return self.pool.submit([self.prompt_ids[i] for i in idx], sampling)

    def finish(self, handle) -> tuple[list[Sample], dict]:
        return self.pool.collect(handle), {}

    def settle(self, handle) -> None:
        """Nothing waits before a sync (the pool's requests keep their weights)."""

    def now(self, idx: list[int], sampling: dict) -> tuple[list[Sample], dict]:
        return self.finish(self.start(idx, sampling))

    def evaluation(self):
        """How evaluation generates (None: the pool's own completions)."""
        return None


class Episodes(Completions):
    """Multi-turn samples (``rollout.environment``): each prompt's episode with the job's
    environment, turn by turn; started ahead, they go on in a driver thread with a tokenizer of
    its own (a fast tokenizer is not for two threads at once)."""

    def __init__(self, spec, pool, envs, tokenizer, prompts):
        super().__init__(pool, None)
        self.spec, self.envs, self.tokenizer, self.prompts = spec, envs, tokenizer, prompts
        self.thread_tokenizer = copy.deepcopy(tokenizer) if spec.rl.async_rollout else tokenizer

    def run(self, rows: list[dict], sampling: dict, tokenizer=None) -> tuple[list[Sample], dict]:
        rl, limit = self.spec.rl, self.spec.rollout.max_model_len
        return run_episodes(self.pool, self.envs, tokenizer or self.tokenizer, rows, sampling, rl.max_turns,
                            rl.max_episode_tokens or limit, limit)

    def start(self, idx: list[int], sampling: dict) -> Future:
        return in_background(self.run, [self.prompts[i] for i in idx], sampling, self.thread_tokenizer)

    def finish(self, handle: Future) -> tuple[list[Sample], dict]:
        return handle.result()

    def settle(self, handle: Future) -> None:
        """The episodes end on the weights they began with (a failure is raised by ``finish``)."""
        wait([handle])

    def now(self, idx: list[int], sampling: dict) -> tuple[list[Sample], dict]:
        return self.run([self.prompts[i] for i in idx], sampling)

    def evaluation(self):
        """Evaluation's episodes, the greedy ones' first few kept in ``shown`` for the log."""
        def generate(rows: list[dict], sampling: dict) -> list[Sample]:
            samples = self.run(rows, sampling)[0]
            if sampling.get("temperature") == 0.0:
                self.shown = samples[:EPISODES_SHOWN]
            return samples
        return generate


class InStep:
    """Each step's batch rolled out when the step asks, on the newest weights."""

    max_staleness = 0  # in weight versions, the oldest token a batch may hold

    def __init__(self, spec, samples: Completions, order: PromptOrder):
        self.spec, self.samples, self.order = spec, samples, order

    def next(self, step: int, version: int) -> tuple[list[int], list[Sample], dict]:
        idx = self.order.draw()
        return (idx, *self.samples.now(idx, sampling_params(self.spec, step)))

    def more(self, step: int) -> tuple[list[int], list[Sample]]:
        idx, samples, _ = InStep.next(self, step, 0)  # rolled out now, whatever the mode
        return idx, samples

    def weights_changing(self) -> None:
        pass

    def state(self) -> dict:
        return {"prompts_seen": self.order.drawn}

    def restore(self, state: dict | None) -> None:
        """``state``: a checkpoint's (None: the run's start; one without the position: its step's)."""
        state = state or {}
        self.order.drawn = state.get("prompts_seen", state.get("step", 0) * self.spec.rl.prompts_per_step)

    def drop(self) -> None:
        pass


class Ahead(InStep):
    """``rl.async_rollout``: batches rolled out ahead on the current weights while the trainers
    train, up to ``rl.max_staleness`` of them (one with episodes, which end before a sync);
    none is in flight across a checkpoint, so a resumed run rolls out as this one does."""

    def __init__(self, spec, samples: Completions, order: PromptOrder, cadence, episodes: bool):
        super().__init__(spec, samples, order)
        rl = spec.rl
        self.max_staleness = rl.max_staleness
        self.depth = min(1, rl.max_staleness) if episodes else rl.max_staleness
        self.cadence = cadence
        self.pending: deque = deque()  # (step, indices, handle)

    def _start(self, step: int) -> None:
        idx = self.order.draw()
        self.pending.append((step, idx, self.samples.start(idx, sampling_params(self.spec, step))))

    def next(self, step: int, version: int) -> tuple[list[int], list[Sample], dict]:
        if not self.pending:
            self._start(step)
        _, idx, handle = self.pending.popleft()
        samples, info = self.samples.finish(handle)
        while len(self.pending) < self.depth and step + 1 + len(self.pending) < self.spec.rl.num_steps:
            ahead = step + 1 + len(self.pending)
            if any(self.cadence.checkpoint(t + 1) for t in range(step, ahead)):
                break
            self._start(ahead)
        return idx, samples, info

    def weights_changing(self) -> None:
        for _, _, handle in self.pending:
            self.samples.settle(handle)

    def state(self) -> dict:
        ahead = sum(len(idx) for _, idx, _ in self.pending)  # drawn for the steps after this one
        return {"prompts_seen": self.order.drawn - ahead}

    def drop(self) -> None:
        self.weights_changing()
        self.pending.clear()


class FullyAsync(InStep):
    """``rl.fully_async``: the step's batch from the queue of groups in flight (rounds now only
    while none is ready), then the queue refilled and its rounds going on in a driver thread
    until the weights change (``stream``)."""

    def __init__(self, spec, samples: Completions, order: PromptOrder, stream: Stream):
        super().__init__(spec, samples, order)
        self.max_staleness = spec.rl.max_staleness
        self.stream = stream
        self.segment: Future | None = None

    def next(self, step: int, version: int) -> tuple[list[int], list[Sample], dict]:
        stream, pool = self.stream, self.samples.pool
        stream.fill(self.order.draw)
        stream.expire(version)
        while not stream.ready(version):
            stream.round(pool)
        out = stream.take(version)
        stream.fill(self.order.draw)
        if step + 1 < self.spec.rl.num_steps:
            stream.arm()
            self.segment = in_background(stream.segment, pool, version + 1)
        return out

    def weights_changing(self, failed_ok: bool = False) -> None:
        """The rounds stop once the trainers are done; ``failed_ok`` (a recovery): after the
        round in flight, and a failure is dropped."""
        segment, self.segment = self.segment, None
        if segment is None:
            return
        self.stream.trained.set()
        if failed_ok:
            self.stream.halted.set()
        try:
            segment.result()
        except Exception:
            if not failed_ok:
                raise

    def state(self) -> dict:
        return {**super().state(), "stream": self.stream.state()}

    def restore(self, state: dict | None) -> None:
        super().restore(state)
        self.stream.restore((state or {}).get("stream", Stream.EMPTY))

    def drop(self) -> None:
        self.weights_changing(failed_ok=True)


def rollout_source(spec, pool, prompts, prompt_ids, tokenizer, envs, cadence) -> InStep:
    """The job's source (``rl.async_rollout``, ``rl.fully_async``; episodes with ``rollout.environment``)."""
    rl, episodes = spec.rl, bool(spec.rollout.environment)
    samples = Episodes(spec, pool, envs, tokenizer, prompts) if episodes else Completions(pool, prompt_ids)
    order = PromptOrder(spec, len(prompts))
    if rl.fully_async:
        turns = StreamTurns(envs, samples.thread_tokenizer, prompts, rl.samples_per_prompt, rl.max_turns,
                            rl.max_episode_tokens or spec.rollout.max_model_len, spec.rollout.max_model_len) \
            if episodes else None
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return FullyAsync(spec, samples, order, Stream(spec, prompt_ids, decode, turns))
    if rl.async_rollout:
        return Ahead(spec, samples, order, cadence, episodes)
    return InStep(spec, samples, order)
