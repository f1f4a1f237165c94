"""Policy, value and entropy terms of PPO-style objectives, and how per-token losses are
aggregated into one number."""
from __future__ import annotations

import torch

from elasticrl.algorithms.registry import Registry

AGGREGATIONS = Registry("loss aggregation")


# Each aggregation divides a local sum by a denominator; passing the denominator counted over
# the whole (global) batch makes the sum of every rank's and micro-batch's loss the exact
# global mean, whatever the data-parallel size and gradient accumulation.

@AGGREGATIONS.register("token_mean")
def token_mean(loss_bt, mask_bt, num_tokens=None, **_):
    """Sum over real tokens / number of real tokens (``num_tokens``: the global count)."""
    denom = mask_bt.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss_bt.dtype)
    return (loss_bt * mask_bt).sum() / denom.clamp(min=1)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_bt, mask_bt, num_seqs=None, **_):
    """Mean over responses of each response's token mean (the original GRPO). A response with
    no token in the loss (dropped, or cut by rl.overlong_filter) is no response here: it
    counts in neither sum (``num_seqs``: the global count of the others), as in verl and
    OpenRLHF."""
    tokens = mask_bt.sum(1)
    per_seq = (loss_bt * mask_bt).sum(1) / tokens.clamp(min=1)
    return per_seq.sum() / ((tokens > 0).sum().clamp(min=1) if num_seqs is None else num_seqs)


@AGGREGATIONS.register("seq_sum_norm")
def seq_sum_norm(loss_bt, mask_bt, norm_length=None, num_rows=None, **_):
    """Token sum / (responses x a constant length): Dr. GRPO's length-unbiased form. The
    constants are the mini-batch's rows, every one counted (``num_rows``: the global count),
    and the longest response the job allows (``norm_length``; the paper's generation budget)."""
    norm = norm_length if norm_length is not None else mask_bt.shape[1]
    return (loss_bt * mask_bt).sum() / ((loss_bt.shape[0] if num_rows is None else num_rows) * norm)


def aggregate(loss_bt, mask_bt, aggregation: str = "token_mean", **kwargs):
    return AGGREGATIONS.get_or_raise(aggregation, "rl.loss_aggregation")(loss_bt, mask_bt, **kwargs)


def policy_loss(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt, *, clip_low=0.2, clip_high=0.2,
                dual_clip=None, token_weights_bt=None, ratio_level="token", aggregation="token_mean", **agg_kwargs):
    """Clipped surrogate loss.

    ratio = exp(logp - logp_old); loss_t = -min(ratio A, clip(ratio, 1-clip_low, 1+clip_high) A).
    ``clip_high > clip_low`` is DAPO's clip-higher. With ``dual_clip = c > 1``, for A < 0 the
    loss is also capped at -c A (the ratio cannot push it further). ``token_weights_bt``
    (no gradient) scales each token, e.g. truncated importance weights of off-policy samples.
    ``ratio_level='sequence'`` is GSPO's ratio: every token of a response gets the response's
    exp(mean over its tokens of (logp - logp_old)), the geometric mean of its token ratios,
    and is clipped as one (GSPO pairs it with seq_mean_token_mean and much smaller clips).
    Returns (loss, stats).
    """
    log_ratio = logprobs_bt - old_logprobs_bt
    if ratio_level == "sequence":
        per_seq = (log_ratio * mask_bt).sum(1, keepdim=True) / mask_bt.sum(1, keepdim=True).clamp(min=1)
        log_ratio = per_seq.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * advantages_bt
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages_bt
    loss_bt = -torch.min(surr1, surr2)
    if dual_clip is not None:  # > 1 (the spec checks rl.dual_clip)
        loss_bt = torch.where(advantages_bt < 0, torch.min(loss_bt, -dual_clip * advantages_bt), loss_bt)
    if token_weights_bt is not None:
        loss_bt = loss_bt * token_weights_bt.detach()
    loss = aggregate(loss_bt, mask_bt, aggregation, **agg_kwargs)
    with torch.no_grad():
        clipped = ((surr2 < surr1).float() * mask_bt).sum() / mask_bt.sum().clamp(min=1)
        approx_kl = (0.5 * (logprobs_bt - old_logprobs_bt) ** 2 * mask_bt).sum() / mask_bt.sum().clamp(min=1)
    return loss, {"clip_frac": clipped.item(), "approx_kl": approx_kl.item()}


def value_loss(values_bt, old_values_bt, returns_bt, mask_bt, *, clip=0.2, aggregation="token_mean",
               **agg_kwargs):
    """0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2); ``clip=None`` unclipped."""
    loss_bt = (values_bt - returns_bt) ** 2
    if clip is not None:
        clipped = old_values_bt + (values_bt - old_values_bt).clamp(-clip, clip)
        loss_bt = torch.max(loss_bt, (clipped - returns_bt) ** 2)
    return 0.5 * aggregate(loss_bt, mask_bt, aggregation, **agg_kwargs)


def entropy_from_logits(logits_btv: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z, per position."""
    logits = logits_btv.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
