"""The quantized GEMM's int8 mode (gemm._gemm_kernel with INT8) compiles for an NVIDIA sm_90 and an AMD gfx906
target for Q4_K, Q6_K and Q8_0 at the rule's 16-row launch, with an int8 matrix instruction in it: on sm_90 the
int8 tl.dot is wgmma with s8 operands and an s32 accumulator (m64n16k32 at BLOCK_M 16); gfx906 has no matrix
cores, and Triton's AMD backend makes the dot v_dot4_i32_i8 (four byte products a lane), the instruction the
int8 decode mat-vecs use there. These compilers need no GPU; whether the mode is faster than the bf16 one is
not measured yet (nothing selects it).

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions).
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import gemm, matmul
from vegaserve.triton_kernels.dequant import GGMLType as T

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
ptrs = {"x_ptr": "*i8", "y_ptr": "*fp32", "base": "*u8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "order_ptr": "*i64",
        "counts_ptr": "*i64", "starts_ptr": "*i64", "pstarts_ptr": "*i64"}
for name in ("Q4_K", "Q6_K", "Q8_0"):
    tid = int(getattr(T, name))
    p = gemm.gemm_rule(tid, 4096, 4096, 16, 132)
    nb = matmul.tile_split(tid, 4096, p["nb"], 1)[0]
    consts = dict(WTYPE=tid, QK=gemm._qk(tid), BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], NB=nb, GROUPED=0,
                  XDIV=1, E_P2=1, DOT_F32=0, SUB=0, INT8=1, tab_ptr=None)
    fn = gemm._gemm_kernel
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=target,
                       options={"num_warps": p["num_warps"], "num_stages": p["num_stages"]})
    asm = k.asm["ptx" if backend == "cuda" else "amdgcn"]
    found = sorted(set(re.findall(r"wgmma\.mma_async\S*s8\b|mma\.sync\S*\.s8\b|v_dot4_i32_i8|v_mfma\w*i8", asm)))
    print(name, " ".join(found) or "-")
print("compiled")
"""

WANT = {"cuda": "wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8", "hip": "v_dot4_i32_i8"}


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_int8_gemm_compiles_to_int8_dot_instructions_for_nvidia_and_amd(backend, arch, warp, offline_compile):
    out = offline_compile(COMPILE, backend, arch, warp)
    found = dict(line.split(" ", 1) for line in out.splitlines() if line != "compiled")
    assert found == {name: WANT[backend] for name in ("Q4_K", "Q6_K", "Q8_0")}, out
