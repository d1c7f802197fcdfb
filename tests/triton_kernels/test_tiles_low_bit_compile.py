"""The tile kernels of the low-bit super-block types (Q2_K, Q3_K, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
IQ2_S, IQ1_S, IQ1_M) compile for an NVIDIA sm_90 and an AMD gfx906 target: the decode mat-vec's `tiles`
kernel as the fallback rule launches it (one row, two super-blocks a tile) and the prefill path's
dequantizer. The interpreter accepts what a compiler may not (16-bit table loads, 4-D register tensors, the
f16 bitcast of IQ1_M's scale); these compilers need no GPU.

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions).
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import matmul
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.tiles_iq import LATTICE

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
act = "*bf16" if backend == "cuda" else "*fp16"
names = ("Q2_K", "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
for name in names:
    tid = int(getattr(T, name))
    ptrs = {"x_ptr": act, "part_ptr": "*fp32", "base": "*u8", "out_ptr": act, "tab_ptr": "*i16"}
    nb = matmul.tile_split(tid, 4096, 16, 1)[0]
    kernels = ((matmul._matvec_kernel, dict(matmul.tile_constexprs(tid, 1, 16, nb), EXPERTS=0, XDIV=1)),
               (matmul._dequant_kernel, dict(WTYPE=tid, QK=256, BLOCK_N=16, NB=1, EXPERTS=0)))
    for fn, consts in kernels:
        consts = dict(consts)
        if tid not in LATTICE:
            consts["tab_ptr"] = None
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
        triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4})
    print(name)
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_low_bit_tile_kernels_compile_for_nvidia_and_amd(backend, arch, warp, offline_compile):
    out = offline_compile(COMPILE, backend, arch, warp)
    assert out.split() == ["Q2_K", "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
                           "IQ1_M", "compiled"]
