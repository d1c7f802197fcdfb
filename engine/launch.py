"""Launch: how every rank builds its share of the model. Planned by rank 0 before anything loads, and
planned alike by each rank torchrun starts (engine/executor.py's run_torchrun_worker): the device, the
context length and KV blocks (`engine_shape`), the topology, the layers of each pipeline stage, and the
memory check. Every impossible request fails here, before a process is spawned or a weight read.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.distributed.topology import (
    SINGLE, Topology, check_model_splits, kv_heads_per_lane, partition_layers, plan_topology,
)
from vegaserve.engine.env import local_rank
from vegaserve.engine.gguf_file import GGUFFile, TensorInfo
from vegaserve.engine.layers.attention import kv_cache_dtype
from vegaserve.engine.models.arch_config import ArchConfig
from vegaserve.triton_kernels.dequant import spec_for

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def engine_shape(config: EngineConfig, gguf: GGUFFile) -> tuple[int, int]:
    """(context length, KV blocks): computed alike on every rank."""
    trained = int(gguf.metadata.get(f"{gguf.architecture}.context_length", 0) or 0)
    max_model_len = config.cache.context_size or trained or 4096
    # the same memory a one-slot-per-sequence cache would use; sharing prefixes makes it go further
    bs = config.cache.block_size
    return max_model_len, config.cache.num_blocks or config.scheduler.max_num_seqs * -(-max_model_len // bs)


@dataclass(frozen=True)
class Launch:
    """How every rank builds its share; the same on every rank (it pickles to spawned workers)."""

    config: EngineConfig
    path: str
    topo: Topology
    stages: tuple[range, ...]  # layers of each pipeline stage
    max_model_len: int
    num_slots: int
    device_type: str  # cpu | cuda (ROCm's torch calls its GPUs cuda too)
    init_method: str
    threads: int  # torch CPU threads per rank (CPU ranks)
    torchrun: bool = False
    shared_gpus: bool = False  # more ranks than GPUs (a test setup): ranks share GPUs round-robin, over gloo


def count_devices(config: EngineConfig) -> int:
    """Devices to use: -ndev if given, else every visible GPU (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES
    choose them), else one (the CPU)."""
    if config.parallel.n_devices:
        return config.parallel.n_devices
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer_bytes(gguf: GGUFFile, arch: ArchConfig) -> list[int]:
    sizes = [0] * arch.n_layers
    for name, info in gguf.tensors.items():
        if name.startswith("blk."):
            sizes[int(name.split(".")[1])] += info.n_bytes
    return sizes


def scratch_elements(gguf: GGUFFile, layers: range, head: bool, cap: int) -> int:
    """Bound of the GPU method's prompt scratch (engine/layers/linear.py TritonMethod), in elements, on a rank
    holding `layers` (and the output matrix where `head`): the largest matrix it was given dequantized, where
    one block's matrices fused into one count at most their sum, or the largest stack of a block's experts,
    gate and up stacked, with the shared expert where there is one; at most `cap` (the tuning file's
    scratch_mib, in elements: a larger one goes through it in windows of rows). Tensor-parallel slices count
    whole."""
    dense = experts = 0
    blocks: dict[int, list[TensorInfo]] = {}
    for name, info in gguf.tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) in layers:
            blocks.setdefault(int(name.split(".")[1]), []).append(info)
    for infos in blocks.values():
        dense = max(dense, sum(math.prod(i.shape) for i in infos if len(i.shape) == 2))
        size = {i.name.split(".", 2)[2]: math.prod(i.shape) for i in infos}

        def stack(*names: str) -> int:
            return sum(size.get(f"ffn_{n}.weight", 0) for n in names)

        if "ffn_down_exps.weight" in size:  # (a shared expert of the experts' shape joins their stacks)
            experts = max(experts, stack("gate_exps", "up_exps", "gate_shexp", "up_shexp"),
                          stack("down_exps", "down_shexp"))
    if head:
        out = gguf.info("output.weight") if "output.weight" in gguf else gguf.info("token_embd.weight")
        dense = max(dense, math.prod(out.shape))
    return min(max(dense, experts), cap)


def _rank_bytes(gguf: GGUFFile, arch: ArchConfig, launch: Launch, stage: int) -> int:
    """Weights and KV cache one rank of `stage` holds (tensor-parallel slices are 1/tp of each matrix); a hybrid
    model's KV for its attention layers only, and the recurrent state of max_num_seqs sequences and of its
    prefix-caching snapshots. On a GPU also the prompt scratches (scratch_elements, bf16)."""
    layers = launch.stages[stage]
    sizes = _layer_bytes(gguf, arch)
    n = sum(sizes[i] for i in layers)
    embd = gguf.info("token_embd.weight").n_bytes
    if stage == 0:
        n += embd
    if stage == launch.topo.pp - 1:
        n += gguf.info("output.weight").n_bytes if "output.weight" in gguf else (embd if stage else 0)
    itemsize = torch.empty(0, dtype=kv_cache_dtype(launch.config.cache.kv_dtype, torch.device(launch.device_type))).element_size()
    hy = arch.hybrid
    kv_layers = len(layers) if hy is None else sum(not hy.recurrent[i] for i in layers if i < hy.trunk)
    if hy is not None and launch.config.speculative.type == "draft-mtp":  # the MTP blocks' attention
        kv_layers += sum(i >= hy.trunk for i in layers)
    kv_heads = kv_heads_per_lane(arch.n_kv_heads, launch.topo.tp)
    kv = 2 * kv_layers * launch.num_slots * kv_heads * arch.head_dim * itemsize
    # (speculative decoding keeps a backup of each sequence's state for its verify steps; prefix caching its
    # snapshots)
    cfg = launch.config
    states = cfg.scheduler.max_num_seqs * (1 + cfg.speculative.enabled) + cfg.state_snapshots
    state = 0 if hy is None else hy.lane(launch.topo.tp).state_bytes(layers) * states
    head = stage == launch.topo.pp - 1
    scratch = 0
    if launch.device_type == "cuda":
        from vegaserve.triton_kernels.tuning import load_tuning

        mib = load_tuning(path=launch.config.kernels.tuning_file).scratch_mib
        scratch = 2 * scratch_elements(gguf, layers, head, mib * 2**20 // 2)
    return n // launch.topo.tp + kv + state + scratch


def _device_memory(config: EngineConfig, device_type: str, world: int) -> tuple[int, str]:
    """Bytes one rank may use, and where the figure comes from."""
    if config.parallel.device_memory_gib:
        return int(config.parallel.device_memory_gib * 2**30), "--device-memory"
    if device_type == "cuda":
        n = min(world, torch.cuda.device_count())
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) * n // world, "the smallest GPU"
    with open("/proc/meminfo") as f:
        avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)
    return (avail // world, "available host memory") if avail else (0, "")


# the share of a device an automatically sized KV cache fills, with what else the plan counts (weights, recurrent
# state, prompt scratches): the rest is for what it does not (activations, decode graphs, the allocator's slack)
AUTO_FILL = 0.9


def _draft_bytes(launch: Launch) -> Callable[[Launch], int]:
    """What a draft model (--spec-type draft) holds on the target's first device for a launch: its weights and
    a KV cache of as many slots as the target's (engine/speculative.py's DraftModelProposer); 0 without one."""
    spec = launch.config.speculative
    if spec.type != "draft" or not spec.draft_model:
        return lambda _: 0
    from vegaserve.engine.models.arch_config import arch_config_from_gguf

    gguf = GGUFFile(spec.draft_model)
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    config = dataclasses.replace(launch.config, speculative=dataclasses.replace(spec, type="none", draft_model=None),
                                 cache=dataclasses.replace(launch.config.cache, prefix_states=0))
    return lambda target: _rank_bytes(gguf, arch, dataclasses.replace(
        target, config=config, topo=SINGLE, stages=(range(arch.n_layers),)), 0)


def _fit_memory(launch: Launch, gguf: GGUFFile, arch: ArchConfig, limit: int, source: str) -> Launch:
    """The launch if every stage fits in `limit` bytes a device (a draft model's weights and cache counted on
    the first). If not, and the cache's size is the automatic one (neither -c nor a block count given), a
    cache shrunk to what fits in AUTO_FILL of it, whole blocks, and the context a sequence may reach capped to
    match: so that a model trained on a long context serves at -np N where N full contexts would not fit, as
    llama-server's default does. Otherwise, or where not even a block a sequence fits, a ConfigError naming
    the need."""
    stages = range(launch.topo.pp)
    draft = _draft_bytes(launch)

    def needs(plan: Launch) -> list[int]:
        return [_rank_bytes(gguf, arch, plan, s) + (draft(plan) if s == 0 else 0) for s in stages]

    need = needs(launch)
    if max(need) <= limit:
        return launch
    config, bs = launch.config, launch.config.cache.block_size
    n_seqs = config.scheduler.max_num_seqs
    if not config.cache.context_size and not config.cache.num_blocks:
        fixed = needs(dataclasses.replace(launch, num_slots=0))
        room = [int(AUTO_FILL * limit) - f for f in fixed]
        # blocks each stage has room for, at the bytes a block of KV costs it (none on a stage without attention)
        per_block = [(n - f) // (launch.num_slots // bs) for n, f in zip(need, fixed, strict=True)]
        blocks = min((r // b for r, b in zip(room, per_block, strict=True) if b), default=launch.num_slots // bs)
        if blocks >= n_seqs and min(room) >= 0:
            tokens = blocks * bs
            log.warning("KV cache sized to fit %s (%.2f GiB): %d tokens shared by %d sequences, context %d a "
                        "sequence (the model's %d for each would need %.2f GiB); -c sets it", source, limit / 2**30,
                        tokens, n_seqs, min(tokens, launch.max_model_len), launch.max_model_len,
                        max(need) / 2**30)
            return dataclasses.replace(launch, num_slots=tokens, max_model_len=min(tokens, launch.max_model_len))
    stage = max(stages, key=lambda s: need[s])
    state = f" and recurrent state for {n_seqs} sequences" if arch.hybrid is not None else ""
    snapshots = config.state_snapshots if arch.hybrid is not None else 0
    if snapshots:
        state += f" and {snapshots} saved for prefix caching"
    if stage == 0 and config.speculative.type == "draft":
        state += ", with the draft model's"
    fewer = "fewer sequences (-np)" + (" or fewer saved states (--prefix-states)" if snapshots else "")
    raise ConfigError(
        f"{gguf.path}: {launch.topo.describe()} needs {need[stage] / 2**30:.2f} GiB on each device of stage {stage} "
        f"(weights and KV cache for {launch.num_slots} tokens{state}), but {source} gives {limit / 2**30:.2f} GiB: "
        f"use more devices, a smaller context (-c) or {fewer}"
    )


def plan_launch(config: EngineConfig, gguf: GGUFFile, arch: ArchConfig, max_model_len: int, num_slots: int,
                device: torch.device, torchrun_world: int = 0) -> Launch:
    """The topology, layer split and memory check for this config; every impossible request fails here."""
    n = torchrun_world or count_devices(config)
    topo = plan_topology(config.parallel.split_mode, config.parallel.tensor_parallel_group, n)
    if topo.world_size < n and config.parallel.split_mode != "none":
        log.warning("%d devices visible, %s uses %d", n, topo.describe(), topo.world_size)
    # the largest block of each matrix a lane slices by input columns, over all layers (mixes differ per layer)
    sliced = {"attn_output": "attn_output", "ffn_down": "ffn_down_exps" if arch.moe is not None else "ffn_down"}
    if arch.moe is not None and arch.moe.shared_ff:
        sliced["ffn_down_shexp"] = "ffn_down_shexp"
    if arch.hybrid is not None:
        sliced["ssm_out"] = "ssm_out"
    # (a hybrid model's linear-attention layers have no attn_output)
    block = {k: max((spec_for(gguf.info(t).type_id).block_size
                     for t in (f"blk.{i}.{name}.weight" for i in range(arch.n_layers)) if t in gguf), default=1)
             for k, name in sliced.items()}
    check_model_splits(arch, topo, block, str(gguf.path), config.kernels.shexp_split)
    embd = gguf.info("token_embd.weight").n_bytes
    head = gguf.info("output.weight").n_bytes if "output.weight" in gguf else embd
    stages = tuple(partition_layers(_layer_bytes(gguf, arch), topo.pp, embd, head))
    cores = os.cpu_count() or 1
    launch = Launch(
        config=config, path=str(gguf.path), topo=topo, stages=stages, max_model_len=max_model_len,
        num_slots=num_slots, device_type=device.type,
        # torchrun's rendezvous is in the environment (MASTER_ADDR, MASTER_PORT); one node: a local port
        init_method="env://" if torchrun_world else f"tcp://127.0.0.1:{_free_port()}",
        threads=max(1, cores // topo.world_size), torchrun=bool(torchrun_world),
    )
    if device.type == "cuda" and not torchrun_world and topo.world_size > torch.cuda.device_count():
        log.warning("%d ranks on %d GPU(s): ranks share GPUs and talk over gloo (for testing; slow)",
                    topo.world_size, torch.cuda.device_count())
        launch = dataclasses.replace(launch, shared_gpus=True)
    limit, source = _device_memory(config, device.type, topo.world_size)
    return _fit_memory(launch, gguf, arch, limit, source) if limit else launch


def rank_device(launch: Launch, rank: int) -> torch.device:
    if launch.device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", local_rank() if launch.torchrun else rank % torch.cuda.device_count())
