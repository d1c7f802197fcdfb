"""The mixture-of-experts architectures (qwen3moe, qwen2moe with its shared expert, gpt-oss) against two
independent references: tiny random transformers models converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py, with transformers' fp32 logits and llama.cpp's CPU outputs on the same files
(tests/data/moe/, made by benchmarks/moe_references.py).

On the CPU path (weights dequantized once, f32 activations): the logits of every prompt position and the
top-8 of every greedy position within 1e-4 relative of transformers on the F32 GGUF, the 32 greedy tokens
identical, llama.cpp's teacher-forced argmax agreed at >= 99% of the positions where its top-1/top-2
margin exceeds 0.1; on the Q8_0 GGUF, transformers on the same weights dequantized to F32 (llama.cpp's
Q8_0 path also quantizes the activations, which alone moves argmaxes of a tiny random model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegaserve.engine.engine_core import EngineCore

DATA = Path(__file__).resolve().parents[1] / "data" / "moe"
MODELS = ["qwen3moe", "qwen2moe", "gpt-oss"]


@pytest.fixture(scope="module", params=MODELS)
def model(request, converted) -> tuple[str, dict, EngineCore]:
    return request.param, converted.reference(DATA, request.param), converted.core(DATA, request.param)


def test_logits_match_transformers_on_the_f32_gguf(model, converted):
    converted.check_logits_match_transformers(model[2], model[1], model[0])


def test_greedy_tokens_equal_transformers(model, converted):
    converted.check_greedy_tokens(model[2], model[1], model[0])


def test_teacher_forced_argmax_agrees_with_llama_cpp(model, converted):
    name, ref, core = model
    agree, counted = converted.llama_cpp_argmax_agreement(core, ref, "llama_cpp_f32")
    assert counted > 50 and agree >= 0.99 * counted, (name, agree, counted)


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_gguf_matches_transformers_on_the_same_weights_dequantized(name, converted):
    ref = converted.reference(DATA, name)
    core = converted.core(DATA, name, "q8_0")
    vocab = ref["hf_config"]["vocab_size"]
    for p in ref["prompts"]:
        logits = core.forward_logits(p["prompt_ids"] + p["greedy_ids"]).float()
        t = p["transformers_dequantized_q8_0"]
        assert converted.rel(logits[-1], converted.floats(t["last_logits_b64"], vocab)[0]) < 1e-4
        converted.check_top8(logits, t["top8"], 1e-4, name)


def test_a_batch_of_sequences_equals_each_alone(model, converted):
    """Several sequences in one step route their tokens independently: each sequence's logits equal its
    own run (the experts' grouping of tokens from different sequences changes nothing)."""
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
    """On a GPU (expert mat-vecs for the decode rows, the grouped GEMM over the experts and the dense GEMMs for
    the prompt, the attention kernels with gpt-oss's window and sinks; an f32 KV cache), with the prompt GEMMs'
    scratch in f32 and in the shipped bf16: converted.check_gpu_path."""
    core = converted.gpu_core(DATA, name, scratch, tmp_path)
    converted.check_gpu_path(core, converted.reference(DATA, name), name, scratch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton attention "
                    "kernels, which only the interpreter takes")
@pytest.mark.parametrize("name", MODELS)
def test_a_decode_graphs_static_batch_equals_the_eager_step(name, converted):
    """engine/cuda_graphs.py's static batch for the MoE models (not captured on a CPU: the same staging run
    eagerly, its attention through the Triton kernels under the interpreter, gpt-oss's sliding window and
    sinks included): three sequences of 5, 40 and 1 tokens in a bucket of four; the decode step's logits
    equal the eager step's and pick the same tokens."""
    from vegaserve.engine.cuda_graphs import DecodeGraphs
    from vegaserve.engine.forward_batch import StepPlan
    from vegaserve.engine.layers.attention import KVCache

    core = converted.core(DATA, name)
    worker, bs = core.runner.executor.worker, core.pool.block_size
    lengths = [5, 40, 1]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, core.arch.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + 1) // bs)) for n in lengths]
    worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, bs))
    plan = StepPlan([(b, n, [t]) for b, n, t in zip(blocks, lengths, [11, 12, 13], strict=True)], [False] * 3, bs)
    cache = worker.cache
    spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                    cache.k.device, spare=bs)
    spare.k[:, : cache.num_slots], spare.v[:, : cache.num_slots] = cache.k, cache.v
    static = DecodeGraphs(worker.model, spare, 4, core.max_model_len, bs, torch.device("cpu")).run(plan.seqs).clone()
    eager = worker.run(plan)
    assert converted.rel(static, eager) < 1e-5
    assert torch.equal(static.argmax(-1), eager.argmax(-1))


def test_an_expert_split_that_would_cut_a_quantization_block_is_refused_before_any_worker_starts():
    """Each lane holds 16 of every expert's 32 intermediate columns: whole F32 elements, but half a Q8_0
    block of the down projection, which is refused naming the tensor and the numbers; a shared expert that
    does not divide over the lanes is dealt in whole blocks (32 and 31 F32 columns), and refused only where
    it has fewer blocks than lanes, unless held whole (LLAMA_SHEXP_SPLIT=0)."""
    from dataclasses import replace

    from vegaserve.engine.config import ConfigError
    from vegaserve.engine.distributed.topology import Topology, check_model_splits
    from vegaserve.engine.gguf_file import GGUFFile
    from vegaserve.engine.models.arch_config import arch_config_from_gguf

    gguf = GGUFFile(DATA / "qwen2moe-f32.gguf")
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), "qwen2moe")
    check_model_splits(arch, Topology(2, 1), {"attn_output": 1, "ffn_down": 1, "ffn_down_shexp": 1}, "m.gguf")
    with pytest.raises(ConfigError, match=r"ffn_down would be split into slices of 16 columns, which cuts its 32"):
        check_model_splits(arch, Topology(2, 1), {"attn_output": 32, "ffn_down": 32, "ffn_down_shexp": 32}, "m.gguf")
    odd = replace(arch, moe=replace(arch.moe, shared_ff=63))
    check_model_splits(odd, Topology(2, 1), {"attn_output": 1, "ffn_down": 1}, "m.gguf")
    one_block = replace(arch, moe=replace(arch.moe, shared_ff=32))
    with pytest.raises(ConfigError, match=r"ffn_down_shexp .* 32 columns make 1 whole block\(s\), fewer than the 2"):
        check_model_splits(one_block, Topology(2, 1), {"attn_output": 1, "ffn_down": 1, "ffn_down_shexp": 32}, "m.gguf")
    check_model_splits(one_block, Topology(2, 1), {"attn_output": 1, "ffn_down": 1, "ffn_down_shexp": 32}, "m.gguf",
                       shared_split=False)


@pytest.mark.parametrize("data, name", [(DATA, "qwen2moe"), (DATA, "gpt-oss"), (DATA.parent / "hybrid", "qwen35moe")])
def test_a_layers_unsummed_expert_outputs_reach_the_next_norm_and_the_last_add(data, name, converted, monkeypatch):
    """On a GPU a MoE layer on one lane hands its experts' outputs on unsummed (moe_ops.ExpertSum) and the
    next layer's norm, or the last add, sums them. Made to on the CPU path (its own torch routing and
    experts, the parts not summed), the model's logits equal the summed path's: every layer's hand-off,
    the shared expert's (qwen2moe, qwen35moe) and the down biases' (gpt-oss) included."""
    import torch.nn.functional as F

    from vegaserve.engine.layers import moe
    from vegaserve.triton_kernels.moe_ops import ExpertSum, with_shared_expert

    calls = []

    def unsummed(self, x, xq=None):
        calls.append(x.shape[0])
        T, E = x.shape[0], self.cfg.experts
        logits = F.linear(x.float(), self.router, self.router_bias)
        weights, ids = moe.route(logits[:, :E], self.cfg)
        if self.joined:  # the shared expert as expert E of the stacks (qwen35moe)
            weights, ids = with_shared_expert(weights, ids, logits[:, E:], E)
        k, a = ids.shape[1], ids.reshape(-1)
        y = self.down(moe.expert_act(self.gate_up(x, a, k, T), self.cfg), a, 1, T, add_bias=False)
        shared = logit = None
        if self.shared_gate_up is not None:
            shared = self.shared_down(moe.expert_act(self.shared_gate_up(x), self.cfg))
            logit = logits[:, E].contiguous()
        return ExpertSum(y, weights, ids, self.down.bias, shared, logit)

    core = converted.core(data, name)
    prompt = converted.reference(data, name)["prompts"][0]["prompt_ids"]
    want = core.forward_logits(prompt)
    monkeypatch.setattr(moe.MoE, "delta", unsummed)
    got = core.forward_logits(prompt)
    assert calls and all(t == len(prompt) for t in calls)
    assert converted.rel(got, want) < 1e-5, name
