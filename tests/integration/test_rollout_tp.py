"""Tensor-parallel engines: each vLLM worker holds exactly its slice after a sync, the slices
match the Llama tensor-parallel layout written out independently here, and a TP=2 engine
scores like the trainer for every transport. Also: a sync that must change greedy output
does, and the CPU sleep fallback restarts the engine."""
from __future__ import annotations

import pytest
import torch

from elasticrl.cluster import RoleGroup
from elasticrl.spec import load_spec, spec_to_dict
from elasticrl.trainers.sft import SFTWorker, resolve_paths
from elasticrl.world.model import PRESETS
from tests.integration.test_weight_sync import PROBE, _trainer_logprobs, pool_of

pytestmark = pytest.mark.slow
SPEC = ["model.dtype=fp32", "train.micro_batch_size=8", "train.global_batch_size=32", "train.lr=3e-3",
        "train.warmup_ratio=0", "train.zero_stage=3", "rollout.max_model_len=64", "rollout.bucket_mb=1",
        "rollout.cpu_sleep=restart", "rollout.cpu_mode=dense"]  # the other suite covers packed


def expected_slice(name: str, full: dict[str, torch.Tensor], rank: int, tp: int) -> torch.Tensor:
    """The Llama TP layout: column-parallel layers split output rows (q/k/v and gate/up
    each split, then concatenated), row-parallel layers split input columns, embeddings
    split the vocabulary, norms are whole."""
    def rows(t):
        n = t.shape[0] // tp
        return t[rank * n:(rank + 1) * n]

    def cols(t):
        n = t.shape[1] // tp
        return t[:, rank * n:(rank + 1) * n]

    if name.endswith("qkv_proj.weight"):
        base = name.replace("qkv_proj", "{}")
        return torch.cat([rows(full[base.format(p)]) for p in ("q_proj", "k_proj", "v_proj")])
    if name.endswith("gate_up_proj.weight"):
        base = name.replace("gate_up_proj", "{}")
        return torch.cat([rows(full[base.format(p)]) for p in ("gate_proj", "up_proj")])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return cols(full[name])
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return rows(full[name])
    return full[name]


@pytest.fixture(scope="module")
def tp_pool(ray_cluster):
    yield from pool_of(load_spec({}, SPEC + ["rollout.tp_size=2"]))


@pytest.fixture(scope="module")
def trainer(ray_cluster):
    spec = load_spec({}, SPEC)
    group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), resolve_paths(spec))
    group.setup(50)
    yield group
    group.shutdown()


def test_tp2_engine_holds_vllm_slices_and_scores_like_the_trainer(tp_pool, trainer, tmp_path):
    assert tp_pool.infos[0]["tp_size"] == 2
    _, _, heads, kv_heads, _ = PRESETS["2m"]
    assert heads % 2 == 0 and kv_heads % 2 == 0
    # gathered broadcast: rank 0 sends every tensor whole, bucket after bucket (1 MB), into both workers
    for version, (transport, layout) in enumerate((("broadcast", "auto"), ("broadcast", "gathered"), ("shm", "auto"),
                                                   ("shm_staged", "auto"), ("files", "auto")), start=1):
        trainer.call("train_step", version)
        trainer.call("attach_rollout", tp_pool.engines, tp_pool.infos, transport, 1, str(tmp_path), layout)
        stats = trainer.call("sync_weights", version)[0]
        assert stats["sync/layout"] == ("gathered" if layout == "gathered" else "sliced") or transport != "broadcast"
        trainer.call("detach_rollout")
        expected = trainer.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
        got, versions = tp_pool.score(PROBE)
        assert versions == [version]
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-4, rtol=0, msg=transport)
    full = trainer.call("__ray_call__", lambda w: {n: p.detach().clone() for n, p in
                                                   _gathered(w).items()})[0]
    workers = tp_pool.group.call_rank(0, "worker_weights")
    assert len(workers) == 2
    for rank, params in enumerate(workers):
        assert set(params) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} | {
            n for n in params if n.startswith("model.layers.")}
        for name, values in params.items():
            torch.testing.assert_close(torch.tensor(values), expected_slice(name, full, rank, 2),
                                       atol=0, rtol=0, msg=f"rank {rank} {name}")


def _gathered(worker):
    import deepspeed

    module = worker.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_a_sync_that_must_change_greedy_output_changes_it(tp_pool, trainer, tmp_path):
    prompt = PROBE[0][:8]
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    before = tp_pool.generate([prompt], sampling)[0].token_ids
    assert before != [0, 0, 0, 0]

    # Zero the output head on the trainer: every logit becomes 0 and greedy decoding must
    # pick the first vocabulary entry (token 0) at every step.
    import deepspeed

    def zero_head(w):
        head = w.engine.module.lm_head.weight
        with deepspeed.zero.GatheredParameters([head], modifier_rank=0):
            head.data.zero_()
    trainer.call("__ray_call__", zero_head)
    trainer.call("attach_rollout", tp_pool.engines, tp_pool.infos, "shm", 1, str(tmp_path))
    trainer.call("sync_weights", 100)
    trainer.call("detach_rollout")
    after = tp_pool.generate([prompt], sampling)[0]
    assert after.token_ids == [0, 0, 0, 0] and after.weight_version == 100


def test_cpu_sleep_restarts_and_the_next_sync_restores_weights(tp_pool, trainer, tmp_path):
    def sync(version):
        trainer.call("attach_rollout", tp_pool.engines, tp_pool.infos, "shm", 1, str(tmp_path))
        trainer.call("sync_weights", version)
        trainer.call("detach_rollout")

    trainer.call("train_step", 40)
    sync(101)
    reference, _ = tp_pool.score(PROBE)
    slept = tp_pool.call("sleep")[0]
    assert slept["slept"] == "restart"
    assert tp_pool.call("wake")[0]["seconds"] > 0
    assert tp_pool.call("info")[0]["version"] == 0
    fresh, _ = tp_pool.score(PROBE)  # the restarted engine has the checkpoint's weights ...
    assert max(abs(a - b) for x, y in zip(fresh, reference) for a, b in zip(x, y)) > 1e-3
    sync(102)  # ... until the sync that follows every wake
    again, versions = tp_pool.score(PROBE)
    assert versions == [102]
    for a, b in zip(again, reference):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tp1_pool(ray_cluster):
    yield from pool_of(load_spec({}, SPEC))


@pytest.fixture(scope="module")
def autotp_trainer(ray_cluster):
    spec = load_spec({}, SPEC + ["train.tp_size=2", "train.zero_stage=1", "train.micro_batch_size=16"])
    group = RoleGroup("trainer", SFTWorker, 2, spec_to_dict(spec), resolve_paths(spec))
    group.setup(50)
    yield group
    group.shutdown()


def _sync_and_compare(trainer, engines, infos, pools, transport, version, tmp_path) -> dict:
    trainer.call("train_step", version)
    assert trainer.call("attach_rollout", engines, infos, transport, 1, str(tmp_path))[0] == transport
    stats = trainer.call("sync_weights", version)[0]
    trainer.call("detach_rollout")
    assert stats["sync/layout"] == "sliced"
    expected = trainer.call("__ray_call__", lambda w: _trainer_logprobs(w, PROBE))[0]
    for pool in pools:
        got, versions = pool.score(PROBE)
        assert versions == [version]
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-4, rtol=0,
                                       msg=f"{transport} into tp {pool.infos[0]['tp_size']}")
    return stats


def test_autotp_slices_go_straight_into_tp2_and_tp1_engines(autotp_trainer, tp_pool, tp1_pool, tmp_path):
    """AutoTP 2 -> engine TP 2 and 2 -> 1 in one sync, into the engines' shared memory, point to
    point, and through the senders' shared buffers: each trainer rank sends its own slices only
    (rank 0 sent the whole model when it gathered)."""
    from elasticrl.weights.shards import iter_tensors

    full = sum(t.numel() * 4 for _, t in iter_tensors(resolve_paths(load_spec({}, SPEC))["model"]))
    local = autotp_trainer.call("__ray_call__", lambda w: sum(p.numel() * 4 for p in w.engine.module.parameters()))
    assert max(local) < 0.75 * full  # AutoTP really cut the model: each rank holds little more than half
    engines, infos = tp_pool.engines + tp1_pool.engines, tp_pool.infos + tp1_pool.infos
    # ipc: on a GPU through CUDA IPC, here through /dev/shm: the same buckets, messages and copies
    for version, transport in enumerate(("shm", "broadcast", "ipc"), start=200):
        stats = _sync_and_compare(autotp_trainer, engines, infos, [tp_pool, tp1_pool], transport, version, tmp_path)
        sent = [gb * 1e9 for gb in stats["sync/sent_gbytes_by_rank"]]
        assert all(sent[k] <= 2 * local[k] for k in range(2)), (transport, sent, local)  # its slices, per engine
        # both engines got the whole model (the TP 2 workers each their own copy of the norms)
        assert 2 * full <= sum(sent) <= 2.05 * full, (transport, sent, full)


def test_two_replicas_feed_two_engines_at_once_and_one_rank_fills_a_tp2_engine(trainer, tp_pool, tp1_pool,
                                                                               tmp_path):
    """ZeRO-3 with two data-parallel ranks (AutoTP 1): each replica feeds one engine, the
    biggest first (the TP 2 engine, whose workers each hold the norms), 1 -> 2 and 1 -> 1."""
    from elasticrl.weights.shards import iter_tensors

    full = sum(t.numel() * 4 for _, t in iter_tensors(resolve_paths(load_spec({}, SPEC))["model"]))
    engines, infos = tp_pool.engines + tp1_pool.engines, tp_pool.infos + tp1_pool.infos
    for version, transport in enumerate(("shm", "broadcast"), start=300):
        stats = _sync_and_compare(trainer, engines, infos, [tp_pool, tp1_pool], transport, version, tmp_path)
        to_tp2, to_tp1 = (gb * 1e9 for gb in stats["sync/sent_gbytes_by_rank"])
        assert to_tp1 == full and full < to_tp2 <= 1.05 * full, (transport, to_tp2, to_tp1, full)
