"""The peer-write AllReduce kernels compile for an NVIDIA sm_90 and an AMD gfx906 target (one-shot and
two-shot, 2, 5 and 8 ranks, f32 and bf16 activations), and their flags keep the memory model the kernel
file states: the flag raise is a release exchange and the poll an acquire at system scope (PTX `.sys`;
in AMD's LLVM IR an atomic with no `syncscope`, i.e. the system's), never the GPU scope that would let a
peer over PCIe see the flag before the data.

Runs in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted functions)."""

from __future__ import annotations

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import allreduce as ar

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
text = []
for fn, world, dt, phases in ((ar._one_shot_kernel, 2, "*fp32", ar.PUSH | ar.REDUCE),
                              (ar._one_shot_kernel, 8, "*bf16", ar.PUSH | ar.REDUCE),
                              (ar._two_shot_kernel, 5, "*fp32", ar.ALL), (ar._two_shot_kernel, 8, "*bf16", ar.ALL)):
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(x_ptr=dt, peers_ptr="*i64", WORLD="constexpr", BLOCK="constexpr", PHASES="constexpr")
    k = triton.compile(ASTSource(fn, sig, {"WORLD": world, "BLOCK": 1024, "PHASES": phases}), target=target,
                       options={"num_warps": 4})
    text.append(k.asm["ptx"] if backend == "cuda" else k.asm["llir"])
for line in "\n".join(text).splitlines():
    if ("atom" in line or "acquire" in line) and "fence" not in line:  # PTX atom / ld.acquire; LLVM atomicrmw
        print("ATOMIC", line.strip())
print("compiled")
"""


def _atomics(out: str) -> list[str]:
    return [line.removeprefix("ATOMIC ") for line in out.splitlines() if line.startswith("ATOMIC ")]


def test_the_kernels_compile_for_sm90_with_system_scope_flags(offline_compile) -> None:
    atomics = _atomics(offline_compile(COMPILE, "cuda", "90", 32))
    raises = [a for a in atomics if ".exch" in a and ".release" in a]
    polls = [a for a in atomics if ".acquire" in a and "ld." in a or ".acquire.add" in a]
    assert raises and all(".sys." in a for a in raises if ".gpu." not in a)
    # every release exchange on a peer's flag is .sys; the one .gpu release is the epoch's own advance
    assert sum(".sys." in a for a in raises) >= 2 and all(".sys." in a for a in polls) and polls


def test_the_kernels_compile_for_gfx906_with_system_scope_flags(offline_compile) -> None:
    atomics = _atomics(offline_compile(COMPILE, "hip", "gfx906", 64))
    raises = [a for a in atomics if "atomicrmw xchg" in a and " release" in a]
    polls = [a for a in atomics if " acquire" in a]  # the add of 0, which LLVM turns into an or of 0
    # the flag raises at system scope; the epoch's own advance (syncscope agent) stays on this GPU
    assert sum("syncscope" not in a for a in raises) >= 2, raises
    assert polls and all("syncscope" not in a for a in polls), polls
