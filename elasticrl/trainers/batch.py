"""RL batches: prompt + completion token ids packed into padded tensors, as one typed record.

Every per-token tensor is ``[B, L-1]`` in *shifted* full-sequence coordinates: entry t
describes token t+1 predicted from tokens <= t, exactly as ``token_logprobs`` returns it.
``response_mask`` marks the completion's tokens there, so log-probs, values, KL and
advantages line up with no re-indexing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from elasticrl.algorithms.logprobs import IGNORE
from elasticrl.rollout.sample import Sample


@dataclass
class Experience:
    """What the RL roles learn from (OpenRLHF's ``Experience``): the step's sequences, and what
    the experience phase adds for them. ``[B, L]``: whole sequences; ``[B, L-1]``: per token,
    shifted. The optional fields are None until computed, or when the run needs none."""

    input_ids: torch.Tensor                        # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor                   # [B, L] 1 on real tokens
    labels: torch.Tensor                           # [B, L] the completion's ids, IGNORE elsewhere
    response_mask: torch.Tensor                    # [B, L-1] 1 on completion tokens in the loss
    old_logprobs: torch.Tensor | None = None       # [B, L-1] the policy's before the update (None: the update's own)
    ref_logprobs: torch.Tensor | None = None       # [B, L-1] the reference policy's
    old_values: torch.Tensor | None = None         # [B, L-1] the critic's before its update
    advantages: torch.Tensor | None = None         # [B, L-1]
    returns: torch.Tensor | None = None            # [B, L-1] the critic's targets
    behaviour_logprobs: torch.Tensor | None = None  # [B, L-1] the engine's, of the policy that sampled

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def _map(self, fn) -> Experience:
        return dataclasses.replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    def rows(self, index) -> Experience:
        return self._map(lambda v: v[index])

    def to(self, device) -> Experience:
        return self._map(lambda v: v.to(device))

    def trimmed(self) -> Experience:
        """Rows cut to their longest sequence: the padding columns they all have at the right
        end go, from ``[B, L]`` tensors and from the shifted ``[B, L-1]`` ones alike, so a
        micro-batch of short sequences computes no padding of the batch's longest."""
        full = self.input_ids.shape[1]
        width = int(self.attention_mask.sum(1).max())
        if width == full:
            return self
        return self._map(lambda v: v[:, :width] if v.shape[1] == full else v[:, :width - 1])

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int, masks: list | None = None) -> Experience:
    """``masks``: per response, True on the model's tokens, or None (all are); an episode's
    observation tokens are in the sequence but not in the loss."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        labels[i, len(p): len(s)] = torch.tensor(s[len(p):])
        if masks and masks[i] is not None:
            labels[i, len(p): len(s)][~torch.tensor(masks[i], dtype=torch.bool)] = IGNORE
    return Experience(input_ids, attention_mask, labels, (labels[:, 1:] != IGNORE).float())


def widened(values_bt: torch.Tensor, width: int) -> torch.Tensor:
    """A trimmed micro-batch's per-token results back at the batch's width (zeros right)."""
    return torch.nn.functional.pad(values_bt, (0, width - values_bt.shape[1]))


def rows_reply(rows: slice | list[int], key: str, values: torch.Tensor | None, leader: bool) -> dict:
    """A rank's answer for its ``rows`` of a batch, in that order (``gather_rows`` reassembles
    them); ``leader``: false on tensor-parallel peers, whose rows the leader already sent."""
    return {"rows": list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows, key: values,
            "leader": leader}


def gather_rows(parts: list[dict], key: str) -> torch.Tensor:
    """Reassemble the ranks' ``rows_reply`` answers in row order."""
    pieces = [(p["rows"], p[key]) for p in parts if p["leader"] and p[key] is not None]
    out = pieces[0][1].new_zeros(sum(len(r) for r, _ in pieces), *pieces[0][1].shape[1:])
    for rows, values in pieces:
        out[torch.tensor(rows)] = values
    return out


def behaviour_logprobs(results: list[Sample], batch: Experience) -> torch.Tensor:
    """The rollout engine's log-probs of the sampled tokens, placed in the shifted layout."""
    out = torch.zeros_like(batch.response_mask)
    for i, r in enumerate(results):
        pos = batch.response_mask[i].nonzero().flatten()
        out[i, pos[: len(r.logprobs)]] = torch.tensor(r.logprobs[: len(pos)], dtype=out.dtype)
    return out
