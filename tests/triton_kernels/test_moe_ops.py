"""The mixture-of-experts layer's small operations (triton_kernels/moe_ops.py) against engine/layers/moe.py's
torch code: routing (both gatings, k not a power of two, ties, NaN and infinite logits: every id an expert,
the k distinct), the experts' activations with their biases and q8_1 copy, and the weighted sum with the down
biases and the gated shared expert. Outputs poisoned with NaN. Under the interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch

from vegaserve.engine.layers import moe as layer
from vegaserve.engine.models.arch_config import MoEConfig
from vegaserve.triton_kernels.moe_ops import (
    GATE_EXPERT, GATE_LOGIT, ROUTER_ROWS, combine, expert_act, route, router, router_counters,
)
from vegaserve.triton_kernels.q8_1 import reference_quantize_q8_1

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("gating, norm", [("softmax", True), ("softmax", False), ("topk_softmax", False)])
@pytest.mark.parametrize("k", [1, 4, 6])
def test_routing_equals_the_layers_torch_routing(gating, norm, k):
    logits = torch.randn(7, 12, generator=torch.Generator().manual_seed(k)) * 3
    cfg = MoEConfig(experts=12, used=k, expert_ff=8, gating=gating, norm_topk=norm)
    want_w, want_ids = layer.route(logits, cfg)
    w, ids = route(logits.to(DEVICE), k, gating == "softmax", norm)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.allclose(w.cpu(), want_w, rtol=1e-6, atol=1e-7)


def test_routing_takes_every_id_from_the_experts_whatever_the_logits():
    logits = torch.tensor([[float("nan")] * 8, [float("inf"), float("-inf")] + [0.0] * 6, [1.0] * 8,
                           [0.0, float("nan"), 3.0, float("inf"), -1.0, 2.0, float("-inf"), 0.5],
                           [float("-inf")] * 8])
    for softmax in (True, False):
        _, ids = route(logits.to(DEVICE), 3, softmax, True)
        ids = ids.cpu()
        assert bool(((ids >= 0) & (ids < 8)).all())
        assert all(len(set(row)) == 3 for row in ids.tolist())
        assert ids[2].tolist() == [0, 1, 2]  # ties go to the lower id
        if not softmax:  # (a softmax over an infinite logit is NaN throughout, as torch's)
            assert ids[3].tolist() == [3, 2, 5]  # +inf first, NaN as -inf


@pytest.mark.parametrize("gating, norm, bias", [("softmax", True, False), ("topk_softmax", False, True)],
                         ids=["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("T", [1, 3, ROUTER_ROWS, ROUTER_ROWS + 1])
def test_router_equals_the_layers_logits_then_routing(gating, norm, bias, T):
    """router: the logits x W^T (+ b) and the choice, one launch up to ROUTER_ROWS rows (12 experts over 3
    programs of 4 a token, the last to finish choosing), torch's matmul then route above; the same ids as the
    layer's torch code on float64 logits and its weights, twice in a row (the tickets go back to zero)."""
    gen = torch.Generator().manual_seed(T + 10 * bias)
    E, H, k = 12, 1500, 4  # H past one BLOCK_H (1024 at 4 experts a program) of the fused launch's loop
    x = torch.randn(T, H, generator=gen)
    weight = torch.randn(E, H, generator=gen) / 8
    b = torch.randn(E, generator=gen) if bias else None
    cfg = MoEConfig(experts=E, used=k, expert_ff=8, gating=gating, norm_topk=norm)
    logits = (x.double() @ weight.double().T + (b.double() if bias else 0)).float()
    want_w, want_ids = layer.route(logits, cfg)
    counters = router_counters(torch.device(DEVICE))
    d = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    for _ in range(2):
        w, ids = router(d(x), d(weight), d(b), k, gating == "softmax", norm, counters)
        assert torch.equal(ids.cpu(), want_ids)
        assert torch.allclose(w.cpu(), want_w, rtol=1e-5, atol=1e-6)
        assert not counters.any()
    with pytest.raises(ValueError, match="router"):
        router(d(x), d(weight[:, :-1]), None, k, True, True, counters)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [1, 5, ROUTER_ROWS + 3])
def test_router_with_the_shared_gate_as_its_last_row_hands_back_its_logit(bias, T):
    """shared_gate: the weight's last row is the shared expert's gate (its bias row 0): the choice is over
    the other rows alone, as the router of those rows gives it, and the gate's logit x . w comes back third
    ([T] f32, contiguous: combine reads it a row at a time), or as the shared expert's weight in a choice
    k + 1 of expert E; 15 experts and the gate over 4 programs of 4
    rows a token, the gate's logit the largest of the row (a choice that looked at it would take it), the
    ticket of each token back at zero after."""
    gen = torch.Generator().manual_seed(T + 10 * bias)
    E, H, k = 15, 700, 3
    x = torch.randn(T, H, generator=gen)
    weight = torch.randn(E + 1, H, generator=gen) / 8
    weight[E] = x.mean(0) * 4
    b = torch.cat([torch.randn(E, generator=gen), torch.zeros(1)]) if bias else None
    counters = router_counters(torch.device(DEVICE))
    d = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    want_w, want_ids = router(d(x), d(weight[:E].contiguous()), d(b[:E] if bias else None), k, True, True, counters)
    w, ids, logit = router(d(x), d(weight), d(b), k, True, True, counters, shared_gate=GATE_LOGIT)
    assert torch.equal(ids.cpu(), want_ids.cpu()) and torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
    assert logit.shape == (T,) and logit.is_contiguous()
    assert torch.allclose(logit.cpu().double(), x.double() @ weight[E].double(), rtol=1e-5, atol=1e-5)
    assert not counters.any()
    # GATE_EXPERT: the shared expert (id E) is every token's choice k + 1, its weight the gate's sigmoid
    w2, ids2 = router(d(x), d(weight), d(b), k, True, True, counters, shared_gate=GATE_EXPERT)
    assert w2.shape == ids2.shape == (T, k + 1)
    assert torch.equal(ids2[:, :k], ids) and torch.equal(w2[:, :k], w) and (ids2[:, k] == E).all()
    assert torch.allclose(w2[:, k], torch.sigmoid(logit), rtol=1e-6, atol=1e-7)
    assert not counters.any()


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_expert_activation_equals_the_layers_with_its_biases_and_q8_1_copy(act, with_bias):
    gen = torch.Generator().manual_seed(3)
    A, F, E = 6, 64, 5
    gate_up = torch.randn(A, 2 * F, generator=gen) * 6  # past the clamp at 7 often
    ids = torch.tensor([0, 4, 4, 1, 2, 0])
    bias = torch.randn(E, 2 * F, generator=gen) if with_bias else None
    cfg = MoEConfig(experts=E, used=2, expert_ff=F, act=act)
    want = layer.expert_act(gate_up + (bias[ids] if with_bias else 0), cfg)
    y, (q, d, s) = expert_act(gate_up.to(DEVICE), act == "swiglu_oai", cfg.alpha, cfg.limit,
                              bias.to(DEVICE) if with_bias else None, ids.to(DEVICE), q8_1=True)
    assert torch.allclose(y.cpu(), want, rtol=1e-5, atol=1e-6)
    rq, rd, rs = reference_quantize_q8_1(y.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(d.cpu(), rd)


@pytest.mark.parametrize("with_bias, with_shared", [(False, False), (True, False), (False, True), (True, True)])
def test_combine_sums_each_tokens_experts_with_their_weights(with_bias, with_shared):
    gen = torch.Generator().manual_seed(4)
    T, k, H, E = 3, 2, 96, 5
    y = torch.randn(T * k, H, generator=gen)
    w = torch.rand(T, k, generator=gen)
    ids = torch.randint(0, E, (T, k), generator=gen)
    bias = torch.randn(E, H, generator=gen) if with_bias else None
    shared = torch.randn(T, H, generator=gen) if with_shared else None
    logit = torch.randn(T, generator=gen) if with_shared else None
    want = ((y + (bias[ids.reshape(-1)] if with_bias else 0)).view(T, k, H) * w[..., None]).sum(1)
    if with_shared:
        want = want + torch.sigmoid(logit)[:, None] * shared
    dev = {t: (v.to(DEVICE) if v is not None else None) for t, v in
           {"b": bias, "s": shared, "l": logit}.items()}
    out = combine(y.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), dev["b"], dev["s"], dev["l"])
    assert torch.allclose(out.cpu(), want, rtol=1e-5, atol=1e-6)


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import moe_ops

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)
f32 = "*fp32"
# the decode router as router() launches it: Qwen3.6-35B-A3B's 256 experts, 8 chosen, the shared expert joined
block_h = min(moe_ops.ROUTER_TILE // moe_ops.ROUTER_BLOCK, 2048)
consts = dict(K=8, K_P2=8, E_P2=256, SOFTMAX=True, NORM=True, BIAS=False, GATE=moe_ops.GATE_EXPERT,
              BLOCK_E=moe_ops.ROUTER_BLOCK, BLOCK_H=block_h, PDL=False)
ptrs = {"x_ptr": f32, "r_ptr": f32, "b_ptr": f32, "logits_ptr": f32, "count_ptr": "*i32", "w_ptr": f32,
        "ids_ptr": "*i64", "s_ptr": f32}
fn = moe_ops._router_kernel
sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": moe_ops.ROUTER_WARPS})
print("compiled")
"""


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_the_router_compiles_for_the_target_at_its_launch(backend, arch, warp, offline_compile):
    """The fused decode router at the launcher's rows a program and warps, for an NVIDIA sm_90 and an AMD
    gfx906 (one wave of 64 there; not run on one)."""
    offline_compile(COMPILE, backend, arch, warp)
