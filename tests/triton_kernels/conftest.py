"""Fixtures of the kernel tests."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


_COPY_KERNEL = r"""
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def copy(x_ptr, y_ptr):
    i = tl.arange(0, 64)
    tl.store(y_ptr + i, tl.load(x_ptr + i))

triton.compile(ASTSource(copy, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {}),
               target=GPUTarget(sys.argv[1], sys.argv[2], int(sys.argv[3])))
print("compiled")
"""


def _compile_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset
    return env


@functools.cache
def _refused_target(backend: str, arch: str, warp: int) -> str | None:
    """Why the installed Triton cannot compile even a copy kernel for an AMD target (None where it can):
    Triton 3.6's AMD backend answers "unsupported target: 'gfx906'" for every kernel; 3.9 and the ROCm image's
    triton-gfx906 compile for it."""
    if backend != "hip":
        return None
    with tempfile.TemporaryDirectory() as tmp:  # @triton.jit reads its function's source from a file
        probe = Path(tmp) / "copy_kernel.py"
        probe.write_text(_COPY_KERNEL)
        done = subprocess.run([sys.executable, str(probe), backend, arch, str(warp)], capture_output=True, text=True,
                              env=_compile_env(), timeout=600)
    if done.returncode == 0 and "compiled" in done.stdout:
        return None
    import triton

    lines = done.stderr.strip().splitlines() or ["no output"]
    first_error = next((line for line in lines if "error:" in line), lines[-1])
    return f"Triton {triton.__version__} compiles nothing for {arch} ({first_error.split('error:')[-1].strip()})"


@pytest.fixture
def offline_compile():
    """Run a compile script (argv: backend, arch, warp size) in a Python without TRITON_INTERPRET (under it
    @triton.jit gives interpreted functions), for Triton's compilers, which need no GPU; returns its
    stdout after checking that it printed "compiled". Skipped where the installed Triton compiles no kernel at
    all for the AMD target (a copy kernel is tried first), since then the script's failure says nothing of
    ours."""

    def run(script: str, backend: str, arch: str, warp: int) -> str:
        refused = _refused_target(backend, arch, warp)
        if refused is not None:
            pytest.skip(refused)
        done = subprocess.run([sys.executable, "-c", script, backend, arch, str(warp)], capture_output=True,
                              text=True, env=_compile_env(), timeout=600)
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
