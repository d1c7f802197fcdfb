"""Which AllReduce a tensor-parallel message takes (the llama.cpp fork's policy), why the custom one may not
be there at all, and how the ranks agree on a refusal (`agree`: one rank refused, every rank falls back).

    device     NCCL / RCCL on GPUs, gloo on the CPU: the custom AllReduce is off (GGML_ENABLE_CUSTOM_AR=0),
               refused at start (`refusal`, custom_allreduce.open_custom_allreduce), or the message is
               larger than the size gate (prefill-size messages, where the ring's bandwidth wins)
    two_shot   decode-size messages at TP 5, 8 and 10, and at TP 4 inside a multi-stage -tps pipeline
    one_shot   decode-size messages otherwise (standalone TP 2 to 4: one-shot's single round trip wins)
GGML_TP_AR_TWOSHOT=0 / 1 forces one-shot / two-shot below the gate. Sizes are bytes on the wire (f32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

Variant = Literal["device", "one_shot", "two_shot"]
TWO_SHOT_TP = frozenset({5, 8, 10})  # the fork's measured choice on gfx906 over PCIe


@dataclass(frozen=True)
class AllReduceSwitches:
    custom: bool = False  # GGML_ENABLE_CUSTOM_AR
    two_shot: bool | None = None  # GGML_TP_AR_TWOSHOT; None: by the TP size


def choose(tp: int, pp: int, nbytes: int, gate_bytes: int, two_shot: bool | None = None) -> Variant:
    """The AllReduce of an nbytes message (f32 on the wire) in a group of tp lanes, pp pipeline stages,
    where the custom AllReduce is up."""
    if tp < 2 or nbytes > gate_bytes:
        return "device"
    if two_shot is not None:
        return "two_shot" if two_shot else "one_shot"
    return "two_shot" if tp in TWO_SHOT_TP or (tp == 4 and pp > 1) else "one_shot"


def refusal(device: torch.device, tp: int) -> str | None:
    """Why the custom AllReduce cannot even be tried on this rank (None: try it)."""
    if tp < 2:
        return "no tensor-parallel group (one lane)"
    if device.type != "cuda":
        return "the peer-write AllReduce needs GPUs and this run is on the CPU"
    return None


def device_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "gloo"
    return "RCCL" if torch.version.hip else "NCCL"


def fallback_warning(reason: str, device: torch.device) -> str:
    """The one line logged where GGML_ENABLE_CUSTOM_AR=1 cannot be honoured."""
    return f"GGML_ENABLE_CUSTOM_AR=1: {reason}; {device_backend(device)}'s AllReduce is used"


def agree(reason: str | None, group: Any = None) -> str | None:
    """Collective: every rank's refusal gathered, and the first (`rank r: why`) returned on every rank of
    the group, or None where none refused, so that all ranks take the same path."""
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(reasons)))
    return next((f"rank {r}: {why}" for r, why in zip(ranks, reasons, strict=True) if why is not None), None)
