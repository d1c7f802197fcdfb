"""The int8-dot decode mat-vec kernels (matvec_int8.py: the 32-element types' with their flat loads and the
K-quants' groups kernels; matvec_pieces.py; on NVIDIA matvec_mma.py's lanes kernel) compile for an NVIDIA
sm_90 and an AMD gfx906 target with each one's instructions in them: dp4a and prmt (the level tables),
mma.sync (the lanes kernel) in the PTX, v_dot4_i32_i8 and v_perm_b32 in the AMDGCN assembly. The
interpreter runs the integer emulation of those instructions, so only a compiler sees the inline assembly;
these compilers need no GPU. (Whether gfx906 runs them right is for a gfx906.)

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions). M = 1
(the lanes kernel: 8), a split-K of 2, the tiles of an 8B decode; the 32-element types also with a masked
last tile (TAIL), as gpt-oss's rows of 90 blocks take tiles of 16.
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import matvec_int8, matvec_mma, matvec_pieces
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.int8_ops import AMDGCN_DOT4, PTX_DP4A

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
dot = PTX_DP4A if backend == "cuda" else AMDGCN_DOT4
types = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "base": "*u8", "part_ptr": "*fp32",
         "out_ptr": "*fp32", "count_ptr": "*i32", "ids_ptr": "*u8", "tab_ptr": "*i32"}
# a plain launch, not an expert mat-vec: the constexprs at their defaults, as a launch leaves them
common = dict(M=1, BLOCK_N=16, SPLIT=2, DOT=dot, CARRY=0, PDL=False, EXPERTS=0, XDIV=1)
kernels = {}
for name, nb in (("Q8_0", 32), ("Q4_0", 32), ("IQ4_NL", 32), ("MXFP4", 32), ("IQ4_XS", 16), ("Q4_K", 8), ("Q6_K", 4),
                 ("Q3_K", 4), ("IQ2_XXS", 4), ("Q2_K", 4), ("IQ3_XXS", 4), ("IQ3_S", 4),
                 ("IQ2_XS", 4), ("IQ2_S", 4), ("IQ1_S", 4), ("IQ1_M", 4)):
    fn, type_args = matvec_int8.kernel_for(getattr(T, name), 1)  # as a one-row launch takes it
    kernels[name] = (fn, dict(NB=nb, **type_args))
for name in ("Q8_0", "Q4_0", "IQ4_NL", "MXFP4"):  # tiles of 16 over gpt-oss's rows of 90 blocks: a masked last tile
    fn, type_args = matvec_int8.kernel_for(getattr(T, name), 1)
    kernels[name + "_tail"] = (fn, dict(NB=16, CARRY=1, **{**type_args, "TAIL": 1}))
for name in ("Q4_K", "Q6_K"):
    fn = matvec_pieces._KERNELS[getattr(T, name)]
    kernels[name + "_pieces"] = (fn, dict(NB=8, UNPACK=0))
    kernels[name + "_pieces_unpack"] = (fn, dict(NB=8, UNPACK=1))
if backend == "cuda":  # matrix units: gfx906 has none
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"):
        kernels[name + "_lanes"] = (matvec_mma.lanes_kernel,
                                    dict(M=8, BLOCK_N=64, NB=4, **matvec_mma.kernel_args(getattr(T, name), 4)))
for name, (fn, consts) in kernels.items():
    consts = {k: v for k, v in {**common, **consts}.items() if k in fn.arg_names}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4})
    asm = k.asm["ptx" if backend == "cuda" else "amdgcn"]
    found = [ins for ins in ("dp4a.s32.s32", "prmt.b32", "v_dot4_i32_i8", "v_perm_b32",
                             "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                             "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32") if ins in asm]
    print(name, " ".join(found))
print("compiled")
"""

WANT = {  # kernel -> instructions it must contain, per backend
    "cuda": {"Q8_0": {"dp4a.s32.s32"}, "Q4_0": {"dp4a.s32.s32"}, "IQ4_NL": {"dp4a.s32.s32", "prmt.b32"},
             "MXFP4": {"dp4a.s32.s32", "prmt.b32"}, "IQ4_XS": {"dp4a.s32.s32", "prmt.b32"}, "Q4_K": {"dp4a.s32.s32"},
             "Q8_0_tail": {"dp4a.s32.s32"}, "Q4_0_tail": {"dp4a.s32.s32"}, "IQ4_NL_tail": {"dp4a.s32.s32", "prmt.b32"},
             "MXFP4_tail": {"dp4a.s32.s32", "prmt.b32"},
             "Q6_K": {"dp4a.s32.s32"}, "Q3_K": {"dp4a.s32.s32"},
             "IQ2_XXS": {"dp4a.s32.s32"}, "Q2_K": {"dp4a.s32.s32"}, "IQ3_XXS": {"dp4a.s32.s32"},
             "IQ3_S": {"dp4a.s32.s32"}, "IQ2_XS": {"dp4a.s32.s32"}, "IQ2_S": {"dp4a.s32.s32"},
             "IQ1_S": {"dp4a.s32.s32"}, "IQ1_M": {"dp4a.s32.s32"}, "Q4_K_pieces": {"dp4a.s32.s32"}, "Q4_K_pieces_unpack": {"dp4a.s32.s32"}, "Q6_K_pieces": {"dp4a.s32.s32"},
             "Q6_K_pieces_unpack": {"dp4a.s32.s32"},
             "Q4_K_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q6_K_lanes": {"mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"},
             "Q8_0_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q4_0_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "IQ4_NL_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "prmt.b32"},
             "MXFP4_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "prmt.b32"}},
    "hip": {"Q8_0": {"v_dot4_i32_i8"}, "Q4_0": {"v_dot4_i32_i8"}, "IQ4_NL": {"v_dot4_i32_i8", "v_perm_b32"},
            "MXFP4": {"v_dot4_i32_i8", "v_perm_b32"}, "IQ4_XS": {"v_dot4_i32_i8", "v_perm_b32"},
            "Q8_0_tail": {"v_dot4_i32_i8"}, "Q4_0_tail": {"v_dot4_i32_i8"},
            "IQ4_NL_tail": {"v_dot4_i32_i8", "v_perm_b32"}, "MXFP4_tail": {"v_dot4_i32_i8", "v_perm_b32"},
            "Q4_K": {"v_dot4_i32_i8"}, "Q6_K": {"v_dot4_i32_i8"}, "Q3_K": {"v_dot4_i32_i8"},
            "IQ2_XXS": {"v_dot4_i32_i8"}, "Q2_K": {"v_dot4_i32_i8"}, "IQ3_XXS": {"v_dot4_i32_i8"},
            "IQ3_S": {"v_dot4_i32_i8"}, "IQ2_XS": {"v_dot4_i32_i8"}, "IQ2_S": {"v_dot4_i32_i8"},
            "IQ1_S": {"v_dot4_i32_i8"}, "IQ1_M": {"v_dot4_i32_i8"},
            "Q4_K_pieces": {"v_dot4_i32_i8"}, "Q4_K_pieces_unpack": {"v_dot4_i32_i8"},
            "Q6_K_pieces": {"v_dot4_i32_i8"}, "Q6_K_pieces_unpack": {"v_dot4_i32_i8"}},
}


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_int8_kernels_compile_with_the_targets_dot_and_permute_instructions(backend, arch, warp, offline_compile):
    out = offline_compile(COMPILE, backend, arch, warp)
    found = {line.split()[0]: set(line.split()[1:]) for line in out.splitlines() if line != "compiled"}
    assert set(found) == set(WANT[backend])
    for name, want in WANT[backend].items():
        assert want <= found[name], f"{name} on {arch}: {sorted(found[name])}, expected {sorted(want)}"
        assert not found[name] - {i for w in WANT[backend].values() for i in w}, f"{name}: the other vendor's instruction"
    if backend == "cuda":  # matrix units, no dp4a: mma.sync (the lanes kernels)
        for name in ("Q4_K_lanes", "Q6_K_lanes", "Q8_0_lanes", "Q4_0_lanes", "IQ4_NL_lanes", "MXFP4_lanes"):
            assert "dp4a.s32.s32" not in found[name], name


SM90 = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import matvec_int8, matvec_mma, matvec_pieces
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.int8_ops import PTX_DP4A

TYPES = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "base": "*u8", "part_ptr": "*fp32",
         "out_ptr": "*fp32", "count_ptr": "*i32", "ids_ptr": "*u8"}
PLAIN = {"EXPERTS": 0, "XDIV": 1}  # not an expert mat-vec: these constexprs at their defaults, as a launch leaves them


def sm90(fn, consts, warps):
    # fn compiled for sm_90 as a launch specialises it (pointers, offsets and row strides divisible by 16)
    consts = {k: v for k, v in {**PLAIN, **consts}.items() if k in fn.arg_names}
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in TYPES or re.fullmatch(r"[or]\d|N|K", n)}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 1}).asm
"""

LAYOUT = SM90 + r"""
common = dict(M=1, BLOCK_N=16, SPLIT=1, DOT=PTX_DP4A, CARRY=0, PDL=False)
kernels = {
    "Q8_0": (matvec_int8._legacy_kernel, dict(NB=32, **matvec_int8.kernel_for(T.Q8_0, 1)[1])),
    "Q4_0": (matvec_int8._legacy_kernel, dict(NB=32, **matvec_int8.kernel_for(T.Q4_0, 1)[1])),
    "Q4_K_pieces": (matvec_pieces.q4_k_pieces_kernel, dict(NB=8, UNPACK=0)),
    "Q6_K_pieces": (matvec_pieces.q6_k_pieces_kernel, dict(NB=8, UNPACK=0)),
}
for name, (fn, consts) in kernels.items():
    ttgir = sm90(fn, {**common, **consts}, 4)["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    for shape, layout in re.findall(r"tt\.load %\S+ : tensor<(16x\d+)x!tt\.ptr<i32>, (#\w+)>", ttgir):
        lanes = re.search(r"threadsPerWarp = \[(\d+), (\d+)\]", layouts[layout])
        print(name, shape, lanes.group(1), lanes.group(2))
print("compiled")
"""


def test_quant_word_loads_put_the_lanes_of_a_warp_along_the_row(offline_compile):
    """The flat and pieces loads exist so that one warp instruction reads one row's contiguous run (4 cache
    lines), not 16 rows (16): Triton 3.6 put a [rows, blocks, 4] load's lanes across rows. Each row-run load of the engine's M = 1 kernels, as this Triton lays it
    out: 16 lanes or more along the row (16 bytes each), or as many as its run takes (the Q4_K head records,
    32 words a row: 8 lanes, 4 rows, one cache line each)."""
    out = offline_compile(LAYOUT, "cuda", "90", 32)
    loads = [line.split() for line in out.splitlines() if line != "compiled"]
    assert {name for name, *_ in loads} == {"Q8_0", "Q4_0", "Q4_K_pieces", "Q6_K_pieces"}
    for name, shape, rows, along in loads:
        words = int(shape.split("x")[1])
        assert int(along) >= min(16, words // 4), f"{name} {shape}: {rows} rows x {along} lanes"


LANES = SM90 + r"""
mma_per_tile = {"Q4_K": 8, "Q6_K": 16, "Q8_0": 4, "Q4_0": 4, "IQ4_NL": 4, "MXFP4": 4}  # at NB 4
runs = [(4, 64, 1), (4, 128, 2), (8, 128, 1)]
for name, (warps, block_n, split) in [(n, r) for n in mma_per_tile for r in runs]:
    asm = sm90(matvec_mma.lanes_kernel, dict(M=8, BLOCK_N=block_n, NB=4, SPLIT=split, DOT=PTX_DP4A, CARRY=1,
                                             PDL=True, **matvec_mma.kernel_args(getattr(T, name), warps)), warps)
    ttgir = asm["ttgir"]
    layouts = sorted(set(re.findall(r"^#\w+ = (#ttg\.\w+<.*>)$", ttgir, re.M)))
    key = f"{name} {warps} {block_n} {split}"
    print(key, "layouts", len(layouts), "|".join(layouts))
    print(key, "converts", ttgir.count("ttg.convert_layout"), "shared", ttgir.count("ttg.local_alloc"))
    print(key, "mma", asm["ptx"].count("mma.sync.aligned.m16n8k") // mma_per_tile[name])
print("compiled")
"""


def test_lanes_kernel_keeps_one_value_a_lane_and_no_shared_memory(offline_compile):
    """The lanes kernel (matvec_mma.py) is correct only if each [32 W] tensor keeps Triton's
    one-value-a-lane layout, lane i % 32 of warp i // 32, which the mma.sync fragments assume: one blocked
    layout in the whole kernel (sizePerThread 1, 32 lanes, the W warps), no layout conversion and no
    shared memory (the tl.dot kernel's cost), and one mma a block (Q4_K: 8 a super-block, Q6_K 16) for
    each of the warp's 16-row groups, for every type."""
    out = offline_compile(LANES, "cuda", "90", 32)
    lines = [line.split(maxsplit=5) for line in out.splitlines() if line != "compiled"]
    seen = set()
    for name, warps, block_n, split, what, rest in lines:
        seen.add((name, warps, block_n, split))
        if what == "layouts":
            count, layouts = rest.split(maxsplit=1)
            assert count == "1", layouts
            assert (f"sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], order = [0]"
                    in layouts), layouts
        elif what == "converts":
            assert rest.split() == ["0", "shared", "0"], rest
        else:
            groups = int(block_n) // (16 * int(warps))
            assert int(rest) == groups, (name, warps, block_n, rest)
    assert len(seen) == 18
