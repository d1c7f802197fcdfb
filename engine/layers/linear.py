"""Linear layers and their quantization strategies.

A layer never branches on the GGUF type: it holds a `QuantMethod` that turns canonical GGUF bytes into the
layer's stored form (`create`) and multiplies (`apply`). Matrices that read the same activation (q/k/v,
gate/up) load as one `QuantLinear` over the concatenated output rows.

On a CPU the method is `CPUMethod` (4-bit planes through torch's int4 kernel for Q4_0, Q4_1 and Q8_0) over
`ReferenceMethod` (dequantize once at load with the torch references in `triton_kernels`, torch's matmul);
it is the same model code the GPU kernels run under.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vegaserve.engine.gguf_file import ModelLoadError, TensorInfo
from vegaserve.triton_kernels.dequant import GGMLType, UnsupportedTypeError, dequantize


@dataclass(frozen=True)
class WeightSource:
    """One GGUF tensor handed to a layer: its index entry and canonical bytes."""

    info: TensorInfo
    raw: torch.Tensor
    path: str


def check_shape(src: WeightSource, expect_shape: tuple[int, ...]) -> None:
    if src.info.shape != expect_shape:
        raise ModelLoadError(
            f"{src.path}: tensor {src.info.name} ({src.info.type_name}) has shape {list(src.info.shape)}, "
            f"the model expects {list(expect_shape)}"
        )


def dequantize_source(src: WeightSource, expect_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    check_shape(src, expect_shape)
    try:
        w = dequantize(src.raw, src.info.type_id, src.info.shape)
    except UnsupportedTypeError as e:
        raise ModelLoadError(f"{src.path}: tensor {src.info.name}: unsupported tensor type {src.info.type_name} ({e})") from e
    return w.to(dtype)


class QuantMethod:
    """Strategy: how a linear layer stores its weight and multiplies by it."""

    def create(self, layer: QuantLinear, sources: list[WeightSource]) -> None:
        raise NotImplementedError

    def apply(self, layer: QuantLinear, x: torch.Tensor, q8_1: tuple | None = None) -> torch.Tensor:
        """x @ W^T (+ b); q8_1: x already quantized to q8_1 (see wants_q8_1), else None."""
        raise NotImplementedError

    def wants_q8_1(self, layer: QuantLinear, m: int) -> bool:
        """Whether apply at m rows multiplies a q8_1 copy of x (then the op before may hand it over)."""
        return False

    def create_experts(self, layer, sources: list[WeightSource]) -> None:
        """An ExpertLinear's E matrices (engine/layers/moe.py) from GGUF 3-D tensors [E, rows, K]."""
        raise NotImplementedError

    def apply_experts(self, layer, x: torch.Tensor, ids: torch.Tensor, x_div: int, tokens: int,
                      q8_1: tuple | None = None, sorts: dict | None = None) -> torch.Tensor:
        """y[a] = W[ids[a]] x[a // x_div] for each assignment a: [A, N] f32; q8_1: x's q8_1 copy where
        experts_want_q8_1; sorts: a memo the launches of one step's `ids` share (moe.sorted_runs)."""
        raise NotImplementedError

    def experts_want_q8_1(self, layer, tokens: int) -> bool:
        return False


class ReferenceMethod(QuantMethod):
    """Dequantize at load, torch matmul at run time (CPU path; ground truth for the kernels).

    A matrix is stored column-major (its [K, N] transpose contiguous, `weight` the [N, K] view of it): a
    decode step's one-row product then reads it through the GEMM's fast layout. With f32 SmolLM2 on a 2-core
    CPU (torch 2.13) a one-row product over cold weights read 9.6 GB/s from [N, K] rows and 15.8 GB/s from the
    transpose, and a decode step took 49-60 ms instead of 59-74 (same tokens; logprobs within 1e-5)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def create(self, layer: QuantLinear, sources: list[WeightSource]) -> None:
        parts = [
            dequantize_source(src, (rows, layer.in_features), self.dtype)
            for src, rows in zip(sources, layer.output_sizes, strict=True)
        ]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        layer.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)

    def apply(self, layer: QuantLinear, x: torch.Tensor, q8_1: tuple | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def create_experts(self, layer, sources: list[WeightSource]) -> None:
        e, k = layer.n_experts, layer.in_features
        parts = [dequantize_source(src, (e, rows, k), self.dtype) for src, rows in zip(sources, layer.output_sizes,
                                                                                       strict=True)]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def apply_experts(self, layer, x: torch.Tensor, ids: torch.Tensor, x_div: int, tokens: int,
                      q8_1: tuple | None = None, sorts: dict | None = None) -> torch.Tensor:
        y = torch.empty(ids.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
        for e in ids.unique().tolist():  # the experts in use, each over all its assignments
            sel = (ids == e).nonzero()[:, 0]
            y[sel] = x[sel // x_div] @ layer.weight[e].T
        return y


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at byte `offset` of every block [..., block bytes] (uint8), as f32."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibble_codes(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The 32 4-bit codes of each block whose 16 bytes start at `offset`: element j < 16 the low nibble of
    byte j, element j >= 16 the high nibble of byte j - 16 (Q4_0, Q4_1)."""
    qs = blocks[..., offset : offset + 16].to(torch.int32)
    return torch.cat([qs & 15, qs >> 4], dim=-1)


# the block types CPUMethod multiplies through torch's int4 kernel: block bytes and the (codes, scale, zero)
# planes a block gives, each plane w = scale * (code - 8) + zero with codes 0..15 per 32 elements
_INT4_TYPES = {GGMLType.Q4_0: 18, GGMLType.Q4_1: 20, GGMLType.Q8_0: 34}


def _int4_planes(type_id: int, blocks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """blocks [N, K / 32, bytes] -> planes of (codes [N, K] int32, scale [N, K / 32], zero [N, K / 32]) whose
    sum is the dequantized matrix: one plane for the 4-bit types; Q8_0's code q = 16 hi + lo (hi in -8..7,
    lo in 0..15) gives two, d 16 (hi + 8 - 8) and d (lo - 8) + 8 d."""
    d = _f16_field(blocks, 0)
    n = blocks.shape[0]
    if type_id == GGMLType.Q4_0:  # d (q - 8)
        return [(_nibble_codes(blocks, 2).reshape(n, -1), d, torch.zeros_like(d))]
    if type_id == GGMLType.Q4_1:  # d q + m = d (q - 8) + (m + 8 d)
        return [(_nibble_codes(blocks, 4).reshape(n, -1), d, _f16_field(blocks, 2) + 8 * d)]
    q = blocks[..., 2:34].contiguous().view(torch.int8).to(torch.int32)  # Q8_0: d q
    return [(((q >> 4) + 8).reshape(n, -1), 16 * d, torch.zeros_like(d)), ((q & 15).reshape(n, -1), d, 8 * d)]


class CPUMethod(ReferenceMethod):
    """The CPU's serving method: Q4_0, Q4_1 and Q8_0 matrices stay 4-bit planes multiplied by torch's int4
    kernel (`_weight_int4pack_mm_for_cpu`: groups of 32, bf16 activations and scales, f32 accumulation rounded
    to a bf16 output per plane); every other type as ReferenceMethod (dequantized at load, f32). SmolLM2 Q4_1
    on the 2-core CPU: a decode step 27 ms instead of 54 (one thread); perplexity against llama-perplexity's
    on two texts -0.018% and +0.43% (the f32 path +0.057% and +0.30%). A torch without those operators gets
    ReferenceMethod throughout."""

    available = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    def create(self, layer: QuantLinear, sources: list[WeightSource]) -> None:
        layer.int4 = None
        k = layer.in_features
        if not self.available or k % 32 or any(src.info.type_id not in _INT4_TYPES for src in sources):
            return super().create(layer, sources)
        by_plane: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for src, rows in zip(sources, layer.output_sizes, strict=True):
            check_shape(src, (rows, k))
            planes = _int4_planes(src.info.type_id, src.raw.reshape(rows, k // 32, _INT4_TYPES[src.info.type_id]))
            by_plane.append(planes + [None] * (2 - len(planes)))
        n = layer.out_features
        pad = -n % 16  # the kernel's packing takes rows in sixteens: padded rows have zero scales
        packed = []
        for i in range(2):
            if all(planes[i] is None for planes in by_plane):
                break
            codes, scale, zero = (torch.cat([(p[i][j] if p[i] is not None else _zero_plane(p[0], j))
                                             for p in by_plane] + [_pad_plane(pad, k, j)]) for j in range(3))
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
            packed.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz))
        layer.int4 = packed
        layer.weight = None

    def apply(self, layer: QuantLinear, x: torch.Tensor, q8_1: tuple | None = None) -> torch.Tensor:
        if layer.int4 is None:
            return super().apply(layer, x, q8_1)
        xb = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).to(torch.bfloat16)
        codes, sz = layer.int4[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, codes, 32, sz).float()
        for codes, sz in layer.int4[1:]:  # Q8_0's low plane
            y += torch.ops.aten._weight_int4pack_mm_for_cpu(xb, codes, 32, sz).float()
        if y.shape[1] != layer.out_features:
            y = y[:, : layer.out_features]
        y = y.reshape(*x.shape[:-1], layer.out_features) if x.dim() != 2 else y
        return y if layer.bias is None else y + layer.bias


def _zero_plane(first: tuple[torch.Tensor, ...], j: int) -> torch.Tensor:
    """A part without a second plane (a 4-bit matrix stacked with a Q8_0 one): codes 8, scale and zero 0."""
    return torch.full_like(first[0], 8) if j == 0 else torch.zeros_like(first[j])


def _pad_plane(rows: int, k: int, j: int) -> torch.Tensor:
    return torch.full((rows, k), 8, dtype=torch.int32) if j == 0 else torch.zeros(rows, k // 32)


class TritonMethod(QuantMethod):
    """GPU: weights stay in their GGUF type on the device (repacked planes, or canonical blocks with
    --no-repack); up to 8 rows the decode mat-vec (triton_kernels/matvec.py) with the kernel the tuning
    file names for each matrix; from 9 rows the quantized GEMM (gemm.quant_gemm: the weights read once,
    dequantized in registers); from the file's `dense_from_m`, the matrix is dequantized into a scratch
    buffer and multiplied by the vendor GEMM.

    Stacked matrices of one type become one matrix (their rows concatenated: GGUF rows are independent),
    so q/k/v and gate/up cost one launch each; mixed types run one mat-vec per type. The int8 kernels
    multiply x's q8_1 copy: with `q8_1_cache` (GGML_CUDA_Q8_1_CACHE, on by default) x is quantized once
    for every matrix of the layer, or by the op before (wants_q8_1); off, each matrix quantizes its own.
    """

    def __init__(self, repack: bool = True, gemm_dtype: torch.dtype | None = None, tuning_file: str | None = None,
                 q8_1_cache: bool = True) -> None:
        from vegaserve.triton_kernels.tuning import load_tuning

        self.repack = repack
        self.q8_1_cache = q8_1_cache
        self.tuning = load_tuning(path=tuning_file)
        # long prompts: the vendor GEMM on a dequantized copy, in the target's best operand type
        self.gemm_dtype = gemm_dtype or getattr(torch, self.tuning.scratch_dtype)
        # one buffer for the largest matrix or stack of experts dequantized, shared by all layers, at most
        # the tuning file's scratch_mib (a larger one goes through it a window of rows at a time)
        self.scratch: torch.Tensor | None = None
        self._scratch_cap = self.tuning.scratch_mib * 2**20 // self.gemm_dtype.itemsize

    def create(self, layer: QuantLinear, sources: list[WeightSource]) -> None:
        from vegaserve.triton_kernels import layout
        from vegaserve.triton_kernels.gemm import gemm_params
        from vegaserve.triton_kernels.matmul import SUPPORTED
        from vegaserve.triton_kernels.matvec import choose, device_shape

        device = layer.device
        sms = device_shape(device)[0]
        groups: list[tuple[int, list[torch.Tensor], int]] = []  # (type, raws, rows)
        for src, rows in zip(sources, layer.output_sizes, strict=True):
            check_shape(src, (rows, layer.in_features))
            if groups and groups[-1][0] == src.info.type_id:
                groups[-1] = (groups[-1][0], groups[-1][1] + [src.raw.reshape(rows, -1)], groups[-1][2] + rows)
            else:
                groups.append((src.info.type_id, [src.raw.reshape(rows, -1)], rows))
        layer.packed = []
        for type_id, raws, rows in groups:
            if type_id not in SUPPORTED:
                raise ModelLoadError(
                    f"{sources[0].path}: no GPU kernel yet for {sources[0].info.type_name} "
                    f"(tensor {sources[0].info.name}); run on the CPU with --device cpu"
                )
            raw = torch.cat(raws).to(device)
            build = layout.repack if self.repack else layout.canonical
            w = build(raw, type_id, rows, layer.in_features)
            layer.packed.append(w)
            try:  # the kernels and launch parameters by row count, chosen once here, not per token
                layer.tuned.append([choose(w, m, self.tuning) for m in range(1, 9)])
                layer.gemm.append({m: gemm_params(w, m, self.tuning, sms) for m in self._gemm_buckets()})
            except ValueError as e:
                raise ModelLoadError(str(e)) from e
            self._grow_scratch(w.n * w.k, device)

    def create_experts(self, layer, sources: list[WeightSource]) -> None:
        from vegaserve.triton_kernels.layout import stack_experts
        from vegaserve.triton_kernels.matmul import SUPPORTED
        from vegaserve.triton_kernels.matvec import ExpertChoices

        e, k = layer.n_experts, layer.in_features
        groups: list[tuple[int, list[torch.Tensor], int]] = []  # (type, raws [E, rows, row bytes], rows)
        for src, rows in zip(sources, layer.output_sizes, strict=True):
            if src.info.type_id not in SUPPORTED:
                raise ModelLoadError(f"{src.path}: no GPU kernel yet for {src.info.type_name} (tensor {src.info.name})")
            raw = src.raw.reshape(e, rows, -1)
            if groups and groups[-1][0] == src.info.type_id:
                groups[-1] = (groups[-1][0], groups[-1][1] + [raw], groups[-1][2] + rows)
            else:
                groups.append((src.info.type_id, [raw], rows))
        for type_id, raws, rows in groups:
            raw = torch.cat(raws, dim=1)  # each expert's matrices stacked along its rows (on the host)
            w = stack_experts(raw, type_id, e, rows, k, self.repack, layer.device)
            layer.packed.append(w)
            try:  # the decode kernels by assignments a launch (each assignment is one expert at one row)
                layer.tuned.append(ExpertChoices(w, self.tuning))
            except ValueError as err:
                raise ModelLoadError(str(err)) from err
            self._grow_scratch(e * rows * k, layer.device)

    def _grow_scratch(self, elements: int, device: torch.device) -> None:
        want = min(elements, self._scratch_cap)
        if self.scratch is None or self.scratch.numel() < want:
            self.scratch = None  # the old buffer goes back before the larger one is taken
            self.scratch = torch.empty(want, dtype=self.gemm_dtype, device=device)

    def apply_experts(self, layer, x: torch.Tensor, ids: torch.Tensor, x_div: int, tokens: int,
                      q8_1: tuple | None = None, sorts: dict | None = None) -> torch.Tensor:
        from vegaserve.triton_kernels.moe import Experts, expert_matmul
        from vegaserve.triton_kernels.q8_1 import quantize_q8_1

        experts = Experts(ids, x_div, sorts)
        grouped = not self._decode(tokens)
        choices = [c.at(ids.numel()) for c in layer.tuned]
        if not grouped and q8_1 is None and any(c.kernel.int8 for c in choices):
            q8_1 = quantize_q8_1(x)  # once for every int8 stack of the layer
        # the quantized GEMM while an expert's even share of the assignments stays below dense_from_m rows,
        # where a dense matrix's rows would take it (2048 prompt tokens at 8 of 256 experts: 64 rows each);
        # the stack dequantized into the scratch from there
        quant = ids.numel() < self.tuning.dense_from_m * layer.packed[0].experts
        outs = [expert_matmul(x, w, experts, c, grouped, q8_1=q8_1 if c.kernel.int8 else None,
                              scratch=self.scratch, quant=quant)
                for w, c in zip(layer.packed, choices, strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def experts_want_q8_1(self, layer, tokens: int) -> bool:
        return self.q8_1_cache and self._decode(tokens) and any(c.int8 for c in layer.tuned)

    def _decode(self, m: int) -> bool:
        return m < self.tuning.dense_from_m and m <= 8

    def _gemm_buckets(self) -> list[int]:
        """The row counts the quantized GEMM's launches are chosen for: 16, 32, ... below dense_from_m (a
        step takes the first at or above its rows)."""
        out, m = [], 16
        while m // 2 < self.tuning.dense_from_m - 1:
            out.append(m)
            m *= 2
        return out

    def wants_q8_1(self, layer: QuantLinear, m: int) -> bool:
        return self.q8_1_cache and self._decode(m) and any(by_m[m - 1].kernel.int8 for by_m in layer.tuned)

    def apply(self, layer: QuantLinear, x: torch.Tensor, q8_1: tuple | None = None) -> torch.Tensor:
        from vegaserve.triton_kernels.gemm import quant_gemm
        from vegaserve.triton_kernels.matmul import dense_gemm
        from vegaserve.triton_kernels.matvec import matvec
        from vegaserve.triton_kernels.q8_1 import quantize_q8_1

        m = x.shape[0]
        if not self._decode(m):
            xq = x.to(self.gemm_dtype)
            if m < self.tuning.dense_from_m:  # the weights read once, dequantized in registers
                bucket = next(b for b in layer.gemm[0] if b >= m)
                outs = [quant_gemm(xq, w, **by_m[bucket]) for w, by_m in zip(layer.packed, layer.gemm, strict=True)]
            else:
                outs = [dense_gemm(xq, w, self.scratch).float() for w in layer.packed]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            return y if layer.bias is None else y + layer.bias
        choices = [by_m[m - 1] for by_m in layer.tuned]
        if self.q8_1_cache and q8_1 is None and any(c.kernel.int8 for c in choices):
            q8_1 = quantize_q8_1(x)  # once for every int8 matrix of the layer (q, k and v of mixed types)
        shared = q8_1 if self.q8_1_cache else None
        if m == 1 and len(choices) > 1 and all(c.kernel.int8 for c in choices):
            # one row: each matrix writes its columns of the output in place (no cat launch)
            y = torch.empty(1, layer.out_features, device=x.device)
            at = 0
            for w, c in zip(layer.packed, choices, strict=True):
                matvec(x, w, c, q8_1=shared, out=y[:, at : at + w.n])
                at += w.n
        else:
            outs = [matvec(x, w, c, q8_1=shared if c.kernel.int8 else None)
                    for w, c in zip(layer.packed, choices, strict=True)]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if layer.bias is None else y + layer.bias


class QuantLinear(nn.Module):
    """y = x W^T (+ b); W may be several GGUF matrices stacked along the output rows."""

    def __init__(self, in_features: int, output_sizes: list[int], method: QuantMethod) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.method = method
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        self.packed: list = []  # TritonMethod's PackedWeights
        self.tuned: list = []  # and their mat-vec choices (matvec.Choice) for 1..8 rows
        self.gemm: list = []  # and their quantized GEMM's launch parameters by row bucket (16, 32, ...)
        self.device = torch.device("cpu")

    def load(self, sources: list[WeightSource], device: torch.device, biases: list[torch.Tensor] | None = None) -> None:
        self.device = device
        self.method.create(self, sources)
        if biases is not None:
            self.bias = nn.Parameter(torch.cat(biases).float().to(device), requires_grad=False)

    def forward(self, x: torch.Tensor, q8_1: tuple | None = None) -> torch.Tensor:
        """x [T, in]; q8_1: x's q8_1 copy where wants_q8_1(T) and the op before wrote it."""
        return self.method.apply(self, x, q8_1)

    def wants_q8_1(self, m: int) -> bool:
        return self.method.wants_q8_1(self, m)
