"""benchmarks/synth_gguf.py: llama.cpp's Q4_K_M type mix per tensor, the other type choices, the padded
control tokens, and a written file that the engine loads and generates from. The mixture-of-experts presets:
their plans count the tensors and bytes llama.cpp reports for the published files, a preset at the dims of
tests/data/moe's llama.cpp-converted models plans their tensor names, shapes and types and writes their
`{arch}.*` keys, and tiny written files load in the engine with finite logits."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import gguf
import pytest
import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams

N_LAYERS = 8  # use-more-bits layers of 8: i < 1, i >= 7, (i - 1) % 3 == 2  ->  0, 3, 6, 7
MORE_BITS_OF_8 = {0, 3, 6, 7}
SMOLLM2_VOCAB = 49152
MOE_DATA = Path(__file__).resolve().parents[1] / "data" / "moe"


@pytest.fixture(scope="module")
def synth(gguf_factory: ModuleType) -> ModuleType:
    return gguf_factory.synth_gguf


@pytest.fixture(scope="module")
def written(synth: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The tiny preset with 8 layers in Q4_K_M, written through the script's main(); (path, its stdout)."""
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = synth.main(["--preset", "tiny", "--type", "Q4_K_M", "--layers", str(N_LAYERS), "--out", str(path)])
    assert rc == 0
    return path, out.getvalue()


@pytest.fixture(scope="module")
def core(written: tuple[Path, str]) -> EngineCore:
    config = EngineConfig.from_dict({"model": {"path": str(written[0])}, "cache": {"context_size": 64}, "device": "cpu"})
    return EngineCore(config, show_progress=False)


# -- the type mix ---------------------------------------------------------------------------------------


def test_use_more_bits_is_llama_cpps_rule(synth: ModuleType) -> None:
    # src/llama-quant.cpp: i < n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2, integer division
    assert {i for i in range(8) if synth.use_more_bits(i, 8)} == MORE_BITS_OF_8
    expected_32 = set(range(4)) | set(range(28, 32)) | {6, 9, 12, 15, 18, 21, 24, 27}
    assert {i for i in range(32) if synth.use_more_bits(i, 32)} == expected_32


def test_written_q4_k_m_has_the_type_of_each_tensor(core: EngineCore) -> None:
    types = {name: t.type_name for name, t in core.gguf.tensors.items()}
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"  # untied: the embedding keeps the base type
    for name, type_name in types.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if name.endswith("norm.weight"):
            assert type_name == "F32", name
        elif m and m[2] in ("attn_v", "ffn_down"):
            assert type_name == ("Q6_K" if int(m[1]) in MORE_BITS_OF_8 else "Q4_K"), name
        elif m:
            assert type_name == "Q4_K", name
    assert sum(name.startswith("blk.") for name in types) == N_LAYERS * 9


def test_llama3_8b_q4_k_m_plan_counts_the_tensors_llama_cpp_reports(synth: ModuleType) -> None:
    # llama.cpp loading Meta-Llama-3-8B Q4_K_M: "type f32: 65 tensors, type q4_K: 193, type q6_K: 33"
    plan = synth.tensor_plan(synth.PRESETS["llama3-8b"], "Q4_K_M")
    assert Counter(t.type_name for t in plan) == {"F32": 65, "Q4_K": 193, "Q6_K": 33}
    assert sum(t.shape[0] * (t.shape[1] if len(t.shape) == 2 else 1) for t in plan) == 8_030_261_248


def test_mxfp4_keeps_embedding_and_output_in_q8_0(synth: ModuleType) -> None:
    plan = {t.name: t.type_name for t in synth.tensor_plan(synth.PRESETS["tiny"], "MXFP4")}
    assert plan.pop("token_embd.weight") == plan.pop("output.weight") == "Q8_0"
    assert {t for n, t in plan.items() if not n.endswith("norm.weight")} == {"MXFP4"}


@pytest.mark.parametrize("type_name", ["Q8_0", "IQ4_NL", "Q4_0", "F16"])
def test_a_single_type_goes_to_every_matrix(synth: ModuleType, type_name: str) -> None:
    plan = synth.tensor_plan(synth.PRESETS["tiny"], type_name)
    assert {t.type_name for t in plan if len(t.shape) == 2} == {type_name}


def test_qwen3_preset_has_qk_norms_and_wide_heads(synth: ModuleType) -> None:
    plan = {t.name: t.shape for t in synth.tensor_plan(synth.PRESETS["qwen3-14b"], "Q8_0")}
    assert plan["blk.0.attn_q_norm.weight"] == plan["blk.0.attn_k_norm.weight"] == (128,)
    assert plan["blk.39.attn_q.weight"] == (40 * 128, 5120)
    assert plan["blk.0.attn_k.weight"] == (8 * 128, 5120)
    assert plan["output.weight"] == (151936, 5120)


def test_tied_llama_1b_q4_k_m_stores_the_embedding_as_the_output(synth: ModuleType) -> None:
    # llama.cpp quantizes a tied embedding with the output tensor's type
    plan = {t.name: t.type_name for t in synth.tensor_plan(synth.PRESETS["llama-1b"], "Q4_K_M")}
    assert "output.weight" not in plan
    assert plan["token_embd.weight"] == "Q6_K"


def test_an_unknown_type_is_refused(synth: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown weight type 'Q9_0'"):
        synth.tensor_plan(synth.PRESETS["tiny"], "Q9_0")


# -- the written file -----------------------------------------------------------------------------------


def test_main_prints_the_size_and_the_type_counts(written: tuple[Path, str]) -> None:
    path, out = written
    assert f"({path.stat().st_size} bytes)" in out
    # 8 layers x 2 norms + output_norm; attn_v and ffn_down on 4 layers + output; 7 matrices x 8 - 8 + token_embd
    assert "tensor types: F32 17, Q4_K 49, Q6_K 9" in out


def test_vocabulary_is_smollm2_padded_with_control_tokens(core: EngineCore, synth: ModuleType) -> None:
    md = core.gguf.metadata
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == core.arch.vocab_size == SMOLLM2_VOCAB + 64
    assert tokens[:SMOLLM2_VOCAB] == synth.smollm2_tokenizer_metadata()["tokenizer.ggml.tokens"]
    assert tokens[SMOLLM2_VOCAB:] == [f"<|pad_{i}|>" for i in range(64)]
    assert set(types[SMOLLM2_VOCAB:]) == {3}  # control
    assert core.tokenizer.encode("a<|pad_5|>", add_special_tokens=False, parse_special=True)[-1] == SMOLLM2_VOCAB + 5
    assert "<|im_start|>" in md["tokenizer.chat_template"]


def test_engine_loads_the_file_and_generates(core: EngineCore) -> None:
    req = GenerateRequest([1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outs = core.generate_sync(req)
    ids = [t for o in outs for t in o.token_ids]
    assert len(ids) == 5 and all(0 <= t < core.arch.vocab_size for t in ids)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"


def test_same_seed_writes_the_same_bytes(synth: ModuleType, tmp_path: Path) -> None:
    paths = [tmp_path / f"{name}.gguf" for name in ("a", "b", "c")]
    for path, seed in zip(paths, (0, 0, 1), strict=True):
        synth.write_synth_gguf(path, "tiny", "Q8_0", n_layers=1, seed=seed)
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b != c


# -- mixture-of-experts presets -------------------------------------------------------------------------


def _counts_and_gib(synth: ModuleType, preset, type_name: str) -> tuple[dict[str, int], float]:
    plan = synth.tensor_plan(synth.PRESETS[preset] if isinstance(preset, str) else preset, type_name)
    return Counter(t.type_name for t in plan), round(sum(synth._nbytes(t) for t in plan) / 2**30, 2)


def test_qwen3_30b_a3b_q4_k_m_plan_counts_the_tensors_and_bytes_llama_cpp_reports(synth: ModuleType) -> None:
    # llama.cpp loading Qwen3-30B-A3B Q4_K_M (unsloth): "type f32: 241, q4_K: 289, q6_K: 49", "17.28 GiB"
    counts, gib = _counts_and_gib(synth, "qwen3-30b-a3b", "Q4_K_M")
    assert counts == {"F32": 241, "Q4_K": 289, "Q6_K": 49}
    assert gib == 17.28


@pytest.mark.parametrize(("preset", "n_layers", "counts", "gib"), [
    # llama.cpp loading the published gpt-oss-20b / -120b MXFP4 GGUFs (file type "MXFP4 MoE")
    ("gpt-oss-20b", None, {"F32": 289, "Q8_0": 98, "MXFP4": 72}, 11.27),
    ("gpt-oss-120b", None, {"F32": 433, "Q8_0": 146, "MXFP4": 108}, 59.02),
    ("gpt-oss-120b", 12, {"F32": 145, "Q8_0": 50, "MXFP4": 36}, 20.44),  # the load benchmark's cut
])  # fmt: skip
def test_gpt_oss_mxfp4_plan_counts_the_tensors_and_bytes_llama_cpp_reports(
    synth: ModuleType, preset: str, n_layers: int | None, counts: dict[str, int], gib: float
) -> None:
    p = synth.PRESETS[preset]
    assert _counts_and_gib(synth, replace(p, n_layers=n_layers or p.n_layers), "MXFP4") == (counts, gib)


def test_q4_k_m_stores_the_experts_down_matrices_like_ffn_down(synth: ModuleType) -> None:
    # llama-quant.cpp reads the layer of an expert tensor from its name; 48 layers: i < 6, i >= 42, (i-6) % 3 == 2
    more_bits = set(range(6)) | set(range(8, 42, 3)) | set(range(42, 48))
    plan = {t.name: t.type_name for t in synth.tensor_plan(synth.PRESETS["qwen3-30b-a3b"], "Q4_K_M")}
    for kind in ("ffn_down_exps", "attn_v"):
        assert {i for i in range(48) if plan[f"blk.{i}.{kind}.weight"] == "Q6_K"} == more_bits, kind
    assert {plan[f"blk.{i}.ffn_{n}_exps.weight"] for i in range(48) for n in ("gate", "up")} == {"Q4_K"}
    assert {plan[f"blk.{i}.ffn_gate_inp.weight"] for i in range(48)} == {"F32"}
    assert (plan["token_embd.weight"], plan["output.weight"]) == ("Q4_K", "Q6_K")


def test_mxfp4_on_experts_is_llama_quantizes_mxfp4_moe(synth: ModuleType) -> None:
    plan = synth.tensor_plan(synth.PRESETS["gpt-oss-20b"], "MXFP4")
    assert {t.type_name for t in plan if t.name.endswith("_exps.weight")} == {"MXFP4"}
    assert {t.type_name for t in plan if len(t.shape) == 2 and t.around is None} == {"Q8_0"}
    assert {t.type_name for t in plan if t.around is not None} == {"F32"}  # norms, biases, sinks, routers
    assert synth._file_type("MXFP4", True) == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)


@pytest.mark.parametrize("type_name", ["Q8_0", "IQ4_NL", "F16"])
def test_a_single_type_goes_to_every_qwen3moe_matrix_but_the_router(synth: ModuleType, type_name: str) -> None:
    plan = synth.tensor_plan(synth.PRESETS["qwen3-30b-a3b"], type_name)
    assert {t.type_name for t in plan if t.around is None} == {type_name}
    assert {t.type_name for t in plan if "ffn_gate_inp" in t.name} == {"F32"}


# The dims of tests/data/moe's tiny models (its README), each made by llama.cpp's convert_hf_to_gguf.py and
# llama-quantize Q8_0; the other fields (rope, eps, YaRN) are the real presets'.
_REFERENCE_DIMS = {
    "qwen3moe": ("qwen3-30b-a3b", dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim_override=32, ffn=64,
                                       context=4096, experts=8, experts_used=2, expert_ff=32)),
    "gpt-oss": ("gpt-oss-20b", dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim_override=32, ffn=32,
                                    experts=4, experts_used=2, expert_ff=32, sliding_window=8)),
}  # fmt: skip


def _reference_preset(synth: ModuleType, arch: str, vocab: int):
    preset, dims = _REFERENCE_DIMS[arch]
    return replace(synth.PRESETS[preset], vocab=vocab, **dims)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_moe_plan_has_the_tensors_of_llama_cpps_converted_file(synth: ModuleType, arch: str) -> None:
    ref = gguf.GGUFReader(MOE_DATA / f"{arch}-q8_0.gguf")
    want = {t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name) for t in ref.tensors}
    plan = synth.tensor_plan(_reference_preset(synth, arch, 320), "Q8_0")
    assert {t.name: (t.shape, t.type_name) for t in plan} == want


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_moe_file_has_the_arch_keys_of_llama_cpps_converted_file(
    synth: ModuleType, arch: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{arch}.gguf"
    synth.write_synth_gguf(path, _reference_preset(synth, arch, SMOLLM2_VOCAB + 64), "Q8_0")
    ours, ref = gguf.GGUFReader(path).fields, gguf.GGUFReader(MOE_DATA / f"{arch}-q8_0.gguf").fields
    keys = [k for k in ref if k.startswith(f"{arch}.") or k == "general.file_type"]
    assert len(keys) >= 13
    for k in keys:
        assert k in ours, k
        assert ours[k].types == ref[k].types, k
        assert ours[k].contents() == pytest.approx(ref[k].contents()), k


# Tiny files of the real presets' architectures, through write_synth_gguf's layer cut (48 -> 2, 24 -> 2)
_TINY_MOE = {
    "qwen3moe": ("qwen3-30b-a3b", "Q4_K_M", dict(hidden=256, n_heads=4, n_kv_heads=2, head_dim_override=64, ffn=512,
                                                 experts=8, experts_used=2, expert_ff=256)),
    "gpt-oss": ("gpt-oss-20b", "MXFP4", dict(hidden=64, n_heads=4, n_kv_heads=2, head_dim_override=32, ffn=64,
                                             experts=4, experts_used=2, expert_ff=64, sliding_window=8)),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(_TINY_MOE))
def moe_core(request, synth: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    preset, type_name, dims = _TINY_MOE[request.param]
    path = tmp_path_factory.mktemp("synth_moe") / f"{request.param}.gguf"
    p = replace(synth.PRESETS[preset], vocab=SMOLLM2_VOCAB + 64, **dims)
    synth.write_synth_gguf(path, p, type_name, n_layers=2)
    config = EngineConfig.from_dict({"model": {"path": str(path)}, "cache": {"context_size": 64}, "device": "cpu"})
    return EngineCore(config, show_progress=False)


def test_engine_reads_the_moe_files_shape(moe_core: EngineCore) -> None:
    a = moe_core.arch
    assert a.n_layers == 2 and a.moe is not None and a.vocab_size == SMOLLM2_VOCAB + 64
    if a.architecture == "gpt-oss":
        assert (a.moe.experts, a.moe.used, a.moe.expert_ff, a.moe.biases) == (4, 2, 64, True)
        assert (a.sliding_window, a.attn_sinks, a.o_bias, a.qkv_bias) == (8, True, True, True)
        rope = a.rope_scaling
        assert (rope.kind, rope.factor, rope.original_context_length) == ("yarn", 32.0, 4096)
    else:
        assert a.architecture == "qwen3moe"
        assert (a.moe.experts, a.moe.used, a.moe.expert_ff, a.qk_norm, a.head_dim) == (8, 2, 256, True, 64)


def test_engine_computes_finite_logits_from_the_moe_file(moe_core: EngineCore) -> None:
    ids = [1, 200, 3000, 40000, 49200]
    logits = moe_core.forward_logits(ids).float()
    assert logits.shape == (len(ids), SMOLLM2_VOCAB + 64)
    assert torch.isfinite(logits).all()
    assert math.isfinite(float(logits.std())) and float(logits.std()) > 0


# -- hybrid linear-attention presets --------------------------------------------------------------------

HYBRID_DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid"
# The dims of tests/data/hybrid's converted models (their layers [linear, full, linear] are the interval rule
# with interval 2; qwen35's has its MTP block and ties its head); rope, eps and the rest are the real presets'.
_TINY_HYBRID = dict(n_layers=3, hidden=64, n_heads=2, n_kv_heads=1, head_dim_override=32, rope_dim_override=8,
                    rope_sections=(1, 1, 2, 0), ffn=64, context=4096, rope_theta=1e6, linear_heads=(2, 4),
                    linear_head_dim=16, full_attention_interval=2)
_HYBRID_REFERENCE = {
    "qwen35": ("qwen3.6-27b", dict(_TINY_HYBRID, nextn=1, tied=True)),
    "qwen35moe": ("qwen3.6-35b-a3b", dict(_TINY_HYBRID, nextn=0, experts=4, experts_used=2, expert_ff=32, shared_ff=32)),
}


@pytest.mark.parametrize("arch", sorted(_HYBRID_REFERENCE))
def test_hybrid_plan_has_the_tensors_of_llama_cpps_converted_file(synth: ModuleType, arch: str) -> None:
    ref = gguf.GGUFReader(HYBRID_DATA / f"{arch}-q8_0.gguf")
    want = {t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name) for t in ref.tensors}
    preset, dims = _HYBRID_REFERENCE[arch]
    plan = synth.tensor_plan(replace(synth.PRESETS[preset], vocab=320, **dims), "Q8_0")
    assert {t.name: (t.shape, t.type_name) for t in plan} == want


@pytest.mark.parametrize("arch", sorted(_HYBRID_REFERENCE))
def test_hybrid_file_has_the_arch_keys_of_llama_cpps_converted_file(synth: ModuleType, arch: str, tmp_path: Path) -> None:
    """All but full_attention_interval: the converter writes its default 4 when the config lists layer_types
    (the recurrent_layers flags, compared too, are what both readers follow)."""
    path = tmp_path / f"{arch}.gguf"
    preset, dims = _HYBRID_REFERENCE[arch]
    synth.write_synth_gguf(path, replace(synth.PRESETS[preset], vocab=SMOLLM2_VOCAB + 64, **dims), "Q8_0")
    ours, ref = gguf.GGUFReader(path).fields, gguf.GGUFReader(HYBRID_DATA / f"{arch}-q8_0.gguf").fields
    keys = [k for k in ref if (k.startswith(f"{arch}.") or k == "general.file_type")
            and k != f"{arch}.full_attention_interval"]
    assert len(keys) >= 18 and f"{arch}.attention.recurrent_layers" in keys
    for k in keys:
        assert k in ours, k
        assert ours[k].contents() == pytest.approx(ref[k].contents()), k


@pytest.mark.parametrize("preset", ["qwen3.6-27b", "qwen3.6-35b-a3b"])
def test_hybrid_q4_k_m_plan_gives_every_tensor_llama_quantizes_type(synth: ModuleType, preset: str) -> None:
    """llama-quantize Q4_K_M on the preset at its full layer count (small dims; tests/data/hybrid/README.md):
    a linear layer's attn_qkv counts with the attn_v tensors (one of the two a block, the MTP block's too), so
    both are Q6_K on the use-more-bits blocks; the convolution, decay and norms stay F32."""
    ref = json.loads((HYBRID_DATA / "q4_k_m_types.json").read_text())[preset]
    plan = synth.tensor_plan(replace(synth.PRESETS[preset], **ref["dims"]), "Q4_K_M")
    assert {t.name: t.type_name for t in plan} == ref["types"]


def test_qwen3_6_27b_q4_k_m_plan_has_the_published_files_size(synth: ModuleType) -> None:
    """Real shapes: a linear layer's q/k/v rows (2 x 16 key heads and 48 value heads of 128), q's rows doubled by
    the output gate, the MTP block's eh_proj. Without the MTP block (files converted before llama.cpp kept it)
    the plan is 15.401 GiB at 4.919 bits a weight, as llama.cpp prints the published Qwen3.6-27B Q4_K_M
    (mradermacher's); qwen3.6-35b-a3b's 19.70 GiB (21.2 GB) is the 21 GB listed for its published Q4_K_M."""
    plan = {t.name: t for t in synth.tensor_plan(synth.PRESETS["qwen3.6-27b"], "Q4_K_M")}
    assert plan["blk.0.attn_qkv.weight"].shape == (2 * 16 * 128 + 48 * 128, 5120)
    assert plan["blk.3.attn_q.weight"].shape == (2 * 24 * 256, 5120)
    assert plan["blk.0.ssm_conv1d.weight"].shape == (10240, 4)
    assert plan["blk.64.nextn.eh_proj.weight"].shape == (5120, 10240) and len(plan) == 866
    trunk = synth.tensor_plan(replace(synth.PRESETS["qwen3.6-27b"], nextn=0), "Q4_K_M")
    n_bytes, n_weights = sum(synth._nbytes(t) for t in trunk), sum(math.prod(t.shape) for t in trunk)
    assert (round(n_bytes / 2**30, 3), round(8 * n_bytes / n_weights, 3)) == (15.401, 4.919)
    moe = synth.tensor_plan(replace(synth.PRESETS["qwen3.6-35b-a3b"], nextn=0), "Q4_K_M")
    assert round(sum(synth._nbytes(t) for t in moe) / 2**30, 2) == 19.70


@pytest.fixture(scope="module", params=["qwen3.6-27b", "qwen3.6-35b-a3b"])
def hybrid_core(request, synth: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    """The presets cut to 4 trunk layers (three DeltaNet, one full attention) and their MTP block, at dims
    of whole Q4_K blocks, through write_synth_gguf's Q4_K_M mix."""
    dims = dict(hidden=256, n_heads=2, n_kv_heads=1, head_dim_override=128, rope_dim_override=32, ffn=256,
                linear_heads=(2, 4), linear_head_dim=64, vocab=SMOLLM2_VOCAB + 64)
    if request.param == "qwen3.6-35b-a3b":
        dims.update(experts=4, experts_used=2, expert_ff=256, shared_ff=256)
    path = tmp_path_factory.mktemp("synth_hybrid") / f"{request.param}.gguf"
    synth.write_synth_gguf(path, replace(synth.PRESETS[request.param], **dims), "Q4_K_M", n_layers=4)
    config = EngineConfig.from_dict({"model": {"path": str(path)}, "cache": {"context_size": 64}, "device": "cpu"})
    return EngineCore(config, show_progress=False)


def test_engine_reads_the_hybrid_files_shape_and_computes_finite_logits(hybrid_core: EngineCore) -> None:
    a = hybrid_core.arch
    assert a.n_layers == 5 and a.hybrid.nextn == 1 and a.hybrid.recurrent == (True, True, True, False, False)
    assert (a.hybrid.k_heads, a.hybrid.v_heads, a.hybrid.head_dim, a.hybrid.tiled) == (2, 4, 64, True)
    assert a.rope_dim == 32 and len(hybrid_core.runner.executor.model.nextn) == 1
    logits = hybrid_core.forward_logits([1, 200, 3000, 40000, 49200]).float()
    assert logits.shape == (5, SMOLLM2_VOCAB + 64) and torch.isfinite(logits).all() and float(logits.std()) > 0
