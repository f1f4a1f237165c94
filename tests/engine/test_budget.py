"""Micro-batches cut by tokens (train.max_tokens_per_micro_batch, engine/budget.py): the plan's
shape (every row once, within the budget, as many micro-batches on every rank, balanced), and
the losses and gradients its micro-batches sum to, equal to one padded batch's (fp32, 1e-5),
for every RL loss aggregation, the critic, SFT and the reward model, padded and packed."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from elasticrl.algorithms.kl import KL_ESTIMATORS
from elasticrl.algorithms.logprobs import token_logprobs
from elasticrl.algorithms.losses import AGGREGATIONS, aggregate, policy_loss, value_loss
from elasticrl.algorithms.preference import bradley_terry_loss
from elasticrl.engine.budget import balance, cost, imbalance, plan
from elasticrl.models.load import token_values
from elasticrl.models.scoring import packed_forward
from elasticrl.spec import load_spec
from elasticrl.trainers.batch import pack
from elasticrl.trainers.rl_workers import _denominators
from tests.conftest import EXAMPLES


def _long_tail(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(8, int(rng.lognormvariate(5.5, 0.9))) for _ in range(n)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_long_tail_batch_is_cut_within_the_budget_and_balanced_over_the_ranks(packed):
    lengths = _long_tail(64, 0)  # a few rows of thousands of tokens, most of a few hundred
    assert max(lengths) > 4 * sorted(lengths)[32]
    ranks = plan(lengths, 2, 4096, packed)
    assert len(ranks[0]) == len(ranks[1]) > 1  # as many micro-batches on each rank
    rows = [i for micro in ranks for m in micro if m for i in m]
    assert sorted(rows) == list(range(64))  # every row once
    for micro in ranks:
        for m in filter(None, micro):
            assert cost([lengths[i] for i in m], packed) <= 4096 or len(m) == 1
    shares = [[i for m in micro if m for i in m] for micro in ranks]
    # the tokens two ranks hold differ by under 1 %; the rows' halves in order differ by far more
    assert imbalance(lengths, shares) < 0.01 < 0.10 < imbalance(lengths, [list(range(32)), list(range(32, 64))])


def test_a_rank_short_of_rows_runs_an_empty_micro_batch_and_one_long_of_them_splits():
    # 2 ranks, budget 10, padded: rank 0 holds the 10-token row; rank 1 the 6 and the 4, which
    # padded to 6 cost 12, so two micro-batches: rank 0's second is empty
    assert balance([10, 6, 4], 2) == [[0], [1, 2]]
    assert plan([10, 6, 4], 2, 10, packed=False) == [[[0], None], [[1], [2]]]
    assert plan([10, 6, 4], 2, 10, packed=True) == [[[0]], [[1, 2]]]  # packed they cost 10: one
    # packed, budget 10: rank 0 holds the 10 and a 1 (11 tokens: two micro-batches), rank 1 the 9
    # and the other 1 (10: one), so rank 1 splits its one in two rather than run an empty one
    assert balance([10, 9, 1, 1], 2) == [[0, 3], [1, 2]]
    assert plan([10, 9, 1, 1], 2, 10, packed=True) == [[[0], [3]], [[1], [2]]]


def _tiny(seed: int, head: bool = False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return (LlamaForSequenceClassification if head else LlamaForCausalLM)(cfg)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _rl_batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    # ragged responses, one with no token in the loss (a dropped one) and one of a single token
    sizes = [int(torch.randint(1, 40, (1,), generator=g)) for _ in range(rows)]
    sizes[1] = 1
    responses = [torch.randint(1, 40, (n,), generator=g).tolist() for n in sizes]
    batch = pack(prompts, responses, 0)
    batch.response_mask[3] = 0
    shape = batch.response_mask.shape
    batch.old_logprobs = -torch.rand(shape, generator=g) * 3
    batch.ref_logprobs = -torch.rand(shape, generator=g) * 3
    batch.advantages = torch.randn(shape, generator=g)
    batch.advantages[5] = 0  # a tie: every sample of its group scored the same
    batch.old_values = torch.randn(shape, generator=g)
    batch.returns = torch.randn(shape, generator=g)
    return batch


def _rl_loss(policy, critic, mb, packed: bool, aggregation: str, denom: dict) -> torch.Tensor:
    """The actor's and the critic's losses of one micro-batch as their workers compute them."""
    if packed:
        logits = packed_forward(lambda **kw: policy(**kw, use_cache=False).logits, mb.input_ids, mb.attention_mask)
    else:
        logits = policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    logp = token_logprobs(logits, mb.labels)
    mask = mb.response_mask
    loss, _ = policy_loss(logp, mb.old_logprobs, mb.advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                          aggregation=aggregation, **denom)
    kl = aggregate(KL_ESTIMATORS["k3"](logp, mb.ref_logprobs), mask, aggregation, **denom)
    values = token_values(critic, mb.input_ids, mb.attention_mask, packed)[:, :-1]
    return loss + 0.1 * kl + value_loss(values, mb.old_values, mb.returns, mask, clip=0.2,
                                        aggregation=aggregation, **denom)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_token_budget_micro_batches_give_the_padded_batch_loss_and_gradients(aggregation):
    """The RL actor's policy and KL losses and the critic's value loss of a mini-batch of 12 ragged
    rows: one padded batch, against the plan's micro-batches over 2 ranks (each trimmed, padded or
    packed, each loss over the mini-batch's global counts; the ranks' gradients summed, as the
    trainers' backward scales DeepSpeed's mean back up)."""
    spec = load_spec(EXAMPLES / "tiny_grpo.yaml", [f"rl.loss_aggregation={aggregation}"])
    batch = _rl_batch(7, 12)
    index = torch.arange(12)
    denom = _denominators(batch, index, spec)
    policy, critic = _tiny(0), _tiny(1, head=True)
    whole = _rl_loss(policy, critic, batch, False, aggregation, denom)
    whole.backward()
    expected = _grads(policy), _grads(critic)
    lengths = batch.attention_mask.sum(1).tolist()
    for packed in (False, True):
        policy.zero_grad()
        critic.zero_grad()
        ranks = plan(lengths, 2, 60, packed)
        assert len(ranks[0]) > 2  # several micro-batches of different sizes
        total = 0.0
        for micro in ranks:
            for m in filter(None, micro):
                loss = _rl_loss(policy, critic, batch.rows(torch.tensor(m)).trimmed(), packed, aggregation, denom)
                loss.backward()
                total += loss.item()
        assert total == pytest.approx(whole.item(), abs=1e-5), packed
        torch.testing.assert_close(_grads(policy), expected[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_grads(critic), expected[1], atol=1e-5, rtol=1e-4)


def test_token_budget_micro_batches_give_sft_and_the_reward_models_padded_loss_and_gradients():
    """SFT's summed NLL over the global batch's trained tokens, and the reward model's
    Bradley-Terry mean over pairs scaled by each micro-batch's share of the global batch."""
    from elasticrl.data.records import pad_batch
    from elasticrl.models.scoring import response_logps

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 40, (int(torch.randint(3, 50, (1,), generator=g)),), generator=g).tolist()
            for _ in range(10)]
    examples = [(s, [i >= 2 for i in range(len(s))]) for s in seqs]
    tokens = sum(sum(t[1:]) for _, t in examples)
    model, head = _tiny(2), _tiny(3, head=True)

    def sft(part, packed):
        return -response_logps(model, part, 0, packed)[0].sum() / tokens

    def rm(pairs):  # pairs of positions: (chosen, rejected)
        b = pad_batch([seqs[i] for i, _ in pairs] + [seqs[j] for _, j in pairs], 0)
        v = token_values(head, b["input_ids"], b["attention_mask"])
        r = v[torch.arange(len(v)), b["attention_mask"].sum(1) - 1]
        return bradley_terry_loss(r[:len(pairs)], r[len(pairs):]) * len(pairs) / 5

    pairs = [(2 * k, 2 * k + 1) for k in range(5)]
    (sft(examples, False) + rm(pairs)).backward()
    expected = _grads(model), _grads(head)
    for packed in (False, True):
        model.zero_grad()
        head.zero_grad()
        for micro in plan([len(s) for s in seqs], 2, 70, packed):
            for m in filter(None, micro):
                sft([examples[i] for i in m], packed).backward()
        pair_lengths = [len(seqs[i]) + len(seqs[j]) for i, j in pairs]
        for micro in plan(pair_lengths, 2, 100, packed):
            for m in filter(None, micro):
                rm([pairs[k] for k in m]).backward()
        torch.testing.assert_close(_grads(model), expected[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_grads(head), expected[1], atol=1e-5, rtol=1e-4)
