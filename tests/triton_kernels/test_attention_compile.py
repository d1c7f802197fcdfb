"""The attention kernels compile for an NVIDIA sm_90 and an AMD gfx906 target with each backend's fallback
launch parameters, the decode split kernel with one split and several, and the kernels that write the
output with and without its q8_1 copy, and gpt-oss's sliding window and attention sinks:
the interpreter accepts code the compiler rejects, and these compilers need no GPU.

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions). f16
cache, Llama-3-8B's head_dim 128 and group 4.
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import attention_decode as dec, attention_prefill as pre
from vegaserve.triton_kernels.attention_common import backend_fallback, split_params

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
types = {"q_ptr": "*fp32", "k_ptr": "*fp16", "v_ptr": "*fp16", "table_ptr": "*i32", "lens_ptr": "*i32",
         "qstart_ptr": "*i32", "out_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
         "q8_ptr": "*i8", "q8d_ptr": "*fp32", "q8s_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale": "fp32"}

def build(fn, consts, opts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=target, options=opts)

pdl = backend == "cuda"  # programmatic dependent launch: sm_90's, AMD has none (pdl.py)
meta, opts = split_params(backend_fallback(backend, "decode"))
for single, q8 in ((False, False), (True, True), (False, True), (True, False)):
    build(dec._decode_split_kernel, dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_G=16, BLOCK_D=128,
          BLOCK_N=meta["block_n"], SPLIT_KEYS=meta["split_keys"], DOT_F32=False, SINGLE=single, Q8=q8, PDL=pdl),
          opts)
# gpt-oss's layers: a sliding window and attention sinks
build(dec._decode_split_kernel, dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_G=16, BLOCK_D=128,
      BLOCK_N=meta["block_n"], SPLIT_KEYS=meta["split_keys"], DOT_F32=False, SINGLE=False, Q8=False, PDL=pdl,
      WINDOW=128, SINKS=1), opts)
for q8, window, sinks in ((False, 0, 0), (True, 0, 0), (False, 128, 1)):
    build(dec._decode_combine_kernel, dict(HEAD_DIM=128, BLOCK_P=32, BLOCK_D=128, BLOCK_N=meta["block_n"],
          SPLIT_KEYS=meta["split_keys"], Q8=q8, PDL=pdl, WINDOW=window, SINKS=sinks), {})
meta, opts = split_params(backend_fallback(backend, "prefill"))
for window, sinks in ((0, 0), (128, 1)):
    build(pre._prefill_kernel, dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_G=4, BLOCK_Q=meta["block_m"] // 4,
          BLOCK_D=128, BLOCK_N=meta["block_n"], DOT_F32=False, WINDOW=window, SINKS=sinks), opts)
print("compiled")
"""


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_kernels_compile_for_the_target_with_its_fallback_parameters(backend, arch, warp, offline_compile):
    offline_compile(COMPILE, backend, arch, warp)
