"""RL batches: packing, and micro-batches cut to their own width."""
from __future__ import annotations

import torch

from elasticrl.algorithms.logprobs import IGNORE
from elasticrl.trainers.batch import pack, widened


def test_a_micro_batch_loses_only_the_padding_all_its_rows_share():
    # three sequences of lengths 3, 5 and 4 (prompt + response) padded to 5 with pad id 0
    b = pack([[7, 8], [7, 8, 9], [7]], [[5], [5, 6], [5, 6, 4]], pad_id=0)
    b.advantages = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert b.input_ids.tolist() == [[7, 8, 5, 0, 0], [7, 8, 9, 5, 6], [7, 5, 6, 4, 0]]
    # rows 0 and 2 end at lengths 3 and 4: width 4, the shifted tensors width 3
    mb = b.rows(torch.tensor([0, 2])).trimmed()
    assert mb.input_ids.tolist() == [[7, 8, 5, 0], [7, 5, 6, 4]]
    assert mb.labels.tolist() == [[IGNORE, IGNORE, 5, IGNORE], [IGNORE, 5, 6, 4]]
    assert mb.response_mask.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert mb.advantages.tolist() == [[0.0, 1.0, 2.0], [8.0, 9.0, 10.0]]
    # a row of full length keeps the batch as it is
    assert b.rows(torch.tensor([1, 2])).trimmed().input_ids.shape == (2, 5)
    # results of a trimmed micro-batch go back to the batch's shifted width with zeros
    assert widened(torch.tensor([[1.0, 2.0, 3.0]]), 4).tolist() == [[1.0, 2.0, 3.0, 0.0]]
