"""Fixtures of the kernel tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture
def poisoned_empty():
    """torch.empty returns NaN-filled memory for the duration of a test (deterministic mode's fill), so an
    output element a kernel fails to write cannot pass as a zero. Opt in with
    `pytestmark = pytest.mark.usefixtures("poisoned_empty")`."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]


@pytest.fixture
def offline_compile():
    """Run a compile script (argv: backend, arch, warp size) in a Python without TRITON_INTERPRET (under it
    @triton.jit gives interpreted functions), for Triton's compilers, which need no GPU; returns its
    stdout after checking that it printed "compiled"."""

    def run(script: str, backend: str, arch: str, warp: int) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset
        done = subprocess.run([sys.executable, "-c", script, backend, arch, str(warp)], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-4000:]
        return done.stdout

    return run
