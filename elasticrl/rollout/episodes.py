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


@dataclass
class Episode:
    row: dict
    seed: int
    messages: list = field(default_factory=list)   # the conversation so far (the model's turns as text)
    tools: list = field(default_factory=list)      # the tools' JSON schemas, as offered
    prompt_ids: list = field(default_factory=list)
    tokens: list = field(default_factory=list)     # everything after the prompt: model and observation tokens
    mask: list = field(default_factory=list)       # True on the model's tokens
    logprobs: list = field(default_factory=list)   # the engine's, of the model's tokens
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    retries: int = 0                               # a remote environment's requests retried
    reward: float = 0.0                            # the environment's, summed over turns
    version: int | None = None                     # the oldest weights that generated a turn
    text: str = ""                                 # the model's last turn
    finish: str | None = None
    done: bool = False
    truncated: bool = False
    error: str | None = None


def render(tokenizer, messages: list[dict], tools: list, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation)


def observation_ids(tokenizer, e: Episode, generated: list[int], observation: list[dict]) -> list[int]:
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
        if isinstance(got, str):
            e.error, e.done, e.truncated = got, True, True
            continue
        e.messages, e.tools = got["messages"], got["tools"]
        e.prompt_ids = tokenizer(render(tokenizer, e.messages, e.tools, True), add_special_tokens=False)["input_ids"]
    budget = sampling["max_tokens"]
    for turn in range(max_turns):
        live = [k for k, e in enumerate(eps) if not e.done]
        for k in list(live):
            e = eps[k]
            if len(e.prompt_ids) + len(e.tokens) + budget > max_model_len or len(e.tokens) + budget > max_tokens:
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
            e = eps[k]
            if isinstance(got, str):
                e.error, e.done, e.truncated = got, True, True
                continue
            e.tool_calls += got["tool_calls"]
            e.tool_errors += got["tool_errors"]
            e.retries += got["retries"]
            e.reward += got["reward"] or 0.0
            if got["done"] or turn == max_turns - 1:  # (past the last turn, no observation is needed)
                e.done, e.truncated = True, not got["done"]
                continue
            observed = observation_ids(tokenizer, e, generated, got["messages"])
            e.messages += [{"role": "assistant", "content": e.text}, *got["messages"]]
            e.tokens += observed
            e.mask += [False] * len(observed)
    envs.ask([{"op": "end", "id": k} for k in range(len(eps))])
    samples = [Sample(k // n, e.tokens, e.logprobs, e.text, e.finish, e.version or 0, mask=e.mask,
                      prompt_ids=e.prompt_ids, episode={
                          "reward": e.reward, "error": e.error,
                          "messages": e.messages + ([{"role": "assistant", "content": e.text}] if e.turns else [])})
               for k, e in enumerate(eps)]
    count = max(1, len(eps))
    info = {"episode/turns": sum(e.turns for e in eps) / count,
            "episode/tool_calls": sum(e.tool_calls for e in eps) / count,
            "episode/tool_errors": sum(e.tool_errors for e in eps) / count,
            "episode/tool_success": 1 - sum(e.tool_errors for e in eps) / max(1, sum(e.tool_calls for e in eps)),
            "episode/truncated": sum(e.truncated for e in eps) / count,
            "episode/reward": sum(e.reward for e in eps) / count,
            "episode/env_errors": sum(e.error is not None for e in eps),
            "episode/env_retries": sum(e.retries for e in eps), "time/environment": t_env}
    return samples, info
