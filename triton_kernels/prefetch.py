"""Weights into L2 ahead of the kernels that read them (NVIDIA, sm_80 and later).

A decode layer's small matrices (q/k/v, o_proj) are read by kernels too short to reach the memory's rate:
their launch, first loads and tail cost as much as their bytes, and the norms, RoPE and attention
between them read almost nothing. One launch at the top of a layer asks L2 for the first `budget` bytes
of the layer's weights in the order the layer reads them; the memory streams them while the small
kernels run, and the mat-vecs then find them in L2.

The kernel issues its prefetches and ends (a prefetch returns no data and holds no register): with
programmatic dependent launch (pdl.py) it starts while the kernel before it is still running, and only
its first program waits for that kernel, so that the kernels after it still see everything before it
finished. Weights are the only memory it reads.

AMD parts (gfx906's L2 is 4 MB), the interpreter and CPUs: no launch. `record` runs the same walk over
the ranges with a counter per line instead of the prefetch, which is how the CPU tests check it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl

LINE = 128  # bytes a prefetch asks for: one L2 line
_BLOCK = 256  # lines per program and iteration
_budget = 0  # bytes a layer prefetches; set_budget
# how the lines are asked for (MODE): prefetch.global.L2 of each line's address, the same of each 32-byte
# sector, the sectors loaded through L2 (.cg) and dropped, Hopper's bulk prefetch of each line
PREFETCH_LINE, PREFETCH_SECTORS, LOAD_SECTORS, BULK_LINE = 0, 1, 2, 3
MODES = {"line": PREFETCH_LINE, "sectors": PREFETCH_SECTORS, "loads": LOAD_SECTORS, "bulk": BULK_LINE}
_mode = PREFETCH_LINE


def set_budget(mib: int, mode: str | None = None) -> None:
    """Bytes of each layer's weights to prefetch, in MiB (0: none), and how (MODES; unchanged if None)."""
    global _budget, _mode
    if mib < 0:
        raise ValueError(f"l2 prefetch budget must be >= 0 MiB, got {mib}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"l2 prefetch mode {mode!r}: one of {', '.join(MODES)}")
    _budget = mib << 20
    _mode = MODES[mode] if mode is not None else _mode


def budget() -> int:
    return _budget


def enabled(device: torch.device) -> bool:
    """Whether `device` takes the prefetch launch: NVIDIA sm_80 and later, outside the interpreter."""
    if device.type != "cuda" or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _ampere_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _ampere_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


@triton.jit
def _prefetch(addr, BULK: tl.constexpr):
    """Ask L2 for the line (BULK: the LINE bytes) at each address; the result is a dummy (inline asm must
    return a value)."""
    if BULK:
        return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 128;\n\tmov.u32 $0, 0;", "=r,l",
                                         [addr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(table_ptr, hits_ptr, n_ranges, LINE_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                        RECORD: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    """table [n_ranges, 3] int64: (address, lines, index of its first line among all). The programs take
    BLOCK lines each in turn over every range; RECORD counts each line in hits instead of fetching it."""
    pdl.let_next_start(PDL)
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    sector = tl.arange(0, 4) * (LINE_BYTES // 4)
    seen = tl.zeros([BLOCK, 4], tl.int32)
    for r in range(n_ranges):
        base = tl.load(table_ptr + 3 * r)
        n = tl.load(table_ptr + 3 * r + 1)
        first = tl.load(table_ptr + 3 * r + 2)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            line = tl.minimum(start + lanes, n - 1)  # the last line again in the last block's spare lanes
            if RECORD:
                tl.atomic_add(hits_ptr + first + line, 1)
            elif MODE == 0 or MODE == 3:
                _prefetch(base + line * LINE_BYTES, MODE == 3)
            elif MODE == 1:
                _prefetch(base + line[:, None] * LINE_BYTES + sector[None, :], False)
            else:
                words = (base + line[:, None] * LINE_BYTES + sector[None, :]).to(tl.pointer_type(tl.int32))
                seen ^= tl.load(words, cache_modifier=".cg")
    if MODE == 2 and not RECORD:  # the loads' values must look used; no table holds this address
        tl.store(hits_ptr + lanes[:, None] * 4 + tl.arange(0, 4)[None, :], seen, mask=seen == 0x5EED5EED)
    if pid == 0:
        pdl.wait_for_inputs(PDL)  # the kernels after this one wait for it, so it waits for the one before


def plan_ranges(tensors: Sequence[torch.Tensor], limit: int) -> list[tuple[int, int, int]]:
    """(address, lines, first line) of the first `limit` bytes of `tensors` taken in order, in whole
    lines that end inside each tensor (a tensor's last partial line is left out)."""
    out: list[tuple[int, int, int]] = []
    first = 0
    for t in tensors:
        lines = min(t.numel() * t.element_size(), limit) // LINE
        if lines <= 0:
            break
        out.append((t.data_ptr(), lines, first))
        first += lines
        limit -= lines * LINE
    return out


class LayerPrefetch:
    """The weights of one layer in the order it reads them; `launch` prefetches the first budget() bytes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self._tables: dict[int, torch.Tensor] = {}  # budget -> table on the device (graphs keep its address)
        self._sink = torch.empty(_BLOCK * 4, dtype=torch.int32, device=self.device)  # MODE 2's stores go here

    def table(self, limit: int) -> torch.Tensor:
        if limit not in self._tables:
            rows = plan_ranges(self.tensors, limit)
            self._tables[limit] = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64, device=self.device)
        return self._tables[limit]

    def launch(self, limit: int | None = None, hits: torch.Tensor | None = None, mode: int | None = None) -> None:
        """Prefetch (or with `hits`, count into hits[line]) the first `limit` bytes (default: budget())."""
        limit = budget() if limit is None else limit
        mode = _mode if mode is None else mode
        if limit <= 0 or not self.tensors or (hits is None and not enabled(self.device)):
            return
        table = self.table(limit)
        programs = _programs(self.device)
        launch = {"PDL": False} if hits is not None else pdl.launch_args(self.device)
        record = hits is not None
        hits = self._sink if hits is None else hits
        _l2_prefetch_kernel[(programs,)](table, hits, table.shape[0], LINE_BYTES=LINE,
                                         BLOCK=_BLOCK, RECORD=record, MODE=mode, num_warps=4, **launch)


@functools.cache
def _programs_on(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device) -> int:
    """One program per compute unit (3 under the interpreter: enough to test the walk)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 3
    return _programs_on(device.index if device.index is not None else torch.cuda.current_device())
