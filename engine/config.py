"""The one typed configuration tree. Frozen dataclasses per area, validated at construction.

Sources, highest first: CLI flags, environment (engine/env.py), a YAML file (`--config`). The CLI
(server/cli.py) merges them into plain dicts and calls `EngineConfig.from_dict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

LoadMode = Literal["mmap", "read", "dio"]
SplitMode = Literal["none", "layer", "tensor"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which setting and why."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    load_mode: LoadMode = "mmap"
    no_repack: bool = False
    served_model_name: str | None = None  # default: the file's stem

    def __post_init__(self) -> None:
        _require(self.load_mode in ("mmap", "read", "dio"), f"load mode must be mmap, read or dio, got {self.load_mode!r}")


@dataclass(frozen=True)
class CacheConfig:
    context_size: int = 0  # 0: the model's trained context length
    kv_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # 0: enough for max_num_seqs sequences of the full context
    # --prefix-states: hybrid models' recurrent states kept for prefix caching (engine/state_pool.py), each the
    # size of one sequence's state; 0: no prefix caching for them. None: one per sequence (-np), at least 4
    # (EngineConfig.state_snapshots)
    prefix_states: int | None = None

    def __post_init__(self) -> None:
        _require(self.prefix_states is None or self.prefix_states >= 0,
                 f"--prefix-states must be >= 0, got {self.prefix_states}")
        _require(self.context_size >= 0, f"context size must be >= 0, got {self.context_size}")
        _require(self.block_size >= 1, f"KV block size must be >= 1, got {self.block_size}")
        _require(self.num_blocks >= 0, f"KV block count must be >= 0, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 1  # llama-server's -np
    max_num_batched_tokens: int = 2048
    # VEGASERVE_ASYNC_DECODE: launch the next decode step before the host has read this one's tokens
    # (engine_core.py); None: on where the device runs asynchronously (a GPU), off on a CPU
    async_decode: bool | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"parallel sequences (-np) must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16")


@dataclass(frozen=True)
class ParallelConfig:
    split_mode: SplitMode = "none"
    tensor_parallel_group: int = 0  # -tps T; 0: one group of all GPUs
    sched_n_copies: int | None = None  # GGML_SCHED_N_COPIES
    n_devices: int = 0  # -ndev; 0: every visible GPU (on a CPU: 1; more runs that many CPU processes)
    device_memory_gib: float = 0.0  # --device-memory; 0: what each device reports
    # GGML_ENABLE_CUSTOM_AR: tensor-parallel AllReduces below the tuning file's size gate through the
    # peer-write kernels (engine/distributed/custom_allreduce.py), which also lets decode graphs be captured
    # under tensor parallelism; off: NCCL / RCCL everywhere
    custom_allreduce: bool = False
    allreduce_two_shot: bool | None = None  # GGML_TP_AR_TWOSHOT: force two-shot (True) / one-shot (False); None: by TP size

    def __post_init__(self) -> None:
        _require(self.n_devices >= 0, f"-ndev must be >= 0, got {self.n_devices}")
        _require(self.device_memory_gib >= 0, f"--device-memory must be >= 0, got {self.device_memory_gib}")
        _require(self.sched_n_copies is None or self.sched_n_copies >= 1, f"GGML_SCHED_N_COPIES must be >= 1, got {self.sched_n_copies}")
        _require(self.split_mode in ("none", "layer", "tensor"), f"split mode must be none, layer or tensor, got {self.split_mode!r}")
        _require(self.tensor_parallel_group >= 0, f"-tps must be >= 0, got {self.tensor_parallel_group}")
        _require(isinstance(self.custom_allreduce, bool),
                 f"parallel.custom_allreduce must be true or false, got {self.custom_allreduce!r}")
        _require(self.allreduce_two_shot is None or isinstance(self.allreduce_two_shot, bool),
                 f"parallel.allreduce_two_shot must be true, false or unset, got {self.allreduce_two_shot!r}")


@dataclass(frozen=True)
class KernelConfig:
    token_graph: bool = True  # GGML_META_TOKEN_GRAPH
    q8_1_cache: bool = True  # GGML_CUDA_Q8_1_CACHE
    pdl: bool = True  # VEGASERVE_PDL: programmatic dependent launch of the decode kernels (sm_90+)
    shexp_split: bool = True  # LLAMA_SHEXP_SPLIT: a shared expert split over tensor-parallel lanes, not held whole
    cpu_int4: bool = True  # VEGASERVE_CPU_INT4: Q4_0/Q4_1/Q8_0 through torch's int4 CPU kernel; off: f32 throughout
    tuning_file: str | None = None
    # a GPU engine runs the prompt path once at start (EngineCore.warm_up), so its kernels are compiled before
    # the first request rather than during it; --no-warmup (llama-server's flag) skips it
    warmup: bool = True


SpecType = Literal["none", "ngram", "draft", "draft-mtp"]

# Draft tokens per step when --draft-max is not given. draft: llama-server's long-standing 16; ngram: 8,
# enough for a copied passage, short enough that a miss costs a narrow verify step; draft-mtp: 2, as the
# fork measures its MTP heads.
DEFAULT_DRAFT_MAX: dict[str, int] = {"ngram": 8, "draft": 16, "draft-mtp": 2}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py): a proposer guesses the next tokens, one target step
    checks them all."""

    type: SpecType = "none"
    draft_model: str | None = None  # -md: the draft GGUF (type draft)
    draft_max: int | None = None  # --draft-max: draft tokens per step; None: DEFAULT_DRAFT_MAX of the type
    draft_min: int = 0  # --draft-min: a shorter draft is not verified at all
    draft_p_min: float = 0.75  # --draft-p-min: a draft model stops where its top token is less likely than this
    ngram_size: int = 3  # --spec-ngram-size-n: the longest suffix ngram looks up; shorter ones down to 2 are tried

    def __post_init__(self) -> None:
        _require(self.type in ("none", "ngram", "draft", "draft-mtp"),
                 f"--spec-type must be none, ngram, draft or draft-mtp, got {self.type!r}")
        _require(self.draft_max is None or self.draft_max >= 1, f"--draft-max must be at least 1, got {self.draft_max}")
        _require(self.draft_min >= 0, f"--draft-min must be >= 0, got {self.draft_min}")
        _require(0.0 <= self.draft_p_min <= 1.0, f"--draft-p-min must be in [0, 1], got {self.draft_p_min}")
        _require(self.ngram_size >= 2, f"--spec-ngram-size-n must be at least 2, got {self.ngram_size}")
        _require(self.type == "draft" or self.draft_model is None,
                 f"-md (a draft model) needs --spec-type draft, not {self.type}")
        _require(self.type != "draft" or bool(self.draft_model), "--spec-type draft needs a draft model: -md FILE")
        _require(self.draft_min <= self.max_draft or self.type == "none",
                 f"--draft-min {self.draft_min} exceeds --draft-max {self.max_draft}")

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    @property
    def max_draft(self) -> int:
        """Draft tokens per step, the type's default filled in."""
        return self.draft_max if self.draft_max is not None else DEFAULT_DRAFT_MAX.get(self.type, 0)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    log_level: str = "info"
    drain_timeout_s: float = 30.0  # after SIGTERM: how long in-flight requests may take to finish
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this
    body_timeout_s: float = 60.0  # ... and its body within this after them
    special_tokens_in_content: bool = False  # True: control-token text in messages is parsed (llama-server)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")
        _require(self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("header_timeout_s", "body_timeout_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "auto"  # auto: cuda/hip if present, else cpu
    seed: int | None = None

    @property
    def state_snapshots(self) -> int:
        """Recurrent-state snapshots a hybrid model keeps for prefix caching (--prefix-states filled in)."""
        if self.cache.prefix_states is not None:
            return self.cache.prefix_states
        # (at least 4: a request may save twice, its shared head and its end, and one conversation of a lone
        # user should not evict its system prompt's state)
        return max(self.scheduler.max_num_seqs, 4)

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> EngineConfig:
        """Build from a nested dict ({'model': {...}, 'server': {...}, 'device': ...}); unknown keys are errors."""
        kwargs: dict[str, Any] = {}
        sections = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in tree.items():
            _require(key in sections, f"unknown configuration section {key!r} (known: {', '.join(sections)})")
            sub = _SECTION_TYPES.get(key)
            if sub is None:
                kwargs[key] = value
                continue
            _require(isinstance(value, dict), f"configuration section {key!r} must be a mapping")
            names = {f.name for f in dataclasses.fields(sub)}
            unknown = set(value) - names
            _require(not unknown, f"unknown setting(s) in {key!r}: {', '.join(sorted(unknown))}")
            kwargs[key] = sub(**value)
        return cls(**kwargs)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "kernels": KernelConfig,
    "speculative": SpeculativeConfig,
    "server": ServerConfig,
}


def merge_trees(*trees: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge config dicts; later trees win (pass lowest priority first)."""
    out: dict[str, Any] = {}
    for tree in trees:
        for key, value in tree.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge_trees(out[key], value)
            else:
                out[key] = value
    return out
