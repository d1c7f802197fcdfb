"""benchmarks/synth_gguf.py: llama.cpp's Q4_K_M type mix per tensor, the other type choices, the padded
control tokens, and a written file that the engine loads and generates from."""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams

N_LAYERS = 8  # use-more-bits layers of 8: i < 1, i >= 7, (i - 1) % 3 == 2  ->  0, 3, 6, 7
MORE_BITS_OF_8 = {0, 3, 6, 7}
SMOLLM2_VOCAB = 49152


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
    with pytest.raises(ValueError, match="unknown weight type 'Q3_K'"):
        synth.tensor_plan(synth.PRESETS["tiny"], "Q3_K")


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
