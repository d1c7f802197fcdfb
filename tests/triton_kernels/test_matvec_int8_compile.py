"""The int8-dot mat-vec kernels (the 32-element types' with their flat loads, and both K-quant kernels:
groups and pieces, and the pieces pair kernel) compile for an NVIDIA sm_90 and an AMD gfx906 target with each one's
instructions in them: dp4a and prmt (the level tables) in the PTX, v_dot4_i32_i8 and v_perm_b32 in the
AMDGCN assembly. The interpreter runs the integer emulation of those instructions, so only a compiler sees
the inline assembly; these compilers need no GPU. (Whether gfx906 runs them right is for a gfx906.)

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions). M = 1,
a split-K of 2, the tiles of an 8B decode.
"""

from __future__ import annotations

import pytest

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import matvec_int8 as mv

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
dot = mv.PTX_DP4A if backend == "cuda" else mv.AMDGCN_DOT4
types = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "base": "*u8", "part_ptr": "*fp32",
         "out_ptr": "*fp32", "count_ptr": "*i32", "base_a": "*u8", "part_a": "*fp32", "out_a": "*fp32",
         "count_a": "*i32", "base_b": "*u8", "part_b": "*fp32", "out_b": "*fp32", "count_b": "*i32"}
common = dict(M=1, BLOCK_N=16, SPLIT=2, DOT=dot, CARRY=0, PDL=False)
kernels = {
    "Q8_0": (mv._legacy_kernel, dict(NB=32, WORDS=8, TABLE=0, E8M0=False, FLAT=1)),
    "Q4_0": (mv._legacy_kernel, dict(NB=32, WORDS=4, TABLE=0, E8M0=False, FLAT=1)),
    "IQ4_NL": (mv._legacy_kernel, dict(NB=32, WORDS=4, TABLE=1, E8M0=False, FLAT=1)),
    "MXFP4": (mv._legacy_kernel, dict(NB=32, WORDS=4, TABLE=2, E8M0=True, FLAT=1)),
    "Q4_K": (mv._q4_k_kernel, dict(NB=8, STAGE=1)),
    "Q6_K": (mv._q6_k_kernel, dict(NB=4)),
    "Q4_K_pieces": (mv.q4_k_pieces_kernel, dict(NB=8, UNPACK=0, GATHER=0)),
    "Q4_K_pieces_unpack": (mv.q4_k_pieces_kernel, dict(NB=8, UNPACK=1, GATHER=0)),
    "Q6_K_pieces": (mv.q6_k_pieces_kernel, dict(NB=8, UNPACK=0, GATHER=0)),
    "Q6_K_pieces_unpack": (mv.q6_k_pieces_kernel, dict(NB=8, UNPACK=1, GATHER=0)),
    "Q4_K_pieces_gather": (mv.q4_k_pieces_kernel, dict(NB=2, UNPACK=1, GATHER=1)),
    "Q6_K_pieces_gather": (mv.q6_k_pieces_kernel, dict(NB=2, UNPACK=0, GATHER=1)),
    # a layer's Q4_K q/k and Q6_K v in one launch, with the H200 file's launches of 5120x4096 and 1024x4096
    "pair": (mv.pieces_pair_kernel, dict(KIND_A=mv.Q4_K, BLOCK_N_A=32, NB_A=2, SPLIT_A=4, CARRY_A=0, UNPACK_A=0,
                                          GATHER_A=1, KIND_B=mv.Q6_K, BLOCK_N_B=8, NB_B=2, SPLIT_B=16, CARRY_B=0,
                                          UNPACK_B=0, GATHER_B=0, DOT=dot, PDL=False)),
}
if backend == "cuda":  # matrix units: gfx906 has none
    kernels["Q4_K_mma"] = (mv._q4_k_mma_kernel, dict(M=8, BLOCK_N=64, NB=1))
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"):
        fn, type_args = mv.choose_kernel(getattr(mv, name), 8, {"mma": 2, "num_warps": 4})
        kernels[name + "_lanes"] = (fn, dict(M=8, BLOCK_N=64, NB=4, **type_args))
    for name, pipe in (("Q4_K", 1), ("Q4_K", 2), ("Q6_K", 2), ("MXFP4", 2)):  # the pipelined loops
        fn, type_args = mv.choose_kernel(getattr(mv, name), 8, {"mma": 2, "num_warps": 4, "pipe": pipe})
        kernels[f"{name}_lanes_pipe{pipe}"] = (fn, dict(M=8, BLOCK_N=64, NB=4, **type_args))
for name, (fn, consts) in kernels.items():
    consts = consts if "KIND_A" in consts else {**common, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4})
    asm = k.asm["ptx" if backend == "cuda" else "amdgcn"]
    found = [ins for ins in ("dp4a.s32.s32", "prmt.b32", "v_dot4_i32_i8", "v_perm_b32", "mma_async.sync.aligned.m64n16k32.s32.s8.s8",
                             "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                             "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32") if ins in asm]
    print(name, " ".join(found))
print("compiled")
"""

WANT = {  # type -> instructions its kernel must contain, per backend
    "cuda": {"Q8_0": {"dp4a.s32.s32"}, "Q4_0": {"dp4a.s32.s32"}, "IQ4_NL": {"dp4a.s32.s32", "prmt.b32"},
             "MXFP4": {"dp4a.s32.s32", "prmt.b32"}, "Q4_K": {"dp4a.s32.s32"}, "Q6_K": {"dp4a.s32.s32"},
             "Q4_K_pieces": {"dp4a.s32.s32"}, "Q4_K_pieces_unpack": {"dp4a.s32.s32"}, "Q6_K_pieces": {"dp4a.s32.s32"},
             "Q6_K_pieces_unpack": {"dp4a.s32.s32"}, "pair": {"dp4a.s32.s32"},
             "Q4_K_pieces_gather": {"dp4a.s32.s32"}, "Q6_K_pieces_gather": {"dp4a.s32.s32"}, "Q4_K_mma": {"mma_async.sync.aligned.m64n16k32.s32.s8.s8"},
             "Q4_K_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q4_K_lanes_pipe1": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q4_K_lanes_pipe2": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q6_K_lanes_pipe2": {"mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"},
             "MXFP4_lanes_pipe2": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "prmt.b32"},
             "Q6_K_lanes": {"mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"},
             "Q8_0_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "Q4_0_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"},
             "IQ4_NL_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "prmt.b32"},
             "MXFP4_lanes": {"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "prmt.b32"}},
    "hip": {"Q8_0": {"v_dot4_i32_i8"}, "Q4_0": {"v_dot4_i32_i8"}, "IQ4_NL": {"v_dot4_i32_i8", "v_perm_b32"},
            "MXFP4": {"v_dot4_i32_i8", "v_perm_b32"}, "Q4_K": {"v_dot4_i32_i8"}, "Q6_K": {"v_dot4_i32_i8"},
            "Q4_K_pieces": {"v_dot4_i32_i8"}, "Q4_K_pieces_unpack": {"v_dot4_i32_i8"},
            "Q6_K_pieces": {"v_dot4_i32_i8"}, "Q6_K_pieces_unpack": {"v_dot4_i32_i8"}, "pair": {"v_dot4_i32_i8"},
            "Q4_K_pieces_gather": {"v_dot4_i32_i8"}, "Q6_K_pieces_gather": {"v_dot4_i32_i8"}},
}


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_int8_kernels_compile_with_the_targets_dot_and_permute_instructions(backend, arch, warp, offline_compile):
    out = offline_compile(COMPILE, backend, arch, warp)
    found = {line.split()[0]: set(line.split()[1:]) for line in out.splitlines() if line != "compiled"}
    for name, want in WANT[backend].items():
        assert want <= found[name], f"{name} on {arch}: {sorted(found[name])}, expected {sorted(want)}"
        assert not found[name] - {i for w in WANT[backend].values() for i in w}, f"{name}: the other vendor's instruction"
    if backend == "cuda":  # matrix units, no dp4a: Hopper's warpgroup MMA (tl.dot), mma.sync (the lanes kernels)
        for name in ("Q4_K_mma", "Q4_K_lanes", "Q6_K_lanes", "Q8_0_lanes", "Q4_0_lanes", "IQ4_NL_lanes", "MXFP4_lanes"):
            assert "dp4a.s32.s32" not in found[name], name


SM90 = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import matvec_int8 as mv

TYPES = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "base": "*u8", "part_ptr": "*fp32",
         "out_ptr": "*fp32", "count_ptr": "*i32", "base_a": "*u8", "part_a": "*fp32", "out_a": "*fp32",
         "count_a": "*i32", "base_b": "*u8", "part_b": "*fp32", "out_b": "*fp32", "count_b": "*i32"}


def sm90(fn, consts, warps):
    # fn compiled for sm_90 as a launch specialises it (pointers, offsets and row strides divisible by 16)
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in TYPES or re.fullmatch(r"[or]\d|N|K", n)}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 1}).asm
"""

LAYOUT = SM90 + r"""
common = dict(M=1, BLOCK_N=16, SPLIT=1, DOT=mv.PTX_DP4A, CARRY=0, PDL=False)
kernels = {
    "Q8_0": (mv._legacy_kernel, dict(NB=32, WORDS=8, TABLE=0, E8M0=False, FLAT=1)),
    "Q4_0": (mv._legacy_kernel, dict(NB=32, WORDS=4, TABLE=0, E8M0=False, FLAT=1)),
    "Q4_K_pieces": (mv.q4_k_pieces_kernel, dict(NB=8, UNPACK=0, GATHER=0)),
    "Q6_K_pieces": (mv.q6_k_pieces_kernel, dict(NB=8, UNPACK=0, GATHER=0)),
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
    lines), not 16 rows (16): Triton 3.6 put a [rows, blocks, 4] load's lanes across rows (docs/PERF.md,
    2026-12-04, fourth sitting). Each row-run load of the engine's M = 1 kernels, as this Triton lays it
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
    fn, type_args = mv.choose_kernel(getattr(mv, name), 8, {"mma": 2, "num_warps": warps})
    asm = sm90(fn, dict(M=8, BLOCK_N=block_n, NB=4, SPLIT=split, DOT=mv.PTX_DP4A, CARRY=1, PDL=True,
                        **type_args), warps)
    ttgir = asm["ttgir"]
    layouts = sorted(set(re.findall(r"^#\w+ = (#ttg\.\w+<.*>)$", ttgir, re.M)))
    key = f"{name} {warps} {block_n} {split}"
    print(key, "layouts", len(layouts), "|".join(layouts))
    print(key, "converts", ttgir.count("ttg.convert_layout"), "shared", ttgir.count("ttg.local_alloc"))
    print(key, "mma", asm["ptx"].count("mma.sync.aligned.m16n8k") // mma_per_tile[name])
print("compiled")
"""


def test_lanes_kernels_keep_one_value_a_lane_and_no_shared_memory(offline_compile):
    """The lanes kernels (matvec_mma.py) are correct only if each [32 W] tensor keeps Triton's
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
