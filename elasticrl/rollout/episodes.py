"""Multi-turn episodes (``rollout.environment``): the model talks to an environment, turn by
turn, on the elastic rollout pool.

Each step's episodes (rl.samples_per_prompt per prompt) advance together: every turn is one
pool request of the live episodes' token contexts, so an engine's death re-dispatches its
episodes' turns to the live engines (``RolloutPool``), and each turn is seeded from (step,
episode, turn), so what an episode samples does not depend on which engine served it. The
environments answer in their own processes (``elasticrl.envs.child``, ``rewards.workers`` of
them), side by side.

Token-exact: an episode's sequence is the prompt's tokens, then each turn's generated tokens as
sampled, then the observation's tokens as the chat template renders them after that turn (the
text it adds after the model's own tokens, tokenized), never a re-tokenisation of decoded text;
the next turn continues from exactly those tokens. ``mask`` marks the model's tokens (the loss's),
``logprobs`` holds the engine's log-prob of each of them. An episode ends when the environment
says done, or truncated: at rl.max_turns, past rl.max_episode_tokens, at a turn cut at
rl.max_new_tokens, or when its environment fails (an error, a lost process).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from elasticrl.envs.pool import EnvironmentPool
from elasticrl.rollout.sample import Sample


@dataclass(kw_only=True)
class Conversation:
    """An episode as far as it got: what ``run_episodes``' episodes and the stream's samples
    (``stream.Item``) share."""
    messages: list = field(default_factory=list)   # the conversation so far (the model's turns as text)
    tools: list = field(default_factory=list)      # the tools' JSON schemas, as offered
    prompt_ids: list | None = None                 # its first messages rendered, once its environment started
    tokens: list = field(default_factory=list)     # everything after the prompt: model and observation tokens
    mask: list = field(default_factory=list)       # True on the model's tokens
    logprobs: list = field(default_factory=list)   # the engine's, of the model's tokens
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    retries: int = 0                               # a remote environment's requests retried
    reward: float = 0.0                            # the environment's, summed over turns
    text: str = ""                                 # the model's last finished turn
    finish: str | None = None                      # 'stop' or 'length' once finished
    truncated: bool = False
    error: str | None = None


@dataclass
class Episode(Conversation):
    row: dict
    seed: int
    version: int | None = None                     # the oldest weights that generated a turn
    done: bool = False


def render(tokenizer, messages: list[dict], tools: list, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation)


def observation_ids(tokenizer, e: Conversation, generated: list[int], observation: list[dict]) -> list[int]:
    """The tokens after the model's turn up to the model's next one: what the template adds
    after the model's own tokens (its end of turn, where the model did not generate all of
    it), the observation's messages, and the next generation prompt."""
    opened = render(tokenizer, e.messages, e.tools, True)
    turn = e.messages + [{"role": "assistant", "content": e.text}]
    closed = render(tokenizer, turn, e.tools, False)
    after = render(tokenizer, turn + observation, e.tools, True)
    if not (closed.startswith(opened) and after.startswith(closed)):
        raise ValueError("the chat template does not render a conversation as its first turns followed by more; "
                         "set data.chat_template")
    own = tokenizer.decode(generated, skip_special_tokens=False)
    rest = closed[len(opened):]
    tail = rest[len(own):] if rest.startswith(own) else ""
    return tokenizer(tail + after[len(closed):], add_special_tokens=False)["input_ids"]


def opened(tokenizer, e: Conversation, got) -> bool:
    """The environment's start ``got`` (its first messages and tools, or an error) into the
    episode ``e``; whether it can go on."""
    if isinstance(got, str):
        e.error, e.truncated, e.prompt_ids = got, True, []
        return False
    e.messages, e.tools = got["messages"], got["tools"]
    e.prompt_ids = tokenizer(render(tokenizer, e.messages, e.tools, True), add_special_tokens=False)["input_ids"]
    return True


def has_room(e: Conversation, budget: int, max_tokens: int, max_model_len: int) -> bool:
    """Whether a turn of ``budget`` tokens fits the episode's model length and token budget."""
    return len(e.prompt_ids) + len(e.tokens) + budget <= max_model_len and len(e.tokens) + budget <= max_tokens


def answered(tokenizer, e: Conversation, generated: list[int], got, last: bool) -> bool:
    """The environment's reply ``got`` to the model's turn (its ``generated`` tokens, its text
    ``e.text``) into the episode: its figures, and the observation's tokens where it goes on
    (past the ``last`` turn allowed, no observation is needed); whether it goes on."""
    if isinstance(got, str):
        e.error, e.truncated = got, True
        return False
    e.tool_calls += got["tool_calls"]
    e.tool_errors += got["tool_errors"]
    e.retries += got["retries"]
    e.reward += got["reward"] or 0.0
    if got["done"] or last:
        e.truncated = not got["done"]
        return False
    observed = observation_ids(tokenizer, e, generated, got["messages"])
    e.messages += [{"role": "assistant", "content": e.text}, *got["messages"]]
    e.tokens += observed
    e.mask += [False] * len(observed)
    return True


def episode_sample(index: int, e: Conversation, version: int, versions: list[int] | None = None) -> Sample:
    """A finished episode as the trainers take it."""
    return Sample(index, e.tokens, e.logprobs, e.text, e.finish, version, mask=e.mask, prompt_ids=e.prompt_ids,
                  versions=versions, episode={
                      "reward": e.reward, "error": e.error,
                      "messages": e.messages + ([{"role": "assistant", "content": e.text}] if e.turns else [])})


def run_episodes(pool, envs: EnvironmentPool, tokenizer, rows: list[dict], sampling: dict, max_turns: int,
                 max_tokens: int, max_model_len: int) -> tuple[list[Sample], dict]:
    """``sampling["n"]`` episodes per row, turn by turn, seeded from ``sampling["seed"]``; the
    samples in row order (``prompt_index``: the row) and the episode figures."""
    n, seed = sampling.get("n", 1), sampling.get("seed", 0)
    sampling = {k: v for k, v in sampling.items() if k not in ("n", "seed")}
    t_env, eps = 0.0, [Episode(rows[k // n], seed + k * max_turns) for k in range(len(rows) * n)]
    t0 = time.time()
    starts = envs.ask([{"op": "start", "id": k, "row": e.row} for k, e in enumerate(eps)])
    t_env += time.time() - t0
    for e, got in zip(eps, starts):
        e.done = not opened(tokenizer, e, got)
    budget = sampling["max_tokens"]
    for turn in range(max_turns):
        live = [k for k, e in enumerate(eps) if not e.done]
        for k in list(live):
            e = eps[k]
            if not has_room(e, budget, max_tokens, max_model_len):
                e.done = e.truncated = True
                live.remove(k)
        if not live:
            break
        outs = pool.generate([eps[k].prompt_ids + eps[k].tokens for k in live],
                             {**sampling, "n": 1, "seeds": [eps[k].seed + turn for k in live]})
        stepping = []
        for k, r in zip(live, outs):
            e = eps[k]
            e.tokens += r.token_ids
            e.mask += [True] * len(r.token_ids)
            e.logprobs += r.logprobs
            e.turns, e.text, e.finish = e.turns + 1, r.text, r.finish_reason
            e.version = r.weight_version if e.version is None else min(e.version, r.weight_version)
            if r.finish_reason == "length":
                e.done = e.truncated = True
            else:
                stepping.append((k, r.token_ids))
        t0 = time.time()
        replies = envs.ask([{"op": "step", "id": k, "text": eps[k].text} for k, _ in stepping])
        t_env += time.time() - t0
        for (k, generated), got in zip(stepping, replies):
            eps[k].done = not answered(tokenizer, eps[k], generated, got, turn == max_turns - 1)
    envs.ask([{"op": "end", "id": k} for k in range(len(eps))])
    return [episode_sample(k // n, e, e.version or 0) for k, e in enumerate(eps)], episode_info(eps, t_env)


def episode_info(eps: list[Conversation], t_env: float) -> dict:
    """The figures of finished episodes."""
    count = max(1, len(eps))
    return {"episode/turns": sum(e.turns for e in eps) / count,
            "episode/tool_calls": sum(e.tool_calls for e in eps) / count,
            "episode/tool_errors": sum(e.tool_errors for e in eps) / count,
            "episode/tool_success": 1 - sum(e.tool_errors for e in eps) / max(1, sum(e.tool_calls for e in eps)),
            "episode/truncated": sum(e.truncated for e in eps) / count,
            "episode/reward": sum(e.reward for e in eps) / count,
            "episode/env_errors": sum(e.error is not None for e in eps),
            "episode/env_retries": sum(e.retries for e in eps), "time/environment": t_env}


class StreamTurns:
    """rl.fully_async with an environment (``rollout.stream``): the stream's samples are
    episodes. Each round takes every live one a chunk further within its turn; a turn that ends
    steps its environment, and the next round continues from the observation's tokens, on
    whatever weights the engines hold by then. Environments of stream episodes are numbered
    from ``ID_BASE`` (evaluation's count from 0)."""

    ID_BASE = 1 << 30

    def __init__(self, envs: EnvironmentPool, tokenizer, rows: list[dict], samples_per_prompt: int,
                 max_turns: int, max_tokens: int, max_model_len: int):
        self.envs, self.tokenizer, self.rows, self.n = envs, tokenizer, rows, samples_per_prompt
        self.max_turns, self.max_tokens, self.max_model_len = max_turns, max_tokens, max_model_len
        self.t_env = 0.0  # seconds in the environments since the last batch

    def _ask(self, ops: list[dict]) -> list:
        t0 = time.time()
        try:
            return self.envs.ask(ops) if ops else []
        finally:
            self.t_env += time.time() - t0

    def _id(self, i) -> int:
        return self.ID_BASE + i.group * self.n + i.j

    def _start(self, items: list) -> list:
        return self._ask([{"op": "start", "id": self._id(i), "row": self.rows[i.record]} for i in items])

    def live(self, items: list, budget: int) -> list:
        """Of the unfinished ``items``, those the next round extends: new episodes' environments
        start first; an episode without room for another turn of ``budget`` tokens ends, truncated."""
        new = [i for i in items if i.prompt_ids is None]
        for i, got in zip(new, self._start(new)):
            if not opened(self.tokenizer, i, got):
                i.finish = "stop"
        for i in items:
            if i.finish is None and not i.turn and not has_room(i, budget, self.max_tokens, self.max_model_len):
                i.finish, i.truncated = "length", True
        return [i for i in items if i.finish is None]

    def turns_ended(self, ended: list[tuple]) -> None:
        """(item, finish reason) of the turns that ended this round: the environments step; a
        turn cut at rl.max_new_tokens ends its episode, truncated."""
        stepping = []
        for i, reason in ended:
            i.text, i.turns = self.tokenizer.decode(i.turn, skip_special_tokens=True), i.turns + 1
            if reason == "length":
                i.finish, i.truncated = "length", True
            else:
                stepping.append(i)
        for i, got in zip(stepping, self._ask([{"op": "step", "id": self._id(i), "text": i.text} for i in stepping])):
            if not answered(self.tokenizer, i, i.turn, got, i.turns == self.max_turns):
                i.finish = "stop"
            i.turn = []

    def taken(self, items: list) -> dict:
        """Episodes a batch took: their environments end; the figures since the last batch."""
        self._ask([{"op": "end", "id": self._id(i)} for i in items])
        info = episode_info(items, self.t_env)
        self.t_env = 0.0
        return info

    def replay(self, items: list) -> list:
        """After a restore: each started, unfinished episode's environment starts again and is
        told the model's turns so far; the episodes whose environment now answers otherwise than
        the conversation recorded (they start over)."""
        live = [i for i in items if i.finish is None and i.prompt_ids is not None]
        said = [[m["content"] for m in i.messages if m["role"] == "assistant"] for i in live]
        talk = [got if isinstance(got, str) else got["messages"] for got in self._start(live)]
        for t in range(max(map(len, said), default=0)):
            who = [k for k in range(len(live)) if t < len(said[k]) and not isinstance(talk[k], str)]
            replies = self._ask([{"op": "step", "id": self._id(live[k]), "text": said[k][t]} for k in who])
            for k, got in zip(who, replies):
                talk[k] = got if isinstance(got, str) else \
                    talk[k] + [{"role": "assistant", "content": said[k][t]}, *got["messages"]]
        return [i for i, t in zip(live, talk) if t != i.messages]
