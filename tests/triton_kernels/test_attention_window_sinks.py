"""Sliding-window attention and attention sinks (gpt-oss) in the paged-attention kernels, against the float64
references: decode (one split, and split + combine over the keys the window leaves),
prefill and chunked prefill where the window is shorter than a query block (rows that see no key in the
first tiles), with and without sinks. The same NaN-poisoned caches and outputs as test_attention.py."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode
from vegaserve.triton_kernels.attention_prefill import prefill_attention, reference_prefill

from .test_attention import DEVICE, KV, PAGE, SCALE, TOL, nan_like, paged_cache, query_layout, rel_err

LENS = [1, 5, 13, 40, 77]
CASES = [(0, True), (8, False), (8, True), (20, True), (200, True)]  # (window, sinks): 200 covers every key
IDS = ["sinks", "window8", "window8-sinks", "window20-sinks", "window-past-the-keys"]


def _sinks(group: int, on: bool, seed: int) -> torch.Tensor | None:
    if not on:
        return None
    return (torch.randn(group * KV, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


@pytest.mark.parametrize("window, sinks_on", CASES, ids=IDS)
@pytest.mark.parametrize("split_keys", [128, 16], ids=["one-split", "split"])
def test_decode_with_a_window_and_sinks_matches_the_reference(window, sinks_on, split_keys):
    """A window of 8 is one 16-key tile, so it stays one split; the others split in 16 keys."""
    group, D = 2, 64
    k, v, tables, gen = paged_cache(LENS, D, torch.float32, seed=31)
    seq_lens, _ = query_layout(LENS, [1] * len(LENS))
    q = torch.randn(len(LENS), group * KV, D, generator=gen).to(DEVICE)
    sinks = _sinks(group, sinks_on, 32)
    out = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, max(LENS), out=nan_like(q), block_n=16,
                           split_keys=split_keys, min_programs=0, window=window, sinks=sinks)
    ref = reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE, window, sinks)
    assert rel_err(out, ref) < TOL[torch.float32]


# (cached, new): a prompt longer than the window and a query block; a chunk after cached keys; decode rows
PREFILL = [(0, 37), (21, 6), (12, 1), (0, 1), (5, 11)]


@pytest.mark.parametrize("window, sinks_on", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_prefill_with_a_window_and_sinks_matches_the_reference(window, sinks_on, dtype):
    group, D = 2, 64
    lens = [c + n for c, n in PREFILL]
    news = [n for _, n in PREFILL]
    k, v, tables, gen = paged_cache(lens, D, dtype, seed=33)
    seq_lens, qstart = query_layout(lens, news)
    q = torch.randn(sum(news), group * KV, D, generator=gen).to(DEVICE)
    sinks = _sinks(group, sinks_on, 34)
    out = prefill_attention(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, max(news), out=nan_like(q),
                            block_m=32, block_n=16, window=window, sinks=sinks)
    ref = reference_prefill(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, window, sinks)
    assert rel_err(out, ref) < TOL[dtype]


def test_the_references_window_and_sinks_change_the_result():
    """So that the kernels' agreement above says something: a window and sinks each move the output."""
    k, v, tables, gen = paged_cache(LENS, 64, torch.float32, seed=35)
    seq_lens, _ = query_layout(LENS, [1] * len(LENS))
    q = torch.randn(len(LENS), 2 * KV, 64, generator=gen).to(DEVICE)
    plain = reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE)
    assert rel_err(reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE, 8), plain) > 0.05
    assert rel_err(reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE, 0, _sinks(2, True, 36)), plain) > 0.05
