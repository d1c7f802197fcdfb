"""benchmarks/kernel_resources.py: the gfx906 tile kernel at 8 activation rows, as its tuning file launches
the K-quants, compiles without spilling (the only check of that file there is without the GPU), where the
fallback's two super-blocks a tile spilled; the script reports both. Which kernel and constexprs it compiles
for an entry (the entry's kernel, as its launcher would take it), and which entries. And --sass's reading
of a listing: which loop it counts, what it counts, and the bytes a warp's iteration covers."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_resources.py"
sys.path.insert(0, str(SCRIPT.parent))
from kernel_resources import TYPE_IDS, entries, launch, loop_bytes, loop_mix  # noqa: E402

from vegaserve.triton_kernels import matmul, matvec_int8, matvec_launch, matvec_mma, matvec_pieces  # noqa: E402
from vegaserve.triton_kernels.int8_ops import AMDGCN_DOT4, PTX_DP4A  # noqa: E402
from vegaserve.triton_kernels.tuning import CONFIG_DIR, load_tuning  # noqa: E402


def test_gfx906_k_quant_tile_kernels_at_8_rows_do_not_spill_at_the_shipped_entries() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compilers, not the interpreter
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "hip:gfx906", "--ms", "8",
         "--shapes", "Q4_K:4096x14336,Q5_K:4096x14336,Q6_K:4096x14336", "--extra", '{};{"nb": 16}'],
        capture_output=True, text=True, env=env, timeout=900, cwd=SCRIPT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert {r["kernel"] for r in rows} == {"_matvec_kernel"}  # gfx906's entries name the tile kernel
    shipped = [r for r in rows if r["params"]["nb"] == 8]
    wider = [r for r in rows if r["params"]["nb"] == 16]
    assert len(shipped) == len(wider) == 3
    assert all(r["spill_bytes"] == 0 for r in shipped), shipped
    assert any(r["spill_bytes"] > 0 for r in wider), wider  # why the entries are there
    assert all(s["registers"] < w["registers"] for s, w in zip(shipped, wider, strict=True))


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"canonical": False, "shapes": None, "ms": "1", "extra": None, **given})


def test_entries_are_the_files_exact_shapes_with_their_kernel_over_its_rule():
    """Without --shapes: every entry of the file that names one shape (no class), its kernel named and the
    parameters it leaves out from that kernel's rule; --canonical: the canonical table's (sm90's has classes
    only). With --shapes: the file's choice at --ms and each --extra variant on top, which may name
    another kernel (then that kernel's rule fills in)."""
    tuning = load_tuning("cuda_sm90", CONFIG_DIR / "cuda_sm90.json")
    listed = entries(tuning, _args())
    exact = {(name, shape, m) for name, by_shape in tuning.table["matvec"].items() for shape, by_m in by_shape.items()
             if "x" in shape for m in by_m}
    assert {(name, f"{n}x{k}", str(m)) for name, n, k, m, _ in listed} == exact and len(listed) == len(exact)
    for name, n, k, m, params in listed:
        found = tuning.matvec(name, n, k, m)
        assert {key: params[key] for key in found} == found and {"block_n", "nb", "split_k", "num_warps"} <= set(params)
    assert entries(tuning, _args(canonical=True)) == []
    variants = entries(tuning, _args(shapes="Q4_K:28672x4096", ms="1", extra='{};{"kernel": "int8", "nb": 16}'))
    assert [p["kernel"] for *_, p in variants] == ["pieces", "int8"]
    assert variants[1][4]["nb"] == 16 and variants[1][4]["block_n"] == variants[0][4]["block_n"]


@pytest.mark.parametrize("kernel, type_name, k, nb, want", [
    ("tiles", "Q4_K", 4096, 16, "_matvec_kernel"),
    ("int8", "Q8_0", 4096, 16, "_legacy_kernel"),
    ("int8", "MXFP4", 2880, 16, "_legacy_kernel"),  # gpt-oss's rows of 90 blocks: tiles of 16, the last of 10
    ("int8", "Q6_K", 4096, 16, "_q6_k_kernel"),
    ("int8", "IQ2_XXS", 4096, 16, "iq2_xxs_kernel"),
    ("pieces", "Q4_K", 4096, 32, "q4_k_pieces_kernel"),
    ("lanes", "Q6_K", 4096, 8, "lanes_kernel"),
    ("lanes", "MXFP4", 4096, 8, "lanes_kernel"),
    # a row of 3 blocks: one-block tiles send lanes to the int8 kernel, which masks its last tile of 2 (TAIL)
    ("lanes", "Q8_0", 96, 2, "_legacy_kernel"),
], ids=str)
def test_launch_compiles_the_kernel_and_constexprs_the_entrys_launcher_takes(kernel, type_name, k, nb, want):
    """launch(): the kernel function the entry's launcher runs for that type, with constexprs that bind every
    constexpr of that function and nothing else (a compile of a launch that cannot happen, or one that
    misses a knob, would report another kernel's registers), the type's own as its launcher passes them."""
    tid = TYPE_IDS[type_name]
    m = 8 if kernel == "lanes" else 1
    entry = {"kernel": kernel, "block_n": 64, "nb": nb, "split_k": 2, "num_warps": 4, "carry": 0, "unpack": 1}
    fn, consts, stages = launch(type_name, k, m, entry, "cuda")
    assert fn.__name__ == want
    constexprs = {name for name, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}
    assert set(consts) == constexprs, set(consts) ^ constexprs
    int8 = want == "_legacy_kernel" or kernel == "int8"  # the int8 kernel: RAGGED types' tiles need not divide
    per_tile, _, split = matmul.tile_split(tid, k, nb, 2, int8 and tid in matvec_launch.RAGGED)
    assert consts["NB"] == per_tile and consts["BLOCK_N"] == 64 and consts["M"] == m
    assert consts.get("TAIL", 0) == int(int8 and tid in matvec_launch.RAGGED and (k // 32) % per_tile != 0)
    if kernel == "tiles":
        assert stages == 2 and consts == {**matmul.tile_constexprs(tid, m, 64, per_tile), "EXPERTS": 0, "XDIV": 1}
        return
    assert stages == 1 and consts["SPLIT"] == split and consts["DOT"] == PTX_DP4A and consts["PDL"]
    assert consts["CARRY"] == 0
    if kernel == "pieces":
        assert fn is matvec_pieces._KERNELS[tid] and consts["UNPACK"] == 1
    elif want == "lanes_kernel":
        assert fn is matvec_mma.lanes_kernel
        assert {key: consts[key] for key in matvec_mma.kernel_args(tid, 4)} == matvec_mma.kernel_args(tid, 4)
    else:
        kernel_fn, type_args = matvec_int8.kernel_for(tid, m)
        type_args = matvec_int8.tail_args(type_args, tid, k, per_tile)
        assert fn is kernel_fn and {key: consts[key] for key in type_args} == type_args
    assert launch(type_name, k, m, entry, "hip")[1]["DOT"] == AMDGCN_DOT4


LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;        /* 0x0000000404027981 */
        /*0020*/                   LOP3.LUT R6, R2, 0xf0f0f0f, RZ, 0xc0, !PT ;  /* 0x0 */
        /*0030*/                   IMMA.16832.S8.S8 R8, R6.ROW, R10.COL, RZ ;   /* 0x0 */
        /*0040*/                   I2FP.F32.S32 R8, R8 ;                  /* 0x0 */
        /*0050*/               @P0 BRA 0x10 ;                             /* 0x0 */
        /*0060*/                   STG.E desc[UR4][R4.64], R8 ;           /* 0x0 */
        /*0070*/                   LDS R3, [R2] ;                         /* 0x0 */
        /*0080*/               @!P1 BRA 0x60 ;                            /* 0x0 */
        /*0090*/                   EXIT ;                                 /* 0x0 */
        /*00a0*/                   BRA 0xa0;                              /* 0x0 */
"""


def test_loop_mix_counts_the_longest_backward_branch_only():
    """The loop 0x10..0x50 (5 instructions) beats the shorter one 0x60..0x80 (3); the trailing self-branch
    is not a loop; predicated branches count."""
    assert loop_mix(LISTING) == {"all": 5, "mma_dot": 1, "ldg": 1, "shared": 0, "spill": 0, "alu": 2}


def test_loop_bytes_is_one_super_block_for_the_k_quant_lanes_kernels_whatever_nb():
    consts = {"BLOCK_N": 64, "NB": 8, "KIND": 1}
    assert loop_bytes("Q4_K", "lanes_kernel", consts, 4) == 16 * 144
    assert loop_bytes("Q8_0", "lanes_kernel", {**consts, "KIND": 0}, 4) == 16 * 8 * 34
    assert loop_bytes("Q4_K", "q4_k_pieces_kernel", consts, 4) == 16 * 8 * 144


def test_offline_compile_specializes_the_integer_arguments_as_a_launch_does():
    """The int8 kernels compiled as their launchers launch them: the repacked layout's offsets and row strides
    (multiples of 16) and aligned pointers known to be so, so the Q4_K pieces kernel's quant and head
    runs load 16 bytes a thread (ld.global.v4), as on the GPU; without the launch's integers the same
    kernel loads them 4 bytes at a time, which is what the compiled code looked like before this."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = r"""
import kernel_resources as kr
from triton.backends.compiler import GPUTarget
p = {"kernel": "pieces", "block_n": 16, "nb": 32, "num_warps": 4, "split_k": 1, "carry": 0, "unpack": 1}
fn, consts, stages = kr.launch("Q4_K", 4096, 1, p, "cuda")
ints = kr.launch_ints("Q4_K", 28672, 4096, p)
assert ints["r2"] % 16 == 0 and ints["N"] == 28672 and ints["blocks_per_split"] == 16, ints
for given in (ints, None):
    ptx = kr.compile_kernel(fn, dict(consts), 4, stages, GPUTarget("cuda", 90, 32), given).asm["ptx"]
    print(ptx.count("ld.global.v4"), ptx.count("ld.global"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          cwd=SCRIPT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    (wide, loads), (wide_plain, loads_plain) = (tuple(map(int, line.split())) for line in done.stdout.split("\n")[:2])
    assert wide >= 4 and wide_plain == 0 and loads < loads_plain
