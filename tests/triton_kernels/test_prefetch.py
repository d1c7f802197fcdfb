"""L2 prefetch of a layer's weights (triton_kernels/prefetch.py): which bytes it asks for, and that its
walk over them (the kernel run with a counter per line in place of the prefetch instruction) reaches
every line of the budget once and nothing past it. That the launch leaves every result unchanged under
programmatic dependent launch is test_pdl.py's captured chain (GPU)."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels import prefetch
from vegaserve.triton_kernels.prefetch import LINE, LayerPrefetch, plan_ranges


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU, the kernel itself on a GPU


def tensors(device: str = "cpu") -> list[torch.Tensor]:
    # odd sizes: partial last lines; the middle one long enough for several rounds of every program
    return [torch.zeros(1000, dtype=torch.uint8, device=device), torch.zeros(100_003, dtype=torch.int32, device=device),
            torch.zeros(5000, dtype=torch.uint8, device=device)]


def whole_lines(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() // LINE for t in ts)


@pytest.mark.parametrize("limit", [0, LINE - 1, LINE, 3000, 300_000, 10**9])
def test_plan_takes_the_first_bytes_in_order_in_whole_lines(limit: int):
    ts = tensors()
    rows = plan_ranges(ts, limit)
    lines = [n for _, n, _ in rows]
    assert sum(lines) * LINE <= limit
    left = limit  # the same walk by hand: each tensor gives min(its whole lines, what the budget has left)
    expect = []
    for t in ts:
        n = min(t.numel() * t.element_size(), left) // LINE
        if n == 0:
            break
        expect.append(n)
        left -= n * LINE
    assert lines == expect
    for (addr, n, first), t in zip(rows, ts):
        assert addr == t.data_ptr() and n * LINE <= t.numel() * t.element_size()
    assert [first for _, _, first in rows] == [sum(lines[:i]) for i in range(len(rows))]
    # every tensor before the last one taken is taken whole (to its last whole line)
    for (_, n, _), t in zip(rows[:-1], ts):
        assert n == t.numel() * t.element_size() // LINE


@pytest.mark.parametrize("limit", [LINE, 3000, 300_000, 10**9])
def test_the_kernel_walks_every_planned_line_and_no_other(limit: int):
    ts = tensors(DEV)
    total = sum(n for _, n, _ in plan_ranges(ts, limit))
    hits = torch.zeros(total + 64, dtype=torch.int32, device=DEV)  # room past the end: a stray line would show there
    LayerPrefetch(ts).launch(limit, hits=hits)
    assert (hits[:total] >= 1).all(), f"lines never fetched: {(hits[:total] == 0).nonzero().flatten()[:8].tolist()}"
    assert (hits[total:] == 0).all()
    # each line once, but for the last line of a range, which a program's spare lanes repeat
    assert int((hits[:total] > 1).sum()) <= len(ts)


def test_no_launch_without_a_budget_or_off_nvidia():
    hits = torch.zeros(64, dtype=torch.int32)
    LayerPrefetch(tensors()).launch(0, hits=hits)
    assert int(hits.sum()) == 0
    assert not prefetch.enabled(torch.device("cpu"))
    LayerPrefetch(tensors()).launch(1 << 20)  # a CPU tensor: nothing to launch, and no error


def test_budget_in_mib_and_negative_refused():
    before = prefetch.budget()
    try:
        prefetch.set_budget(24)
        assert prefetch.budget() == 24 << 20
        with pytest.raises(ValueError, match=">= 0"):
            prefetch.set_budget(-1)
    finally:
        prefetch.set_budget(before >> 20)
