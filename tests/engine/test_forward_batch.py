"""ForwardBatch.build: every input the model reads, through the one-copy host staging or without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vegaserve.engine.forward_batch import ForwardBatch, HostStaging

SEQS = [(list(range(40, 49)), 0, [5, 6, 7, 8, 9, 1, 2, 3, 4]), (np.arange(16, 23), 6, [11]), ([3], 0, [12])]


def check(fb: ForwardBatch) -> None:
    assert fb.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4, 11, 12]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 0]
    assert fb.logits_rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [(s.start, s.n, s.offset) for s in fb.seqs] == [(0, 9, 0), (6, 1, 9), (0, 1, 10)]
    assert [s.slots.tolist() for s in fb.seqs] == [list(range(40, 49)), list(range(16, 23)), [3]]
    a = fb.attention
    assert a.seq_lens.tolist() == [9, 7, 1] and a.query_start.tolist() == [0, 9, 10, 11]
    assert a.block_tables.tolist() == [[10, 11, 12], [4, 5, 5], [0, 0, 0]]  # pages of 4; the last repeats
    assert a.new_slots.tolist() == list(range(40, 49)) + [22, 3]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")])])
def test_build_gives_every_input_with_and_without_staging(device: str) -> None:
    dev = torch.device(device)
    check(ForwardBatch.build(SEQS, [True, False, False], dev, block_size=4))
    staging = HostStaging(dev)
    for _ in range(3):  # the buffers are reused from the second step on
        check(ForwardBatch.build(SEQS, [True, False, False], dev, block_size=4, staging=staging))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_staging_grows_in_powers_of_two_and_keeps_its_buffers() -> None:
    staging = HostStaging(torch.device("cuda"))
    a, b = staging.upload([[1, 2, 3], np.arange(5)])
    assert a.tolist() == [1, 2, 3] and b.tolist() == list(range(5)) and staging.host.numel() == 1024
    assert staging.host.is_pinned()
    first = staging.dev.data_ptr()
    staging.upload([list(range(1000))])
    assert staging.dev.data_ptr() == first
    (big,) = staging.upload([list(range(3000))])
    assert big.tolist() == list(range(3000)) and staging.host.numel() == 4096
