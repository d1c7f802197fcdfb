"""Emulation of llama.cpp's CPU (ggml-cpu) arithmetic, for matching its logits, not for speed.

An analysis tool (it explained why llama.cpp's reference logits cannot be matched closer than its own
build-to-build spread); the engine does not use it.

A model computed in plain f32 agrees with transformers to ~1e-6 but not with llama.cpp: ggml's CPU backend
rounds in places f32 torch does not. With q8 activations SmolLM2-135M is chaotic: a 1e-6 relative nudge of
the matmul inputs moves first-token logprobs by 0.1-0.2, so only a bit-exact emulation can match llama.cpp's
logits; this module gets the formulas right, not every f32 ulp. What ggml does:

* Activation quantization before every quantized matmul. The activation row is quantized to the weight
  type's `vec_dot_type` and the dot runs on integers:
      q8_0 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): per 32 values, d = amax/127 stored as f16,
          q = round(x * 127/amax) (x86 AVX: nearest-even; scalar reference: roundf with 1/d).
          Dot = sum_b d_w16 * d_x16 * sum(q_w q_x)  ==  (q_x d_x16) . w_dequant.
      q8_1 (Q4_1, Q5_1): as q8_0 plus s = f16(d * sum(q)) with the *f32* d. The weight's per-block min m
          multiplies s, not sum(x): dot = sum_b d_w d_x16 sum(q_w q_x) + m_b s_b, so relative to
          (q_x d_x16) . w_dequant there is a correction sum_b m_b (s_b - d_x16 sum(q)); it needs m.
      q8_K (K-quants, IQ*_XS/XXS/S, TQ*): per 256 values, iscale = -127/max (max: the signed value of
          largest magnitude), q = nearest-even(iscale x) capped at 127, d = 1/iscale kept in f32.
      f16 / bf16 weights: the activation is rounded to f16 / bf16 (products then accumulate in f32).
* Attention (flash attention, on by default on CPU) over an f16 KV cache, for ubatches of fewer than 64
  queries (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): q is rounded to f16, q.k accumulates in
  f32, online softmax over keys in cache order, and the V accumulator is an f16 vector:
  acc = f16(f16(acc * expf(Mold - M))) on a new max, acc = f16(acc + v * expf(s - M)) per key;
  out = f32(acc) * (1/S). For >= 64 queries ggml tiles in f32 (q f32, k/v f16 -> f32): `path="tiled"`.
* RoPE angles: theta_i = p * theta_scale^i by repeated f32 multiplication, theta_scale = powf(base, -2/d).

Not emulated: ggml's SIMD expf in silu, FMA contraction in rope, the KQ dot's lane order, split-KV decode
(>= 512 cached keys). Each is an f32-ulp effect, which is enough to flip q8 roundings (see above).
`legacy_linear_exact` reproduces the x86 lane/FMA order of the legacy dots, slowly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ggml type ids (ggml.h)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29
BF16, TQ1_0, TQ2_0, MXFP4 = 30, 34, 35, 39

_VEC_DOT_TYPE = {
    F32: "f32", F16: "f16", BF16: "bf16",
    Q4_0: "q8_0", Q5_0: "q8_0", Q8_0: "q8_0", IQ4_NL: "q8_0", MXFP4: "q8_0",
    Q4_1: "q8_1", Q5_1: "q8_1",
    **{t: "q8_K" for t in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0)},
}
_HAS_BLOCK_MIN = (Q4_1, Q5_1)

# ggml_fa_tile_config::Q: ubatches with at least this many queries take the tiled f32 attention path
FA_TILE_Q = 64


def vec_dot_type(weight_type_id: int) -> str:
    """The activation format ggml-cpu converts to before a matmul with this weight type."""
    try:
        return _VEC_DOT_TYPE[weight_type_id]
    except KeyError:
        raise ValueError(f"no ggml vec_dot_type known for type id {weight_type_id}") from None


def f16_round(x: torch.Tensor) -> torch.Tensor:
    """f32 -> f16 -> f32, round to nearest even (what F16C's vcvtps2ph with imm 0 does)."""
    return x.to(torch.float16).to(torch.float32)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C roundf: ties away from zero (torch.round rounds ties to even). Exact: x - trunc(x) is exact."""
    t = torch.trunc(x)
    return torch.where((x - t).abs() == 0.5, t + torch.sign(x), torch.round(x))


# --- activation quantization ------------------------------------------------------------------------


def _blocks(x: torch.Tensor, qk: int) -> torch.Tensor:
    if x.shape[-1] % qk:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the block size {qk}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // qk, qk)


def quantize_q8_0(x: torch.Tensor, variant: str = "x86") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of 32 along the last dim -> (q [.., nb, 32] as f32 integers, d16 [.., nb, 1], d32 [.., nb, 1]).

    variant "x86": quantize_row_q8_0/q8_1 under AVX/AVX2 (id = 127/amax, nearest-even);
    "ref": quantize_row_q8_0_ref, the scalar fallback (id = 1/d, roundf).
    """
    xb = _blocks(x, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    if variant == "x86":
        inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(xb * inv)
    elif variant == "ref":
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = round_half_away(xb * inv)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return q, f16_round(d), d


def quantize_q8_1(x: torch.Tensor, variant: str = "x86") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d16, s16): q8_0's q and d plus s = f16(d32 * sum(q)) per block (the f32 d, not the f16 one)."""
    q, d16, d32 = quantize_q8_0(x, variant)
    s16 = f16_round(d32 * q.sum(-1, keepdim=True))
    return q, d16, s16


def quantize_q8_K(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 256 -> (q [.., nb, 256], d [.., nb, 1] f32), as quantize_row_q8_K_ref (x86 uses it too)."""
    xb = _blocks(x, 256)
    idx = xb.abs().argmax(-1, keepdim=True)  # first index of the largest |x|, as the strict '>' scan
    mx = xb.gather(-1, idx)
    nz = mx != 0
    iscale = torch.where(nz, -127.0 / torch.where(nz, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    q = torch.round(iscale * xb).clamp(max=127.0)  # nearest_int: the 1.5*2^23 trick, ties to even
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale))
    return q, d


def quantize_activation_like_ggml(x: torch.Tensor, weight_type_id: int, variant: str = "x86") -> torch.Tensor:
    """x as the integer dot sees it, dequantized back to f32 (same shape as x)."""
    kind = vec_dot_type(weight_type_id)
    if kind == "f32":
        return x.float()
    if kind == "f16":
        return f16_round(x)
    if kind == "bf16":
        return x.to(torch.bfloat16).float()
    if kind == "q8_K":
        q, d = quantize_q8_K(x)
    else:
        q, d, _ = quantize_q8_0(x, variant)
    return (q * d).reshape(x.shape)


def q8_1_min_correction(x: torch.Tensor, block_min: torch.Tensor, variant: str = "x86") -> torch.Tensor:
    """sum_b m_b (s_b - d16_b sum(q_b)): what Q4_1/Q5_1 x q8_1 adds over (q_x d16) . w_dequant.

    x [..., K]; block_min [N, K/32] (the weight's f16 m per block, as f32). Returns [..., N].
    """
    q, d16, s16 = quantize_q8_1(x, variant)
    delta = (s16 - d16 * q.sum(-1, keepdim=True)).squeeze(-1)  # [..., nb]
    return delta @ block_min.t()


def quantized_linear_like_ggml(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_type_id: int,
    block_min: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    variant: str = "x86",
) -> torch.Tensor:
    """y = x W^T as ggml-cpu's mul_mat computes it for a weight of `weight_type_id`.

    weight: the dequantized weight [N, K] (f32). block_min: for Q4_1/Q5_1 the per-block mins [N, K/32];
    without it the f16 rounding of q8_1's s is not emulated (a ~2e-4 relative error on the min term).
    Rows of W stacked from several GGUF matrices (qkv, gate/up) are fine: quantization is per x row.
    """
    xq = quantize_activation_like_ggml(x, weight_type_id, variant)
    y = xq @ weight.float().t()
    if block_min is not None and weight_type_id in _HAS_BLOCK_MIN:
        y = y + q8_1_min_correction(x, block_min, variant)
    if bias is not None:
        y = y + bias
    return y


def block_mins_from_raw(raw: torch.Tensor, weight_type_id: int, shape: tuple[int, int]) -> torch.Tensor:
    """The f16 m of every Q4_1 (20-byte) / Q5_1 (24-byte) block of canonical GGUF bytes -> [N, K/32] f32."""
    block_bytes = {Q4_1: 20, Q5_1: 24}[weight_type_id]
    n, k = shape
    b = raw.reshape(-1).view(torch.uint8).reshape(n * (k // 32), block_bytes)
    return b[:, 2:4].contiguous().view(torch.float16).float().reshape(n, k // 32)


# --- bit-faithful legacy dot (x86 AVX2 ggml_vec_dot_q{4,5,8}_{0,1}_q8_{0,1}) ----------------------------


@dataclass(frozen=True)
class LegacyBlocks:
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight as ggml's integer dot sees it: q [N, K] integer values (f32, with
    Q4_0's -8 / Q5_0's -16 applied), d [N, K/32] and, for Q4_1/Q5_1, m [N, K/32] (f16 values as f32)."""

    type_id: int
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @staticmethod
    def from_raw(raw: torch.Tensor, type_id: int, shape: tuple[int, int]) -> LegacyBlocks:
        n, k = shape
        nbytes = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}[type_id]
        b = raw.reshape(-1).view(torch.uint8).reshape(n * (k // 32), nbytes)

        def f16_at(off: int) -> torch.Tensor:
            return b[:, off : off + 2].contiguous().view(torch.float16).float().reshape(n, k // 32)

        d = f16_at(0)
        m = f16_at(2) if type_id in (Q4_1, Q5_1) else None
        if type_id == Q8_0:
            q = b[:, 2:].contiguous().view(torch.int8).float()
        else:
            qs = b[:, nbytes - 16 :].long()
            q = torch.cat((qs & 0xF, qs >> 4), dim=1)  # element j: low nibble of byte j, j+16: high nibble
            if type_id in (Q5_0, Q5_1):
                off = 2 if type_id == Q5_0 else 4
                qh = b[:, off : off + 4].long()
                qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
                q = q | (((qh[:, None] >> torch.arange(32)) & 1) << 4)
            q = (q - {Q4_0: 8, Q4_1: 0, Q5_0: 16, Q5_1: 0}[type_id]).float()
        return LegacyBlocks(type_id, q.reshape(n, k), d, m)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.reshape(n, k // 32, 32) * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(n, k)


def legacy_linear_exact(x: torch.Tensor, w: LegacyBlocks, variant: str = "x86", chunk: int = 8192) -> torch.Tensor:
    """x [T, K] @ W^T with ggml's x86 float order: per block the int dot splits into 8 lanes of 4
    consecutive products; lane l accumulates fma(d_w d_x, sumi_l, acc_l) over blocks in f32; then
    hsum_float_8 ((l, l+4) pairs, then (0,2),(1,3), then the two) and, for Q4_1/Q5_1, + sum_b m_b s_b
    summed in block order. The fma is emulated in f64 (exact product), rounding once to f32."""
    T, K = x.shape
    nb = K // 32
    if w.type_id in (Q4_1, Q5_1):
        qx, dx, s16 = quantize_q8_1(x, variant)
    else:
        qx, dx, _ = quantize_q8_0(x, variant)
        s16 = None
    X = qx.reshape(T, nb * 8, 4).permute(1, 0, 2)  # [nb*8, T, 4]
    outs = []
    for n0 in range(0, w.q.shape[0], chunk):
        qw, dw = w.q[n0 : n0 + chunk], w.d[n0 : n0 + chunk]
        N = qw.shape[0]
        Wl = qw.reshape(N, nb * 8, 4).permute(1, 2, 0)  # [nb*8, 4, N]
        lanes = torch.bmm(X, Wl).reshape(nb, 8, T, N)  # integer sums, exact in f32
        dd = (dx.squeeze(-1)[:, None, :] * dw[None, :, :]).double()  # [T, N, nb]; f16*f16 exact in f32
        acc = torch.zeros(T, N, 8, dtype=torch.float32)
        for b in range(nb):
            acc = (dd[:, :, b, None] * lanes[b].permute(1, 2, 0).double() + acc.double()).float()
        r = acc[..., 4:] + acc[..., :4]
        r = (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])
        if w.m is not None:
            summs = torch.zeros(T, N)
            mw = w.m[n0 : n0 + chunk]
            for b in range(nb):
                summs = summs + s16[:, b, 0][:, None] * mw[None, :, b]
            r = r + summs
        outs.append(r)
    return torch.cat(outs, dim=1)


# --- attention --------------------------------------------------------------------------------------


def _expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t.repeat_interleave(n_heads // t.shape[0], dim=0) if t.shape[0] != n_heads else t


def ggml_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, path: str = "auto"
) -> torch.Tensor:
    """ggml-cpu flash attention over an f16 KV cache. q [H, n, D] f32; k, v [KV, L, D] (values already
    f16, e.g. the cache); mask [n, L] bool (True: attend) or None. Returns [H, n, D] f32.

    path "one_chunk" (ubatches of < 64 queries): f16 q and f16 V accumulator, keys in order.
    path "tiled" (>= 64 queries): f32 throughout, only k/v are f16; "auto" picks as ggml does.
    """
    H, n, _ = q.shape
    kf = _expand_kv(f16_round(k), H)
    vf = _expand_kv(f16_round(v), H)
    if path == "auto":
        path = "tiled" if n >= FA_TILE_Q else "one_chunk"
    qf = q.float() if path == "tiled" else f16_round(q)
    s = (qf @ kf.transpose(-1, -2)) * scale  # [H, n, L]: f16 x f16 products are exact in f32
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if path == "tiled":
        return torch.softmax(s, dim=-1) @ vf
    if path != "one_chunk":
        raise ValueError(f"unknown path {path!r}")
    M = torch.full((H, n, 1), float("-inf"))
    S = torch.zeros(H, n, 1)
    acc = torch.zeros(H, n, vf.shape[-1])
    for j in range(s.shape[-1]):
        sj = s[:, :, j : j + 1]
        live = sj != float("-inf")  # masked keys are skipped (`continue`), not weighted by zero
        new_max = live & (sj > M)
        ms = torch.where(new_max, torch.exp(M - sj), torch.ones_like(sj))
        vs = torch.where(new_max | ~live, torch.ones_like(sj), torch.exp(sj - M))
        scaled = torch.where(new_max, f16_round(acc * ms), acc)
        acc = torch.where(live, f16_round(scaled + vf[:, j : j + 1, :] * vs), acc)
        S = torch.where(live, S * ms + vs, S)
        M = torch.where(new_max, sj, M)
    inv = torch.where(S == 0, torch.zeros_like(S), 1.0 / S)
    return acc * inv


# --- rope ------------------------------------------------------------------------------------------


def ggml_rope_cos_sin(
    positions: torch.Tensor, n_dims: int, base: float, freq_scale: float = 1.0, mscale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, n_dims/2] as ggml_rope_cache_init builds them (no YaRN ramp): theta starts at p and is
    multiplied by theta_scale = powf(base, -2/n_dims) in f32 once per pair, so the error grows with i."""
    theta_scale = torch.tensor(math.pow(base, -2.0 / n_dims), dtype=torch.float32)
    theta = positions.to(torch.float32)
    cols = []
    for i in range(n_dims // 2):
        t = theta if freq_factors is None else theta / freq_factors[i].float()
        cols.append(t * torch.tensor(freq_scale, dtype=torch.float32))
        theta = theta * theta_scale
    angles = torch.stack(cols, dim=-1)
    return torch.cos(angles) * mscale, torch.sin(angles) * mscale
