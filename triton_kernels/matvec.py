"""The decode mat-vec, one entry point for every weight type and layout: y[M, N] = x[M, K] @ W[N, K]^T for
1 <= M <= 8 rows of x (decode and speculative verify), y f32.

The kernels that ship behind it (`KERNELS`); which one serves a (type, shape, rows), and with what launch
parameters, is data: the tuning file names it per entry (tuning.py), `choose` reads that once per matrix
at load, and `matvec` launches it per step.
  tiles   matmul.tile_matvec: tiles dequantized in registers, f32 FMA; every type, either layout. Every
          backend's fallback, and the kernel of the types no int8 kernel serves.
  int8    matvec_int8.py: x quantized to q8_1 once (its copy shared by every matrix that reads x), four
          int8 products an instruction (dp4a, v_dot4); Q8_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q6_K,
          Q3_K, Q2_K, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M repacked.
  pieces  matvec_pieces.py: Q4_K and Q6_K with each row's loads along it (int8 products, as int8).
  lanes   matvec_mma.py: one mma.sync (int8) a block and 16 rows, each lane building its operands; the
          int8 types on NVIDIA sm_80 and later.
Torch references: matmul.reference_matmul (dequant(W) @ x in float64), and for the kernels on x's q8_1
form matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from vegaserve.triton_kernels import matvec_int8, matvec_launch, matvec_mma, matvec_pieces
from vegaserve.triton_kernels.layout import PackedWeight, expert
from vegaserve.triton_kernels.matmul import SUPPORTED, tile_matvec
from vegaserve.triton_kernels.q8_1 import Q8_1, reference_quantize_q8_1
from vegaserve.triton_kernels.tuning import Tuning, load_tuning

# (type id, n, k, m, the device's SMs and warp size) -> launch parameters
Rule = Callable[[int, int, int, int, int, int], dict[str, int]]


@dataclass(frozen=True)
class MatvecKernel:
    name: str
    types: frozenset[int]  # the weight types it serves
    canonical: bool  # reads GGUF's canonical blocks (--no-repack) as well as the repacked layout
    int8: bool  # multiplies x's q8_1 copy (the op before x may hand it over)
    launch: Callable[..., torch.Tensor]  # (x, w, params, q8_1, out, experts) -> y
    rule: Rule  # launch parameters an entry leaves out


@dataclass(frozen=True)
class Choice:
    kernel: MatvecKernel
    params: dict[str, int]


def _tiles(x: torch.Tensor, w: PackedWeight, params: dict[str, int], q8_1: Q8_1 | None = None,
           out: torch.Tensor | None = None, experts=None) -> torch.Tensor:
    y = tile_matvec(x, w, **params, experts=experts)
    return y if out is None else out.copy_(y)


def _tiles_rule(type_id: int, n: int, k: int, m: int, sms: int, warp: int) -> dict[str, int]:
    return {"block_n": 16, "nb": 16, "split_k": 1, "num_warps": 4}


def _lanes_rule(type_id: int, n: int, k: int, m: int, sms: int, warp: int) -> dict[str, int]:
    """64 rows on 2 warps, a super-block (8 blocks) a tile, the sweep's smaller split."""
    return next(c for c in matvec_mma.candidates(type_id, n, k, sms) if c["block_n"] == 64 and c["num_warps"] == 2)


KERNELS: dict[str, MatvecKernel] = {
    "tiles": MatvecKernel("tiles", SUPPORTED, True, False, _tiles, _tiles_rule),
    "int8": MatvecKernel("int8", matvec_int8.TYPES, False, True, matvec_int8.matvec_int8, matvec_launch.rule),
    "pieces": MatvecKernel("pieces", matvec_pieces.TYPES, False, True, matvec_pieces.matvec_pieces,
                           matvec_launch.rule),
    "lanes": MatvecKernel("lanes", matvec_mma.TYPES, False, True, matvec_mma.matvec_lanes, _lanes_rule),
}


@lru_cache(maxsize=8)
def device_shape(device: torch.device) -> tuple[int, int]:
    """(SMs or CUs, warp size) the rules size launches for; an H200's on a CPU (tests, offline compiles)."""
    if device.type != "cuda":
        return 132, 32
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "warp_size", 32)


def choose(w: PackedWeight, m: int, tuning: Tuning | None = None) -> Choice:
    """The kernel and launch parameters of `w` at m rows: the tuning file's entry over the kernel's rule."""
    tuning = tuning or load_tuning()
    entry = tuning.matvec(w.type_name, w.n, w.k, m, w.repacked)
    return _choice(w, m, entry, f"tuning file {tuning.file or tuning.target}: the {w.type_name} {w.n}x{w.k} "
                   f"entry at {m} rows")


def choose_experts(w: PackedWeight, assignments: int, tuning: Tuning | None = None) -> Choice:
    """The decode kernel of a stack of experts (layout.stack_experts) in a launch of `assignments` (each one
    expert at one row): the tuning file's `experts` entry where it has one (its kernel, else the `matvec`
    entry's, and its parameters over that kernel's rule), else the `matvec` entry of one expert at one row."""
    tuning = tuning or load_tuning()
    one = expert(w, 0)
    entry = tuning.matvec(w.type_name, w.n, w.k, 1, w.repacked)
    over = tuning.experts(w.type_name, w.n, w.k, assignments) if w.repacked else None
    where = f"tuning file {tuning.file or tuning.target}: the {w.type_name} {w.n}x{w.k}"
    if over is None:
        return _choice(one, 1, entry, f"{where} entry at 1 row")
    return _choice(one, 1, {"kernel": entry.get("kernel", "tiles"), **over},
                   f"{where} experts entry at {assignments} assignments")


class ExpertChoices:
    """A stack's decode kernels by assignments a launch: choose_experts at each count the tuning file
    measured (all chosen, and checked, here at load); a launch takes the nearest measured count at or above
    its own, else the largest (as the file's row counts)."""

    def __init__(self, w: PackedWeight, tuning: Tuning | None = None) -> None:
        tuning = tuning or load_tuning()
        counts = tuning.expert_counts(w.type_name, w.n, w.k) if w.repacked else []
        self.by_count = {a: choose_experts(w, a, tuning) for a in counts or [1]}

    def at(self, assignments: int) -> Choice:
        return self.by_count[next((a for a in self.by_count if a >= assignments), max(self.by_count))]

    @property
    def int8(self) -> bool:
        """Whether any of its launches multiplies x's q8_1 copy."""
        return any(c.kernel.int8 for c in self.by_count.values())


def _choice(w: PackedWeight, m: int, entry: dict, where: str) -> Choice:
    """`entry` ({"kernel": name, launch parameters...}) over its kernel's rule for w at m rows, checked."""
    name = entry.get("kernel", "tiles")
    kernel = KERNELS.get(name)
    if kernel is None:
        raise ValueError(f"{where} names kernel {name!r}; the kernels are {', '.join(KERNELS)}")
    if w.type_id not in kernel.types or not (w.repacked or kernel.canonical):
        layout = "repacked" if w.repacked else "canonical"
        raise ValueError(f"{where} names kernel {name!r}, which does not serve {w.type_name} ({layout})")
    if kernel.name == "lanes" and w.data.device.type == "cuda" and not matvec_mma.has_matrix_units(w.data.device):
        raise ValueError(f"{where} names kernel 'lanes', which takes NVIDIA's int8 matrix units (sm_80 and later)")
    rule = kernel.rule(w.type_id, w.n, w.k, m, *device_shape(w.data.device))
    return Choice(kernel, {**rule, **{key: v for key, v in entry.items() if key != "kernel"}})


def matvec(x: torch.Tensor, w: PackedWeight, choice: Choice | None = None, q8_1: Q8_1 | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 8, K] -> y [M, N] f32 with `choice` (default: the tuning file's); q8_1: x's q8_1 copy for an
    int8 kernel where the op before wrote it; out: where y goes (f32 [M, N]; at one row any column slice
    of a wider output)."""
    choice = choice or choose(w, x.shape[0])
    return choice.kernel.launch(x, w, choice.params, q8_1, out)


def reference_matvec(x: torch.Tensor, w: PackedWeight, choice: Choice) -> torch.Tensor:
    """What `matvec` computes with `choice`, in float64: on x's q8_1 form for the int8 kernels."""
    if choice.kernel.int8:
        q, d, _ = reference_quantize_q8_1(x)
        return matvec_int8.reference_matvec_q8_1(q, d, w)
    return matvec_int8.reference_matmul(x, w)
