"""The acid test of weight sync: after training steps with ZeRO-2/3 and a sync through each
transport, vLLM's log-probabilities of fixed sequences equal the trainer's own log-softmax
within 1e-4 (fp32), for 1 and for 2 engines. Real Ray, DeepSpeed and vLLM's CPU build."""
from __future__ import annotations

import pytest
import torch

from elasticrl.algorithms.logprobs import token_logprobs
from elasticrl.cluster import RoleGroup
from elasticrl.data.records import pad_batch
from elasticrl.rollout.pool import RolloutPool
from elasticrl.spec import load_spec, spec_to_dict
from elasticrl.trainers.sft import SFTWorker, resolve_paths

pytestmark = pytest.mark.slow

SPEC = ["model.dtype=fp32", "train.micro_batch_size=8", "train.global_batch_size=32", "train.lr=3e-3",
        "train.warmup_ratio=0", "rollout.num_engines=2", "rollout.max_model_len=64", "rollout.bucket_mb=1"]
# Arithmetic prompts with answers, as token ids (chat template applied), and a longer one.
PROBE = [[1, 4, 7, 13, 78, 11, 86, 5, 9, 9, 2], [1, 4, 8, 78, 8, 86, 5, 17, 2],
         [1, 4] + [6 + (i * 7) % 10 for i in range(40)] + [5, 7, 2]]


def _trainer_logprobs(worker, ids):
    batch = pad_batch(ids, 0)
    worker.engine.eval()
    with torch.no_grad():
        logits = worker.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = token_logprobs(logits, batch["labels"])
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(ids)]


def pool_of(spec):
    """A module fixture's body: fp32 engines of ``spec`` for the module's tests."""
    p = RolloutPool(resolve_paths(spec)["model"], spec.rollout, "fp32", seed=0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster):
    yield from pool_of(load_spec({}, SPEC))


HF = SPEC + ["rollout.backend=hf", "rollout.num_engines=1"]


@pytest.fixture(scope="module")
def hf_pool(ray_cluster):
    """The transformers fallback engine, for the tests of both engines (the stop-string test
    first: it asks for the starting weights' greedy answers)."""
    yield from pool_of(load_spec({}, HF))


@pytest.mark.parametrize("stage", [2, 3])
def test_synced_engines_score_like_the_trainer(pool, stage, tmp_path):
    spec = load_spec({}, SPEC + [f"train.zero_stage={stage}"])
    group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), resolve_paths(spec))
    try:
        group.setup(50)
        initial = group.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
        step, version = 0, 0
        for transport in ("shm", "shm_staged", "broadcast", "files"):
            for engines in (pool.engines[:1], pool.engines):
                infos = pool.infos[: len(engines)]
                for _ in range(2):  # train so every sync carries new weights
                    group.call("train_step", step)
                    step += 1
                chosen = group.call("attach_rollout", engines, infos, transport, spec.rollout.bucket_mb,
                                    str(tmp_path / "weights"))
                assert chosen[0] == transport
                version += 1
                stats = group.call("sync_weights", version)[0]
                assert stats["sync/transport"] == transport and stats["sync/gbytes"] > 0.008  # 2.1M fp32
                if transport == "shm":
                    assert stats["sync/shm_mode"] == "direct"
                group.call("detach_rollout")
                expected = group.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
                for engine in engines:
                    got, got_version = pool.group._get([engine.score.remote(PROBE)])[0]
                    assert got_version == version
                    for g, e in zip(got, expected):
                        torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-4, rtol=0,
                                                   msg=f"{transport} x{len(engines)} ZeRO-{stage}")
        after, versions = pool.score(PROBE)
        assert versions == [version, version]
        assert max(abs(a - b) for x, y in zip(after, initial) for a, b in zip(x, y)) > 0.1  # weights moved
    finally:
        group.shutdown()


def test_a_stop_string_ends_a_completion_alike_on_vllm_and_transformers(pool, hf_pool):
    """rl.stop as both engines apply it: generation ends at the token that completes the
    string (those tokens are what the trainer sees), the text ends before it."""
    from elasticrl.models import load_tokenizer

    tok = load_tokenizer(resolve_paths(load_spec({}, HF))["model"])
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    for engines in (pool, hf_pool):
        [full] = engines.generate([PROBE[0][:8]], greedy)
        tokens, text = full.token_ids, full.text
        start = len(tok.decode(tokens[:2], skip_special_tokens=True))
        stop = next(c for c in text[start:] if not c.isspace())  # a character the answer reaches later
        end = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k], skip_special_tokens=True))
        [cut] = engines.generate([PROBE[0][:8]], {**greedy, "stop": [stop]})
        assert cut.token_ids == tokens[:end] and cut.finish_reason == "stop", (engines.infos, stop)
        assert cut.text == text[: text.index(stop)]


def test_transformers_fallback_engine_generates_and_receives_weights(hf_pool, tmp_path):
    spec = load_spec({}, HF)
    group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), resolve_paths(spec))
    try:
        assert hf_pool.infos[0]["mode"] == "hf"
        group.setup(50)
        for version, transport in enumerate(("shm", "broadcast", "files"), start=1):
            group.call("train_step", version)
            group.call("attach_rollout", hf_pool.engines, hf_pool.infos, transport, 1, str(tmp_path))
            stats = group.call("sync_weights", version)[0]
            group.call("detach_rollout")
            if transport == "shm":
                assert stats["sync/shm_mode"] == "staged"  # no vLLM loaders to plan with
            expected = group.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
            got, versions = hf_pool.score(PROBE)
            assert versions == [version]
            for g, e in zip(got, expected):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-4, rtol=0, msg=transport)
        out = hf_pool.generate([PROBE[0][:8], PROBE[1][:6]], {"max_tokens": 3, "temperature": 0.0, "n": 2,
                                                              "ignore_eos": True})
        assert [r.prompt_index for r in out] == [0, 0, 1, 1]
        for r in out:  # greedy: each token is the argmax, its logprob the trainer's
            prompt = [PROBE[0][:8], PROBE[1][:6]][r.prompt_index]
            lp = group.call("__ray_call__", lambda w, s=prompt + r.token_ids: _trainer_logprobs(w, [s]))[0][0]
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(lp[len(prompt) - 1:]),
                                       atol=1e-4, rtol=0)
    finally:
        group.shutdown()
