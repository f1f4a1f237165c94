"""rl.fully_async's queue by hand: which groups a batch takes, which samples start over, what
a checkpoint keeps and how a restored one's episodes meet their environments again (the rounds
themselves run on real engines in test_faults.py and test_agents.py)."""
from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest

from elasticrl.rollout.stream import Item, Stream


def _stream(prompts_per_step=2, samples=2, staleness=1):
    rl = SimpleNamespace(prompts_per_step=prompts_per_step, samples_per_prompt=samples, max_staleness=staleness)
    spec = SimpleNamespace(rl=rl, seed=7)
    return Stream(spec, prompt_ids={r: [100 + r] for r in range(10, 20)}, decode=lambda ids: " ".join(map(str, ids)))


def _done(item: Item, versions: list[int]) -> None:
    item.tokens, item.logprobs, item.versions = [5] * len(versions), [-0.5] * len(versions), versions
    item.finish = "stop"


def test_a_batch_takes_the_first_finished_groups_and_stale_samples_start_over():
    s = _stream()
    drawn = iter([[10, 11], [12, 13], [14, 15]])
    s.fill(lambda: next(drawn))
    # capacity 2 x (1 + 1) groups: two draws of two prompts; 2 samples each
    assert s.groups == 4 and [(i.group, i.record, i.j) for i in s.items][:3] == [(0, 10, 0), (0, 10, 1), (1, 11, 0)]
    assert s.ids == {10: [110], 11: [111], 12: [112], 13: [113]}
    by = {(i.group, i.j): i for i in s.items}
    _done(by[0, 0], [0, 0, 1])          # group 0 finished, its oldest token of version 0
    _done(by[0, 1], [1])
    _done(by[2, 0], [2, 2])             # group 2 finished, newer
    _done(by[2, 1], [1, 2])
    _done(by[3, 0], [2])                # group 3 half finished
    by[1, 0].tokens, by[1, 0].versions, by[1, 0].logprobs = [9], [0], [-1.0]  # group 1 under way since version 0
    assert not s.ready(2)  # at version 2, group 0 (a version-0 token) is too stale: only group 2 counts
    assert s.ready(1)      # at version 1 groups 0 and 2
    s.expire(2)            # version 2 allows tokens of version >= 1: group 0's sample 0 and group 1's sample 0
    assert s.regenerated == 2 and by[0, 0].tokens == [] and by[0, 0].life == 1 and by[0, 0].finish is None
    assert by[1, 0].life == 1 and by[1, 0].versions == [] and by[0, 1].life == 0
    _done(by[0, 0], [2])
    _done(by[3, 1], [2, 2])
    records, samples, info = s.take(2)  # groups 0, 2 and 3 finished: the first two, in draw order
    assert records == [10, 12]
    assert [(x.prompt_index, x.weight_version, x.versions, x.text) for x in samples] == [
        (0, 2, [2], "5"), (0, 1, [1], "5"), (1, 2, [2, 2], "5 5"), (1, 1, [1, 2], "5 5")]
    # lags at version 2: tokens of versions 2, 1, 2, 2, 1, 2 -> 0 four times, 1 twice
    assert info["rl/token_staleness_max"] == 1 and info["rl/token_staleness/0"] == 4 / 6
    assert info["rl/token_staleness/1"] == 2 / 6 and info["rl/regenerated"] == 2
    assert info["rl/versions_per_sample"] == (1 + 1 + 1 + 2) / 4 and info["rollout/carried"] == 2  # group 3's
    assert sorted({i.group for i in s.items}) == [1, 3] and s.ids == {11: [111], 13: [113]} and s.regenerated == 0
    s.fill(lambda: next(drawn))  # room for one more draw
    assert s.groups == 6 and sorted({i.group for i in s.items}) == [1, 3, 4, 5]
    # a checkpoint's state restores the queue, tokens, versions and lives included
    t = _stream()
    t.restore(s.state())
    assert t.items == s.items and t.groups == 6 and t.ids == s.ids
    t.restore(Stream.EMPTY)
    assert t.items == [] and t.groups == 0


@pytest.mark.parametrize("env, replayed", [("Chatty", True), ("Moody", False)])
def test_a_restored_stream_tells_each_episodes_environment_its_turns_again(env, replayed):
    """A checkpoint's episodes in flight, restored: each started one's environment (a real
    process) starts again and is told the model's turns so far. Chatty answers as it did, so the
    episode goes on where it was; Moody's answers are random, so its episode starts over
    (counted). An episode not yet started, and a finished one, are left alone."""
    from elasticrl.envs.pool import EnvironmentPool
    from elasticrl.rollout.episodes import StreamTurns

    envs = EnvironmentPool({"environment": f"tests.integration.environments:{env}", "tools": [], "parser": "hermes",
                            "timeout_s": 5, "retries": 0}, timeout_s=30, workers=1)
    rows = {10: {"prompt": "abcd"}}  # Chatty: 1 + 4 % 3 = 2 turns answered, then done
    s = _stream()
    s.episodes = StreamTurns(envs, None, rows, 2, 3, 64, 64)
    try:
        first = [envs.ask([op])[0] for op in ({"op": "start", "id": 0, "row": rows[10]},
                                              {"op": "step", "id": 0, "text": "hi"})]
        said = first[0]["messages"] + [{"role": "assistant", "content": "hi"}, *first[1]["messages"]]
        live = Item(0, 10, 0, tokens=[1, 2, 3], logprobs=[-0.1, -0.2], versions=[0, 0], mask=[True, False, True],
                    prompt_ids=[100], turn=[3], messages=said, text="hi", turns=1)
        fresh, done = Item(0, 10, 1), Item(1, 11, 0, tokens=[4], logprobs=[-1.0], versions=[0], finish="stop")
        state = {"items": [asdict(i) for i in (live, fresh, done)], "groups": 2, "regenerated": 0, "rounds": 0}
        s.restore(state)
        assert s.items[1:] == [fresh, done]
        if replayed:
            assert s.items[0] == live and s.regenerated == 0
            # its environment is where the episode was: one more turn answered, then done
            probe = [envs.ask([{"op": "step", "id": StreamTurns.ID_BASE, "text": "x"}])[0]["done"] for _ in "12"]
            assert probe == [False, True]
        else:
            assert s.items[0] == Item(0, 10, 0, life=1) and s.regenerated == 1
    finally:
        envs.close()
