"""Topology from -sm / -tps, the checks on the model's shapes, the layer split by memory, the MoE hook."""

from __future__ import annotations

import dataclasses

import pytest

from vegaserve.engine.config import ConfigError
from vegaserve.engine.distributed.topology import (
    Topology, check_experts_split, check_model_splits, kv_heads_per_lane, lane_kv_head, partition_layers,
    plan_topology,
)
from vegaserve.engine.models.arch_config import ArchConfig, RopeScaling

ARCH = ArchConfig(
    architecture="llama", n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2, head_dim=64,
    intermediate_size=1024, vocab_size=1000, context_length=256, rms_eps=1e-5, rope_theta=1e4, rope_dim=64,
    rope_scaling=RopeScaling(), qk_norm=False, qkv_bias=False, tied_embeddings=True,
)


@pytest.mark.parametrize(("mode", "tps", "n", "tp", "pp"), [
    ("none", 0, 4, 1, 1),
    ("layer", 0, 3, 1, 3),
    ("tensor", 0, 4, 4, 1),
    ("tensor", 2, 4, 2, 2),
    ("tensor", 4, 8, 4, 2),
    ("tensor", 1, 3, 1, 3),
    ("row", 0, 2, 2, 1),
])
def test_topologies(mode, tps, n, tp, pp) -> None:
    t = plan_topology(mode, tps, n)
    assert (t.tp, t.pp) == (tp, pp)


def test_ranks_are_stage_major() -> None:
    t = Topology(tp=2, pp=3)
    assert [(t.stage_of(r), t.lane_of(r)) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(t.rank_of(t.stage_of(r), t.lane_of(r)) == r for r in range(6))


@pytest.mark.parametrize(("mode", "tps", "n", "message"), [
    ("tensor", 3, 4, "-tps 3 must divide the number of devices"),
    ("tensor", 8, 4, "only 4 are visible"),
    ("layer", 2, 4, "-tps 2 needs -sm tensor"),
    ("tensor", -1, 4, "-tps must be >= 0"),
    ("tensor", 0, 0, "no device"),
])
def test_impossible_topologies(mode, tps, n, message) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_topology(mode, tps, n)


def test_model_shape_checks() -> None:
    check_model_splits(ARCH, Topology(2, 1), {"attn_output": 32, "ffn_down": 256}, "m.gguf")
    check_model_splits(ARCH, Topology(4, 1), {"attn_output": 32, "ffn_down": 256}, "m.gguf")  # KV heads replicated
    with pytest.raises(ConfigError, match="8 attention heads do not divide over 3"):
        check_model_splits(ARCH, Topology(3, 1), {}, "m.gguf")
    with pytest.raises(ConfigError, match="3 KV heads can neither be split over 2"):
        check_model_splits(dataclasses.replace(ARCH, n_kv_heads=3, n_heads=6), Topology(2, 1), {}, "m.gguf")
    with pytest.raises(ConfigError, match="ffn_down would be split into slices of 128 columns, which cuts its 256"):
        check_model_splits(ARCH, Topology(8, 1), {"attn_output": 32, "ffn_down": 256}, "m.gguf")
    with pytest.raises(ConfigError, match="5 pipeline stages but the model has only 4 layers"):
        check_model_splits(ARCH, Topology(1, 5), {}, "m.gguf")


def test_every_lane_reads_the_kv_head_of_its_query_heads() -> None:
    for n_heads, n_kv, tp in ((8, 2, 4), (8, 2, 8), (8, 2, 2), (8, 8, 4), (32, 8, 8), (32, 8, 4), (4, 1, 4)):
        group = n_heads // n_kv
        per_lane = n_heads // tp
        kvl = kv_heads_per_lane(n_kv, tp)
        for lane in range(tp):
            kv0 = lane_kv_head(n_heads, n_kv, tp, lane)
            for h in range(lane * per_lane, (lane + 1) * per_lane):
                # local query head h - first maps to local KV head (h - first) // (group) within the slice
                assert kv0 <= h // group < kv0 + kvl, (n_heads, n_kv, tp, lane, h)
                assert (h - lane * per_lane) // (per_lane // kvl) == h // group - kv0


def test_layers_split_in_proportion_to_memory() -> None:
    assert partition_layers([10] * 8, 2) == [range(0, 4), range(4, 8)]
    assert partition_layers([10] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # the embedding on stage 0 and the head on the last weigh like two layers each
    assert partition_layers([10] * 8, 2, first_extra=20, last_extra=20) == [range(0, 4), range(4, 8)]
    assert partition_layers([10] * 8, 2, first_extra=40) == [range(0, 2), range(2, 8)]
    # heavier layers (a Q6_K ffn_down) pull the boundary
    assert partition_layers([30, 10, 10, 10, 10, 10], 2) == [range(0, 2), range(2, 6)]
    # every stage gets a layer even when one layer outweighs the rest
    parts = partition_layers([1000, 1, 1, 1], 4)
    assert parts == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ConfigError, match="5 pipeline stages but only 4 layers"):
        partition_layers([1] * 4, 5)


def test_the_moe_hook_splits_experts_evenly() -> None:
    assert check_experts_split(64, Topology(4, 1), "m.gguf") == range(16)
    with pytest.raises(ConfigError, match="6 experts do not divide over 4"):
        check_experts_split(6, Topology(4, 1), "m.gguf")


def test_hybrid_splits_follow_the_linear_attention_heads() -> None:
    """Qwen3.6-27B's linear-attention shape (16 key heads, 48 value heads of 128, tiled): ssm_out's columns go
    to a lane in runs of 16 / tp key heads' width, whole Q4_K blocks up to TP 8; a TP whose run would cut a
    block, or whose share of the heads is not whole, is refused naming the numbers."""
    from vegaserve.engine.models.hybrid_config import HybridConfig

    hy = HybridConfig(recurrent=(True, True, True, False), conv_kernel=4, k_heads=16, v_heads=48, head_dim=128,
                      tiled=True)
    arch = dataclasses.replace(ARCH, architecture="qwen35", n_heads=8, n_kv_heads=4, head_dim=256, hybrid=hy,
                               intermediate_size=17408)
    for tp in (2, 4, 8):
        check_model_splits(arch, Topology(tp, 1), {"attn_output": 256, "ffn_down": 256, "ssm_out": 256}, "m.gguf")
    with pytest.raises(ConfigError, match="ssm_out would be split into runs of 256 columns, which cuts its 512"):
        check_model_splits(arch, Topology(8, 1), {"ssm_out": 512}, "m.gguf")
    with pytest.raises(ConfigError, match="16 key and 48 value heads do not divide over 32"):
        check_model_splits(dataclasses.replace(arch, n_heads=32, n_kv_heads=32), Topology(32, 1), {}, "m.gguf")
    grouped = dataclasses.replace(arch, hybrid=dataclasses.replace(hy, tiled=False))  # one run of 48 / tp heads
    check_model_splits(grouped, Topology(8, 1), {"ssm_out": 768}, "m.gguf")


def test_a_lanes_value_heads_read_its_own_key_heads() -> None:
    """HybridConfig.lane_heads: over the lanes every head is taken once, and the lane's value head i reads
    its own key head i % k (tiled) or i // (v / k) (grouped), as value head h reads h % K or h // (V / K)."""
    from vegaserve.engine.models.hybrid_config import HybridConfig

    for tiled in (True, False):
        hy = HybridConfig(recurrent=(True,), conv_kernel=4, k_heads=4, v_heads=12, head_dim=8, tiled=tiled)
        taken_k, taken_v = [], []
        for lane in range(2):
            keys, values = hy.lane_heads(2, lane)
            local = hy.lane(2)
            taken_k += keys
            taken_v += values
            for i, h in enumerate(values):
                reads = h % hy.k_heads if tiled else h // (hy.v_heads // hy.k_heads)
                mine = i % local.k_heads if tiled else i // (local.v_heads // local.k_heads)
                assert keys[mine] == reads
        assert sorted(taken_k) == list(range(4)) and sorted(taken_v) == list(range(12))
