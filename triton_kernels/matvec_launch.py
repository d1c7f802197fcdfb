"""Launch planning shared by the word-tile decode mat-vecs (the `int8`, `pieces` and `lanes` kernels): the
fixed launch rule, the candidates a sweep times, and a launch's K split, grid and outputs.

Tiles: a program owns BLOCK_N rows and one K split; a tile is NB blocks (for the K-quants, super-blocks)
of every row, loaded as 16-byte groups (a thread's vector load). The K split holds whole tiles, and a
tile divides the row's blocks (matmul.tile_split, which the tile kernel shares), except for the `RAGGED`
types, whose int8 kernel masks a last, partial tile: their tile is a power of two whether or not it
divides the row (gpt-oss's rows of 2880 are 90 blocks, whose largest power-of-two divisor is 2). Split-K programs add
their partials in a fixed order through per-tile arrival counts (flat_words.store_rows): no atomics on the
result, the same sum on every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matmul import tile_blocks, tile_split

# type -> (elements per block, 16-byte groups per block, bytes one group loads per row and tile); IQ4_XS's
# super-blocks are 8 of IQ4_NL's blocks to the kernel (matvec_int8), which the rule treats as one
GEOMETRY = {T.Q8_0: (32, 1, 32), T.Q4_0: (32, 1, 16), T.IQ4_NL: (32, 1, 16), T.MXFP4: (32, 1, 16),
            T.IQ4_XS: (256, 8, 16), T.Q4_K: (256, 2, 64), T.Q6_K: (256, 4, 48), T.Q3_K: (256, 4, 32),
            T.Q2_K: (256, 4, 16), T.IQ2_XXS: (256, 4, 16), T.IQ2_XS: (256, 4, 16), T.IQ2_S: (256, 4, 16),
            T.IQ3_XXS: (256, 4, 16), T.IQ3_S: (256, 4, 16), T.IQ1_S: (256, 4, 12), T.IQ1_M: (256, 4, 12)}
# the one-scale 32-element types, whose int8 kernel (matvec_int8._legacy_kernel) masks a partial last tile
RAGGED = frozenset({T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4})
# the super-block kernels (IQ4_XS's is the 32-element one): heavier tiles, fewer rows a thread above M = 1
SUPER_BLOCK_KERNELS = frozenset(t for t, (qk, _, _) in GEOMETRY.items() if qk == 256) - {T.IQ4_XS}

# The fixed rule (`candidates` is what a sweep decides among):
# - groups per tile: 16 for the 16-byte groups (Q4_0, IQ4_NL, MXFP4, IQ4_XS), 8 for the others, so a row's
#   tile is 256-512 bytes. With 4 warps G stays below 32: Triton re-materialises an activation tensor
#   [G, 4] of 128 elements or more through shared memory on every load.
# - rows per thread: 4 (its activation vectors serve 4 rows); 2 for the K-quants at M > 1 (4 spilled on
#   sm_90).
# - 4 warps; a wave64 target (gfx906) puts twice the rows in a warp, so block_n doubles there.
# - split K while a SM's rows (N * split / SMs) times the bytes of a tile row stay under 24 KiB in flight
#   (a SM's share of 4.25 TB/s for ~1 us of latency is ~32 KB) and every split keeps 2 tiles.
_WARPS, _IN_FLIGHT = 4, 24 * 1024


def rule(type_id: int, n: int, k: int, m: int, sm_count: int, warp_size: int = 32) -> dict[str, int]:
    qk, _, bpg = GEOMETRY[type_id]
    groups = 16 if bpg == 16 else 8
    rows = 2 if type_id in SUPER_BLOCK_KERNELS and m > 1 else 4
    return _config(type_id, n, k, groups, rows, _WARPS, warp_size, sm_count)


def candidates(type_id: int, n: int, k: int, m: int, sm_count: int, warp_size: int = 32) -> list[dict[str, int]]:
    """The rule and its neighbours, one knob each: split-K doubled and halved; at M = 1 also the other
    group count, half and (32-element types) twice the rows per thread, and 8 warps. At M > 1 only
    split-K varies for the K-quants: each of their M = 8 kernels takes Triton many seconds to compile."""
    base = rule(type_id, n, k, m, sm_count, warp_size)
    qk, gpb, _ = GEOMETRY[type_id]
    groups = base["nb"] * 32 // qk * gpb
    rows = base["block_n"] * groups // (warp_size * base["num_warps"])
    out = [base, {**base, "split_k": base["split_k"] * 2}]
    if base["split_k"] > 1:
        out.append({**base, "split_k": base["split_k"] // 2})
    variants = []  # (groups, rows per thread, warps)
    if m == 1:
        variants = [(24 - groups, rows, _WARPS), (groups, rows // 2, _WARPS), (groups, rows, 2 * _WARPS)]
        if type_id not in SUPER_BLOCK_KERNELS:
            variants.append((groups, 2 * rows, _WARPS))
    elif type_id not in SUPER_BLOCK_KERNELS:
        variants.append((groups, rows // 2, _WARPS))
    out += [_config(type_id, n, k, g, r, w, warp_size, sm_count) for g, r, w in variants if r >= 1]
    return unique(out)


def unique(configs: list[dict[str, int]]) -> list[dict[str, int]]:
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in configs)]


def _config(type_id: int, n: int, k: int, groups: int, rows: int, warps: int, warp_size: int,
            sm_count: int) -> dict[str, int]:
    """Launch parameters for `groups` per tile and `rows` per thread, with the split-K of the rule."""
    qk, gpb, bpg = GEOMETRY[type_id]
    n_blocks = k // qk
    blocks = tile_blocks(n_blocks, max(1, groups // gpb), type_id in RAGGED)
    groups = blocks * gpb
    block_n = max(8, min(256, rows * warp_size * warps // groups))
    iters = -(-n_blocks // blocks)
    split = 1
    while n * split * groups * bpg < _IN_FLIGHT * sm_count and iters // (2 * split) >= 2:
        split *= 2
    return {"block_n": block_n, "nb": blocks * qk // 32, "num_warps": warps, "split_k": split}


@dataclass(frozen=True)
class Experts:
    """An expert mat-vec's assignments (layout.stack_experts' matrices): assignment a multiplies expert
    ids[a] by row a // x_div of x, into row a of y."""

    ids: torch.Tensor  # [A] int64, on the device
    x_div: int = 1
    # moe.sorted_runs' memo of the assignments sorted by expert, where the launches of one layer's step share
    # them (gate/up and down: one sort, not one a launch)
    sorts: dict | None = field(default=None, compare=False)

    @property
    def count(self) -> int:
        return self.ids.shape[0]


@dataclass(frozen=True)
class Launch:
    """A word-tile mat-vec's launch: parameters, blocks (super-blocks) per tile, per K split, splits; with
    `assignments`, one program column per expert assignment (one row of x each)."""

    params: dict[str, int]
    per_tile: int
    per_split: int
    split: int
    assignments: int = 0

    def grid(self, n: int) -> tuple[int, ...]:
        tiles = triton.cdiv(n, self.params["block_n"])
        return (tiles, self.split, self.assignments) if self.assignments else (tiles, self.split)

    def expert_args(self, w: PackedWeight, experts: Experts | None) -> tuple[list, dict[str, int]]:
        """The kernels' (ids_ptr, expert_bytes) arguments and EXPERTS / XDIV constexprs."""
        if experts is None:
            return [w.data, 0], {}
        return [experts.ids, w.expert_bytes], {"EXPERTS": 1, "XDIV": experts.x_div}

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
        return part, y, arrival_counts(device, self.grid(n)[0] * max(self.assignments, 1))


_COUNTS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, at least n, that split-K programs count into and leave at zero (store_rows). One
    buffer per device, grown and never freed: a captured graph keeps the address it was captured with."""
    held = _COUNTS.setdefault(torch.device(device), [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return held[-1]


def plan(kernel: str, x: torch.Tensor, w: PackedWeight, params: dict[str, int], experts: Experts | None = None,
         ragged: bool = False) -> Launch:
    """The checks and the K split of a word-tile kernel's launch of x [M, K] on w with complete params; with
    `experts`, of one program column per assignment (x's rows then any number: each program takes one);
    `ragged`: a kernel that masks a partial last tile (tile_split)."""
    M, K = x.shape
    if experts is not None:
        if w.experts < 2 and w.expert_bytes == 0:
            raise ValueError(f"{kernel} expert mat-vec: the weight is one matrix, not a stack of experts")
        if experts.ids.dtype != torch.int64 or experts.ids.dim() != 1 or experts.count < 1:
            raise ValueError(f"{kernel} expert mat-vec: ids must be int64 [A]; got {experts.ids.dtype} "
                             f"{tuple(experts.ids.shape)}")
        if M * experts.x_div != experts.count or K != w.k:
            raise ValueError(f"{kernel} expert mat-vec: {experts.count} assignments of x [{M}, {K}] rows taken "
                             f"{experts.x_div} at a time by {w.n}x{w.k} experts")
    elif K != w.k or not 1 <= M <= 8:
        raise ValueError(f"{kernel} mat-vec takes 1..8 rows of K={w.k}; got x {tuple(x.shape)}")
    if not w.repacked:
        raise ValueError(f"the {kernel} mat-vec reads 16-byte words: the repacked layout (layout.repack) only")
    if params["block_n"] < 8 or params["block_n"] & (params["block_n"] - 1):
        # BLOCK_N 2 and 4 gave wrong sums in the tile kernel on an H200
        raise ValueError(f"block_n must be a power of two >= 8, got {params['block_n']}")
    return Launch(params, *tile_split(w.type_id, K, params["nb"], params.get("split_k", 1), ragged),
                  experts.count if experts is not None else 0)
