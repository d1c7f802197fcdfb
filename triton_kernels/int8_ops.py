"""The integer instructions the int8-dot kernels share (matvec_int8.py, matvec_mma.py): `dot4`, four
signed-byte products a lane (dp4a on NVIDIA, v_dot4_i32_i8 on AMD), `byte_permute` (prmt, v_perm_b32)
and `lookup16`, a word of 8 nibbles made two words of a 16-entry table's int8 levels (IQ4_NL, MXFP4);
each with the integer emulation that the interpreter (and a CPU tensor) runs, which the tests compare
with the instructions where a GPU is. And the loop pieces the dp4a kernels of matvec_int8.py and
matvec_pieces.py share: a tile pointer's step (`advance`), the sums of a tile's low and high codes
(`low_high_sums`) and their exact int-to-float (`exact_f32`)."""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels.quants.iq4_nl import LEVELS as IQ4_NL_LEVELS
from vegaserve.triton_kernels.quants.mxfp4 import DOUBLED_E2M1

EMULATE, PTX_DP4A, AMDGCN_DOT4 = 0, 1, 2


def _table_words(levels: tuple[int, ...]) -> tl.constexpr:
    """16 int8 levels as four little-endian int32 words (bytes 4i .. 4i + 3 in word i)."""
    return tl.constexpr(tuple(int.from_bytes(bytes(v & 0xFF for v in levels[4 * i : 4 * i + 4]), "little", signed=True)
                              for i in range(4)))


IQ4_NL_WORDS = _table_words(IQ4_NL_LEVELS)
MXFP4_WORDS = _table_words(DOUBLED_E2M1)


@triton.jit
def dot4(a, b, acc, DOT: tl.constexpr):
    """acc + the sum of the products of the four signed bytes of a and b (int32 tensors)."""
    if DOT == 1:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    elif DOT == 2:
        return tl.inline_asm_elementwise("v_dot4_i32_i8 $0, $1, $2, $3", "=v,v,v,v", [a, b, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # (without the interpreter's overflow checks: signed byte products summed over any row we serve stay
        # far inside an int32; the checks were a third of the int8 tests' time)
        for t in tl.static_range(4):
            prod = tl.mul((a << (24 - 8 * t)) >> 24, (b << (24 - 8 * t)) >> 24, sanitize_overflow=False)
            acc = tl.add(acc, prod, sanitize_overflow=False)
        return acc


@triton.jit
def byte_permute(a, b, sel, STRIDE: tl.constexpr, DOT: tl.constexpr):
    """Byte k of the result is byte (sel >> STRIDE k) & 7 of {b, a} (a bytes 0-3, b 4-7). STRIDE 4: nibble
    selectors, PTX prmt.b32 (default mode) on NVIDIA; 8: byte selectors, v_perm_b32 on AMD. Selectors
    here are 0-7 only (prmt's bit 3 replicates a sign, v_perm's 8 and up select constants), so the integer
    emulation, which runs wherever the instruction is not (the interpreter tests both through it), leaves
    those out."""
    if DOT == 1 and STRIDE == 4:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel + tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    elif DOT == 2 and STRIDE == 8:
        return tl.inline_asm_elementwise("v_perm_b32 $0, $1, $2, $3", "=v,v,v,v", [b, a, sel + tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the four bytes at once: {b, a} as one int64, each selector's byte shifted down, then into place
        both = (b.to(tl.int64) << 32) | (a.to(tl.int64) & 0xFFFFFFFF)
        k = tl.arange(0, 4)
        s = (tl.expand_dims(sel + tl.zeros_like(a), len(a.shape)) >> (STRIDE * k)) & 7
        byte = (tl.expand_dims(both, len(a.shape)) >> (s.to(tl.int64) << 3)) & 0xFF
        return tl.sum(byte << (8 * k).to(tl.int64), axis=len(a.shape)).to(tl.int32)


@triton.jit
def lookup16(q, TABLE: tl.constexpr, DOT: tl.constexpr, BYTE_SELECT: tl.constexpr = -1,
             PAIRS: tl.constexpr = False):
    """A word of 8 nibbles (byte t: low nibble and high nibble) -> the table's int8 levels of the low nibbles
    of bytes 0..3 and of the high ones, two words. Nibble k (of the low 16 bits, then of the high) picks its
    byte from table words 0-1 or 2-3 by its low 3 bits, and bit 3 chooses between the two picks. TABLE: 1
    IQ4_NL's levels, 2 MXFP4's. BYTE_SELECT (default: on AMD only) takes AMD's byte-selector permute:
    the low nibbles of the four bytes select at once (q & 0x07070707 is four byte selectors), then the
    high ones, in 6 permutes and no final interleave; NVIDIA's prmt takes nibble selectors (8 permutes).
    PAIRS (the nibble-selector scheme): the words as the permutes leave them, before the final interleave,
    bytes (0 low, 0 high, 1 low, 1 high) then (2 low, 2 high, 3 low, 3 high), for a caller that puts its
    other operand in that order (pairs_order) once for several of these (6 permutes a word)."""
    WORDS: tl.constexpr = IQ4_NL_WORDS if TABLE == 1 else MXFP4_WORDS
    live = q == q  # the table in registers, not immediates (see flat_words.magic)
    t0 = tl.where(live, WORDS[0], 0)
    t1 = tl.where(live, WORDS[1], 0)
    t2 = tl.where(live, WORDS[2], 0)
    t3 = tl.where(live, WORDS[3], 0)
    if BYTE_SELECT == 1 or (BYTE_SELECT == -1 and DOT == 2):
        lo_idx = q & 0x07070707  # byte t: the low 3 bits of its low nibble
        hi_idx = (q >> 4) & 0x07070707  # of its high nibble
        lo_sel = ((q >> 1) & 0x04040404) | 0x03020100  # byte t: t, + 4 where its low nibble has bit 3
        hi_sel = ((q >> 5) & 0x04040404) | 0x03020100
        lo = byte_permute(byte_permute(t0, t1, lo_idx, 8, DOT), byte_permute(t2, t3, lo_idx, 8, DOT), lo_sel, 8, DOT)
        hi = byte_permute(byte_permute(t0, t1, hi_idx, 8, DOT), byte_permute(t2, t3, hi_idx, 8, DOT), hi_sel, 8, DOT)
        return lo, hi
    idx = q & 0x77777777
    sel = ((q >> 1) & 0x44444444) | 0x32103210  # nibble k: k % 4, + 4 where nibble k of q has bit 3
    # a nibble-selector permute reads the low 16 bits of its selector only: no masks for the high halves
    x0 = byte_permute(byte_permute(t0, t1, idx, 4, DOT), byte_permute(t2, t3, idx, 4, DOT), sel, 4, DOT)
    x1 = byte_permute(byte_permute(t0, t1, idx >> 16, 4, DOT), byte_permute(t2, t3, idx >> 16, 4, DOT),
                      sel >> 16, 4, DOT)
    if PAIRS:
        return x0, x1
    return byte_permute(x0, x1, 0x6420, 4, DOT), byte_permute(x0, x1, 0x7531, 4, DOT)


@triton.jit
def pairs_order(lo, hi, DOT: tl.constexpr):
    """Words lo (bytes a0..a3) and hi (b0..b3) as lookup16's PAIRS order: (a0, b0, a1, b1), (a2, b2, a3, b3)."""
    return byte_permute(lo, hi, 0x5140, 4, DOT), byte_permute(lo, hi, 0x7362, 4, DOT)


@triton.jit
def minus_32(code):
    """Four six-bit codes (bytes 0..63) as the signed bytes code - 32 (0x80808080 as an int32)."""
    return (code + 0x60606060) ^ -0x7F7F7F80


@triton.jit
def advance(more, step, CARRY: tl.constexpr):
    """The step a tile pointer takes to the next tile. CARRY (the next tile is loaded at the end of an
    iteration and carried into the next): 0 after the last tile, whose extra load then reloads it (a cache
    hit) instead of reading past the split's end. Else each iteration loads its own tile first."""
    if CARRY:
        return tl.where(more, step, 0)
    else:
        return step


@triton.jit
def low_high_sums(lo, hi, xl, xh, BLOCK_N: tl.constexpr, G: tl.constexpr, DOT: tl.constexpr,
                  EXACT_ADD: tl.constexpr = False):
    """The integer sums of four words of low codes and four of high codes against their activation words
    ([BLOCK_N, G] each; the activations [1, G] broadcast over the rows), as f32 (exact_f32)."""
    s_lo = tl.zeros([BLOCK_N, G], dtype=tl.int32)
    s_hi = tl.zeros([BLOCK_N, G], dtype=tl.int32)
    for i in tl.static_range(4):
        s_lo = dot4(lo[i], xl[i], s_lo, DOT)
        s_hi = dot4(hi[i], xh[i], s_hi, DOT)
    return exact_f32(s_lo, EXACT_ADD), exact_f32(s_hi, EXACT_ADD)


@triton.jit
def exact_f32(s, EXACT_ADD: tl.constexpr):
    """int32 s (|s| < 2^22) as f32: a conversion, or (EXACT_ADD) an integer add into the mantissa of 1.5 *
    2^23 and a float subtract, both full-rate where the conversion is a quarter-rate instruction."""
    if EXACT_ADD:
        return (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    else:
        return s.to(tl.float32)
