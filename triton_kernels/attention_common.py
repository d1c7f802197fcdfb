"""What the paged-attention kernels share: the cache layout, one online-softmax step over a tile of keys,
the input checks, the launch parameters per backend and the gather the torch references use.

Layout, one layer: k_cache / v_cache [num_slots, kv_heads, head_dim]. Position p of sequence s lives in slot
block_tables[s, p // page_size] * page_size + p % page_size (engine/kv_cache.py; page size 1 makes the
table a plain slot list). q and the output are [T, heads, head_dim]; heads = group * kv_heads and query
head h reads kv head h // group (GQA).

Softmax in base 2: a score is (q . k) * scale * log2(e), so 2^score is e^((q . k) * scale). Per query row
the kernels keep the running maximum m, the sum l of 2^(score - m) and acc = sum 2^(score - m) v, all f32.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Launch parameters per backend; a tuning file (configs/kernels/<target>.json) overrides them under
# "attention": {"decode": {...}, "prefill": {...}}. block_n: keys per tile; split_keys: the most keys one
# decode program takes (a multiple of block_n); min_programs: the decode grid splits each sequence's keys
# further until it has that many programs (2 per compute unit by default; attention_decode.split_count);
# block_m: query rows (tokens x heads of one group) per prefill program. The other keys are compiler
# options.
# NVIDIA (warp 32, tensor cores), sm_90: the rule timed on an H200 (docs/PERFORMANCE.md): decode 64-key
#   tiles on 4 warps, prefill 128x64 on 8 warps. ptxas (Triton 3.9) gives the decode 48 bytes of stack
#   on 4 warps and none on 8 (193 registers): 8 warps is the first thing to time. split_keys 2048 with
#   min_programs 2 per SM: timed on an H100 against the 512-key partitions it replaced (PERFORMANCE.md).
# The gfx906 rule is not timed: from the compiler's register report for an f16 cache, head_dim 128, group
#   4 (Triton 3.9, compiled without a GPU), the tiles that fit without spilling.
# gfx906 (wave64, so 8 warps are 512 lanes; no matrix cores: tl.dot lowers to FMA / fp16 dot2, and its
#   operands sit in VGPRs): decode 16-key tiles on 8 warps (124 VGPRs, 2 waves per SIMD, no spills);
#   prefill 32x16 on 4 warps (244 VGPRs, no spills). waves_per_eu=2 caps a wave at 128 VGPRs and spilled
#   both kernels (89 to 498 VGPRs spilled), so it is left out.
# f32 caches spill on both backends; they serve the exact checks.
_FALLBACK: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {
        "decode": {"block_n": 64, "split_keys": 2048, "num_warps": 4, "num_stages": 2},
        "prefill": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    },
    "hip": {
        "decode": {"block_n": 16, "split_keys": 2048, "num_warps": 8},
        "prefill": {"block_m": 32, "block_n": 16, "num_warps": 4},
    },
}
META_KEYS = ("block_n", "split_keys", "min_programs", "block_m")
COMPILER_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "waves_per_eu", "matrix_instr_nonkdim",
                 "kpack")


@lru_cache(maxsize=4)
def _tuned(op: str) -> tuple[tuple[str, Any], ...]:
    from vegaserve.triton_kernels.tuning import load_tuning

    t = load_tuning()
    return tuple({**_FALLBACK[t.backend][op], **t.table.get("attention", {}).get(op, {})}.items())


def split_params(p: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta-parameters, compiler options); any other key is refused (the interpreter would drop it unread)."""
    unknown = sorted(set(p) - set(META_KEYS) - set(COMPILER_KEYS))
    if unknown:
        raise ValueError(f"attention launch parameters {unknown} unknown: meta-parameters are {META_KEYS}, "
                         f"compiler options {COMPILER_KEYS}")
    return {k: v for k, v in p.items() if k in META_KEYS}, {k: v for k, v in p.items() if k not in META_KEYS}


def launch_params(op: str, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split launch parameters for `decode` or `prefill` on the active target, the caller's on top."""
    return split_params({**dict(_tuned(op)), **overrides})


def backend_fallback(backend: str, op: str) -> dict[str, Any]:
    """The fixed rule for `cuda` or `hip`, whatever the active target."""
    return dict(_FALLBACK[backend][op])


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) after the checks every launcher shares."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q [T, H, D] and caches [slots, KV, D] expected, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    H, D = q.shape[1], q.shape[2]
    KV = k_cache.shape[1]
    if k_cache.shape[2] != D or H % KV:
        raise ValueError(f"{H} query heads of {D} over {KV} kv heads of {k_cache.shape[2]}: heads must be a "
                         "multiple of kv heads and head sizes equal")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} is above the {MAX_HEAD_DIM} the kernels hold in registers")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype}/{v_cache.dtype}: one of f32, f16, bf16 for both")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the caches must be contiguous along head_dim")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block tables and seq lens are int32, got {block_tables.dtype}, {seq_lens.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block tables [S, blocks] (rows contiguous) and seq lens [S] expected, got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    return H, KV, D


def head_tiles(D: int, dtype: torch.dtype) -> tuple[int, bool]:
    """(BLOCK_D, DOT_F32): head_dim padded to a power of two (at least 16, tl.dot's smallest K); f32
    caches multiply in f32 with IEEE products, f16/bf16 ones in their own type with f32 accumulation."""
    return max(16, triton.next_power_of_2(D)), dtype == torch.float32


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's type, rounded to nearest even as torch's .to() (a narrowing cast in Triton
    truncates unless told; same type: unchanged)."""
    if x.dtype == cache_ptr.dtype.element_ty:
        return x
    elif cache_ptr.dtype.element_ty == tl.float32:
        return x.to(tl.float32)
    else:
        return x.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def rotate_pair(a, b, cos, sin):
    """A RoPE pair (a, b) turned by the angle: (a cos - b sin, b cos + a sin) in f32, each one fused
    multiply-add on the other product, so that every kernel that rotates rounds the same way (left to the
    compiler, the contraction of a*c - b*s depends on the surrounding code)."""
    return tl.fma(a, cos, -(b * sin)), tl.fma(b, cos, a * sin)


@triton.jit
def tile_slots(table, kstart, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache slots [BLOCK_N] (int64) of key positions kstart .. kstart + BLOCK_N - 1, read through the
    sequence's block table row; positions at or past hi give slot 0 (never loaded)."""
    pos = kstart + tl.arange(0, BLOCK_N)
    page = tl.load(table + pos // PAGE, mask=pos < hi, other=0)
    return page.to(tl.int64) * PAGE + pos % PAGE


@triton.jit
def attend_tile(
    acc, l, m, q, k_head, v_head, table,  # running state [R, BLOCK_D] / [R] / [R], q [R, BLOCK_D], pointers
    kstart, hi, qpos, qk_scale,  # first key position of the tile, end of the keys, query positions [R]
    stride_ks, stride_vs,  # cache slot strides
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, WINDOW: tl.constexpr = 0,
):
    """Fold keys kstart .. kstart + BLOCK_N - 1 (those below hi; with CAUSAL also at most qpos; with a
    WINDOW also above qpos - WINDOW) into the softmax state of the rows of q. k_head / v_head point at the
    tile's kv head in slot 0, table at the sequence's block table row. Without a WINDOW the caller
    guarantees every row sees a key in its first tile, so m is finite after it and no 2^(-inf - -inf)
    arises; with one, a row that has seen no key yet keeps an empty state."""
    slot = tile_slots(table, kstart, hi, PAGE, BLOCK_N)
    return attend_slots(acc, l, m, q, k_head, v_head, slot, kstart, hi, qpos, qk_scale, stride_ks, stride_vs,
                        HEAD_DIM, BLOCK_N, BLOCK_D, CAUSAL, DOT_F32, WINDOW)


@triton.jit
def attend_slots(acc, l, m, q, k_head, v_head, slot, kstart, hi, qpos, qk_scale, stride_ks, stride_vs,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_F32: tl.constexpr, WINDOW: tl.constexpr = 0):
    """attend_tile with the tile's cache slots already read (tile_slots): a caller can read them ahead."""
    k, v = load_kv(k_head, v_head, slot, kstart, hi, stride_ks, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D)
    return attend_kv(acc, l, m, q, k, v, kstart, hi, qpos, qk_scale, BLOCK_N, CAUSAL, DOT_F32, WINDOW)


@triton.jit
def load_kv(k_head, v_head, slot, kstart, end, stride_ks, stride_vs, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile's keys and values [BLOCK_N, BLOCK_D] at `slot`, those of positions below `end` (0 past it)."""
    pos = kstart + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    lmask = (pos < end)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_head + slot[:, None] * stride_ks + d[None, :], mask=lmask, other=0.0)
    v = tl.load(v_head + slot[:, None] * stride_vs + d[None, :], mask=lmask, other=0.0)
    return k, v


@triton.jit
def attend_kv(acc, l, m, q, k, v, kstart, hi, qpos, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_F32: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Fold a loaded tile (keys k, values v [BLOCK_N, BLOCK_D] of positions kstart.., those below hi
    counted) into the softmax state, as attend_tile."""
    pos = kstart + tl.arange(0, BLOCK_N)
    kmask = pos < hi
    if DOT_F32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    visible = kmask[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= qpos[:, None])
    if WINDOW:
        visible = visible & (pos[None, :] > qpos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_exp = m_new
    if WINDOW:  # a row may have seen no key yet: its state stays empty (no 2^(-inf - -inf))
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_exp)
    p = tl.exp2(s - m_exp[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l, m_new


def gather_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """[length, KV, D] of a sequence's positions 0 .. length - 1 read through its block table row."""
    pos = torch.arange(length, device=cache.device)
    slots = table_row.to(cache.device).long()[pos // page_size] * page_size + pos % page_size
    return cache[slots]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                        scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 softmax(q k^T * scale) v of one sequence: q [n, H, D] at positions start .. start + n - 1,
    keys/values [start + n, KV, D]; query i sees keys 0 .. start + i (the last `window` of them where
    window > 0); sinks [H]: each head's logit added to its softmax's denominator."""
    n, H, _ = q.shape
    group = H // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    qpos = torch.arange(start, start + n, device=q.device)[:, None]
    kpos = torch.arange(keys.shape[0], device=q.device)[None, :]
    hidden = (kpos > qpos) | ((kpos <= qpos - window) if window else False)
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # a key never attended, its logit in every denominator
        s = torch.cat((s, sinks.double().to(q.device)[:, None, None].expand(-1, n, 1)), dim=-1)
        return (torch.softmax(s, dim=-1)[..., :-1] @ v).transpose(0, 1)
    return (torch.softmax(s, dim=-1) @ v).transpose(0, 1)  # [n, H, D]
