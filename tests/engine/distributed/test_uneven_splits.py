"""Tensor splits by whole blocks: a lane's slice of a row-split matrix (the feed-forward's down projection,
an expert's, the shared expert's) is whole quantization blocks, dealt as evenly as they go, so a lane may
hold a block more than its neighbour, and the gate/up rows that feed it follow. Only fewer blocks than lanes
is refused, naming the tensor and the numbers.

The planner on the real shapes of big models (no file: it takes an ArchConfig), the dealing itself, a
mixture-of-experts layer's lanes of uneven expert slices (their partial sums add up to the whole layer),
and a tiny model at TP 3 whose down projections (a Q4_K one of 5 super-blocks, a Q8_0 one of 40 blocks)
split into no even whole blocks, over three CPU processes (gloo): its logits equal one process's within
1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.distributed.sharding import block_split, lane_block_split, slice_cols
from vegaserve.engine.distributed.topology import Topology, check_model_splits
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError, TensorInfo
from vegaserve.engine.layers.linear import ReferenceMethod, WeightSource
from vegaserve.engine.layers.moe import MoE
from vegaserve.engine.models.arch_config import ArchConfig, RopeScaling, arch_config_from_gguf
from vegaserve.engine.models.weights import WeightLoader
from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

QWEN3_32B = ArchConfig(
    architecture="qwen3", n_layers=64, hidden_size=5120, n_heads=64, n_kv_heads=8, head_dim=128,
    intermediate_size=25600, vocab_size=151936, context_length=40960, rms_eps=1e-6, rope_theta=1e6, rope_dim=128,
    rope_scaling=RopeScaling(), qk_norm=True, qkv_bias=False, tied_embeddings=False,
)
# Qwen2.5-72B: 29568 intermediate columns are 115.5 super-blocks, so its quants keep ffn_down in a
# 32-element type (llama-quantize's fallback)
QWEN25_72B = dataclasses.replace(QWEN3_32B, architecture="qwen2", n_layers=80, hidden_size=8192,
                                 intermediate_size=29568, qk_norm=False, qkv_bias=True)


@pytest.mark.parametrize(("arch", "tp", "blocks", "shares"), [
    (QWEN3_32B, 8, {"attn_output": 256, "ffn_down": 256}, [13] * 4 + [12] * 4),  # 100 super-blocks
    (QWEN25_72B, 8, {"attn_output": 256, "ffn_down": 32}, [116] * 4 + [115] * 4),  # 924 blocks
    (QWEN25_72B, 4, {"attn_output": 256, "ffn_down": 32}, [231] * 4),
], ids=["qwen3-32b-tp8", "qwen2.5-72b-tp8", "qwen2.5-72b-tp4"])
def test_big_models_plan_with_each_lane_whole_blocks(arch, tp, blocks, shares):
    check_model_splits(arch, Topology(tp, 1), blocks, "m.gguf")
    qk = blocks["ffn_down"]
    split = [block_split(arch.intermediate_size, qk, tp, lane) for lane in range(tp)]
    assert [count // qk for _, count in split] == shares


def test_fewer_blocks_than_lanes_is_refused_naming_the_tensor_and_the_numbers():
    small = dataclasses.replace(QWEN3_32B, intermediate_size=1280)  # 5 super-blocks
    check_model_splits(small, Topology(4, 1), {"attn_output": 256, "ffn_down": 256}, "m.gguf")
    with pytest.raises(ConfigError, match=r"m.gguf: ffn_down .* its 1280 columns make 5 whole block\(s\), "
                                          r"fewer than the 8 tensor-parallel devices"):
        check_model_splits(small, Topology(8, 1), {"attn_output": 256, "ffn_down": 256}, "m.gguf")
    with pytest.raises(ConfigError, match=r"attn_output would be split into slices of 640 columns \(5 heads of "
                                          r"128\), which cuts its 256-element"):
        check_model_splits(dataclasses.replace(QWEN3_32B, n_heads=40), Topology(8, 1),
                           {"attn_output": 256, "ffn_down": 256}, "m.gguf")


@pytest.mark.parametrize(("cols", "block", "tp"), [(1280, 256, 3), (1024, 32, 4), (320, 32, 3), (63, 1, 2),
                                                   (256, 256, 1), (29568, 32, 8)])
def test_block_split_deals_whole_blocks_covering_every_column_once(cols, block, tp):
    split = [block_split(cols, block, tp, lane) for lane in range(tp)]
    assert [start for start, _ in split] == [sum(c for _, c in split[:i]) for i in range(tp)]
    assert sum(c for _, c in split) == cols
    assert all(start % block == 0 and count % block == 0 and count > 0 for start, count in split)
    assert max(c for _, c in split) - min(c for _, c in split) <= block
    if (cols // block) % tp == 0:  # an even split stays the even split
        assert all(c == cols // tp for _, c in split)


@pytest.mark.parametrize("type_name", ["Q4_K", "IQ2_XXS", "Q8_0"])
def test_uneven_slices_dequantize_to_the_slices_of_the_whole(type_name):
    tid = next(t for t, s in GGML_TYPES.items() if s.name == type_name)
    qk = GGML_TYPES[tid].block_size
    cols = 5 * 256
    raw = random_blocks(tid, 6, cols // qk, torch.Generator().manual_seed(3))
    info = TensorInfo("blk.0.ffn_down.weight", tid, type_name, (6, cols), raw.numel(), 0, 0)
    src = WeightSource(info, raw.reshape(-1), "m.gguf")
    whole = dequantize(raw.reshape(-1), tid, (6, cols))
    parts = [slice_cols(src, *lane_block_split(src, 3, lane)) for lane in range(3)]
    assert torch.equal(torch.cat([dequantize(p.raw, tid, p.info.shape) for p in parts], dim=1), whole)
    with pytest.raises(ModelLoadError, match=r"blk.0.ffn_down.weight .*1280 columns in blocks of 256 do not give "
                                             r"each of 8 lanes"):
        lane_block_split(dataclasses.replace(src, info=dataclasses.replace(info, type_id=12, type_name="Q4_K")), 8, 0)


TINY = dict(arch="llama", n_layers=2, hidden=192, n_heads=3, n_kv_heads=1, ffn=1280, tied=True, seed=11,
            weight_type="Q8_0", tensor_types={"blk.0.ffn_down.weight": "Q4_K"})
PROMPT = [1, 17, 300, 4000, 512, 9, 21000, 77, 640, 5, 12, 99]


def _logits(path, parallel: dict | None = None) -> torch.Tensor:
    # the f32 path: the int4 kernel would round each lane's partial product to bf16 (7.6e-3 from one process)
    cfg = {"model": {"path": str(path)}, "cache": {"context_size": 64}, "parallel": parallel or {}, "device": "cpu",
           "kernels": {"cpu_int4": False}}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    try:
        return core.forward_logits(PROMPT)
    finally:
        core.close()


def test_a_tiny_model_whose_down_projections_split_unevenly_at_tp3_gives_one_processs_logits(gguf_factory, tmp_path):
    path = gguf_factory.write_tiny_gguf(tmp_path / "uneven.gguf", gguf_factory.TinySpec(**TINY))
    one = _logits(path)
    split = _logits(path, {"split_mode": "tensor", "n_devices": 3})
    err = float((split - one).norm() / one.norm())
    assert err < 1e-4, f"{err:.2e}"


MOE_DATA = Path(__file__).resolve().parents[2] / "data" / "moe"


@pytest.mark.parametrize("name", ["qwen2moe", "gpt-oss"])
def test_moe_lanes_with_uneven_expert_slices_sum_to_the_whole_layer(name):
    """F32 experts of 32 intermediate columns over 3 lanes: 11, 11 and 10 columns of every expert (and of
    qwen2moe's 64-column shared expert: 22, 21, 21); the lanes' partial sums add up to the whole layer's
    output, gpt-oss's biases included (gate/up sliced, down added by lane 0)."""
    gguf = GGUFFile(MOE_DATA / f"{name}-f32.gguf")
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), name)

    def layer(tp: int, lane: int) -> MoE:
        moe = MoE(arch.hidden_size, arch.moe, ReferenceMethod(), tp, lane)
        moe.load(WeightLoader(gguf, torch.device("cpu"), torch.float32, show_progress=False), "blk.0.")
        return moe

    x = torch.randn(5, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    lanes = [layer(3, lane) for lane in range(3)]
    assert [m.ff for m in lanes] == [11, 11, 10]
    if arch.moe.shared_ff:
        assert [m.shared_ff for m in lanes] == [22, 21, 21]
    whole = layer(1, 0)(x)
    err = float((sum(m(x) for m in lanes) - whole).norm() / whole.norm())
    assert err < 1e-5, f"{err:.2e}"
