"""The mixture-of-experts layer (engine/layers/moe.py) on the GPU's quant method (TritonMethod: experts
stacked per expert, the expert matmuls of triton_kernels/moe.py, and its kernel path with the routing,
activation and weighted sum of triton_kernels/moe_ops.py) against the CPU's (ReferenceMethod: each expert
dequantized, torch), on the converted tiny models' first layer (tests/data/moe): a decode-sized step
(the expert mat-vecs) and a prefill-sized one (the grouped GEMM), the shared expert (qwen2moe) and gpt-oss's
biases and clamped SwiGLU included. And the router: every id it gives is an expert, whatever the logits.
Under the interpreter on a CPU (the grouped GEMM's scratch in f32 there: the interpreter has no bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError
from vegaserve.engine.layers.linear import ReferenceMethod, TritonMethod
from vegaserve.engine.layers.moe import MoE, route
from vegaserve.engine.models.arch_config import MoEConfig, arch_config_from_gguf
from vegaserve.engine.models.weights import WeightLoader
from vegaserve.triton_kernels.fused import add_rms_norm
from vegaserve.triton_kernels.moe_ops import combine

DATA = Path(__file__).resolve().parents[1] / "data" / "moe"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(name: str, method, layer: int = 0) -> MoE:
    gguf = GGUFFile((DATA if (DATA / f"{name}-f32.gguf").exists() else DATA.parent / "hybrid") / f"{name}-f32.gguf")
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), name)
    moe = MoE(arch.hidden_size, arch.moe, method)
    moe.load(WeightLoader(gguf, DEVICE, torch.float32, show_progress=False), f"blk.{layer}.")
    return moe


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "gpt-oss", "qwen35moe"])
@pytest.mark.parametrize("tokens", [3, 12], ids=["decode", "grouped"])
def test_the_gpu_method_gives_the_reference_layers_output(name, tokens):
    """qwen2moe's shared expert runs beside the experts (its intermediate size is not theirs), qwen35moe's
    as one of them (expert E of the stacks, chosen by the router for every token)."""
    triton_moe = _layer(name, TritonMethod(gemm_dtype=torch.float32))
    reference = _layer(name, ReferenceMethod()).to(DEVICE)  # the reference dequantizes on the host
    assert triton_moe.gate_up.packed and reference.gate_up.weight is not None
    assert triton_moe.joined == reference.joined == (name == "qwen35moe")
    assert triton_moe.gate_up.n_experts == triton_moe.cfg.experts + triton_moe.joined
    x = torch.randn(tokens, reference.hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    want = reference(x)
    got = triton_moe(x)
    # the GPU's path whatever the device: routing, activation and weighted sum as kernels (moe_ops)
    parts = triton_moe._forward_kernels(x, None)
    fused = combine(*parts)
    for y in (got, fused):
        assert torch.isfinite(y).all()
        assert float((y - want).norm() / want.norm()) < 1e-5, (name, tokens)
    # a decoder layer hands the parts to the next residual add's norm, which sums them in its own launch:
    # the same bits as the sum's launch and then the add's
    h = torch.randn(tokens, reference.hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weight = torch.rand(reference.hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for a, b in zip(add_rms_norm(h, parts, weight, 1e-6, q8_1=True), add_rms_norm(h, fused, weight, 1e-6, q8_1=True)):
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(u, v), name


def test_router_ids_are_experts_whatever_the_logits():
    """NaN, infinite and tied logits still give k distinct ids in range, for both gatings."""
    logits = torch.tensor([[float("nan")] * 8, [float("inf"), float("-inf")] + [0.0] * 6, [1.0] * 8,
                           [0.0, float("nan"), 3.0, float("inf"), -1.0, 2.0, float("-inf"), 0.5]])
    for gating in ("softmax", "topk_softmax"):
        cfg = MoEConfig(experts=8, used=3, expert_ff=4, gating=gating)
        _, ids = route(logits, cfg)
        assert ids.shape == (4, 3)
        assert bool(((ids >= 0) & (ids < 8)).all())
        assert all(len(set(row)) == 3 for row in ids.tolist())


def test_expert_tensors_that_disagree_with_the_metadata_are_refused():
    """Experts expected 4 where the tensors hold 8: refused at load, naming the tensor and both shapes; and
    metadata asking for more experts a token than there are: refused naming both keys."""
    src = GGUFFile(DATA / "qwen3moe-f32.gguf")
    arch = arch_config_from_gguf(src.metadata, set(src.tensors), "qwen3moe")
    cfg = MoEConfig(experts=4, used=2, expert_ff=arch.moe.expert_ff)
    moe = MoE(arch.hidden_size, cfg, ReferenceMethod())
    with pytest.raises(ModelLoadError, match=r"ffn_gate_inp.weight .*\[8, 64\].*\[4, 64\]"):
        moe.load(WeightLoader(src, DEVICE, torch.float32, show_progress=False), "blk.0.")
    md = {**src.metadata, "qwen3moe.expert_used_count": 9}
    with pytest.raises(ModelLoadError, match=r"expert_used_count 9 .*expert_count 8"):
        arch_config_from_gguf(md, set(src.tensors), "bad.gguf")


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_the_kernel_path_hands_the_int8_experts_their_q8_1_copies(name, monkeypatch, tmp_path):
    """Q8_0 experts on the int8 kernel (a tuning file naming it): the activation kernel writes the down
    projection's q8_1 input and x's comes from the caller (the norm, in a model), so no quantize launch runs
    in the layer; the output equals the layer's with each expert matmul quantizing its own input."""
    import json

    from vegaserve.triton_kernels import q8_1 as q8_1_module
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1

    tuning = tmp_path / f"{name}.json"
    tuning.write_text(json.dumps({"matvec": {"Q8_0": {"any": {"1": {"kernel": "int8"}}}}}))
    gguf = GGUFFile(DATA / f"{name}-q8_0.gguf")
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), name)
    moe = MoE(arch.hidden_size, arch.moe, TritonMethod(gemm_dtype=torch.float32, tuning_file=str(tuning)))
    moe.load(WeightLoader(gguf, DEVICE, torch.float32, show_progress=False), "blk.1.")
    assert moe.wants_q8_1(3) and moe.down.wants_q8_1(3) and not moe.wants_q8_1(12)
    x = torch.randn(3, arch.hidden_size, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = moe.forward(x) if not x.is_cuda else None
    xq = quantize_q8_1(x)
    calls = []
    real = q8_1_module.quantize_q8_1
    monkeypatch.setattr(q8_1_module, "quantize_q8_1", lambda t: calls.append(t.shape) or real(t))
    got = combine(*moe._forward_kernels(x, xq))
    assert calls == []
    if want is not None:
        assert float((got - want).norm() / want.norm()) < 1e-4
