"""The hybrid linear-attention architectures (qwen35, qwen35moe, qwen3next) against two independent references:
tiny random transformers models converted to GGUF by llama.cpp's own convert_hf_to_gguf.py, with transformers'
fp32 logits and llama.cpp's CPU outputs on the same files (tests/data/hybrid/, made by
benchmarks/hybrid_references.py).

On the CPU path (weights dequantized once, f32 activations, the torch references of the convolution and the
chunked delta rule): every prompt row's logits and the top-8 of every greedy row within 1e-4 relative of
transformers on the F32 GGUF, the 32 greedy tokens identical (a prompt, then one token a step: the recurrent
state carried by the engine), llama.cpp's teacher-forced argmax agreed at >= 99% of the rows where its
top-1/top-2 margin exceeds 0.1; the Q8_0 GGUF against llama.cpp on the Q8_0 file's weights dequantized to F32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegaserve.engine.engine_core import EngineCore

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid"
MODELS = ["qwen35", "qwen35moe", "qwen3next"]


@pytest.fixture(scope="module", params=MODELS)
def model(request, converted) -> tuple[str, dict, EngineCore]:
    return request.param, converted.reference(DATA, request.param), converted.core(DATA, request.param)


def test_logits_match_transformers_on_the_f32_gguf(model, converted):
    converted.check_logits_match_transformers(model[2], model[1], model[0])


def test_greedy_tokens_equal_transformers(model, converted):
    name, ref, core = model
    converted.check_greedy_tokens(core, ref, name)
    assert core.states.num_free == core.states.num_slots  # every request gave its state slot back


def test_teacher_forced_argmax_agrees_with_llama_cpp(model, converted):
    name, ref, core = model
    agree, counted = converted.llama_cpp_argmax_agreement(core, ref, "llama_cpp_f32")
    assert counted > 100 and agree >= 0.99 * counted, (name, agree, counted)


def test_the_tokenizer_splits_the_prompts_as_transformers_and_llama_cpp(model):
    """qwen35 and qwen35moe carry Qwen3.5's own pre-tokenizer (tokenizer.ggml.pre "qwen35")."""
    name, ref, core = model
    for p in ref["prompts"]:
        assert p["llama_cpp_tokenizes_text_alike"], name
        assert core.tokenizer.encode(p["text"], add_special_tokens=False) == p["prompt_ids"], name


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_gguf_matches_llama_cpp_on_the_same_weights_dequantized(name, converted):
    """llama.cpp on the Q8_0 file itself also rounds every matmul's activations to 8 bits, which alone moves
    7-9% of a tiny random model's clear argmaxes (`agreement` in the JSON); on the same weights dequantized to
    F32 it computes what our CPU path does."""
    ref = converted.reference(DATA, name)
    core = converted.core(DATA, name, "q8_0")
    vocab = ref["hf_config"]["vocab_size"]
    for p in ref["prompts"]:
        last = core.forward_logits(p["prompt_ids"] + p["greedy_ids"])[-1]
        want = converted.floats(p["llama_cpp_q8_0_dequantized"]["last_logits_b64"], vocab)[0]
        assert converted.rel(last, want) < 1e-3, name
    agree, counted = converted.llama_cpp_argmax_agreement(core, ref, "llama_cpp_q8_0_dequantized")
    assert counted > 100 and agree >= 0.99 * counted, (name, agree, counted)


def test_the_nextn_block_is_loaded_and_kept_beside_the_trunk(converted):
    """qwen35's file ends with one MTP block (blk.3: a full-attention block, eh_proj and its norms): the
    trunk runs blocks 0-2 only, and the block's tensors are on the model, none reported unused."""
    core = converted.core(DATA, "qwen35")
    model = core.runner.executor.model
    assert core.arch.n_layers == 4 and core.arch.hybrid.nextn == 1 and core.arch.hybrid.trunk == 3
    assert [layer.index for layer in model.layers] == [0, 1, 2]
    (head,) = model.nextn
    assert head.index == 3 and not head.block.linear
    assert head.eh_proj.weight.shape == (64, 128) and head.head_norm is not None
    hf = converted.reference(DATA, "qwen35")["gguf_f32"]["tensors"]
    assert {n for n in hf if n.startswith("blk.3.nextn.")} == {
        "blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
        "blk.3.nextn.shared_head_norm.weight"}
    assert len(converted.core(DATA, "qwen35moe").runner.executor.model.nextn) == 0  # converted without one


def test_a_batch_of_sequences_equals_each_alone(model, converted):
    """Three prompts admitted together, prefilled in one step and decoded side by side: each sequence's
    first sampled distribution equals its own run's (each sequence reads and writes only its own state)."""
    converted.check_batch_equals_each_alone(model[2], [p["prompt_ids"] for p in model[1]["prompts"]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels on CPU tensors run under the interpreter only")
@pytest.mark.parametrize("name", MODELS)
def test_the_gpu_paths_python_on_a_cpu_matches_transformers(name, converted, monkeypatch):
    """Where the GPU test fails and this passes, the difference is in what only a GPU runs
    (converted.check_gpu_path_on_cpu)."""
    converted.check_gpu_path_on_cpu(DATA, name, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs a GPU")
@pytest.mark.parametrize("scratch", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", MODELS)
def test_the_gpu_path_agrees_with_transformers(name, scratch, converted, tmp_path):
    """On a GPU (the chunked delta-rule and convolution kernels for the prompt, their one-step updates and the
    decode graphs for the tokens, the expert kernels for qwen35moe and qwen3next, an f32 KV cache), with the
    prompt GEMMs' scratch in f32 and in the shipped bf16: converted.check_gpu_path; every state slot given
    back."""
    core = converted.gpu_core(DATA, name, scratch, tmp_path)
    converted.check_gpu_path(core, converted.reference(DATA, name), name, scratch)
    assert core.states.num_free == core.states.num_slots
