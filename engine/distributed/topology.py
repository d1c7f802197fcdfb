"""Which rank does what: the topology from `-sm` and `-tps`, and the checks that it can hold the model.

Ranks are numbered stage-major: rank = stage * tp + lane. Stage 0 lane 0 is global rank 0, the process with
the HTTP front and the scheduler; the last stage's lane 0 gathers the logits and sends them to rank 0.

    -sm none            one device
    -sm layer           a pipeline of n stages, one device each
    -sm tensor          one tensor-parallel group of all n devices (-tps 0, the default)
    -sm tensor -tps T   n / T pipeline stages, each a tensor-parallel group of T devices (n % T == 0)

Every impossible request fails here, before any worker starts, with one line that says what and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from vegaserve.engine.config import ConfigError
from vegaserve.engine.models.arch_config import ArchConfig


@dataclass(frozen=True)
class Topology:
    tp: int  # lanes per tensor-parallel group
    pp: int  # pipeline stages

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def lane_of(self, rank: int) -> int:
        return rank % self.tp

    def rank_of(self, stage: int, lane: int) -> int:
        return stage * self.tp + lane

    def describe(self) -> str:
        if self.world_size == 1:
            return "one device"
        parts = []
        if self.pp > 1:
            parts.append(f"{self.pp} pipeline stages")
        if self.tp > 1:
            parts.append(f"tensor parallel over {self.tp} devices" + (" per stage" if self.pp > 1 else ""))
        return ", ".join(parts)


SINGLE = Topology(tp=1, pp=1)


def plan_topology(split_mode: str, tps: int, n_devices: int) -> Topology:
    """The topology for `-sm split_mode -tps tps` over n_devices devices, or a ConfigError saying why not."""
    if n_devices < 1:
        raise ConfigError(f"no device to run on (asked for {n_devices})")
    if split_mode == "row":
        split_mode = "tensor"
    if tps and split_mode != "tensor":
        raise ConfigError(f"-tps {tps} needs -sm tensor (it sizes the tensor-parallel groups), got -sm {split_mode}")
    if split_mode == "none":
        return SINGLE
    if split_mode == "layer":
        return Topology(tp=1, pp=n_devices)
    if split_mode != "tensor":
        raise ConfigError(f"split mode must be none, layer or tensor, got {split_mode!r}")
    if tps < 0:
        raise ConfigError(f"-tps must be >= 0, got {tps}")
    if tps == 0:
        return Topology(tp=n_devices, pp=1)
    if tps > n_devices:
        raise ConfigError(f"-tps {tps} asks for tensor-parallel groups of {tps} devices, but only {n_devices} are visible")
    if n_devices % tps:
        raise ConfigError(
            f"-tps {tps} must divide the number of devices: {n_devices} devices do not split into groups of {tps}"
        )
    return Topology(tp=tps, pp=n_devices // tps)


def check_model_splits(arch: ArchConfig, topo: Topology, block_sizes: dict[str, int], path: str,
                       shared_split: bool = True) -> None:
    """Refuse a split that the model's shapes cannot take. block_sizes: the largest GGUF block size
    (elements) of each matrix whose input dimension a lane slices (attn_output, ffn_down, ffn_down_shexp,
    a hybrid model's ssm_out).
    The feed-forward's blocks are dealt over the lanes (sharding.block_split: a lane may hold a block more
    than its neighbour), so only fewer blocks than lanes is refused; attn_output follows the heads, whose
    even share must be whole blocks."""
    tp = topo.tp
    if topo.pp > arch.n_layers:
        raise ConfigError(f"{path}: {topo.pp} pipeline stages but the model has only {arch.n_layers} layers")
    if tp == 1:
        return
    hy = arch.hybrid
    if hy is not None:  # each lane takes a share of the DeltaNet's key heads and the value heads reading them
        if hy.k_heads % tp or hy.v_heads % tp:
            raise ConfigError(f"{path}: the linear-attention layers' {hy.k_heads} key and {hy.v_heads} value heads "
                              f"do not divide over {tp} tensor-parallel devices")
        # ssm_out's columns a lane takes come in runs of whole heads (tiled heads: one run per key-head repeat)
        run = (hy.k_heads if hy.tiled else hy.v_heads) // tp * hy.head_dim
        qk = block_sizes.get("ssm_out", 1)
        if run % qk:
            raise ConfigError(f"{path}: ssm_out would be split into runs of {run} columns, which cuts its {qk}-element "
                              f"quantization blocks; use a tensor-parallel size whose share of the heads is whole blocks")
    if arch.n_heads % tp:
        raise ConfigError(f"{path}: {arch.n_heads} attention heads do not divide over {tp} tensor-parallel devices")
    if arch.n_kv_heads % tp and tp % arch.n_kv_heads:
        raise ConfigError(
            f"{path}: {arch.n_kv_heads} KV heads can neither be split over {tp} tensor-parallel devices "
            f"nor replicated evenly on them"
        )
    k, qk = arch.q_size // tp, block_sizes.get("attn_output", 1)
    if k % qk:
        raise ConfigError(
            f"{path}: attn_output would be split into slices of {k} columns ({arch.n_heads // tp} heads of "
            f"{arch.head_dim}), which cuts its {qk}-element quantization blocks; use a tensor-parallel size "
            f"whose share of the heads is whole blocks"
        )
    # the feed-forward a lane slices: each expert's intermediate size in a mixture of experts
    split = {"ffn_down": arch.moe.expert_ff if arch.moe is not None else arch.intermediate_size}
    if arch.moe is not None and arch.moe.shared_ff and shared_split:
        split["ffn_down_shexp"] = arch.moe.shared_ff
    for name, cols in split.items():
        qk = block_sizes.get(name, 1)
        if cols // qk < tp:
            raise ConfigError(
                f"{path}: {name} would be split into slices of {cols // tp} columns, which cuts its {qk}-element "
                f"quantization blocks: its {cols} columns make {cols // qk} whole block(s), fewer than the {tp} "
                f"tensor-parallel devices" + (" (LLAMA_SHEXP_SPLIT=0 holds it whole on each)"
                                              if name == "ffn_down_shexp" else "")
            )


def check_experts_split(n_experts: int, topo: Topology, path: str) -> range:
    """The MoE hook: the experts lane `lane` holds are range(lane * e, (lane + 1) * e), e = n_experts / tp."""
    if n_experts % topo.tp:
        raise ConfigError(f"{path}: {n_experts} experts do not divide over {topo.tp} tensor-parallel devices")
    return range(n_experts // topo.tp)


def partition_layers(layer_bytes: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous layer ranges, one per stage, in proportion to memory: stage 0 also holds `first_extra`
    bytes (the embedding), the last stage `last_extra` (norm and LM head). Every stage gets a layer."""
    n = len(layer_bytes)
    if n_stages > n:
        raise ConfigError(f"{n_stages} pipeline stages but only {n} layers")
    before = [first_extra]  # before[b]: bytes of stage-0 extras and layers 0 .. b-1
    for b in layer_bytes:
        before.append(before[-1] + b)
    total = before[-1] + last_extra
    bounds = [0]
    for s in range(1, n_stages):
        target = total * s / n_stages
        # the boundary nearest the target that leaves a layer for this stage and each one after it
        choices = range(bounds[-1] + 1, n - (n_stages - s) + 1)
        bounds.append(min(choices, key=lambda b: abs(before[b] - target)))
    bounds.append(n)
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def kv_heads_per_lane(n_kv_heads: int, tp: int) -> int:
    """KV heads a lane holds: its share when they split, one (replicated) when there are fewer than lanes."""
    return n_kv_heads // tp if n_kv_heads >= tp else 1


def lane_kv_head(n_heads: int, n_kv_heads: int, tp: int, lane: int) -> int:
    """The first KV head of a lane's slice."""
    if n_kv_heads >= tp:
        return lane * (n_kv_heads // tp)
    # fewer KV heads than lanes: the lane's query heads all read one KV head, replicated on several lanes
    return lane * (n_heads // tp) // (n_heads // n_kv_heads)
