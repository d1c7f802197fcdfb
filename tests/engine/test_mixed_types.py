"""A mixed file, as the `Q2_K_XL` / `UD-Q4_K_XL` quants of big models are: every layer's matrices of different
low-bit types (Q2_K, Q3_K, IQ4_XS and the IQ1/IQ2/IQ3 lattice types) beside BF16 ones. It loads and runs on
the CPU path to the logits transformers computes from the same file (its GGUF loader dequantizes with
gguf-py, an independent reference), and each of its layers' matrices gives, through the GPU's quant method
(TritonMethod: the tile mat-vec for a decode step, the dense dequantized copy for a prefill one; under the
interpreter on a CPU), what the reference method gives.
"""

from __future__ import annotations

import pytest
import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.gguf_file import GGUFFile
from vegaserve.engine.layers.linear import QuantLinear, ReferenceMethod, TritonMethod
from vegaserve.engine.layers.mlp import DenseMLP
from vegaserve.engine.models.weights import WeightLoader

# a type for every matrix of two layers, and for the embedding and the (untied) head
MIX = {
    "token_embd": "Q3_K", "output": "IQ4_XS",
    "blk.0.attn_q.weight": "IQ2_XXS", "blk.0.attn_k.weight": "IQ2_XS", "blk.0.attn_v.weight": "IQ2_S",
    "blk.0.attn_output.weight": "IQ3_XXS", "blk.0.ffn_gate.weight": "IQ3_S", "blk.0.ffn_up.weight": "IQ1_S",
    "blk.0.ffn_down.weight": "IQ1_M",
    "blk.1.attn_q.weight": "Q2_K", "blk.1.attn_k.weight": "BF16", "blk.1.attn_v.weight": "IQ4_XS",
    "blk.1.attn_output.weight": "BF16", "blk.1.ffn_gate.weight": "Q3_K", "blk.1.ffn_up.weight": "Q3_K",
    "blk.1.ffn_down.weight": "Q2_K",
}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def mixed_file(gguf_factory, tmp_path_factory):
    spec = gguf_factory.TinySpec(tied=False, seed=5, tensor_types=MIX)
    return gguf_factory.write_tiny_gguf(tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf", spec)


def test_the_file_holds_every_new_type_and_bf16(mixed_file):
    types = {info.type_name for info in GGUFFile(mixed_file).tensors.values()}
    assert set(MIX.values()) <= types


def test_a_mixed_file_runs_on_the_cpu_to_transformers_logits(mixed_file):
    core = EngineCore(EngineConfig.from_dict({"model": {"path": str(mixed_file)}, "device": "cpu"}),
                      show_progress=False)
    ids = [1, 17, 300, 4000, 512, 9, 21000, 77]
    ours = core.forward_logits(ids).float()
    assert ours.shape == (len(ids), 49152) and torch.isfinite(ours).all()
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(mixed_file.parent), gguf_file=mixed_file.name,
                                                           dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() < 1e-3 * ref.abs().max()


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("tokens", [2, 12], ids=["decode", "prefill"])
def test_each_layers_matrices_through_the_gpu_method_give_the_reference_outputs(mixed_file, layer, tokens, tmp_path):
    """q/k/v (three types stacked: one matmul per type), o_proj, and the feed-forward (gate, up and down),
    through the tile kernel on every type: a tuning file without entries, so that the backend's fallback
    picks it on a GPU too (the sm_90 file names the int8 kernel for some of these types, whose rounding of
    x to 8 bits tests/triton_kernels/test_matvec_int8.py checks against its own reference)."""
    bare = tmp_path / "bare.json"
    bare.write_text("{}")
    gguf = GGUFFile(mixed_file)
    hidden, ffn, kv = 256, 512, 128
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + layer)).to(DEVICE)
    layers = []
    for method in (TritonMethod(gemm_dtype=torch.float32, tuning_file=str(bare)), ReferenceMethod()):
        w = WeightLoader(gguf, DEVICE, torch.float32, show_progress=False)
        qkv = QuantLinear(hidden, [hidden, kv, kv], method)
        qkv.load([w.source(f"blk.{layer}.attn_{n}.weight") for n in "qkv"], DEVICE)
        o_proj = QuantLinear(hidden, [hidden], method)
        o_proj.load([w.source(f"blk.{layer}.attn_output.weight")], DEVICE)
        mlp = DenseMLP(hidden, ffn, method)
        mlp.load(w, f"blk.{layer}.")
        layers.append((qkv, o_proj, mlp))
    gpu, ref = layers
    packed = [w.type_name for w in (*gpu[0].packed, *gpu[1].packed, *gpu[2].gate_up.packed, *gpu[2].down.packed)]
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = [MIX[f"blk.{layer}.{n}.weight"] for n in names]
    # one packed matrix per run of one type inside a layer's stack (q/k/v; gate/up), each on the tile kernel
    assert packed == [t for i, t in enumerate(types) if i in (0, 3, 4, 6) or t != types[i - 1]]
    assert {c.kernel.name for m in (*gpu[:2], *gpu[2].children()) for by_m in m.tuned for c in by_m} == {"tiles"}
    for got, want in zip((m(x) for m in gpu), (m(x) for m in ref), strict=True):
        assert torch.isfinite(got).all()
        assert float((got.float() - want).norm() / want.norm()) < 1e-5
