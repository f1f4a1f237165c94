"""Where each rank's in-memory copy is kept (trainers.copies.holders)."""
from elasticrl.trainers.copies import holders


def test_a_ranks_copy_is_kept_on_the_next_node_in_the_ring_or_on_its_own_when_alone():
    # 4 ranks, 2 nodes: each copy leaves its rank's node (ranks 0-1 to B, ranks 2-3 to A)
    assert holders(["A", "A", "B", "B"]) == ["B", "B", "A", "A"]
    # 3 nodes, ranks interleaved: the next rank in the ring already sits elsewhere
    assert holders(["A", "B", "C", "A"]) == ["B", "C", "A", "B"]
    # one node: the copies stay on it (a keeper process of their own outlives a killed rank)
    assert holders(["A", "A"]) == ["A", "A"] and holders(["A"]) == ["A"]
