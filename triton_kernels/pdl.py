"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
kernel before it in the stream is still running, so its launch, its programs' set-up and its weight
loads overlap the previous kernel's last wave instead of following it.

Every kernel that takes part calls `let_next_start` first (the next kernel may be scheduled once all of
this kernel's programs have started) and `wait_for_inputs` before it reads anything an earlier kernel
wrote and before it writes anything at all. Before the wait come only reads of memory that no kernel
launched with PDL writes in the same step: weights and tables of constants; a step's inputs (token ids,
positions, cache slots, lengths, block tables), which host copies and torch's kernels write (those launch
without PDL, so the kernel after one starts when it has finished, and every later kernel after that);
and what only earlier steps wrote, such as the KV cache below a decode step's new positions (a step
starts after the last one has finished: a graph replay after the one before, and eager steps with
torch's sampling kernels between them). The wait returns once the previous kernel has finished and its
writes are visible, and since that kernel waited on its own predecessor, everything earlier in the
stream is finished too.

Off under the Triton interpreter, on AMD and before sm_90, and after `set_enabled(False)`: the engine
calls it from its `kernels.pdl` setting (VEGASERVE_PDL=0, engine/env.py); each kernel then starts after
the last has finished, as without this.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


_on = True

# the first line of a profiler's kernel table taken with PDL on (benchmarks/bench_engine.py, bench_verify.py)
PROFILE_NOTE = ("PDL on: each kernel's device time runs from its early start, its wait for the kernel before it "
                "included, so the times overlap and do not add up to the step (VEGASERVE_PDL=0: times that do)\n")


def set_enabled(on: bool) -> None:
    """Launch with PDL where the device has it (the default), or never."""
    global _on
    _on = on


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if device.type != "cuda" or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not _on:
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device) -> dict[str, bool]:
    """The keywords of a launch of a kernel that takes the constant PDL and calls let_next_start and
    wait_for_inputs with it: PDL, and Triton's launch_pdl where it is on."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def let_next_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
