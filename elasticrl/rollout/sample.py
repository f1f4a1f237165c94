"""What a rollout engine answers for each completion: one typed record, whatever the engine
(vLLM's or the transformers fallback) and whichever engine of the pool served it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    prompt_index: int          # which of the request's prompts it completes
    token_ids: list[int]       # the completion's tokens, as sampled
    logprobs: list[float]      # each token's log-prob under the distribution it was drawn from
    text: str                  # the tokens decoded
    finish_reason: str | None  # 'stop' (end of sequence or a stop string), 'length' (max_tokens)
    weight_version: int        # the engine's weights when it generated them
    # a multi-turn episode (rollout.environment): token_ids hold every token after prompt_ids, the
    # model's (mask True; logprobs are theirs) and the observations'; text is the model's last turn
    mask: list[bool] | None = None
    prompt_ids: list[int] | None = None
    episode: dict | None = None  # {"reward": the environment's, "error": why it ended early or None, "messages"}
    versions: list[int] | None = None  # rl.fully_async: per token, the weight version that produced it

    @property
    def episode_reward(self) -> float:
        """The environment's own reward of an episode (0 for a plain completion)."""
        return self.episode["reward"] if self.episode else 0.0
