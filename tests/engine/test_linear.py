"""The linear layer's GPU strategy (engine/layers/linear.py, TritonMethod) on the decode mat-vec: each matrix
runs the kernel its tuning entry names, chosen once at load (layer.tuned); matrices of one activation share
its q8_1 copy (GGML_CUDA_Q8_1_CACHE) or, with the cache off, quantize their own, with the same outputs; at
one row the int8 matrices write their columns of one output. Under the interpreter on a CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from vegaserve.engine.gguf_file import ModelLoadError, TensorInfo
from vegaserve.engine.layers import linear
from vegaserve.engine.layers.linear import QuantLinear, TritonMethod, WeightSource
from vegaserve.triton_kernels import matvec_int8, matvec_mma, matvec_pieces, q8_1
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.matvec import KERNELS, Choice, reference_matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IDS = {s.name: t for t, s in GGML_TYPES.items()}


def _sources(gen: torch.Generator, k: int, mats: list[tuple[str, int]]) -> list[WeightSource]:
    """WeightSources of random matrices of (type, rows) and k columns, stacked in that order."""
    sources = []
    for name, rows in mats:
        tid = IDS[name]
        raw = random_blocks(tid, rows, k // GGML_TYPES[tid].block_size, gen).to(DEVICE)
        info = TensorInfo(name, tid, name, (rows, k), raw.numel(), 0, 0)
        sources.append(WeightSource(info, raw.reshape(-1), "t.gguf"))
    return sources


def _layer(tmp_path, table: dict, sources: list[WeightSource], k: int, name: str = "t.json", **method) -> QuantLinear:
    f = tmp_path / name
    f.write_text(json.dumps(table))
    layer = QuantLinear(k, [s.info.shape[0] for s in sources], TritonMethod(tuning_file=str(f), **method))
    layer.load(sources, torch.device(DEVICE))
    return layer


def _cpu(w):
    return replace(w, data=w.data.cpu())


def _count_launches(monkeypatch) -> list[str]:
    """Each kernel's launch recorded by name (patched before a layer's load, which keeps the kernel it chose)."""
    calls: list[str] = []
    for name, kernel in list(KERNELS.items()):
        monkeypatch.setitem(KERNELS, name, replace(kernel, launch=lambda *a, _n=name, _k=kernel: calls.append(_n)
                                                   or _k.launch(*a)))
    return calls


def _count_quantizes(monkeypatch) -> list[str]:
    """Each q8_1 quantize of x recorded by who made it: the layer (for all its matrices) or a kernel's
    launcher (for its own)."""
    made: list[str] = []
    real = q8_1.quantize_q8_1
    for module, who in ((q8_1, "layer"), (matvec_int8, "int8"), (matvec_pieces, "pieces"), (matvec_mma, "lanes")):
        monkeypatch.setattr(module, "quantize_q8_1", lambda x, _w=who: made.append(_w) or real(x))
    return made


def test_the_tuning_file_picks_each_matrixs_kernel_and_the_layer_runs_it(tmp_path, monkeypatch):
    """Q4_0, Q8_0 and Q4_K stacked: Q4_0's entry names the lanes kernel, Q4_K's the pieces kernel at one row
    and the int8 kernel above, Q8_0 has none (the tile kernel, the fallback). layer.tuned holds each
    matrix's choice for 1..8 rows, each kernel runs once a call, each part equals its kernel's reference;
    a q8_1 copy of x handed over (as the norm before writes it) is used, not made again."""
    calls = _count_launches(monkeypatch)
    table = {"matvec": {"Q4_0": {"small": {"8": {"kernel": "lanes", "block_n": 16, "nb": 2, "num_warps": 1}}},
                        "Q4_K": {"any": {"1": {"kernel": "pieces", "block_n": 8},
                                         "8": {"kernel": "int8", "block_n": 8}}}}}
    gen = torch.Generator().manual_seed(0)
    k = 256
    layer = _layer(tmp_path, table, _sources(gen, k, [("Q4_0", 24), ("Q8_0", 24), ("Q4_K", 24)]), k)
    assert [[c.kernel.name for c in by_m] for by_m in layer.tuned] == [
        ["lanes"] * 8, ["tiles"] * 8, ["pieces"] + ["int8"] * 7]
    assert all(isinstance(c, Choice) for by_m in layer.tuned for c in by_m)
    assert layer.tuned[0][2].params["block_n"] == 16 and layer.tuned[0][2].params["nb"] == 2
    for m, kernels in ((3, ["int8", "lanes", "tiles"]), (1, ["lanes", "pieces", "tiles"])):
        calls.clear()
        x = torch.randn(m, k, generator=gen)
        y = layer(x.to(DEVICE)).cpu().double()
        assert sorted(calls) == kernels
        for part, w, by_m in zip(y.split(24, dim=-1), layer.packed, layer.tuned, strict=True):
            ref = reference_matvec(x, _cpu(w), by_m[m - 1])
            assert float((part - ref).norm() / ref.norm()) < 1e-5, by_m[m - 1].kernel.name
    assert layer.wants_q8_1(3) and not layer.wants_q8_1(9)
    x = torch.randn(3, k, generator=gen).to(DEVICE)
    y = layer(x)
    made = _count_quantizes(monkeypatch)
    assert torch.equal(layer(x, q8_1.quantize_q8_1(x)), y) and made == ["layer"]  # the copy handed over only


def test_one_row_through_stacked_int8_matrices_of_two_types_needs_no_cat(tmp_path, monkeypatch):
    """Q4_K q/k with a Q6_K v (the Q4_K_M mix): at one row each int8 mat-vec writes its columns of the
    layer's output in place (no torch.cat), and each part equals the reference product on the same q8_1
    activation; at two rows the outputs are concatenated, with the same values per row."""
    gen = torch.Generator().manual_seed(5)
    k = 256
    table = {"matvec": {name: {"any": {"8": {"kernel": "int8", "block_n": 8}}} for name in ("Q4_K", "Q6_K")}}
    layer = _layer(tmp_path, table, _sources(gen, k, [("Q4_K", 16), ("Q4_K", 8), ("Q6_K", 8)]), k)
    assert [w.type_name for w in layer.packed] == ["Q4_K", "Q6_K"]
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(linear.torch, "cat", lambda *a, **kw: cats.append(1) or real_cat(*a, **kw))
    x = torch.randn(2, k, generator=gen).to(DEVICE)
    one = layer(x[:1])
    assert not cats and one.shape == (1, 32)
    both = layer(x)
    assert cats and both.shape == (2, 32)
    for rows, y in ((1, one), (2, both)):
        for part, w, by_m in zip(y.split([24, 8], dim=-1), layer.packed, layer.tuned, strict=True):
            ref = reference_matvec(x[:rows].cpu(), _cpu(w), by_m[rows - 1])
            assert float((part.cpu().double() - ref).norm() / ref.norm()) < 1e-5


def test_q8_1_cache_off_quantizes_per_matrix_and_gives_the_same_outputs(tmp_path, monkeypatch):
    """GGML_CUDA_Q8_1_CACHE: on, x is quantized once a layer call for all its int8 matrices (q/k/v as Q4_K
    and Q6_K) and the op before may hand that copy over (wants_q8_1); off, no copy is asked for and each
    int8 matrix's launcher quantizes x itself. The same q8_1 either way, so the same outputs bit for bit,
    at one row (the columns written in place; pieces and int8) and at three (int8 and lanes)."""
    table = {"matvec": {"Q4_K": {"any": {"1": {"kernel": "pieces", "block_n": 8},
                                         "8": {"kernel": "int8", "block_n": 8}}},
                        "Q6_K": {"any": {"1": {"kernel": "int8", "block_n": 8},
                                         "8": {"kernel": "lanes", "block_n": 16, "num_warps": 1}}}}}
    k = 256
    sources = _sources(torch.Generator().manual_seed(7), k, [("Q4_K", 16), ("Q4_K", 8), ("Q6_K", 8)])
    layers = {cache: _layer(tmp_path, table, sources, k, f"t{int(cache)}.json", q8_1_cache=cache)
              for cache in (True, False)}
    made = _count_quantizes(monkeypatch)
    for m in (1, 3):
        assert layers[True].wants_q8_1(m) and not layers[False].wants_q8_1(m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(8 + m)).to(DEVICE)
        made.clear()
        shared = layers[True](x)
        assert made == ["layer"]
        made.clear()
        own = layers[False](x)
        assert sorted(made) == sorted(c[m - 1].kernel.name for c in layers[False].tuned)  # one per int8 matrix
        assert torch.equal(shared, own)


def test_a_tuning_entry_its_kernel_cannot_serve_fails_the_model_load_naming_the_file(tmp_path):
    table = {"matvec": {"Q5_K": {"any": {"1": {"kernel": "int8"}}}}}
    sources = _sources(torch.Generator().manual_seed(9), 256, [("Q5_K", 16)])
    with pytest.raises(ModelLoadError, match=r"t\.json.*names kernel 'int8', which does not serve Q5_K"):
        _layer(tmp_path, table, sources, 256)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _int4_reference(x: torch.Tensor, sources: list[WeightSource], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What CPUMethod computes, in float64, and one bf16 ulp of each plane's output summed (the bound): each
    block's scale and zero in bf16 as the kernel keeps them, x rounded to bf16, the codes exact, each plane's
    product rounded to bf16 as the kernel returns it."""
    from vegaserve.engine.layers.linear import _INT4_TYPES, _int4_planes

    outs, ulps = [], []
    for src in sources:
        rows = src.info.shape[0]
        planes = _int4_planes(src.info.type_id, src.raw.reshape(rows, k // 32, _INT4_TYPES[src.info.type_id]))
        y, ulp = 0, 0
        for codes, scale, zero in planes:
            w = (codes.double() - 8) * _bf16(scale).repeat_interleave(32, 1) + _bf16(zero).repeat_interleave(32, 1)
            exact = _bf16(x) @ w.T
            y = y + _bf16(exact)
            ulp = ulp + torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        outs.append(y)
        ulps.append(ulp)
    return torch.cat(outs, dim=1), torch.cat(ulps, dim=1)


@pytest.mark.parametrize("mats", [[("Q4_1", 40)], [("Q4_0", 16), ("Q4_1", 24)], [("Q8_0", 37)],
                                  [("Q4_1", 19), ("Q8_0", 13)], [("Q6_K", 16)]],
                         ids=["q4_1", "q4_0+q4_1", "q8_0", "q4_1+q8_0", "q6_k-dequantized"])
@pytest.mark.parametrize("m", [1, 5])
def test_the_cpu_method_multiplies_block_types_through_int4_planes(mats, m):
    """Q4_0, Q4_1 and Q8_0 (two planes: 16 hi + lo) through torch's int4 kernel: every output within a bf16
    ulp of the float64 product of the same bf16-rounded scales and activations, rounded to bf16 per plane; against
    the dequantized f32 matrix, within the bf16 rounding (1e-2). Row counts not a multiple of 16 are padded;
    other types stay dequantized f32."""
    if not linear.CPUMethod.available:
        pytest.skip("this torch has no _weight_int4pack_mm_for_cpu")
    gen = torch.Generator().manual_seed(len(mats) * 10 + m)
    k = 256
    sources = [replace(s, raw=s.raw.cpu()) for s in _sources(gen, k, mats)]
    layer = QuantLinear(k, [s.info.shape[0] for s in sources], linear.CPUMethod())
    layer.load(sources, torch.device("cpu"))
    exact = QuantLinear(k, [s.info.shape[0] for s in sources], linear.ReferenceMethod())
    exact.load(sources, torch.device("cpu"))
    x = torch.randn(m, k, generator=gen)
    y, want = layer(x), exact(x).double()
    assert y.shape == (m, layer.out_features) and y.dtype == torch.float32
    if mats[0][0] == "Q6_K":
        assert layer.int4 is None and torch.equal(y, exact(x))
        return
    assert layer.int4 is not None and len(layer.int4) == (2 if any(t == "Q8_0" for t, _ in mats) else 1)
    ref, ulp = _int4_reference(x, sources, k)
    assert bool(((y.double() - ref).abs() <= ulp + 1e-6).all())
    assert float((y.double() - want).norm() / want.norm()) < 1e-2


def test_rows_past_eight_take_the_quantized_gemm_then_the_dense_path_at_dense_from_m(tmp_path, monkeypatch):
    """Q4_K and Q8_0 stacked, dense_from_m 40: 9..39 rows run the quantized GEMM once per matrix with the
    launch parameters chosen at load for the row bucket (the file's gemm entry over the rule), 40 rows the
    dequantize + GEMM path; both equal the reference product (f32 operands)."""
    from vegaserve.triton_kernels import gemm, matmul

    ran: list[tuple[str, dict]] = []
    real_gemm, real_dense = gemm.quant_gemm, matmul.dense_gemm
    monkeypatch.setattr(gemm, "quant_gemm", lambda x, w, **p: ran.append(("gemm", p)) or real_gemm(x, w, **p))
    monkeypatch.setattr(matmul, "dense_gemm", lambda x, w, s=None: ran.append(("dense", {})) or real_dense(x, w, s))
    table = {"prefill": {"dense_from_m": 40}, "gemm": {"Q8_0": {"any": {"32": {"block_n": 32, "split_k": 2}}}}}
    gen = torch.Generator().manual_seed(5)
    k = 512
    layer = _layer(tmp_path, table, _sources(gen, k, [("Q4_K", 40), ("Q8_0", 24)]), k, gemm_dtype=torch.float32)
    assert [sorted(by_m) for by_m in layer.gemm] == [[16, 32, 64]] * 2
    assert layer.gemm[1][32]["block_n"] == 32 and layer.gemm[1][32]["split_k"] == 2
    for m, path in ((9, "gemm"), (16, "gemm"), (32, "gemm"), (39, "gemm"), (40, "dense")):
        ran.clear()
        x = torch.randn(m, k, generator=gen)
        y = layer(x.to(DEVICE)).cpu().double()
        assert [r[0] for r in ran] == [path, path], m
        if path == "gemm":
            bucket = 16 if m <= 16 else 32 if m <= 32 else 64
            assert ran[1][1] == layer.gemm[1][bucket]
        for part, w in zip(y.split([40, 24], dim=-1), layer.packed, strict=True):
            ref = matmul.reference_matmul(x, _cpu(w))
            assert float((part - ref).norm() / ref.norm()) < 1e-5, (m, w.type_name)
    assert not layer.wants_q8_1(9)


def test_a_prompts_experts_take_the_quantized_gemm_while_their_share_stays_below_dense_from_m(tmp_path, monkeypatch):
    """A prompt through 4 Q4_K experts, two a token, dense_from_m 16: the quantized grouped GEMM while the
    assignments stay below 16 rows an expert on average (12 and 20 tokens: 24 and 40 assignments), the stack
    dequantized into the scratch from 64 on (40 tokens); either equals the experts' reference product."""
    from vegaserve.engine.layers.moe import ExpertLinear
    from vegaserve.triton_kernels import moe

    ran: list[str] = []
    real_quant, real_dense = moe.grouped_quant_gemm, moe.grouped_gemm
    monkeypatch.setattr(moe, "grouped_quant_gemm", lambda *a, **p: ran.append("quant") or real_quant(*a, **p))
    monkeypatch.setattr(moe, "grouped_gemm", lambda *a, **p: ran.append("dense") or real_dense(*a, **p))
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"prefill": {"dense_from_m": 16}}))
    E, N, K = 4, 24, 256
    gen = torch.Generator().manual_seed(9)
    raw = random_blocks(IDS["Q4_K"], E * N, K // 256, gen).to(DEVICE)
    info = TensorInfo("ffn_gate_exps", IDS["Q4_K"], "Q4_K", (E, N, K), raw.numel(), 0, 0)
    layer = ExpertLinear(E, K, [N], TritonMethod(tuning_file=str(f), gemm_dtype=torch.float32))
    layer.load([WeightSource(info, raw.reshape(-1), "t.gguf")], torch.device(DEVICE))
    for tokens, path in ((12, "quant"), (20, "quant"), (40, "dense")):
        ran.clear()
        x = torch.randn(tokens, K, generator=gen).to(DEVICE)
        ids = torch.randint(0, E, (tokens * 2,), generator=gen).to(DEVICE)
        y = layer(x, ids, 2, tokens)
        assert ran == [path], tokens
        ref = moe.reference_expert_matmul(x.cpu(), _cpu(layer.packed[0]), moe.Experts(ids, 2))
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, tokens


def test_the_expert_launches_of_one_step_share_one_sort_of_its_assignments(tmp_path, monkeypatch):
    """Two expert stacks over one step's assignments (a layer's gate/up and down) with one memo: the
    assignments are sorted by expert once, and each stack's output equals its output without the memo; for
    the dequantized stack's path (dense_from_m 9) and the quantized GEMM's (dense_from_m 64)."""
    from vegaserve.engine.layers.moe import ExpertLinear
    from vegaserve.triton_kernels import moe

    sorts_made: list[int] = []
    real = moe.sort_by_expert
    monkeypatch.setattr(moe, "sort_by_expert", lambda *a: sorts_made.append(1) or real(*a))
    E, N, K, tokens = 4, 32, 256, 20
    gen = torch.Generator().manual_seed(10)
    for dense_from_m in (9, 64):
        f = tmp_path / f"t{dense_from_m}.json"
        f.write_text(json.dumps({"prefill": {"dense_from_m": dense_from_m}}))
        layers = []
        for name, k in (("ffn_gate_up_exps", K), ("ffn_down_exps", N)):
            raw = random_blocks(IDS["Q8_0"], E * N, k // 32, gen).to(DEVICE)
            info = TensorInfo(name, IDS["Q8_0"], "Q8_0", (E, N, k), raw.numel(), 0, 0)
            layer = ExpertLinear(E, k, [N], TritonMethod(tuning_file=str(f), gemm_dtype=torch.float32))
            layer.load([WeightSource(info, raw.reshape(-1), "t.gguf")], torch.device(DEVICE))
            layers.append(layer)
        x = torch.randn(tokens, K, generator=gen).to(DEVICE)
        ids = torch.randint(0, E, (tokens * 2,), generator=gen).to(DEVICE)
        alone = layers[0](x, ids, 2, tokens)
        alone_down = layers[1](alone, ids, 1, tokens)
        sorts_made.clear()
        memo: dict = {}
        shared = layers[0](x, ids, 2, tokens, sorts=memo)
        shared_down = layers[1](shared, ids, 1, tokens, sorts=memo)
        assert len(sorts_made) == 1, dense_from_m
        assert torch.equal(shared, alone) and torch.equal(shared_down, alone_down), dense_from_m


def test_a_stack_of_experts_launches_with_the_entry_for_its_assignments(tmp_path, monkeypatch):
    """The tuning file's `experts` table, by assignments a launch: a Q8_0 stack whose `matvec` entry names
    the int8 kernel, with `experts` entries at 4 assignments (split_k 2) and 8 (the tile kernel). Two experts
    a token: 1-2 tokens (2, 4 assignments) launch the first, 3-4 tokens (6, 8) the second, 8 tokens (16)
    the largest; without the table every count takes the int8 kernel's rule. Each product equals the
    reference. A kernel the table names that does not exist is refused at load, the entry named."""
    from vegaserve.engine.layers.moe import ExpertLinear
    from vegaserve.triton_kernels import moe

    E, N, K = 4, 32, 256
    gen = torch.Generator().manual_seed(11)
    raw = random_blocks(IDS["Q8_0"], E * N, K // 32, gen).to(DEVICE)
    info = TensorInfo("ffn_down_exps", IDS["Q8_0"], "Q8_0", (E, N, K), raw.numel(), 0, 0)
    matvec_table = {"Q8_0": {"any": {"1": {"kernel": "int8"}}}}

    def load(table: dict) -> ExpertLinear:
        f = tmp_path / "t.json"
        f.write_text(json.dumps(table))
        layer = ExpertLinear(E, K, [N], TritonMethod(tuning_file=str(f), gemm_dtype=torch.float32))
        layer.load([WeightSource(info, raw.reshape(-1), "t.gguf")], torch.device(DEVICE))
        return layer

    launched: list[tuple[str, int]] = []
    real = moe.expert_matmul
    monkeypatch.setattr(moe, "expert_matmul", lambda x, w, e, c, *a, **p: launched.append(
        (c.kernel.name, c.params["split_k"])) or real(x, w, e, c, *a, **p))
    tuned = load({"matvec": matvec_table, "experts": {"Q8_0": {"any": {"4": {"split_k": 2}, "8": {"kernel": "tiles"}}}}})
    plain = load({"matvec": matvec_table})
    rule_split = plain.tuned[0].at(1).params["split_k"]
    for tokens, want in ((1, ("int8", 2)), (2, ("int8", 2)), (3, ("tiles", 1)), (4, ("tiles", 1)), (8, ("tiles", 1))):
        x = torch.randn(tokens, K, generator=gen).to(DEVICE)
        ids = torch.randint(0, E, (tokens * 2,), generator=gen).to(DEVICE)
        for layer, expect in ((tuned, want), (plain, ("int8", rule_split))):
            launched.clear()
            y = layer(x, ids, 2, tokens)
            assert launched == [expect], (tokens, launched)
            ref = moe.reference_expert_matmul(x.cpu(), _cpu(layer.packed[0]), moe.Experts(ids.cpu(), 2))
            if expect[0] == "int8":  # the int8 kernel multiplies x's q8_1 form
                q, d, _ = q8_1.reference_quantize_q8_1(x.cpu())
                xq = (q.double().view(tokens, -1, 32) * d.double()[..., None]).view(tokens, K)
                ref = moe.reference_expert_matmul(xq, _cpu(layer.packed[0]), moe.Experts(ids.cpu(), 2))
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, (tokens, expect)
    with pytest.raises(ModelLoadError, match="experts entry at 4 assignments names kernel 'nope'"):
        load({"matvec": matvec_table, "experts": {"Q8_0": {"any": {"4": {"kernel": "nope"}}}}})
