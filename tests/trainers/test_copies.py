"""Where each rank's in-memory copy is kept (trainers.copies.holders)."""
from elasticrl.trainers.copies import holders


def test_a_ranks_copy_is_kept_on_the_next_node_in_the_ring_or_on_its_own_when_alone():
    # 4 ranks, 2 nodes: each copy leaves its rank's node (ranks 0-1 to B, ranks 2-3 to A)
    assert holders(["A", "A", "B", "B"]) == ["B", "B", "A", "A"]
    # 3 nodes, ranks interleaved: the next rank in the ring already sits elsewhere
    assert holders(["A", "B", "C", "A"]) == ["B", "C", "A", "B"]
    # one node: the copies stay on it (a keeper process of their own outlives a killed rank)
    assert holders(["A", "A"]) == ["A", "A"] and holders(["A"]) == ["A"]


def test_the_confirmed_copy_stays_whole_while_the_next_is_half_taken(tmp_path):
    """A rank stopped while the copy of step 5 is taken: its keeper still holds the copy of
    step 3 whole (the new one goes into the memory of step 1's), so a recovery can use it."""
    import numpy as np

    from elasticrl.trainers.copies import Held

    keeper = Held()
    for step in (1, 3):
        for rank in (0, 1):
            keeper.put("actor", rank, step, {f"pieces-{rank}": np.full(4, step + rank / 10, np.float32),
                                             "meta.json": b"{}"})
    spare = keeper.files[("actor", 0)][1]["pieces-0"]
    keeper.put("actor", 0, 5, {"pieces-0": np.full(4, 5.0, np.float32)})  # rank 1 never hands its over
    assert keeper.files[("actor", 0)][5]["pieces-0"] is spare  # step 1's memory, reused
    assert keeper.write(5, str(tmp_path / "five")) == [["actor", 0]]  # not whole: rank 1 missing
    assert keeper.write(3, str(tmp_path / "three")) == [["actor", 0], ["actor", 1]]
    for rank in (0, 1):
        data = np.frombuffer((tmp_path / "three" / "actor" / f"pieces-{rank}").read_bytes(), np.float32)
        assert data.tolist() == [np.float32(3 + rank / 10)] * 4
