"""Every environment switch vegaserve reads, in one place, mapped onto the config tree.

These are the llama.cpp fork's switches, kept so that existing launch scripts keep working, and vegaserve's
own (VEGASERVE_*). Those of features not implemented yet are listed apart, to be warned about. ROCm's own
variables (HSA_*, GPU_MAX_HW_QUEUES, HIP_VISIBLE_DEVICES) are for the runtime and are not read here.
Nothing else in vegaserve reads os.environ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vegaserve.engine.config import ConfigError


def _flag(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no", ""):
        return False
    raise ConfigError(f"{name} must be 0 or 1, got {value!r}")


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


# name -> (section, key, parser)
SWITCHES: dict[str, tuple[str, str, Any]] = {
    "GGML_SCHED_N_COPIES": ("parallel", "sched_n_copies", _int),
    "GGML_ENABLE_CUSTOM_AR": ("parallel", "custom_allreduce", _flag),
    "GGML_TP_AR_TWOSHOT": ("parallel", "allreduce_two_shot", _flag),
    "GGML_META_TOKEN_GRAPH": ("kernels", "token_graph", _flag),
    "GGML_CUDA_Q8_1_CACHE": ("kernels", "q8_1_cache", _flag),
    "VEGASERVE_PDL": ("kernels", "pdl", _flag),
    "VEGASERVE_CPU_INT4": ("kernels", "cpu_int4", _flag),
    "LLAMA_SHEXP_SPLIT": ("kernels", "shexp_split", _flag),
    "VEGASERVE_ASYNC_DECODE": ("scheduler", "async_decode", _flag),
}

# The fork's switches whose feature vegaserve does not have yet: one set is warned about at start and
# changes nothing. Not refused, because MI50 launch scripts export the fork's recommended environment.
NOT_YET: dict[str, str] = {
    "GGML_CUDA_CUBLAS_COMPUTE_TYPE": "a choice of compute type for bf16 weights is not implemented yet",
    "LLAMA_ENABLE_MTP_OPT": "not implemented yet as a switch, and nothing to turn on: draft-mtp here has no draft "
                            "context (the MTP block's KV sits in the target's cache, written during its catch-up, "
                            "with logits for the last rows only) and always drops a draft with non-finite logits",
    "LLAMA_PLE_SHARD": "per-layer-embedding sharding is not implemented yet",
}


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The environment's part of the config tree, as a nested dict of the switches that are set."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    for name, (section, key, parse) in SWITCHES.items():
        if name in environ:
            tree.setdefault(section, {})[key] = parse(environ[name], name)
    return tree


def ignored_switches(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning line for each not-yet switch that is set (NOT_YET)."""
    environ = os.environ if environ is None else environ
    return [f"{name}={environ[name]} is set: {why}; ignored" for name, why in NOT_YET.items() if name in environ]


def torchrun_rank() -> tuple[int, int] | None:
    """(global rank, world size) when torchrun (or any launcher of its convention) started this process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _int(os.environ["RANK"], "RANK"), _int(os.environ["WORLD_SIZE"], "WORLD_SIZE")
    return None


def local_rank() -> int:
    """This process's GPU index on its node under torchrun (LOCAL_RANK)."""
    return _int(os.environ.get("LOCAL_RANK", "0"), "LOCAL_RANK")
