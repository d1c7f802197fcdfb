"""The quantized GEMM (gemm._gemm_kernel) compiles for an NVIDIA sm_90 and an AMD gfx906 target, plain and
grouped (a stack of experts), with the launch parameters the rule gives at 16 rows, for a super-block type and
a 32-element one, and Q4_K's product a sub-block (the rule's launch at 64 rows on a wide matrix): tl.dot on
bf16 there, on fp16 on gfx906 (no matrix cores: the dot is FMA; what it costs there is not measured, and the
gfx906 fallback does not select the GEMM yet). These compilers need no GPU.

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions).
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import gemm, matmul
from vegaserve.triton_kernels.dequant import GGMLType as T

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
act = "*bf16" if backend == "cuda" else "*fp16"
ptrs = {"x_ptr": act, "y_ptr": "*fp32", "base": "*u8", "order_ptr": "*i64", "counts_ptr": "*i64",
        "starts_ptr": "*i64", "pstarts_ptr": "*i64"}
for name in ("Q4_K", "MXFP4"):  # a 256-element super-block type and a 32-element one (64-element tiles)
    tid = int(getattr(T, name))
    for m, grouped, n in ((16, 0, 4096), (16, 1, 4096)) + (((64, 0, 28672),) if name == "Q4_K" else ()):
        p = gemm.gemm_rule(tid, n, 4096, m, 132)
        assert p.get("sub", 0) == (m == 64)
        nb = matmul.tile_split(tid, 4096, p["nb"], 1)[0]
        consts = dict(WTYPE=tid, QK=gemm._qk(tid), BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], NB=nb,
                      GROUPED=grouped, XDIV=1, E_P2=128 if grouped else 1, DOT_F32=0, SUB=p.get("sub", 0),
                      tab_ptr=None)
        fn = gemm._gemm_kernel
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
        triton.compile(ASTSource(fn, sig, consts), target=target,
                       options={"num_warps": p["num_warps"], "num_stages": p["num_stages"]})
    print(name)
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_quant_gemm_compiles_for_nvidia_and_amd(backend, arch, warp, offline_compile):
    out = offline_compile(COMPILE, backend, arch, warp)
    assert out.split() == ["Q4_K", "MXFP4", "compiled"]
