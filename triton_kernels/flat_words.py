"""Word-tile pieces of the int8 decode mat-vecs (matvec_int8.py, matvec_pieces.py): quant bytes loaded as
int32 words, 16 bytes a thread, and the program's rows, K split and split-K store.

Layout of a tile: [BLOCK_N, G, 4] int32 words, G groups of 4 words (16 bytes, one thread's vector load)
along a row, split at once into 4 word tensors [BLOCK_N, G] (the 4 words are in one thread's registers).
Pointers are built rows-first (`word_ptrs`) so that Triton's coalescing gives the lanes of a warp to the
groups first, then to rows; or, FLAT, as one contiguous run per row (`row_runs`), which puts the lanes
along the row.

`field` makes a field of a word an exact float32 in place, without a shift or an int-to-float conversion:
a field of `width` bits at bit S (S + width <= 23) XORed into the bits of 2^(23 - S) is the float
2^(23 - S) + field; subtracting 2^(23 - S) + bias leaves field - bias, exactly (one LOP3 and one FADD).
A signed byte also flips its top bit in the same LOP3 (the magic carries it), reading q + 128.
"""

import triton
import triton.language as tl


@triton.jit
def magic(S: tl.constexpr, live, SIGNED: tl.constexpr):
    """Bits of 2^(23 - S) (SIGNED: with bit S + 7 set, which flips an int8 field's sign bit). Built from a
    run-time value: ptxas re-materialised an immediate before every LOP3 that needed it (a MOV each, seen
    in the sm_90 SASS when this was written), while a computed value stays in a register."""
    bits = (150 - S) << 23
    if SIGNED:
        bits = bits | (128 << S)
    return tl.where(live, bits, 0)


@triton.jit
def field(src, MASK: tl.constexpr, S: tl.constexpr, mag, BIAS: tl.constexpr):
    """(src >> S) & MASK minus BIAS as an exact float32 (with a SIGNED magic: the field as int8)."""
    return ((src & (MASK << S)) ^ mag).to(tl.float32, bitcast=True) - ((1 << (23 - S)) + BIAS)


@triton.jit
def split4(v):
    """The 4 slices of v [A, B, 4] along its last axis, which is in-thread (no data moves): [A, B] each."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def x_words(xrow, xw, OFF: tl.constexpr):
    """Four int32 words of q8_1 activations per group at word xw + OFF: [1, G] each (one 16-byte load)."""
    return split4(tl.load(xrow + xw + OFF)[None, :, :])


@triton.jit
def word_ptrs(base, off, rs, r64):
    """int32 pointers to the first word of each row of a plane, [BLOCK_N, 1, 1]; add [1, G, 4] word offsets."""
    return (base + off + r64[:, None, None] * rs).to(tl.pointer_type(tl.int32))


@triton.jit
def row_runs(base, off, rs, r64, start, LENGTH: tl.constexpr, PTR: tl.constexpr):
    """Pointers (element type PTR) to LENGTH consecutive elements of each row of a plane from element
    `start`, [BLOCK_N, LENGTH]: one contiguous run per row, which Triton's coalescing lays along the row
    (see block_planes' FLAT)."""
    return (base + off + r64[:, None] * rs).to(tl.pointer_type(PTR)) + (start + tl.arange(0, LENGTH))[None, :]


@triton.jit
def program_rows(N, blocks_per_split, n_blocks, BLOCK_N: tl.constexpr, PER_TILE: tl.constexpr):
    """This program's rows (for the store), rows clamped to N - 1 in int64 (for loads), first block of its
    K split and the number of tiles in it."""
    return program_rows_at(tl.program_id(0), tl.program_id(1), N, blocks_per_split, n_blocks, BLOCK_N,
                           PER_TILE)


@triton.jit
def program_rows_at(pn, pk, N, blocks_per_split, n_blocks, BLOCK_N: tl.constexpr, PER_TILE: tl.constexpr):
    """program_rows of the program at (pn, pk) of a [row tiles, K splits] grid."""
    rows = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    first = pk * blocks_per_split
    n_iter = (tl.minimum(first + blocks_per_split, n_blocks) - first) // PER_TILE
    return rows, tl.minimum(rows, N - 1).to(tl.int64), first, n_iter


@triton.jit
def expert_program(ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K,
                   XDIV: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """An expert mat-vec program's operands (program_id(2) = assignment a, one row of x): expert ids[a]'s
    bytes (layout.stack_experts), row a // XDIV of x's q8_1 form, row a of y [A, N], its partials
    [A, SPLIT, N] and arrival counts [A, row tiles]."""
    a = tl.program_id(2)
    base += tl.load(ids_ptr + a).to(tl.int64) * expert_bytes
    row = a // XDIV
    tiles = tl.cdiv(N, BLOCK_N)
    return (base, xq_ptr + row * (K // 4), dx_ptr + row * (K // 32), sx_ptr + row * (K // 32),
            part_ptr + a * SPLIT * N, out_ptr + a * N, count_ptr + a * tiles)


@triton.jit
def zero_rows(M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """One [BLOCK_N, G] f32 accumulator per activation row."""
    acc = ()
    for _ in tl.static_range(M):
        acc = acc + (tl.zeros([BLOCK_N, G], dtype=tl.float32),)
    return acc


@triton.jit
def store_rows(part_ptr, out_ptr, count_ptr, acc, M: tl.constexpr, N, rows, SPLIT: tl.constexpr):
    """Rows `rows` of y [M, N], the group axis of each accumulator reduced once (store_split)."""
    store_rows_at(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT, tl.program_id(0), tl.program_id(1))


@triton.jit
def store_rows_at(part_ptr, out_ptr, count_ptr, acc, M: tl.constexpr, N, rows, SPLIT: tl.constexpr, pn, pk):
    """store_rows of the program at (pn, pk) (program_rows_at)."""
    values = ()
    index = ()
    live = ()
    for m in tl.static_range(M):
        values = values + (tl.sum(acc[m], axis=1),)
        index = index + (m * N + rows,)
        live = live + (rows < N,)
    store_split_at(part_ptr, out_ptr, count_ptr, values, index, live, M * N, SPLIT, pn, pk)


@triton.jit
def store_split(part_ptr, out_ptr, count_ptr, values, index, live, MN, SPLIT: tl.constexpr):
    """values[i] to y's elements index[i] (m * N + n of y [M, N], MN = M N) where live[i]. With SPLIT > 1
    programs along K, each stores its partial (part [SPLIT, M, N]) and counts itself in
    count_ptr[program_id(0)]; the last of the SPLIT to arrive sums the partials in split order (the same
    sum whatever the order of arrival) into y and sets the count back to 0 for the next launch. No second
    launch for the sum."""
    store_split_at(part_ptr, out_ptr, count_ptr, values, index, live, MN, SPLIT, tl.program_id(0),
                   tl.program_id(1))


@triton.jit
def store_split_at(part_ptr, out_ptr, count_ptr, values, index, live, MN, SPLIT: tl.constexpr, pn, pk):
    """store_split of the program at (pn, pk): row tile pn counts in count_ptr[pn], split pk stores its
    partial at part[pk]."""
    if SPLIT == 1:
        for i in tl.static_range(len(values)):
            tl.store(out_ptr + index[i], values[i], mask=live[i])
    else:
        for i in tl.static_range(len(values)):
            tl.store(part_ptr + pk * MN + index[i], values[i], mask=live[i])
        tl.debug_barrier()  # every thread's partial is written before the count is taken (release, GPU scope)
        arrived = tl.atomic_add(count_ptr + pn, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            for i in tl.static_range(len(values)):
                total = tl.load(part_ptr + index[i], mask=live[i], cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):  # .cg: from L2, where the other programs' stores are
                    total += tl.load(part_ptr + s * MN + index[i], mask=live[i], cache_modifier=".cg")
                tl.store(out_ptr + index[i], total, mask=live[i])
            tl.atomic_xchg(count_ptr + pn, 0)


@triton.jit
def block_planes(base, o_d, r_d, b_d, o_q, r_q, r64, first, NB: tl.constexpr, WORDS: tl.constexpr,
                 FLAT: tl.constexpr = 0):
    """Blocks first .. first + NB - 1 of a 32-element type with one f16 scale: int32 pointers to each
    block's first 4 quant words [BLOCK_N, NB, 4] (WORDS words a block) and byte pointers to its scale
    [BLOCK_N, NB]. The scale's block stride b_d stays a run-time value: with it Triton sees no contiguity
    in that load and lays it out like the word tile's groups; with the constant 2 it chose a vector load
    and converted the result through shared memory (barriers in every iteration).
    FLAT: the quant pointers as [BLOCK_N, NB * WORDS] instead, each row's words of the tile one contiguous
    run. Triton's coalescing orders a load's axes by contiguity; the 3-D form's block and row axes tie at
    1, and Triton 3.6 gives the lanes of a warp to 16 rows first (16 cache lines per load instruction on
    an H200, L1-bound), while the 2-D form's contiguity puts them along the row."""
    g = tl.arange(0, NB)
    if FLAT:  # [BLOCK_N, NB * WORDS]: one contiguous run per row, so the lanes of a warp go along it
        qs = row_runs(base, o_q, r_q, r64, first * WORDS, NB * WORDS, tl.int32)
    else:
        qs = word_ptrs(base, o_q, r_q, r64) + ((first + g) * WORDS)[None, :, None] + tl.arange(0, 4)[None, None, :]
    return qs, base + o_d + r64[:, None] * r_d + (first + g)[None, :] * b_d


@triton.jit
def q4_k_groups(base, o0, r0, b0, o1, r1, b1, o2, r2, r64, first, NB: tl.constexpr):
    """The Q4_K tile's groups (super-block sb, j = 0 or 1: chunks j and j + 2) from super-block `first`:
    int32 pointers to chunk j's first half [BLOCK_N, G, 4] (+ 4 words its second half, + 16 and + 20 those
    of chunk j + 2), byte pointers to d (f16; dmin at + 2) and to scale bytes 2j, 2j + 1 (+ 4, + 8)
    [BLOCK_N, G], and sb, j [G]."""
    g = tl.arange(0, 2 * NB)
    sb = first + g // 2
    j = g % 2
    qs = word_ptrs(base, o2, r2, r64) + (sb * 32 + j * 8)[None, :, None] + tl.arange(0, 4)[None, None, :]
    dm = base + o0 + r64[:, None] * r0 + sb[None, :] * b0
    sp = base + o1 + r64[:, None] * r1 + (sb * b1 + 2 * j)[None, :]
    return qs, dm, sp, sb, j


@triton.jit
def q6_k_groups(base, o0, r0, o1, r1, o2, r2, b2, o3, r3, b3, r64, first, NB: tl.constexpr):
    """The Q6_K tile's groups (super-block sb, half h, quarter l4 of the half's 32 qh bytes) from
    super-block `first`: int32 pointers to the group's qh run and first ql run [BLOCK_N, G, 4] (+ 8
    words the second), byte pointers to the scale of sub-block 8h + l4 (+ 2 gm + 4 gh) and to d
    [BLOCK_N, G], and sb, h, l4 [G]. b2 (16) and b3 stay run-time values: see block_planes."""
    g = tl.arange(0, 4 * NB)
    i4 = tl.arange(0, 4)
    sb = first + g // 4
    h = (g // 2) % 2
    l4 = g % 2
    qh_p = word_ptrs(base, o1, r1, r64) + (sb * 16 + h * 8 + l4 * 4)[None, :, None] + i4[None, None, :]
    ql_p = word_ptrs(base, o0, r0, r64) + (sb * 32 + h * 16 + l4 * 4)[None, :, None] + i4[None, None, :]
    sp = base + o2 + r64[:, None] * r2 + (sb * b2 + h * 8 + l4 * (b2 // 16))[None, :]
    dp = base + o3 + r64[:, None] * r3 + sb[None, :] * b3
    return qh_p, ql_p, sp, dp, sb, h, l4


@triton.jit
def q3_k_groups(base, o0, r0, o1, r1, o2, r2, b2, o3, r3, b3, r64, first, NB: tl.constexpr):
    """The Q3_K tile's groups (super-block sb, half n, sub = 0 or 1) from super-block `first`: int32
    pointers to the group's 16 qs bytes 32n + 16 sub .. and to the 16 hmask bytes 16 sub .. it shares with
    the other half [BLOCK_N, G, 4], int32 pointers to the super-block's 12 scale bytes (3 words) and byte
    pointers to d [BLOCK_N, G], and sb, n, sub [G]. b2 (12) and b3 stay run-time values: see block_planes."""
    g = tl.arange(0, 4 * NB)
    i4 = tl.arange(0, 4)
    sb = first + g // 4
    n = (g // 2) % 2
    sub = g % 2
    hm_p = word_ptrs(base, o0, r0, r64) + (sb * 8 + sub * 4)[None, :, None] + i4[None, None, :]
    qs_p = word_ptrs(base, o1, r1, r64) + (sb * 16 + n * 8 + sub * 4)[None, :, None] + i4[None, None, :]
    sp = (base + o2 + r64[:, None] * r2 + (sb * b2)[None, :]).to(tl.pointer_type(tl.int32))
    dp = base + o3 + r64[:, None] * r3 + sb[None, :] * b3
    return hm_p, qs_p, sp, dp, sb, n, sub


@triton.jit
def q2_k_groups(base, o0, r0, b0, o1, r1, o2, r2, b2, r64, first, NB: tl.constexpr):
    """The Q2_K tile's groups (super-block sb, half n, sub = 0 or 1) from super-block `first`: int32
    pointers to the group's 16 qs bytes 32n + 16 sub .. [BLOCK_N, G, 4] and to scale bytes 8n .. 8n + 7 (2
    words), byte pointers to d (f16; dmin at + 2) [BLOCK_N, G], and sb, n, sub [G]. b0 (16) and b2 stay
    run-time values: see block_planes."""
    g = tl.arange(0, 4 * NB)
    sb = first + g // 4
    n = (g // 2) % 2
    sub = g % 2
    qs_p = word_ptrs(base, o1, r1, r64) + (sb * 16 + n * 8 + sub * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    sp = (base + o0 + r64[:, None] * r0 + (sb * b0 + n * 8)[None, :]).to(tl.pointer_type(tl.int32))
    dm = base + o2 + r64[:, None] * r2 + sb[None, :] * b2
    return qs_p, sp, dm, sb, n, sub


@triton.jit
def quarter_groups(base, o_d, r_d, b_d, o_q, r_q, r64, first, NB: tl.constexpr):
    """A 256-element type's groups of 64 elements (super-block sb, quarter q) whose quants are 16 bytes a
    quarter (IQ2_XXS: sub-blocks 2q and 2q + 1, 8 bytes each) from super-block `first`: int32 pointers to
    the group's 4 quant words [BLOCK_N, G, 4], byte pointers to the super-block's f16 d [BLOCK_N, G], and
    sb, q [G]. b_d stays a run-time value: see block_planes."""
    g = tl.arange(0, 4 * NB)
    sb = first + g // 4
    q = g % 4
    qs_p = word_ptrs(base, o_q, r_q, r64) + (sb * 16 + q * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    dp = base + o_d + r64[:, None] * r_d + sb[None, :] * b_d
    return qs_p, dp, sb, q


@triton.jit
def q6_k_scales(sp, l4):
    """The four signed scales of a Q6_K group, sub-blocks 8h + l4 + 2c for c = 0..3 (sp from q6_k_groups,
    at c = 0), as int32 [BLOCK_N, G]: two aligned word loads of scale bytes 8h .. 8h + 7 instead of four
    byte loads, each scale sign-extended from its byte."""
    w = (sp - l4[None, :]).to(tl.pointer_type(tl.int32))
    lo = tl.load(w) >> (8 * l4)[None, :]  # bytes l4 and l4 + 2 at bits 0 and 16
    hi = tl.load(w + 1) >> (8 * l4)[None, :]
    return (lo << 24) >> 24, (lo << 8) >> 24, (hi << 24) >> 24, (hi << 8) >> 24


@triton.jit
def q4_k_scale_words(sp):
    """The three 16-bit loads q4_k_scale_decode decodes (sp: scale byte 2j of each group)."""
    a = tl.load(sp.to(tl.pointer_type(tl.uint16))).to(tl.int32)  # sc[2j], sc[2j + 1]
    b = tl.load((sp + 4).to(tl.pointer_type(tl.uint16))).to(tl.int32)  # m[2j], m[2j + 1]
    c = tl.load((sp + 8).to(tl.pointer_type(tl.uint16))).to(tl.int32)  # low four bits of the + 4 ones
    return a, b, c


@triton.jit
def q4_k_scale_decode(a, b, c):
    """Each group's scales and mins of its sub-blocks 2j, 2j + 1 (one in each byte of a 16-bit value, six
    bits the caller masks) and 2j + 4, 2j + 5, from the words q4_k_scale_words loaded: sc, sc4, m, m4."""
    return a, (c & 0x0F0F) | ((a >> 2) & 0x3030), b, ((c >> 4) & 0x0F0F) | ((b >> 2) & 0x3030)


@triton.jit
def q4_k_scale_min(a, b, c, s: tl.constexpr):
    """Q4_K's six-bit scale and min of sub-block s (0..7), int32, from its 12 scale bytes as the words a, b,
    c (bytes 0-3, 4-7, 8-11): sub-blocks 0-3 the low six bits of bytes s and s + 4; 4-7 a nibble of byte
    s + 4 with the top two bits of bytes s - 4 and s."""
    if s < 4:
        return (a >> (8 * s)) & 63, (b >> (8 * s)) & 63
    else:
        return (((c >> (8 * (s - 4))) & 15) | (((a >> (8 * (s - 4) + 6)) & 3) << 4),
                ((c >> (8 * (s - 4) + 4)) & 15) | (((b >> (8 * (s - 4) + 6)) & 3) << 4))
