"""Registers and spills of the decode mat-vec kernels as the tuning file launches them, from the compilers
alone (no GPU): what to rule out before spending device time on a sweep, and the one check there is for a
target this project has no machine of (gfx906). A spill is a thing to time, not a verdict: a kernel that
spills reads and writes local memory in its loop, which may or may not be what holds it back.

    python benchmarks/kernel_resources.py [--target cuda:90 | hip:gfx906] [--tuning FILE] [--canonical]
        [--shapes Q4_K:28672x4096,...] [--ms 1,2,8] [--extra '{"num_warps": 8};{"kernel": "int8"}']

Without --shapes: every entry of the tuning file (default: the target's) that names one shape, with the
kernel it names. With it: those shapes at --ms, with the file's choice (over the kernel's rule), each
--extra variant on top (a variant may name another kernel). --canonical: the `matvec_canonical` table.
The kernel and its constexprs are the launcher's own choice, and the int8 kernels' integer arguments are
specialized as a launch specializes them (compile_kernel: the layout's strides are multiples of 16, which
lets the compiler load a run of words 16 bytes at a time). NVIDIA: ptxas -v of the PTX (the ptxas Triton
carries that takes it); AMD: the VGPRs and the scratch bytes of the AMDGCN assembly. Prints a table and
one JSON line.

--sass (NVIDIA): also the main loop's instructions from the SASS (the longest backward branch), by kind:
all, matrix and dot instructions (IMMA, IDP), global loads, shared-memory traffic and barriers (LDS,
STS, BAR), and the integer-ALU share (LOP3, SHF, IADD3, I2FP and the like, which issue at half rate on
sm_90's ALU pipe). With the weight bytes one loop iteration of one warp covers, the issue-time floor of
the whole matrix: every warp instruction takes an issue slot of one of the device's 4 schedulers per SM
each clock (--sms, --clock-ghz); and the ALU floor, two clocks for each ALU instruction. Floors from
instruction counts, not times: they say which kernels the instructions alone keep from the memory's pace.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from vegaserve.triton_kernels import matmul, matvec_int8, matvec_launch, matvec_mma, matvec_pieces
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.int8_ops import AMDGCN_DOT4, PTX_DP4A
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec import KERNELS
from vegaserve.triton_kernels.tuning import CONFIG_DIR, Tuning, load_tuning

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
POINTERS = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "base": "*u8", "part_ptr": "*fp32",
            "out_ptr": "*fp32", "count_ptr": "*i32"}
# a plain (not expert) launch: no expert column (EXPERTS 0 leaves these two unused), no lattice table
LAUNCH_DEFAULTS = {"ids_ptr": None, "expert_bytes": 0, "tab_ptr": None}
# the kernels that always read a lattice table (matvec_iq.py, matvec_iq1.py: lattice.grid_words' int32 words)
TABLE_POINTERS = {"iq2_xxs_kernel": "*i32", "iq3_kernel": "*i32", "iq2_pairs_kernel": "*i32", "iq1_kernel": "*i32"}
ACTIVATIONS = {"cuda": "*bf16", "hip": "*fp16"}  # the tile kernel's x: the model's activation type there
BIN_DIR = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas, cuobjdump
# the device the rule sizes grids for: compute units, warp size
DEVICES = {"cuda": (132, 32), "hip": (60, 64)}


def compile_kernel(fn, consts: dict, num_warps: int, num_stages: int, target: GPUTarget,
                   ints: dict[str, int] | None = None):
    """The kernel compiled for `target` as a launch specializes it: pointers 16-byte aligned (torch's
    allocations are), and each integer argument in `ints` by its value as Triton's launcher does (1 a
    constant, a multiple of 16 known to be one, i64 past i32): which loads the compiler may widen depends
    on it (a plane's row stride a multiple of 16 lets a run of int32 words load 16 bytes at a time). An
    integer not in `ints` is a plain i32."""
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    table = TABLE_POINTERS.get(fn.__name__)
    defaults = {k: v for k, v in LAUNCH_DEFAULTS.items() if not (table and k == "tab_ptr")}
    for name, value in defaults.items():
        if name in fn.arg_names and name not in consts and name not in (ints or {}):
            consts[name] = value
    types = {**POINTERS, "x_ptr": ACTIVATIONS[target.backend], **({"tab_ptr": table} if table else {})}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints and name in ints:
            kind, spec = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if kind == "constexpr":
                consts[name], sig[name] = ints[name], "constexpr"
            else:
                sig[name] = kind
                if spec == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=target,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def launch_ints(type_name: str, n: int, k: int, params: dict) -> dict[str, int]:
    """The int8 kernels' integer arguments as matvec_int8 passes them: the repacked layout's fields (laid
    out on the meta device: no bytes), N, K and the blocks of a K split."""
    tid = TYPE_IDS[type_name]
    spec = GGML_TYPES[tid]
    raw = torch.empty(n * (k // spec.block_size) * spec.type_size, dtype=torch.uint8, device="meta")
    fields = repack(raw, tid, n, k).field_args()
    names = [f"{c}{i}" for i in range(4) for c in "orb"]
    return {**dict(zip(names, fields, strict=True)), "N": n, "K": k,
            "blocks_per_split": matmul.tile_split(tid, k, params["nb"], params.get("split_k", 1))[1]}


def nvidia_resources(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) from ptxas -v; the first of Triton's ptxas binaries that takes the PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        errors = []
        for name in ("ptxas", "ptxas-blackwell"):
            run = subprocess.run([str(BIN_DIR / name), "-v", "--gpu-name", f"sm_{arch}a", f.name, "-o", os.devnull],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spill = re.search(r"(\d+) bytes spill stores", run.stderr)
                return int(regs.group(1)), int(spill.group(1)) if spill else 0
            errors.append(run.stderr.strip().splitlines()[-1])
        raise RuntimeError(f"no ptxas of Triton took the PTX: {errors}")
    finally:
        os.unlink(f.name)


ALU = {"LOP3", "SHF", "IADD3", "I2FP", "SGXT", "PRMT", "SEL", "ISETP", "LEA", "VIADD", "IABS", "BMSK", "FLO",
       "POPC", "BREV", "IMNMX", "VIMNMX"}


def sass(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin (the cuobjdump Triton carries)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        run = subprocess.run([str(BIN_DIR / "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True)
        return run.stdout
    finally:
        os.unlink(f.name)


def loop_mix(text: str) -> dict[str, int]:
    """Instruction counts of the longest loop of a cuobjdump -sass listing: from a backward branch's target
    to the branch (`/*addr*/ [@pred] OPCODE.mods ... ;` a line; the trailing self-branch is no loop)."""
    code = []
    for line in text.splitlines():
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\w]*\s*([^;]*);", line)
        if ins:
            code.append((int(ins.group(1), 16), ins.group(3), ins.group(4)))
    body = (0, -1)
    for i, (addr, op, args) in enumerate(code):
        target = re.match(r"`?\(?0x([0-9a-f]+)", args.strip()) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            start = next(j for j, (a, _, _) in enumerate(code) if a >= int(target.group(1), 16))
            if i - start > body[1] - body[0]:
                body = (start, i)
    mix = {"all": 0, "mma_dot": 0, "ldg": 0, "shared": 0, "spill": 0, "alu": 0}
    for _, op, _ in code[body[0] : body[1] + 1]:
        if op == "NOP":
            continue
        mix["all"] += 1
        mix["mma_dot"] += op in ("IMMA", "HMMA", "IDP", "HGMMA", "IGMMA")
        mix["ldg"] += op == "LDG"
        mix["shared"] += op in ("LDS", "STS", "LDSM", "STSM", "BAR")
        mix["spill"] += op in ("LDL", "STL")
        mix["alu"] += op in ALU
    return mix


def loop_bytes(type_name: str, kernel_name: str, consts: dict, num_warps: int) -> float:
    """Weight bytes one iteration of one warp reads: BLOCK_N rows of NB blocks (super-blocks for the
    K-quants) a program iteration; one super-block for the K-quants' lanes kernel."""
    spec = GGML_TYPES[TYPE_IDS[type_name]]
    one_super_block = kernel_name == "lanes_kernel" and consts["KIND"] != 0
    per_tile = 1 if one_super_block else consts["NB"]
    return consts["BLOCK_N"] * per_tile * spec.type_size / num_warps


def amd_resources(asm: str) -> tuple[int, int]:
    """(VGPRs, scratch bytes per lane) from the AMDGCN assembly's metadata."""
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", asm)
    scratch = re.search(r"\.private_segment_fixed_size:\s+(\d+)", asm)
    return int(vgprs.group(1)), int(scratch.group(1)) if scratch else 0


def entries(tuning: Tuning, args) -> list[tuple[str, int, int, int, dict]]:
    """(type, n, k, m, the entry: its kernel and launch parameters) to compile."""
    backend = tuning.target.split("_")[0]
    sms, warp = DEVICES[backend]

    def entry(name: str, n: int, k: int, m: int, extra: dict | None = None) -> dict:
        found = {**tuning.matvec(name, n, k, m, not args.canonical), **(extra or {})}
        rule = KERNELS[found["kernel"]].rule(TYPE_IDS[name], n, k, m, sms, warp)
        return {**rule, **found}

    out = []
    if args.shapes:
        variants = [json.loads(v) for v in args.extra.split(";")] if args.extra else [{}]
        for item in args.shapes.split(","):
            name, shape = item.split(":")
            n, k = (int(v) for v in shape.split("x"))
            for m in (int(v) for v in args.ms.split(",")):
                out += [(name, n, k, m, entry(name, n, k, m, extra)) for extra in variants]
        return out
    for name, shapes in tuning.table.get("matvec_canonical" if args.canonical else "matvec", {}).items():
        for shape, by_m in shapes.items():
            if "x" not in shape:
                continue  # a shape class: no one shape to compile for
            n, k = (int(v) for v in shape.split("x"))
            out += [(name, n, k, int(m), entry(name, n, k, int(m))) for m in by_m]
    return out


def launch(type_name: str, k: int, m: int, entry: dict, backend: str):
    """(kernel, constexprs, num_stages) as the entry's kernel would launch it."""
    tid = TYPE_IDS[type_name]
    kernel = entry["kernel"]
    nb, _, split = matmul.tile_split(tid, k, entry["nb"], entry.get("split_k", 1))
    if kernel == "tiles":
        fn = matmul._matvec_kernel
        return fn, {**matmul.tile_constexprs(tid, m, entry["block_n"], nb), **_plain(fn)}, entry.get("num_stages", 2)
    if kernel == "lanes" and tid in matvec_mma.TYPES - {12, 14} and nb == 1:
        kernel = "int8"  # a one-block tile: matvec_lanes runs the int8 kernel
    if kernel == "int8":  # the RAGGED types' tiles need not divide the row (a partial last tile)
        nb, _, split = matmul.tile_split(tid, k, entry["nb"], entry.get("split_k", 1), tid in matvec_launch.RAGGED)
        fn, type_args = matvec_int8.kernel_for(tid, m)
        type_args = matvec_int8.tail_args(type_args, tid, k, nb)
    elif kernel == "pieces":
        fn, type_args = matvec_pieces._KERNELS[tid], {"UNPACK": entry.get("unpack", 0)}
    else:
        fn, type_args = matvec_mma.lanes_kernel, matvec_mma.kernel_args(tid, entry["num_warps"])
    dot = PTX_DP4A if backend == "cuda" else AMDGCN_DOT4
    unit = 8 if type_args.get("XS") else 1  # IQ4_XS: its super-blocks as the kernel's blocks of 32 (matvec_int8)
    consts = dict(M=m, BLOCK_N=entry["block_n"], NB=nb * unit, SPLIT=split, DOT=dot, CARRY=entry.get("carry", 1),
                  PDL=backend == "cuda", **type_args)
    return fn, {**consts, **_plain(fn)}, 1


def _plain(fn) -> dict[str, int]:
    """The constexprs of a launch that is not an expert mat-vec (no assignment column)."""
    return {k: v for k, v in (("EXPERTS", 0), ("XDIV", 1)) if k in fn.arg_names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cuda:90", help="cuda:ARCH (sm number) or hip:GFX")
    ap.add_argument("--canonical", action="store_true", help="the matvec_canonical table (weights in GGUF blocks)")
    ap.add_argument("--tuning", default=None, help="tuning file (default: configs/kernels/<target>.json)")
    ap.add_argument("--shapes", default=None, help="TYPE:NxK,... (default: every entry of the tuning file)")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--extra", default=None, help="variants over the parameters, JSON objects separated by ';'")
    ap.add_argument("--sass", action="store_true", help="NVIDIA: the main loop's instruction mix and issue floor")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    args = ap.parse_args()
    if args.sass and not args.target.startswith("cuda"):
        ap.error("--sass reads NVIDIA SASS: --target cuda:ARCH")
    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, DEVICES[backend][1])
    name = f"cuda_sm{arch}" if backend == "cuda" else f"hip_{arch}"
    tuning = load_tuning(name, args.tuning or CONFIG_DIR / f"{name}.json")
    unit = "registers" if backend == "cuda" else "VGPRs"
    sass_head = (" loop instr | IMMA+IDP | LDG | LDS+STS+BAR | ALU | bytes/warp-iter | issue floor us | ALU floor us |"
                 if args.sass else "")
    print(f"| type | shape | M | kernel | parameters | {unit} | spilled bytes |{sass_head}\n"
          f"|---|---|---|---|---|---|---|{'---|' * 8 if args.sass else ''}")
    rows = []
    for type_name, n, k, m, params in entries(tuning, args):
        kernel, consts, stages = launch(type_name, k, m, params, backend)
        ints = launch_ints(type_name, n, k, params) if params["kernel"] != "tiles" else None
        compiled = compile_kernel(kernel, consts, params.get("num_warps", 4), stages, target, ints)
        if backend == "cuda":
            regs, spill = nvidia_resources(compiled.asm["ptx"], int(arch))
        else:
            regs, spill = amd_resources(compiled.asm["amdgcn"])
        shown = {key: v for key, v in sorted(params.items())}
        row = {"type": type_name, "n": n, "k": k, "m": m, "kernel": kernel.__name__, "params": shown,
               "registers": regs, "spill_bytes": spill}
        extra = ""
        if args.sass:
            mix = loop_mix(sass(compiled.asm["cubin"]))
            per_iter = loop_bytes(type_name, kernel.__name__, consts, params.get("num_warps", 4))
            total = n * k // GGML_TYPES[TYPE_IDS[type_name]].block_size * GGML_TYPES[TYPE_IDS[type_name]].type_size
            per_clock_us = total / per_iter / (args.sms * 4 * args.clock_ghz * 1e3)
            floor_us, alu_us = mix["all"] * per_clock_us, 2 * mix["alu"] * per_clock_us
            row.update(loop=mix, bytes_per_warp_iter=per_iter, issue_floor_us=round(floor_us, 2),
                       alu_floor_us=round(alu_us, 2))
            extra = (f" {mix['all']} | {mix['mma_dot']} | {mix['ldg']} | {mix['shared']} | {mix['alu']} | "
                     f"{per_iter:.0f} | {floor_us:.1f} | {alu_us:.1f} |")
        print(f"| {type_name} | {n}x{k} | {m} | {kernel.__name__} | {json.dumps(shown)} | {regs} | "
              f"{'**' + str(spill) + '**' if spill else 0} |{extra}")
        rows.append(row)
    print(json.dumps({"target": args.target, "triton": triton.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
