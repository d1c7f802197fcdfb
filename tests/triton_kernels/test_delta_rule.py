"""The gated DeltaNet kernels (triton_kernels/conv1d.py, delta_rule.py) against their torch references, under
the interpreter at small shapes: a flat batch of sequences of 1 to 70 tokens (prompts and decode steps
alike, some going on from their slot's state and some starting from zeros over a slot holding garbage),
value heads tiled and grouped over the key heads; outputs poisoned with NaN. Also: the chunked reference (the
CPU path's for prompts) equals the token-by-token one, and every kernel compiles for an NVIDIA sm_90 and an
AMD gfx906 target at Qwen3.6's head width (the interpreter accepts code compilers reject).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vegaserve.triton_kernels.conv1d import causal_conv1d_ref, conv1d_prefill, conv1d_update
from vegaserve.triton_kernels.delta_rule import (
    delta_rule_chunked, delta_rule_chunked_ref, delta_rule_recurrent, delta_rule_recurrent_ref, expand_heads,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poisoned_empty")

HK, HV, D = 2, 4, 16
LENGTHS = [70, 1, 5, 64]
SLOTS = [3, 0, 5, 1]
HAS_STATE = [1, 0, 1, 1]


def _batch(lengths: list[int], seed: int = 0, decay: float = 0.2, D: int = D):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(T, HK, D, generator=gen), dim=-1) * D ** -0.5
    k = F.normalize(torch.randn(T, HK, D, generator=gen), dim=-1)
    v = torch.randn(T, HV, D, generator=gen)
    g = -decay * torch.rand(T, HV, generator=gen)  # decays of 0.8 .. 1 a token by default
    beta = torch.rand(T, HV, generator=gen)
    state = torch.randn(6, HV, D, D, generator=gen)
    state[0] = float("nan")  # slot 0's sequence starts from zeros: what the slot held must not leak in
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, state, starts


def _on(*xs):
    return [x.to(DEVICE) for x in xs]


def test_the_chunked_reference_equals_the_token_by_token_one():
    q, k, v, g, beta, state, _ = _batch([150])
    qe, ke = (expand_heads(x, HV, True) for x in (q, k))
    for s0 in (None, state[1]):
        want, want_s = delta_rule_recurrent_ref(qe, ke, v, g, beta, s0)
        for chunk in (64, 16):
            got, got_s = delta_rule_chunked_ref(qe, ke, v, g, beta, s0, chunk)
            assert (got - want).abs().max() < 1e-5 and (got_s - want_s).abs().max() < 1e-5


def _recurrent(q, k, v, g, beta, state, slots, has, starts, tiled):
    return delta_rule_recurrent(q, k, v, g, beta, state, slots, has, starts, tiled)


def _chunked(q, k, v, g, beta, state, slots, has, starts, tiled, **blocks):
    return delta_rule_chunked(q, k, v, g, beta, state, slots, has, starts, int((starts[1:] - starts[:-1]).max()),
                              tiled, **blocks)


def _check_per_sequence(kernel, q, k, v, g, beta, state, starts, tiled, **blocks):
    """The kernel over the flat batch on the test's device (SLOTS, HAS_STATE): each sequence's outputs and final
    state within 1e-5 of the token-by-token reference, and the slots no sequence owns untouched."""
    slots, has = torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(HAS_STATE, dtype=torch.int32)
    new = state.clone().to(DEVICE)
    o = kernel(*_on(q, k, v, g, beta), new, *_on(slots, has, starts), tiled, **blocks).cpu()
    new = new.cpu()
    for i, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
        s0 = state[SLOTS[i]] if HAS_STATE[i] else None
        qe, ke = (expand_heads(x[a:b], HV, tiled) for x in (q, k))
        want, want_s = delta_rule_recurrent_ref(qe, ke, v[a:b], g[a:b], beta[a:b], s0)
        assert (o[a:b] - want).abs().max() < 1e-5, i
        assert (new[SLOTS[i]] - want_s).abs().max() < 1e-5, i
    assert torch.equal(new[[2, 4]], state[[2, 4]])  # slots no sequence owns are untouched


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "grouped"])
@pytest.mark.parametrize("lengths, decay", [(LENGTHS, 0.2), ([1, 1, 3, 1], 0.2), ([150, 2, 17, 48], 20.0)],
                         ids=["prompts", "decode", "long-strong-decay"])
@pytest.mark.parametrize("kernel", [_recurrent, _chunked], ids=["recurrent", "chunked"])
def test_the_delta_rule_kernel_equals_the_reference_per_sequence(kernel, lengths, decay, tiled):
    """The strong decay (down to exp(-20) a token) underflows a chunk's exp(G) and overflows exp(-G)."""
    _check_per_sequence(kernel, *_batch(lengths, seed=len(lengths) + tiled, decay=decay), tiled)


@pytest.mark.parametrize("d, blocks", [(32, dict(block_v=16, block_d=16)), (128, {})], ids=["32-by-16", "128-default"])
def test_the_chunked_kernel_over_several_blocks_of_columns_equals_the_reference(d, blocks):
    """Heads of 32 split into value and solve columns of 16 (the heads above give every program all columns),
    and Qwen3.6's heads of 128 in the blocks the engine launches (the defaults)."""
    _check_per_sequence(_chunked, *_batch(LENGTHS, seed=11, D=d), True, **blocks)


@pytest.mark.parametrize("lengths, block_t", [(LENGTHS, 16), ([2, 1, 1, 3], 32)], ids=["long", "shorter-than-k"])
def test_conv1d_prefill_equals_the_reference_and_rolls_the_state(lengths, block_t):
    C, K = 48, 4
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(sum(lengths), C, generator=gen), torch.randn(C, K, generator=gen)
    state = torch.randn(6, K - 1, C, generator=gen)
    state[0] = float("nan")
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots, has = torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(HAS_STATE, dtype=torch.int32)
    new = state.clone().to(DEVICE)
    y = conv1d_prefill(*_on(x, w), new, *_on(slots, has, starts), block_t=block_t, block_c=32).cpu()
    new = new.cpu()
    for i, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
        want, want_s = causal_conv1d_ref(x[a:b], w, state[SLOTS[i]] if HAS_STATE[i] else None)
        assert (y[a:b] - want).abs().max() < 1e-5 and torch.allclose(new[SLOTS[i]], want_s), i


def test_conv1d_update_equals_the_reference_and_rolls_the_state():
    C, K = 48, 4
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(4, C, generator=gen), torch.randn(C, K, generator=gen)
    state = torch.randn(6, K - 1, C, generator=gen)
    state[0] = float("nan")
    new = state.clone().to(DEVICE)
    slots, has = torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(HAS_STATE, dtype=torch.int32)
    y = conv1d_update(*_on(x, w), new, *_on(slots, has), block_c=32).cpu()
    new = new.cpu()
    for i in range(4):
        want, want_s = causal_conv1d_ref(x[i : i + 1], w, state[SLOTS[i]] if HAS_STATE[i] else None)
        assert (y[i] - want[0]).abs().max() < 1e-5 and torch.allclose(new[SLOTS[i]], want_s), i


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import conv1d, delta_rule

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16",
        "uw_ptr": "*fp32", "h_ptr": "*fp32", "gc_ptr": "*fp32", "a_ptr": "*fp32", "m_ptr": "*fp32",
        "g_ptr": "*fp32",
        "beta_ptr": "*fp32", "state_ptr": "*fp32", "w_ptr": "*fp32", "slots_ptr": "*i32",
        "has_state_ptr": "*i32", "qstart_ptr": "*i32", "cstart_ptr": "*i32"}

def build(fn, consts, opts):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=target, options=opts)

# Qwen3.6-27B: 16 key heads, 48 value heads of 128, tiled; a convolution of width 4 over 10240 channels
heads = dict(HK=16, HV=48, TILED=True, D=128)
build(delta_rule._delta_rule_recurrent_kernel, dict(heads, BV=32), {"num_warps": 4})
prec = "tf32x3" if backend == "cuda" else "ieee"
build(delta_rule._chunk_kkt_kernel, dict(heads, PREC=prec), {"num_warps": 4})
build(delta_rule._chunk_solve_kernel, dict(HV=48, PREC=prec), {"num_warps": 2})
build(delta_rule._chunk_wu_kernel, dict(heads, BD=64, PREC=prec), {"num_warps": 8})
build(delta_rule._chunk_state_kernel, dict(heads, BV=32, PREC=prec), {"num_warps": 8})
build(delta_rule._chunk_output_kernel, dict(heads, BV=32, PREC=prec), {"num_warps": 4})
build(conv1d._conv1d_prefill_kernel, dict(K=4, BLOCK_T=32, BLOCK_C=128), {"num_warps": 4})
build(conv1d._conv1d_update_kernel, dict(K=4, BLOCK_C=256), {"num_warps": 4})
print("compiled")
"""


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_the_kernels_compile_for_the_target(backend, arch, warp, offline_compile):
    offline_compile(COMPILE, backend, arch, warp)
