"""The int8-dot decode mat-vec (triton_kernels/matvec_int8.py): its q8_1 quantizer against gguf's Q8_0
quantizer, and each type's product against the reference on the same quantized activation (float64),
with 1, 3 and 8 rows, odd N, tiles loaded ahead or not, split-K on and off (the last program of a row
tile sums the partials), outputs poisoned with NaN. Under the interpreter dot4 is its integer emulation;
on a GPU the same test runs the dp4a (or v_dot4) instruction."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.int8_ops import lookup16, pairs_order
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec_flat import arrival_counts
from vegaserve.triton_kernels.matvec_int8 import (
    SUPPORTED,
    candidates,
    dot_kind,
    matvec_int8,
    quantize_q8_1,
    reference_matvec_q8_1,
)
from vegaserve.triton_kernels.quants.iq4_nl import LEVELS as IQ4_NL_LEVELS
from vegaserve.triton_kernels.quants.mxfp4 import DOUBLED_E2M1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = {t: s.name for t, s in GGML_TYPES.items()}
IDS = {s.name: t for t, s in GGML_TYPES.items()}


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def test_q8_1_quantizer_equals_gguf_q8_0_element_for_element():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen) * torch.rand(3, 256, generator=gen) * 4
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, quants 0
    x[2, :32] = torch.arange(32) - 15.5  # halves after scaling by 127 / 15.5: ties round away from zero
    x[2, 32:64] = torch.tensor([127.0] + [v + 0.5 for v in range(-16, 15)])  # d = 1: x itself rounded
    q, d, s = quantize_q8_1(x.to(DEVICE))
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(3, 8, 34)
    ref_d = ref[..., :2].copy().view(np.float16)[..., 0]
    ref_q = ref[..., 2:].copy().view(np.int8).reshape(3, 256)
    assert np.array_equal(q.cpu().numpy(), ref_q)
    assert np.array_equal(d.cpu().half().numpy(), ref_d)
    assert torch.allclose(s.cpu(), d.cpu() * q.cpu().view(3, 8, 32).sum(-1).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", sorted(NAMES[t] for t in SUPPORTED))
@pytest.mark.parametrize("split_k, carry", [(1, 1), (2, 1), (2, 0)])
def test_int8_matvec_matches_reference_on_the_quantized_activation(name, split_k, carry):
    tid = IDS[name]
    qk = GGML_TYPES[tid].block_size
    k = 4 * max(qk, 64)
    raw = random_blocks(tid, 37, k // qk, torch.Generator().manual_seed(5))
    w, ref_w = repack(raw.to(DEVICE), tid, 37, k), repack(raw, tid, 37, k)
    gen = torch.Generator().manual_seed(6)
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q, d, s = quantize_q8_1(x)
        y = matvec_int8(x, w, block_n=16, nb=2 if qk == 32 else 8, split_k=split_k, num_warps=1, carry=carry,
                        q8_1=(q, d, s))
        assert torch.isfinite(y).all()
        ref = reference_matvec_q8_1(q.cpu(), d.cpu(), ref_w)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5
        # and against the unquantized activation: the q8_1 rounding only (about 1/127 per element)
        exact = reference_matmul(x.cpu(), ref_w)
        assert float((y.double().cpu() - exact).norm() / exact.norm()) < 2e-2
    # the split programs' arrival counts are back at zero for the next launch (the calls above relied on it)
    assert not arrival_counts(torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("k, nb, split_k, carry", [(1024, 8, 1, 1), (2048, 64, 1, 0), (2048, 16, 2, 1)])
def test_q4_k_staged_activations_give_the_per_group_loads_sums(k, nb, split_k, carry):
    """stage 1 loads the tile's activations contiguously and redistributes them: the same words must reach
    the same products, so the sums equal stage 0's exactly (and the reference's). M > 1 ignores it."""
    tid = IDS["Q4_K"]
    raw = random_blocks(tid, 24, k // 256, torch.Generator().manual_seed(7))
    w, ref_w = repack(raw.to(DEVICE), tid, 24, k), repack(raw, tid, 24, k)
    gen = torch.Generator().manual_seed(8)
    for m in (1, 2):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q8 = quantize_q8_1(x)
        cfg = {"block_n": 8, "nb": nb, "split_k": split_k, "num_warps": 1, "carry": carry, "pieces": 0, "q8_1": q8}
        staged, per_group = matvec_int8(x, w, stage=1, **cfg), matvec_int8(x, w, stage=0, **cfg)
        assert torch.equal(staged, per_group)
        ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
        assert float((staged.double().cpu() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "IQ4_NL", "MXFP4"])
def test_flat_quant_loads_give_the_per_block_loads_sums(name):
    """flat 1 loads each row's quant words of a tile as one run and reshapes it to the blocks (Q8_0: and
    splits the halves); both loads must give the reference's products at 1 and 8 rows (bitwise the same
    under the interpreter; on a GPU the lanes differ, and with them the order of the final row sums)."""
    tid = IDS[name]
    raw = random_blocks(tid, 24, 32, torch.Generator().manual_seed(12))
    w, ref_w = repack(raw.to(DEVICE), tid, 24, 1024), repack(raw, tid, 24, 1024)
    gen = torch.Generator().manual_seed(13)
    for m, nb, split_k, carry in ((1, 8, 2, 1), (8, 16, 1, 0)):
        x = torch.randn(m, 1024, generator=gen).to(DEVICE)
        q8 = quantize_q8_1(x)
        cfg = {"block_n": 8, "nb": nb, "split_k": split_k, "num_warps": 1, "carry": carry, "q8_1": q8}
        flat, per_block = matvec_int8(x, w, flat=1, **cfg), matvec_int8(x, w, flat=0, **cfg)
        ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
        for y in (flat, per_block):
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5
        if dot_kind(x.device) == 0:
            assert torch.equal(flat, per_block)


def _matches_the_reference(name: str, n: int, k: int, rows: tuple[int, ...], seed: int, **launch) -> None:
    """matvec_int8 with `launch` on a random [n, k] weight of type `name`, for each count of rows of x:
    finite, and the reference's product on the same q8_1 activation within 1e-5 (relative Frobenius)."""
    tid = IDS[name]
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed))
    w, ref_w = repack(raw.to(DEVICE), tid, n, k), repack(raw, tid, n, k)
    gen = torch.Generator().manual_seed(seed + 1)
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q8 = quantize_q8_1(x)
        y = matvec_int8(x, w, q8_1=q8, **launch)
        assert torch.isfinite(y).all()
        ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, (name, m, launch)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("nb, split_k, carry", [(2, 1, 1), (4, 2, 0), (8, 1, 0)])
def test_k_quant_pieces_kernels_match_the_reference(name, nb, split_k, carry):
    """pieces 1: the quant words and scale records loaded along each row, the scales decoded per 16-byte
    piece (Q4_K: the min term once a sub-block; Q6_K: each piece's qh bits from the run it shares with
    another piece): the reference's product at 1, 3 and 8 rows, odd N."""
    _matches_the_reference(name, 21, 2048, (1, 3, 8), 14, block_n=8, nb=nb * 8, split_k=split_k, num_warps=1,
                           carry=carry, pieces=1)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_pieces_unpack_variants_give_the_same_products(name):
    """unpack 1 (exact int-to-float by adds; Q4_K: masks chosen per piece) against unpack 0 (conversions;
    Q4_K: a select between both forms): the same scales and sums, so the same products, at 1 and 3 rows;
    and the reference's."""
    _matches_the_reference(name, 21, 2048, (1, 3), 18, block_n=8, nb=64, num_warps=1, pieces=1, unpack=1)
    tid = IDS[name]
    raw = random_blocks(tid, 21, 8, torch.Generator().manual_seed(20))
    w = repack(raw.to(DEVICE), tid, 21, 2048)
    for m in (1, 3):
        x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(21 + m)).to(DEVICE)
        cfg = {"block_n": 8, "nb": 32, "split_k": 2, "num_warps": 1, "pieces": 1, "q8_1": quantize_q8_1(x)}
        assert torch.equal(matvec_int8(x, w, unpack=1, **cfg), matvec_int8(x, w, unpack=0, **cfg))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("block_n, nb, split_k, carry", [(8, 16, 1, 0), (16, 32, 2, 1), (32, 16, 4, 0)])
def test_pieces_gather_loads_give_the_same_products(name, block_n, nb, split_k, carry):
    """gather 1 (the activations and their q8_1 scales, and Q4_K's head words, loaded by computed offsets
    where each thread uses them) puts the same values in the same places as the runs rearranged in
    registers: the same outputs bit for bit at 1 and 3 rows, 1 to 4 super-blocks a tile, split-K on and
    off, carried tiles; and the reference's product. Also through the pair kernel."""
    from vegaserve.triton_kernels.matvec_int8 import matvec_int8_pair

    _matches_the_reference(name, 21, 2048, (1, 3), 33, block_n=block_n, nb=nb, split_k=split_k, num_warps=1,
                           carry=carry, pieces=1, gather=1)
    tid = IDS[name]
    raw = random_blocks(tid, 21, 8, torch.Generator().manual_seed(34))
    w = repack(raw.to(DEVICE), tid, 21, 2048)
    cfg = {"block_n": block_n, "nb": nb, "split_k": split_k, "num_warps": 1, "carry": carry, "pieces": 1}
    for m in (1, 3):
        x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(35 + m)).to(DEVICE)
        q8 = quantize_q8_1(x)
        assert torch.equal(matvec_int8(x, w, gather=1, q8_1=q8, **cfg), matvec_int8(x, w, gather=0, q8_1=q8, **cfg))
    other = IDS["Q6_K" if name == "Q4_K" else "Q4_K"]
    v = repack(random_blocks(other, 13, 8, torch.Generator().manual_seed(36)).to(DEVICE), other, 13, 2048)
    both = matvec_int8_pair(x[:1], (w, {**cfg, "gather": 1}), (v, {**cfg, "gather": 1}), q8_1=tuple(t[:1] for t in q8))
    assert torch.equal(both[:, :21], matvec_int8(x[:1], w, gather=0, q8_1=tuple(t[:1] for t in q8), **cfg))


@pytest.mark.parametrize("split_k", [1, 2])
def test_q4_k_matrix_unit_kernel_matches_the_reference(split_k):
    """mma 1 (M > 1): an int8 tl.dot per 32-element sub-block, rows of x padded to 16 with zeros, scales
    and the min term in f32: the reference's product at 2, 3 and 8 rows, odd N."""
    _matches_the_reference("Q4_K", 37, 1024, (2, 3, 8), 16, block_n=16, nb=8, split_k=split_k, num_warps=4, mma=1)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"])
@pytest.mark.parametrize("block_n, num_warps, nb, split_k, carry",
                         [(16, 1, 2, 1, 1), (32, 1, 4, 2, 0), (64, 2, 8, 1, 1), (64, 4, 4, 2, 1)],
                         ids=["one-group", "two-groups-split", "two-warps", "four-warps-split"])
def test_lanes_kernels_match_the_reference(name, block_n, num_warps, nb, split_k, carry):
    """mma 2: one m16n8k32 per block (Q4_K: sub-block; Q6_K an m16n8k16 per 16) and 16 rows, each lane's
    A, B and D words where the instruction's fragment puts them (under the interpreter its emulation
    regathers the matrices from those words, so a word in the wrong lane or register is a wrong product
    here): the reference's
    product at 1, 3 and 8 rows of x (columns of B past M zero), odd N (rows past N clamped and not
    stored), 1 and 2 groups of 16 rows a warp, 1, 2 and 4 warps, 2 to 8 blocks a tile, split-K."""
    _matches_the_reference(name, 37, 512, (1, 3, 8), 22, block_n=block_n, nb=nb, split_k=split_k,
                           num_warps=num_warps, carry=carry, mma=2)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"])
@pytest.mark.parametrize("pipe", [1, 2])
def test_lanes_pipelined_loop_gives_the_carried_loops_products(name, pipe):
    """pipe 1 and 2 (the weight loads issued half or a whole tile ahead of their products) do the same
    products in the same order as carry 1: the same outputs bit for bit at 3 and 8 rows, and the
    reference's, over 2 tiles a K split (the loads carried from one iteration into the next, and the last
    iteration's reload of its own tile); 2- and 1-byte scale records split in halves (4 blocks a tile)."""
    tid = IDS[name]
    k = 1024 if name in ("Q4_K", "Q6_K") else 512  # 4 super-blocks, or 4 tiles of 4 blocks
    launch = {"block_n": 16, "nb": 4 if k == 512 else 8, "split_k": 2, "num_warps": 1, "mma": 2}
    _matches_the_reference(name, 21, k, (3,), 26, pipe=pipe, **launch)
    w = repack(random_blocks(tid, 21, k // GGML_TYPES[tid].block_size,
                             torch.Generator().manual_seed(27)).to(DEVICE), tid, 21, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(28)).to(DEVICE)
    q8 = quantize_q8_1(x)
    assert torch.equal(matvec_int8(x, w, pipe=pipe, q8_1=q8, **launch), matvec_int8(x, w, carry=1, q8_1=q8, **launch))


def test_pipelined_loop_is_refused_outside_the_lanes_kernels_and_for_tiles_of_two_blocks():
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(29)), tid, 16, 256)
    with pytest.raises(ValueError, match="pipe is the lanes kernels' loop"):
        matvec_int8(torch.randn(2, 256), w, block_n=16, nb=8, num_warps=1, mma=0, pipe=1)
    with pytest.raises(ValueError, match="pipe is 0, 1 or 2"):
        matvec_int8(torch.randn(2, 256), w, block_n=16, nb=8, num_warps=1, mma=2, pipe=3)
    tid = IDS["Q8_0"]
    w = repack(random_blocks(tid, 16, 8, torch.Generator().manual_seed(30)), tid, 16, 256)
    with pytest.raises(ValueError, match="tiles of 4 blocks or more"):
        matvec_int8(torch.randn(2, 256), w, block_n=16, nb=2, num_warps=1, mma=2, pipe=1)


def test_lanes_kernels_refuse_a_block_n_their_warps_cannot_split():
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(23)), tid, 16, 256)
    with pytest.raises(ValueError, match="multiple of 16 x num_warps"):
        matvec_int8(torch.randn(2, 256), w, block_n=32, nb=8, num_warps=4, mma=2)


@pytest.mark.parametrize("name", ["Q8_0", "MXFP4"])  # 2-byte and 1-byte scale records
@pytest.mark.parametrize("k, nb, lanes", [(384, 8, True), (256, 1, False), (96, 2, False)],
                         ids=["tile-of-4", "nb-1", "odd-row"])
def test_lanes_kernels_leave_one_block_tiles_to_dp4a(name, k, nb, lanes, monkeypatch):
    """The lanes kernel reads a tile's q8_1 scales in pairs, so a tile of one block (nb 1, or a row of 3
    blocks, whose only power-of-two tile is 1) runs the dp4a kernel with the same launch instead of failing;
    12 blocks at nb 8 take tiles of 4 there. Each the reference's product."""
    from vegaserve.triton_kernels import matvec_int8 as mv

    chosen = []
    original = mv.choose_kernel

    def spy(type_id, m, params):
        kernel, args = original(type_id, m, params)
        chosen.append(kernel.__name__)
        return kernel, args

    monkeypatch.setattr(mv, "choose_kernel", spy)
    _matches_the_reference(name, 21, k, (3,), 25, block_n=16, nb=nb, num_warps=1, mma=2)
    assert chosen == ["lanes_kernel" if lanes else "_legacy_kernel"]


def test_matrix_unit_kernel_is_refused_on_amd(monkeypatch):
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(19)), tid, 16, 256)
    monkeypatch.setattr(torch.version, "hip", "6.3.0")
    with pytest.raises(ValueError, match="no matrix units"):
        matvec_int8(torch.randn(2, 256), w, mma=1)
    with pytest.raises(ValueError, match="no matrix units"):
        matvec_int8(torch.randn(2, 256), w, block_n=16, nb=8, num_warps=1, mma=2)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_sweep_times_both_k_quant_kernels_at_one_row_and_the_groups_kernel_above(name):
    tid = IDS[name]
    one = candidates(tid, 28672, 4096, 1, 132)
    assert {c["pieces"] for c in one} == {0, 1} and len({tuple(sorted(c.items())) for c in one}) == len(one)
    assert {8, 32} <= {c["block_n"] for c in one if c["pieces"]}
    assert all(c["block_n"] >= 8 and c["block_n"] & (c["block_n"] - 1) == 0 for c in one)
    assert not any(c.get("pieces") for c in candidates(tid, 28672, 4096, 8, 132))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"])
@pytest.mark.parametrize("n, k", [(28672, 4096), (4096, 14336), (1024, 4096)])
def test_sweep_has_lanes_configs_only_where_there_are_matrix_units(name, n, k):
    """mma 2 only with matrix_units; each config one the launcher takes (block_n a
    multiple of 16 x num_warps, nb a power of two, a split of two tiles or more) and enough programs for
    two an SM where the row's tiles allow it; each also with the pipelined loops (pipe 1, 2) at that split
    and half of it."""
    tid = IDS[name]
    assert not any(c.get("mma") for c in candidates(tid, n, k, 8, 132))
    lanes = [c for c in candidates(tid, n, k, 8, 132, matrix_units=True) if c.get("mma") == 2]
    assert {c["num_warps"] for c in lanes} == {1, 2, 4} and {c["block_n"] for c in lanes} == {32, 64, 128}
    qk = GGML_TYPES[tid].block_size
    for c in lanes:
        assert c["block_n"] % (16 * c["num_warps"]) == 0 and c["nb"] & (c["nb"] - 1) == 0 and c["nb"] >= 2
        tiles = k // qk // max(1, c["nb"] * 32 // qk)
        assert tiles // c["split_k"] >= 2
        programs = -(-n // c["block_n"]) * c["split_k"]
        if not c.get("pipe"):  # the pipelined loops are timed at half the split too
            assert programs >= 2 * 132 or tiles // (2 * c["split_k"]) < 2, c  # else a larger split was due
    assert {c.get("pipe", 0) for c in lanes} == {0, 1, 2}
    plain = [c for c in lanes if not c.get("pipe")]  # each pipelined config: a plain one's at its split or half
    for c in lanes:
        assert any({**p, "pipe": c.get("pipe", 0), "split_k": c["split_k"]} == {**c, "pipe": c.get("pipe", 0)}
                   and c["split_k"] in (p["split_k"], max(1, p["split_k"] // 2)) for p in plain), c


@triton.jit
def _lookup_kernel(q_ptr, lo_ptr, hi_ptr, TABLE: tl.constexpr, DOT: tl.constexpr, BYTE_SELECT: tl.constexpr,
                   PAIRS: tl.constexpr = False):
    i = tl.arange(0, 256)
    lo, hi = lookup16(tl.load(q_ptr + i), TABLE, DOT, BYTE_SELECT, PAIRS)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


@triton.jit
def _pairs_kernel(lo_ptr, hi_ptr, a_ptr, b_ptr, DOT: tl.constexpr):
    i = tl.arange(0, 256)
    a, b = pairs_order(tl.load(lo_ptr + i), tl.load(hi_ptr + i), DOT)
    tl.store(a_ptr + i, a)
    tl.store(b_ptr + i, b)


@pytest.mark.parametrize("byte_select", [0, 1], ids=["nibble-selectors", "byte-selectors"])
@pytest.mark.parametrize("table, levels", [(1, IQ4_NL_LEVELS), (2, DOUBLED_E2M1)], ids=["IQ4_NL", "MXFP4"])
def test_table_lookup_gives_each_nibbles_level(table, levels, byte_select):
    """Both permute schemes of lookup16 (NVIDIA's prmt with nibble selectors, AMD's v_perm_b32 with byte
    selectors; each as its instruction or, elsewhere, its integer emulation) against a plain table lookup
    of every nibble, over random words and the all-codes words."""
    words = torch.randint(-2**31, 2**31, (256,), generator=torch.Generator().manual_seed(9), dtype=torch.int64)
    words[:16] = torch.tensor([int.from_bytes(bytes([c | (15 - c) << 4] * 4), "little", signed=True) for c in range(16)])
    q = words.to(torch.int32).to(DEVICE)
    lo, hi = torch.empty_like(q), torch.empty_like(q)
    _lookup_kernel[(1,)](q, lo, hi, TABLE=table, DOT=dot_kind(q.device), BYTE_SELECT=byte_select)
    raw = q.cpu().numpy().view(np.uint8).reshape(256, 4)
    table_np = np.array(levels, dtype=np.int8)
    want_lo = table_np[raw & 15].reshape(-1).view(np.int32)
    want_hi = table_np[raw >> 4].reshape(-1).view(np.int32)
    assert np.array_equal(lo.cpu().numpy(), want_lo) and np.array_equal(hi.cpu().numpy(), want_hi)


@pytest.mark.parametrize("table, levels", [(1, IQ4_NL_LEVELS), (2, DOUBLED_E2M1)], ids=["IQ4_NL", "MXFP4"])
def test_pairs_order_puts_words_in_the_lookups_pair_order(table, levels):
    """lookup16's PAIRS words hold the levels of nibbles (0 low, 0 high, 1 low, 1 high), (2 low, 2 high, 3 low,
    3 high); pairs_order arranges two words' bytes the same way: so the PAIRS levels against pairs_order'd
    activations sum to what the interleaved levels against the activations in order sum to."""
    gen = torch.Generator().manual_seed(10)
    q = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    lo, hi = torch.empty_like(q), torch.empty_like(q)
    _lookup_kernel[(1,)](q, lo, hi, TABLE=table, DOT=dot_kind(q.device), BYTE_SELECT=0, PAIRS=True)
    raw = q.cpu().numpy().view(np.uint8).reshape(256, 4)
    table_np = np.array(levels, dtype=np.int8)
    want = table_np[np.stack([raw & 15, raw >> 4], axis=-1).reshape(256, 8)]  # nibble order: byte t low, high
    assert np.array_equal(lo.cpu().numpy().view(np.int8).reshape(256, 4), want[:, :4])
    assert np.array_equal(hi.cpu().numpy().view(np.int8).reshape(256, 4), want[:, 4:])
    xl = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    xh = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    a, b = torch.empty_like(q), torch.empty_like(q)
    _pairs_kernel[(1,)](xl, xh, a, b, DOT=dot_kind(q.device))
    xlb = xl.cpu().numpy().view(np.int8).reshape(256, 4)
    xhb = xh.cpu().numpy().view(np.int8).reshape(256, 4)
    inter = np.stack([xlb, xhb], axis=-1).reshape(256, 8)  # (lo byte 0, hi byte 0, lo byte 1, ...)
    assert np.array_equal(a.cpu().numpy().view(np.int8).reshape(256, 4), inter[:, :4])
    assert np.array_equal(b.cpu().numpy().view(np.int8).reshape(256, 4), inter[:, 4:])


def _shipped_int8_entries() -> list[tuple[str, int, int, int]]:
    from vegaserve.triton_kernels.tuning import load_tuning

    table = load_tuning(target="cuda_sm90").table.get("matvec_int8", {})
    return [(name, *(int(v) for v in shape.split("x")), int(m))
            for name, shapes in sorted(table.items()) for shape, by_m in sorted(shapes.items())
            if "x" in shape for m in sorted(by_m)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name, n, k, m", _shipped_int8_entries())
def test_every_shipped_int8_config_is_right_at_its_own_shape(name, n, k, m):
    """Each exact-shape entry of the H200 tuning file, at that shape, through the launch a linear layer
    makes: variants that passed the interpreter's small shapes were wrong on the H200 at an engine shape
    twice (docs/PERF.md, 2026-12-04), so the shapes the engine runs are checked here as they run."""
    tid = IDS[name]
    qk = GGML_TYPES[tid].block_size
    raw = random_blocks(tid, n, k // qk, torch.Generator().manual_seed(n + k)).cuda()
    w = repack(raw, tid, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).cuda()
    q8 = quantize_q8_1(x)
    xd = (q8[0].float().view(m, -1, 32) * q8[1][..., None]).view(m, k)
    ref = xd @ dequantize(raw.reshape(-1), tid, (n, k)).T
    y = matvec_int8(x, w, q8_1=q8)  # the tuning file's parameters, as TritonMethod takes them
    assert float((y - ref).norm() / ref.norm()) < 1e-4


def test_one_row_writes_into_a_column_slice_of_a_wider_output():
    """out: at M = 1 the product goes to a column slice of a wider f32 output (the stacked matrices of one
    activation write one output, no cat), its other columns untouched; a wrongly shaped or strided out is
    refused."""
    tid = IDS["Q4_K"]
    raw = random_blocks(tid, 24, 1, torch.Generator().manual_seed(3))
    w = repack(raw.to(DEVICE), tid, 24, 256)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    q8 = quantize_q8_1(x)
    wide = torch.full((1, 40), -7.0, device=DEVICE)
    got = matvec_int8(x, w, q8_1=q8, out=wide[:, 10:34], block_n=8, nb=8, num_warps=1, split_k=1)
    assert got.data_ptr() == wide[:, 10:].data_ptr()
    assert torch.equal(wide[:, 10:34], matvec_int8(x, w, q8_1=q8, block_n=8, nb=8, num_warps=1, split_k=1))
    assert (wide[:, :10] == -7.0).all() and (wide[:, 34:] == -7.0).all()
    for bad in (torch.empty(1, 23, device=DEVICE), torch.empty(1, 24, dtype=torch.float16, device=DEVICE),
                torch.empty(24, 2, device=DEVICE)[:, 0][None]):
        with pytest.raises(ValueError, match="out must be"):
            matvec_int8(x, w, q8_1=q8, out=bad)
    x3 = torch.randn(3, 256, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):  # rows of a column slice are not N apart
        matvec_int8(x3, w, out=torch.empty(3, 40, device=DEVICE)[:, :24])


@pytest.mark.parametrize("first, split_a, split_b, carry", [("Q4_K", 1, 2, 0), ("Q6_K", 2, 1, 1), ("Q4_K", 4, 4, 0)])
def test_pair_launch_gives_each_matrix_its_own_launchs_product(first, split_a, split_b, carry):
    """matvec_int8_pair: a Q4_K and a Q6_K matrix (odd row counts, different row tiles and K splits) in one
    launch write [x Wa^T, x Wb^T] into a column slice of a wider output, bit for bit what each one's own
    launch writes (the same pieces code runs on the same tiles), within 1e-5 of the reference; the columns
    around the slice untouched; the arrival counts left at zero for the next split-K launch."""
    from vegaserve.triton_kernels.matvec_int8 import matvec_int8_pair, pairs

    k = 1024
    second = "Q6_K" if first == "Q4_K" else "Q4_K"
    mats = []
    for name, n, block_n, split, seed in ((first, 37, 16, split_a, 30), (second, 13, 8, split_b, 31)):
        tid = IDS[name]
        raw = random_blocks(tid, n, k // 256, torch.Generator().manual_seed(seed))
        params = {"block_n": block_n, "nb": 16, "split_k": split, "num_warps": 1, "carry": carry, "pieces": 1,
                  "unpack": int(name == "Q4_K")}
        mats.append((repack(raw.to(DEVICE), tid, n, k), params, repack(raw, tid, n, k)))
    (wa, pa, ra), (wb, pb, rb) = mats
    assert pairs((wa, pa), (wb, pb))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    q8 = quantize_q8_1(x)
    wide = torch.full((1, 60), -7.0, device=DEVICE)
    got = matvec_int8_pair(x, (wa, pa), (wb, pb), q8_1=q8, out=wide[:, 5:55])
    assert got.data_ptr() == wide[:, 5:].data_ptr()
    assert torch.equal(wide[:, 5:42], matvec_int8(x, wa, q8_1=q8, **pa))
    assert torch.equal(wide[:, 42:55], matvec_int8(x, wb, q8_1=q8, **pb))
    assert (wide[:, :5] == -7.0).all() and (wide[:, 55:] == -7.0).all()
    for part, ref_w in ((wide[:, 5:42], ra), (wide[:, 42:55], rb)):
        ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
        assert float((part.double().cpu() - ref).norm() / ref.norm()) < 1e-5
    assert not arrival_counts(torch.device(DEVICE), 64)[:64].any()


def test_pair_launch_is_refused_where_a_kernel_is_not_a_pieces_kernel():
    """pairs: the same type (stacked at load instead), a groups-kernel config (pieces 0), a lanes config or
    different warp counts are not a pair, and matvec_int8_pair says so; more than one row of x is refused."""
    from vegaserve.triton_kernels.matvec_int8 import matvec_int8_pair, pairs

    ws = {}
    for name, seed in (("Q4_K", 40), ("Q6_K", 41)):
        tid = IDS[name]
        ws[name] = repack(random_blocks(tid, 16, 2, torch.Generator().manual_seed(seed)).to(DEVICE), tid, 16, 512)
    ok = {"block_n": 8, "nb": 8, "split_k": 1, "num_warps": 1, "carry": 0, "pieces": 1}
    assert pairs((ws["Q4_K"], ok), (ws["Q6_K"], ok))
    assert not pairs((ws["Q4_K"], ok), (ws["Q4_K"], ok))
    assert not pairs((ws["Q4_K"], {**ok, "pieces": 0}), (ws["Q6_K"], ok))
    assert not pairs((ws["Q4_K"], ok), (ws["Q6_K"], {**ok, "mma": 2, "block_n": 16}))
    assert not pairs((ws["Q4_K"], ok), (ws["Q6_K"], {**ok, "num_warps": 2}))
    x = torch.randn(1, 512, device=DEVICE)
    with pytest.raises(ValueError, match="pieces kernels"):
        matvec_int8_pair(x, (ws["Q4_K"], ok), (ws["Q4_K"], ok))
    with pytest.raises(ValueError, match="one row"):
        matvec_int8_pair(torch.randn(2, 512, device=DEVICE), (ws["Q4_K"], ok), (ws["Q6_K"], ok))
