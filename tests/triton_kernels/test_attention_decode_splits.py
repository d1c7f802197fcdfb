"""Decode attention's splits: split_count's launch holds every sequence's live splits (_share) at any length,
and on ragged lengths far below max_seq_len (the decode graphs' grid: most splits dead) the kernels match
the float64 reference, a dead split writing nothing and the combine reading none. The NaN-poisoned caches
and outputs of test_attention.py; the kernels under TRITON_INTERPRET=1 on a CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels import attention_decode
from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode, split_count
from vegaserve.triton_kernels.q8_1 import quantize_q8_1

from .test_attention import DEVICE, KV, PAGE, SCALE, nan_like, paged_cache, query_layout, rel_err


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fill_of(seqs: int, kv_heads: int, min_programs: int) -> int:
    """The smallest power of two >= cdiv(min_programs, seqs * kv_heads), at least 1."""
    want = max(1, cdiv(min_programs, seqs * kv_heads))
    return 1 << (want - 1).bit_length()


def live_splits(seq_len: int, window: int, block_n: int, split_keys: int, fill: int) -> int:
    """_share in Python: the splits of a sequence of seq_len keys that take any."""
    n = min(seq_len, window) if window else seq_len
    share = min(cdiv(cdiv(n, fill), block_n) * block_n, split_keys)
    return cdiv(n, share)


# ------------------------------------------------------------------------------------------ split_count


def test_graph_launch_of_64_sequences_at_262144_keys_takes_128_splits():
    # fill 4 (528 programs over 256 rows) is below the 128 that 2048-key splits of 262144 need
    assert split_count(64, 4, 262144, 0, 64, 2048, 528) == 128


def test_few_sequences_with_a_short_max_take_the_fill_count():
    # 16 rows for 528 programs: 33 splits, rounded up to 64; 8192 keys need only 4 of 2048
    assert split_count(2, 8, 8192, 0, 64, 2048, 528) == 64
    assert split_count(2, 8, 8192, 0, 64, 2048, 0) == 4


def test_a_window_caps_the_live_keys():
    assert split_count(1, 1, 262144, 0, 64, 2048, 0) == 128
    assert split_count(1, 1, 262144, 4096, 64, 2048, 0) == 2
    assert split_count(1, 1, 100, 4096, 64, 2048, 0) == 1  # a window past max_seq_len changes nothing


def test_splits_never_outnumber_the_tiles_of_the_live_keys():
    assert split_count(1, 1, 100, 0, 16, 32, 10**6) == 7
    assert split_count(1, 1, 10**6, 100, 16, 32, 10**6) == 7


def test_one_tile_that_holds_every_key_is_one_split():
    assert split_count(64, 4, 64, 0, 64, 2048, 528) == 1
    assert split_count(1, 1, 50, 0, 64, 2048, 528) == 1
    assert split_count(1, 1, 262144, 64, 64, 2048, 528) == 1


# (seqs, kv_heads, max_seq_len, window, block_n, split_keys, min_programs)
COMBOS = [(64, 4, 4096, 0, 64, 2048, 528), (1, 8, 5000, 0, 16, 32, 240), (3, 2, 3000, 700, 16, 48, 97),
          (7, 1, 2000, 0, 32, 32, 0), (5, 3, 4097, 100, 64, 128, 1000), (2, 2, 1000, 0, 16, 2048, 528),
          (1, 1, 3333, 0, 16, 256, 7)]


@pytest.mark.parametrize("combo", COMBOS, ids=[str(c) for c in COMBOS])
def test_every_length_up_to_max_seq_len_has_at_most_the_launchs_splits_live(combo):
    seqs, kv, max_len, window, block_n, split_keys, min_programs = combo
    splits = split_count(*combo)
    fill = fill_of(seqs, kv, min_programs)
    live = [live_splits(n, window, block_n, split_keys, fill) for n in range(1, max_len + 1)]
    assert max(live) <= splits
    assert min(live) == 1


# ---------------------------------------------------------------------------------------------- kernels

# one key; inside a page; across 16-key shares; a 32-key share; every split live (4090 keys of 32)
LENS = [1, 13, 40, 77, 4090]
MAX_SEQ_LEN = 4096  # 128 splits of 32 keys; fill 4 (40 programs over 10 rows), so most splits are dead
CFG = dict(block_n=16, split_keys=32, min_programs=40)


def _inputs(seed: int, head_dim: int = 64, group: int = 2, dtype: torch.dtype = torch.float32):
    k, v, tables, gen = paged_cache(LENS, head_dim, dtype, seed=seed)
    seq_lens, _ = query_layout(LENS, [1] * len(LENS))
    q = torch.randn(len(LENS), group * KV, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, tables, seq_lens, gen


def _poisoned_partials(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Partial buffers filled with NaN, each launch's kept in the returned list."""
    made = []

    def partials(S, H, splits, D, device):
        made.append((torch.full((S, H, splits, D), float("nan"), device=device),
                     torch.full((S, H, splits), float("nan"), device=device)))
        return made[-1]

    monkeypatch.setattr(attention_decode, "partial_buffers", partials)
    return made


@pytest.mark.parametrize("window,sinks_on", [(0, False), (0, True), (50, False), (50, True)],
                         ids=["plain", "sinks", "window50", "window50-sinks"])
def test_decode_far_below_max_seq_len_matches_reference_with_dead_splits_unwritten_and_unread(
        monkeypatch, window, sinks_on):
    """Partials poisoned with NaN: the output is exact, so the combine read no dead split, and after the
    launch exactly the live splits (_share's count, mirrored here) hold finite partials."""
    made = _poisoned_partials(monkeypatch)
    q, k, v, tables, seq_lens, gen = _inputs(seed=41)
    H = q.shape[1]
    sinks = (torch.randn(H, generator=gen) * 2).to(DEVICE) if sinks_on else None
    out = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, MAX_SEQ_LEN, out=nan_like(q), window=window,
                           sinks=sinks, **CFG)
    assert rel_err(out, reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE, window, sinks)) < 1e-5
    (o, lse), = made
    splits = split_count(len(LENS), KV, MAX_SEQ_LEN, window, CFG["block_n"], CFG["split_keys"], CFG["min_programs"])
    assert lse.shape[2] == splits
    fill = fill_of(len(LENS), KV, CFG["min_programs"])
    for s, n in enumerate(LENS):
        live = live_splits(n, window, CFG["block_n"], CFG["split_keys"], fill)
        assert torch.isfinite(lse[s, :, :live]).all() and torch.isfinite(o[s, :, :live]).all(), (n, live)
        assert lse[s, :, live:].isnan().all() and o[s, :, live:].isnan().all(), (n, live)
    assert any(live_splits(n, window, CFG["block_n"], CFG["split_keys"], fill) > 1 for n in LENS)


def test_decode_far_below_max_seq_len_writes_the_q8_1_copy_of_its_output():
    q, k, v, tables, seq_lens, _ = _inputs(seed=42, group=4, dtype=torch.float16)
    out, (codes, d, sums) = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, MAX_SEQ_LEN, out=nan_like(q),
                                             q8_1=True, **CFG)
    assert rel_err(out, reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE)) < 3e-3
    want = quantize_q8_1(out.reshape(len(LENS), -1))
    assert torch.equal(codes, want[0]) and torch.equal(d, want[1]) and torch.equal(sums, want[2])


def test_split_keys_off_the_tiles_and_the_old_partition_parameter_are_refused():
    q, k, v, tables, seq_lens, _ = _inputs(seed=43)
    args = (q, k, v, tables, seq_lens, SCALE, PAGE, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="block_n 16 .* split_keys 40"):
        decode_attention(*args, block_n=16, split_keys=40)
    with pytest.raises(ValueError, match="'partition'"):  # the launch parameter split_keys replaced
        decode_attention(*args, partition=512)
