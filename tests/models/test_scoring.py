"""Packed batches (sequences end to end, position ids restarting) score exactly like padded ones: the
log-probs, DPO's and SFT's losses and their gradients."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from elasticrl.algorithms.preference import dpo_loss
from elasticrl.models.scoring import response_logps


def _model(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _examples(seed: int, n: int) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 15, (1,), generator=g))
        plen = int(torch.randint(1, length - 1, (1,), generator=g))
        out.append((torch.randint(1, 50, (length,), generator=g).tolist(), [i >= plen for i in range(length)]))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_and_padded_give_the_same_logps_losses_and_gradients(attn):
    model = _model(attn)
    chosen, rejected = _examples(1, 6), _examples(2, 6)
    results = {}
    for packed in (False, True):
        model.zero_grad()
        pc, nc = response_logps(model, chosen, pad_id=0, packed=packed)
        pr, nr = response_logps(model, rejected, pad_id=0, packed=packed)
        loss = dpo_loss(pc, pr, pc.detach() - 0.3, pr.detach() + 0.2, beta=0.5)[0].mean()
        loss = loss - pc.sum() / nc.sum()  # and SFT's: the mean NLL over every response token
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[packed] = (pc.detach(), nc, pr.detach(), loss.detach(), grads)
    (pc0, nc0, pr0, l0, g0), (pc1, nc1, pr1, l1, g1) = results[False], results[True]
    assert torch.equal(nc0, nc1) and nc0.tolist() == [sum(t) for _, t in chosen]  # the response tokens
    torch.testing.assert_close(pc1, pc0, atol=1e-5, rtol=0)
    torch.testing.assert_close(pr1, pr0, atol=1e-5, rtol=0)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
    torch.testing.assert_close(g1, g0, atol=1e-5, rtol=1e-4)


def test_packing_keeps_sequences_apart():
    # the same sequence scores the same whatever is packed before it
    model = _model("sdpa")
    target = _examples(3, 1)
    with torch.no_grad():
        alone = response_logps(model, target, pad_id=0, packed=True)[0]
        after = response_logps(model, _examples(4, 3) + target, pad_id=0, packed=True)[0][-1:]
    torch.testing.assert_close(after, alone, atol=1e-5, rtol=0)


def test_a_packed_rl_forward_gives_the_padded_log_probs_values_and_gradients():
    """The RL roles' forward (data.packing): a right-padded batch's rows laid end to end, the
    output put back in the padded layout. On every real token the policy's log-probs and the
    critic's values equal the padded ones (fp32, 1e-5), and so do the gradients of a loss over
    them; padding positions hold zeros."""
    from transformers import LlamaForSequenceClassification

    from elasticrl.algorithms.logprobs import token_logprobs
    from elasticrl.data.records import pad_batch
    from elasticrl.models.load import token_values
    from elasticrl.models.scoring import packed_forward

    examples = _examples(5, 5)
    b = pad_batch([e[0] for e in examples], 0, [e[1] for e in examples])
    mask = (b["labels"][:, 1:] != -100).float()
    policy = _model("eager")
    torch.manual_seed(1)
    critic = LlamaForSequenceClassification(policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1}))
    outs = {}
    for packed in (False, True):
        policy.zero_grad()
        critic.zero_grad()
        ids, attn = b["input_ids"], b["attention_mask"]
        logits = packed_forward(lambda **kw: policy(**kw, use_cache=False).logits, ids, attn) if packed \
            else policy(input_ids=ids, attention_mask=attn).logits
        logp = token_logprobs(logits, b["labels"])
        values = token_values(critic, b["input_ids"], b["attention_mask"], packed)
        loss = -(logp * mask).sum() / mask.sum() + ((values[:, :-1] - 0.5) ** 2 * mask).sum() / mask.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for m in (policy, critic) for p in m.parameters() if p.grad is not None])
        outs[packed] = (logits.detach(), logp.detach(), values.detach(), grads)
    real = b["attention_mask"].bool()
    torch.testing.assert_close(outs[True][0][real], outs[False][0][real], atol=1e-5, rtol=0)
    assert outs[True][0][~real].abs().sum() == 0 and (~real).any()  # the padding is left out
    torch.testing.assert_close(outs[True][1] * mask, outs[False][1] * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[True][2][real], outs[False][2][real], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[True][3], outs[False][3], atol=1e-5, rtol=1e-4)
