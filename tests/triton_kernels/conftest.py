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


@pytest.fixture
def q8_1_reference_check():
    """`check(launch, name, n, k, rows, seed, params)`: a decode mat-vec launcher (matvec.KERNELS' signature:
    x, w, params, q8_1) on a random [n, k] matrix of type `name`, repacked on the test's device, for each
    count of rows of x; each output finite and within 1e-5 (relative Frobenius) of the reference product
    on the same q8_1 activation (float64). Returns the outputs."""
    from vegaserve.triton_kernels.dequant import GGML_TYPES
    from vegaserve.triton_kernels.layout import repack
    from vegaserve.triton_kernels.matvec_int8 import reference_matvec_q8_1
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1
    from vegaserve.triton_kernels.quants.random_blocks import random_blocks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = {s.name: t for t, s in GGML_TYPES.items()}

    def check(launch, name: str, n: int, k: int, rows: tuple[int, ...], seed: int, params: dict) -> list:
        tid = ids[name]
        raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed))
        w, ref_w = repack(raw.to(device), tid, n, k), repack(raw, tid, n, k)
        gen = torch.Generator().manual_seed(seed + 1)
        outs = []
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device)
            q8 = quantize_q8_1(x)
            y = launch(x, w, params, q8)
            assert torch.isfinite(y).all(), (name, m, params)
            ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, (name, m, params)
            outs.append(y)
        return outs

    return check
