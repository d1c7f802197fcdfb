"""Decode mat-vec on flat word tiles: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, W repacked (layout.py).

A candidate beside matmul.matvec (same signature and result). Each program owns BLOCK_N rows and one K
split; per iteration it loads each row's next run of quant bytes as int32 words, 16 bytes per thread, into
[BLOCK_N, G, 4] tiles (flat_words.py: the tile layout and the in-place decoding, one LOP3 + one FADD per
element), multiplies by the activations read in the words' element order (the weights are never
reordered) and sums each thread's words per scale group; the scale multiplies that sum, and the group
axis is reduced once, after the K loop. The weight tiles are decoded once and used for all M rows of x.

Per type (layouts of quants/*.py; byte t of a word is bits 8t .. 8t + 7; a group is one thread's 16 bytes
of a row, or the 16-byte runs it loads together):
  Q8_0  group = block, two runs (its halves): byte t of word w of half h is element 16h + 4w + t.
        (sum q * x) * d.
  Q4_0  group = block: byte t of word w holds element 4w + t (low nibble) and 4w + t + 16 (high).
        (sum (q - 8) * x) * d.
  Q4_K  group = (super-block, j = 0 or 1), four runs: chunks j and j + 2, two halves each. Byte l of
        chunk c: low nibble is element l of sub-block 2c, high nibble of 2c + 1. Per sub-block
        d * sc * sum(q * x) - dmin * m * sum(x); one thread unpacks the four six-bit scales and mins of
        its two chunks once per row, and sum(x) is shared by its rows.
  Q6_K  group = (super-block, half h, quarter l4 of the half's 32 qh bytes), three runs: those qh words
        and the two ql runs (gm = 0, 1) that use them. Code of ql byte t, nibble gh: element
        32 (gm + 2 gh) + l + 128 h with l = 4 (4 l4 + w) + t; its two high bits are bits 2 (gm + 2 gh) of
        qh byte t. One shift of qh per word puts them above the nibbles, so a code is one LOP3 from a
        combined word. d * scales[i] * sum((q - 32) * x) per 16-element sub-block i.
Split-K partials go to [SPLIT_K, M, N] and are summed in fixed order (no atomics), as in matmul.matvec.
Torch reference: matmul.reference_matmul (dequant.dequantize, then x @ W^T in float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.flat_words import (
    block_planes,
    field,
    magic,
    nibble,
    nibble_magics,
    program_rows,
    q4_k_groups,
    q4_k_scale_pairs,
    q6_k_groups,
    q6_k_scales,
    split4,
    store_rows,
    x_vec,
    zero_rows,
)
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matmul import divisor_at_most, matvec_tiles
from vegaserve.triton_kernels.matmul import reference_matmul  # noqa: F401 - the ground truth these match
from vegaserve.triton_kernels.tuning import Tuning, load_tuning

Q4_0, Q8_0, Q4_K, Q6_K, IQ4_NL, MXFP4 = 2, 8, 12, 14, 20, 39


@triton.jit
def _q8_0_kernel(
    x_ptr, base,  # pointers: activations [M, K], weight bytes
    part_ptr, out_ptr, count_ptr,  # store_rows': partials [SPLIT, M, N] f32, y [M, N] f32, arrival counts
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs
    N, K, blocks_per_split,  # sizes (blocks of 32)
    stride_xm,  # strides
    # meta: rows of x, rows per program, blocks per tile, programs along K
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
):
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 32, BLOCK_N, NB)
    qs, dp = block_planes(base, o0, r0, b0, o1, r1, r64, first, NB, 8)  # qs + 4: the block's second half
    xk = (first + tl.arange(0, NB))[:, None] * 32 + tl.arange(0, 4)[None, :]
    live = N > 0
    m0, m8 = magic(0, live, True), magic(8, live, True)
    acc = zero_rows(M, BLOCK_N, NB)
    for _ in range(0, n_iter):
        words = split4(tl.load(qs)) + split4(tl.load(qs + 4))  # word i: elements 4i .. 4i + 3 of the block
        d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
        new = ()
        for m in tl.static_range(M):
            xrow = x_ptr + m * stride_xm
            s = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
            for i in tl.static_range(8):
                w = words[i]
                w16 = w >> 16
                xv = split4(x_vec(xrow, xk, 4 * i))
                s += field(w, 255, 0, m0, 128) * xv[0]
                s += field(w, 255, 8, m8, 128) * xv[1]
                s += field(w16, 255, 0, m0, 128) * xv[2]
                s += field(w16, 255, 8, m8, 128) * xv[3]
            new = new + (acc[m] + s * d,)
        acc = new
        qs += NB * 8
        dp += NB * b0
        xk += NB * 32
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _q4_0_kernel(
    x_ptr, base,  # pointers: activations [M, K], weight bytes
    part_ptr, out_ptr, count_ptr,  # store_rows': partials [SPLIT, M, N] f32, y [M, N] f32, arrival counts
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs
    N, K, blocks_per_split,  # sizes (blocks of 32)
    stride_xm,  # strides
    # meta: rows of x, rows per program, blocks per tile, programs along K
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
):
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 32, BLOCK_N, NB)
    qs, dp = block_planes(base, o0, r0, b0, o1, r1, r64, first, NB, 4)
    xk = (first + tl.arange(0, NB))[:, None] * 32 + tl.arange(0, 4)[None, :]
    mags = nibble_magics(N > 0)
    acc = zero_rows(M, BLOCK_N, NB)
    for _ in range(0, n_iter):
        words = split4(tl.load(qs))
        d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
        new = ()
        for m in tl.static_range(M):
            xrow = x_ptr + m * stride_xm
            s = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
            for i in tl.static_range(4):  # byte t of word i: low nibble element 4i + t, high 4i + t + 16
                w = words[i]
                w12 = w >> 12
                xl = split4(x_vec(xrow, xk, 4 * i))
                xh = split4(x_vec(xrow, xk, 4 * i + 16))
                for t in tl.static_range(4):
                    s += nibble(w, w12, 2 * t, mags, 8) * xl[t]
                    s += nibble(w, w12, 2 * t + 1, mags, 8) * xh[t]
            new = new + (acc[m] + s * d,)
        acc = new
        qs += NB * 4
        dp += NB * b0
        xk += NB * 32
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _q4_k_chunk(words, xrow, xk, mags, X_SUMS: tl.constexpr):
    """One 32-byte chunk of each group (its 8 word tensors): sums of q * x over the low and the high
    nibbles (two sub-blocks) [BLOCK_N, G], and (X_SUMS) the activation sums of those sub-blocks [1, G].
    Those add the split [1, G] tensors the products use: summing the [1, G, 4] vectors and reducing
    gave them a layout of their own (a second set of loads and shuffles in the SASS)."""
    lo = tl.zeros(words[0].shape, dtype=tl.float32)
    hi = tl.zeros(words[0].shape, dtype=tl.float32)
    xlo = tl.zeros([1, words[0].shape[1]], dtype=tl.float32)
    xhi = tl.zeros([1, words[0].shape[1]], dtype=tl.float32)
    for i in tl.static_range(8):  # byte t of word i is byte 4i + t of the chunk: elements 4i + t, + 32
        w = words[i]
        w12 = w >> 12
        xl = split4(x_vec(xrow, xk, 4 * i))
        xh = split4(x_vec(xrow, xk, 4 * i + 32))
        for t in tl.static_range(4):
            lo += nibble(w, w12, 2 * t, mags, 0) * xl[t]
            hi += nibble(w, w12, 2 * t + 1, mags, 0) * xh[t]
            if X_SUMS:
                xlo += xl[t]
                xhi += xh[t]
    return lo, hi, xlo, xhi


@triton.jit
def _q4_k_kernel(
    x_ptr, base,  # pointers: activations [M, K], weight bytes
    part_ptr, out_ptr, count_ptr,  # store_rows': partials [SPLIT, M, N] f32, y [M, N] f32, arrival counts
    xs_ptr,  # sums of x per 32 elements [M, K / 32] f32 (read when M > 1)
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): dm, scales, qs
    N, K, blocks_per_split,  # sizes (super-blocks of 256)
    stride_xm,  # strides
    # meta: rows of x, rows per program, super-blocks per tile, programs along K
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
):
    G: tl.constexpr = 2 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs, dm, sp, sb, j = q4_k_groups(base, o0, r0, b0, o1, r1, b1, o2, r2, r64, first, NB)
    xk = (sb * 256 + j * 64)[:, None] + tl.arange(0, 4)[None, :]
    xs = sb * 8 + 2 * j  # sub-block 2j in xs
    mags = nibble_magics(N > 0)
    # M = 1: each thread sums its activations (shared by its rows, 1 FADD per element / rows per thread);
    # more rows of x take the launcher's sums, which would cost as many FADDs as the products' FMAs
    X_SUMS: tl.constexpr = M == 1
    acc = zero_rows(M, BLOCK_N, G)
    for _ in range(0, n_iter):
        d = tl.load(dm.to(tl.pointer_type(tl.float16))).to(tl.float32)
        dmin = tl.load((dm + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
        a, sc_hi, b, m_hi = q4_k_scale_pairs(sp)
        # chunk j, then chunk j + 2; with M > 1 rolled: unrolled, Triton's compile time grows with loads x
        # ops of the loop body (tens of seconds at M = 8 when these kernels were written; not re-timed)
        new = acc
        for cc in tl.range(0, 2, loop_unroll_factor=2 if M == 1 else 1):
            words = split4(tl.load(qs + 16 * cc)) + split4(tl.load(qs + 16 * cc + 4))
            s_lo = (tl.where(cc == 0, a, sc_hi) & 63).to(tl.float32)
            s_hi = (tl.where(cc == 0, a >> 8, sc_hi >> 8) & 63).to(tl.float32)
            m_lo = (tl.where(cc == 0, b, m_hi) & 63).to(tl.float32)
            m_hi2 = (tl.where(cc == 0, b >> 8, m_hi >> 8) & 63).to(tl.float32)
            acc_c = ()
            for m in tl.static_range(M):
                lo, hi, xlo, xhi = _q4_k_chunk(words, x_ptr + m * stride_xm, xk + 128 * cc, mags, X_SUMS)
                if not X_SUMS:
                    xlo = tl.load(xs_ptr + m * (K // 32) + xs + 4 * cc)[None, :]
                    xhi = tl.load(xs_ptr + m * (K // 32) + xs + 4 * cc + 1)[None, :]
                acc_c = acc_c + (new[m] + d * (lo * s_lo + hi * s_hi) - dmin * (xlo * m_lo + xhi * m_hi2),)
            new = acc_c
        acc = new
        qs += NB * 32
        dm += NB * b0
        sp += NB * b1
        xk += NB * 256
        xs += NB * 8
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _q6_k_run(ql, qh, gm, xrow, xk, mags):
    """One ql run (4 word tensors) with the group's qh words: sums of (q - 32) * x over the low nibbles
    (sub-block gm of the quarter) and over the high nibbles (gm + 2), [BLOCK_N, G] each. xk is that of
    the run (32 gm added)."""
    lo = tl.zeros(ql[0].shape, dtype=tl.float32)
    hi = tl.zeros(ql[0].shape, dtype=tl.float32)
    for i in tl.static_range(4):
        # combined words: byte t = ql nibble in bits 0..3, its qh pair in 4..5 (6, 7 are masked off later)
        lo_w = (ql[i] & 0x0F0F0F0F) | ((qh[i] << (4 - 2 * gm)) & ~0x0F0F0F0F)
        hi_w = ((ql[i] >> 4) & 0x0F0F0F0F) | ((qh[i] >> (2 * gm)) & ~0x0F0F0F0F)
        xl = split4(x_vec(xrow, xk, 4 * i))
        xh = split4(x_vec(xrow, xk, 4 * i + 64))
        lo += field(lo_w, 63, 0, mags[0], 32) * xl[0]
        hi += field(hi_w, 63, 0, mags[0], 32) * xh[0]
        lo += field(lo_w, 63, 8, mags[2], 32) * xl[1]
        hi += field(hi_w, 63, 8, mags[2], 32) * xh[1]
        lo += field(lo_w, 63, 16, mags[4], 32) * xl[2]
        hi += field(hi_w, 63, 16, mags[4], 32) * xh[2]
        lo += field(lo_w >> 8, 63, 16, mags[4], 32) * xl[3]
        hi += field(hi_w >> 8, 63, 16, mags[4], 32) * xh[3]
    return lo, hi


@triton.jit
def _q6_k_kernel(
    x_ptr, base,  # pointers: activations [M, K], weight bytes
    part_ptr, out_ptr, count_ptr,  # store_rows': partials [SPLIT, M, N] f32, y [M, N] f32, arrival counts
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): ql, qh, scales, d
    N, K, blocks_per_split,  # sizes (super-blocks of 256)
    stride_xm,  # strides
    # meta: rows of x, rows per program, super-blocks per tile, programs along K
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
):
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qh_p, ql_p, sp, dp, sb, h, l4 = q6_k_groups(base, o0, r0, o1, r1, o2, r2, b2, o3, r3, b3, r64, first, NB)
    xk = (sb * 256 + h * 128 + l4 * 16)[:, None] + tl.arange(0, 4)[None, :]
    mags = nibble_magics(N > 0)
    acc = zero_rows(M, BLOCK_N, G)
    for _ in range(0, n_iter):
        qh = split4(tl.load(qh_p))
        d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
        scales = q6_k_scales(sp, l4)
        new = acc
        # the two ql runs; with M > 1 rolled (see _q4_k_kernel)
        for gm in tl.range(0, 2, loop_unroll_factor=2 if M == 1 else 1):
            ql = split4(tl.load(ql_p + 8 * gm))
            sc_lo = tl.where(gm == 0, scales[0], scales[1]).to(tl.float32)  # sub-block 2gm + ..
            sc_hi = tl.where(gm == 0, scales[2], scales[3]).to(tl.float32)  # 2gm + 4 + ..
            acc_g = ()
            for m in tl.static_range(M):
                lo, hi = _q6_k_run(ql, qh, gm, x_ptr + m * stride_xm, xk + 32 * gm, mags)
                acc_g = acc_g + (new[m] + d * (lo * sc_lo + hi * sc_hi),)
            new = acc_g
        acc = new
        qh_p += NB * 16
        ql_p += NB * 32
        sp += NB * b2
        dp += NB * b3
        xk += NB * 256
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


_KERNELS = {Q8_0: _q8_0_kernel, Q4_0: _q4_0_kernel, Q4_K: _q4_k_kernel, Q6_K: _q6_k_kernel}
# type id -> (elements per block, groups per block, bytes one group loads per row and tile): the word-tile
# geometry the launch rule sizes tiles from, for these kernels and matvec_int8's (IQ4_NL and MXFP4 have
# Q4_0's blocks: 16 quant bytes, one group)
GEOMETRY = {Q8_0: (32, 1, 32), Q4_0: (32, 1, 16), IQ4_NL: (32, 1, 16), MXFP4: (32, 1, 16), Q4_K: (256, 2, 64),
            Q6_K: (256, 4, 48)}
SUPPORTED = frozenset(_KERNELS)

# The fixed rule (untimed; `candidates` is what a sweep decides among):
# - groups per tile: 16 for Q4_0, 8 for the others, so a row's tile is 256-512 bytes. With 4 warps G stays
#   below 32: an activation tensor [G, 4] of 128 elements or more counts as expensive to re-materialise
#   in Triton's layout pass, and the kernels then converted it through shared memory on every load.
# - rows per thread: 4 (its activation vectors serve 4 rows); 2 for the K-quants at M > 1, which at 4
#   spilled registers on sm_90 when these kernels were written (ptxas output; not re-checked since).
# - 4 warps; a wave64 target (gfx906) puts twice the rows in a warp, so block_n doubles there.
# - split K while a SM's rows (N * split / SMs) times the bytes of a tile row stay under 24 KiB in flight
#   (a SM's share of 4.25 TB/s for ~1 us of latency is ~32 KB) and every split keeps 2 tiles.
_WARPS, _IN_FLIGHT = 4, 24 * 1024


def groups_per_block(type_id: int) -> int:
    """16-byte groups one block of the type holds in a tile row (a thread's unit of work)."""
    return GEOMETRY[type_id][1]


def rule(type_id: int, n: int, k: int, m: int, sm_count: int, warp_size: int = 32) -> dict[str, int]:
    qk, _, bpg = GEOMETRY[type_id]
    groups = 16 if bpg == 16 else 8
    rows = 2 if qk == 256 and m > 1 else 4
    return _config(type_id, n, k, groups, rows, _WARPS, warp_size, sm_count)


def candidates(type_id: int, n: int, k: int, m: int, sm_count: int, warp_size: int = 32) -> list[dict[str, int]]:
    """The rule and its neighbours, one knob each: split-K doubled and halved; at M = 1 also the other
    group count, half and (legacy types) twice the rows per thread, and 8 warps. At M > 1 only split-K
    varies for the K-quants: each of their M = 8 kernels takes Triton many seconds to compile."""
    base = rule(type_id, n, k, m, sm_count, warp_size)
    qk, gpb, bpg = GEOMETRY[type_id]
    groups = base["nb"] * 32 // qk * gpb
    rows = base["block_n"] * groups // (warp_size * base["num_warps"])
    out = [base, {**base, "split_k": base["split_k"] * 2}]
    if base["split_k"] > 1:
        out.append({**base, "split_k": base["split_k"] // 2})
    variants = []  # (groups, rows per thread, warps)
    if m == 1:
        variants = [(24 - groups, rows, _WARPS), (groups, rows // 2, _WARPS), (groups, rows, 2 * _WARPS)]
        if qk == 32:
            variants.append((groups, 2 * rows, _WARPS))
    elif qk == 32:
        variants.append((groups, rows // 2, _WARPS))
    out += [_config(type_id, n, k, g, r, w, warp_size, sm_count) for g, r, w in variants if r >= 1]
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in out)]


def flat_params(w: PackedWeight, m: int, tuning: Tuning | None = None, op: str = "matvec_flat") -> dict[str, int]:
    """Launch parameters from the tuning file's `op` entry (keyed like "matvec"), over the rule (which
    the word-tile kernels share: matvec_int8 loads the same tiles) for the parameters it leaves out."""
    found = (tuning or load_tuning()).measured(op, w.type_name, w.n, w.k, m) or {}
    if w.data.device.type == "cuda":
        props = torch.cuda.get_device_properties(w.data.device)
        base = rule(w.type_id, w.n, w.k, m, props.multi_processor_count, getattr(props, "warp_size", 32))
    else:
        base = rule(w.type_id, w.n, w.k, m, 132)
    return {**base, **found}


@dataclass(frozen=True)
class Launch:
    """A word-tile mat-vec's launch: parameters, super-blocks (or blocks) per tile, per K split, splits."""

    params: dict[str, int]
    per_tile: int
    per_split: int
    split: int

    def grid(self, n: int) -> tuple[int, int]:
        return triton.cdiv(n, self.params["block_n"]), self.split

    def outputs(self, m: int, n: int, device: torch.device,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The store_rows arguments: partials [split, m, n] (unused at split 1), y [m, n], arrival counts.
        `out`: y given, f32 [m, n] whose rows lie as store_rows writes them (row stride n; any stride
        between rows when m is 1, e.g. a column slice of a wider output)."""
        if out is None:
            y = torch.empty(m, n, dtype=torch.float32, device=device)
        elif (out.shape != (m, n) or out.dtype != torch.float32 or out.device != device
              or out.stride(1) != 1 or (m > 1 and out.stride(0) != n)):
            raise ValueError(f"out must be f32 [{m}, {n}] on {device} with rows of unit stride, {n} apart; got "
                             f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
        else:
            y = out
        if self.split == 1:
            return y, y, y
        part = torch.empty(self.split, m, n, dtype=torch.float32, device=device)
        return part, y, arrival_counts(device, self.grid(n)[0])


_COUNTS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, at least n, that split-K programs count into and leave at zero (store_rows). One
    buffer per device, grown and never freed: a captured graph keeps the address it was captured with."""
    held = _COUNTS.setdefault(torch.device(device), [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return held[-1]


def plan_launch(op: str, x: torch.Tensor, w: PackedWeight, supported: frozenset[int],
                given: dict[str, int | None]) -> Launch:
    """The checks and the K split of `op` (matvec_flat, matvec_int8) for x [M, K] on w; parameters not
    `given` come from `flat_params` under the tuning key `op`."""
    M, K = x.shape
    if K != w.k or not 1 <= M <= 8:
        raise ValueError(f"{op} takes 1..8 rows of K={w.k}; got x {tuple(x.shape)}")
    if w.type_id not in supported:
        raise ValueError(f"{op} has no kernel for {w.type_name}")
    if not w.repacked:
        raise ValueError(f"{op} reads 16-byte words: the repacked layout (layout.repack) only")
    p = dict(given)
    if None in p.values():
        p = {**flat_params(w, M, op=op), **{key: v for key, v in p.items() if v is not None}}
    if p["block_n"] < 8 or p["block_n"] & (p["block_n"] - 1):
        # BLOCK_N 2 and 4 gave wrong sums in matmul.matvec on an H200 (docs/PERF.md, 2026-12-02)
        raise ValueError(f"block_n must be a power of two >= 8, got {p['block_n']}")
    return launch_for(w.type_id, K, p)


def launch_for(type_id: int, k: int, params: dict[str, int]) -> Launch:
    """The K split of rows of k with these parameters: the tile kernel's (matmul.matvec_tiles), whose
    tiles these word-tile kernels share."""
    return Launch(params, *matvec_tiles(type_id, k, params["nb"], params.get("split_k", 1)))


def matvec_flat(x: torch.Tensor, w: PackedWeight, block_n: int | None = None, nb: int | None = None,
                split_k: int | None = None, num_warps: int | None = None, num_stages: int = 1) -> torch.Tensor:
    """x [M <= 8, K] (f32/bf16/f16) -> y [M, N] f32, as matmul.matvec; W in the repacked layout. nb counts
    32-element units (whole super-blocks for K-quants); unset parameters come from `flat_params`."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"activations must be f32, f16 or bf16, got {x.dtype}")
    plan = plan_launch("matvec_flat", x, w, SUPPORTED,
                       {"block_n": block_n, "nb": nb, "split_k": split_k, "num_warps": num_warps})
    M, K = x.shape
    x = x.contiguous()
    part, y, counts = plan.outputs(M, w.n, x.device)
    xs = ()
    if w.type_id == Q4_K:  # activation sums per 32 elements (read by the kernel when M > 1)
        xs = (x.float().view(M, K // 32, 32).sum(-1) if M > 1 else x,)
    _KERNELS[w.type_id][plan.grid(w.n)](
        x, w.data, part, y, counts, *xs, *w.field_args(), w.n, K, plan.per_split, x.stride(0),
        M=M, BLOCK_N=plan.params["block_n"], NB=plan.per_tile, SPLIT=plan.split,
        num_warps=plan.params["num_warps"], num_stages=num_stages,
    )
    return y


def _config(type_id: int, n: int, k: int, groups: int, rows: int, warps: int, warp_size: int,
            sm_count: int) -> dict[str, int]:
    """Launch parameters for `groups` per tile and `rows` per thread, with the split-K of the rule."""
    qk, gpb, bpg = GEOMETRY[type_id]
    blocks = divisor_at_most(k // qk, max(1, groups // gpb))
    groups = blocks * gpb
    block_n = max(8, min(256, rows * warp_size * warps // groups))
    iters = (k // qk) // blocks
    split = 1
    while n * split * groups * bpg < _IN_FLIGHT * sm_count and iters // (2 * split) >= 2:
        split *= 2
    return {"block_n": block_n, "nb": blocks * qk // 32, "num_warps": warps, "split_k": split}

