"""Two kernels of a hybrid mixture-of-experts decode and prompt, timed alone on one GPU:

  delta rule   one prompt of --tokens tokens (Qwen3.6's heads: 16 key heads, 32 or 48 value heads of 128)
               through delta_rule_chunked as the engine runs it (f32 products as three tf32 passes), the
               same with one tf32 pass, and token by token (delta_rule_recurrent), each checked against
               the token-by-token result first (triton's do_bench, L2 flushed between calls);
  router       moe_ops.router's launch for one token at each --blocks experts a program x --warps warps
               (Qwen3.6-35B-A3B: 256 experts and the shared gate over hidden 2048; Qwen3-30B-A3B: 128),
               replayed in a graph over 40 weight copies as a decode step runs it, each choice checked
               against route's; the launcher's own block and warps named beside.

    python benchmarks/bench_hybrid_ops.py [--tokens 512,2048] [--block-v 32] [--blocks 2,4,8,16,32] [--warps 1,2,4]

--block-v: the chunked form's value columns a program of its state and output launches, a list (the first is
timed in one tf32 pass too; 32 is the engine's; at 16 the output launch takes four warps, docs/PERFORMANCE.md);
--blocks '': no router.

Prints one line a case.
"""

from __future__ import annotations

import argparse

import torch
import triton

from vegaserve.triton_kernels import delta_rule, moe_ops
from vegaserve.triton_kernels.delta_rule import delta_rule_chunked, delta_rule_recurrent
from vegaserve.triton_kernels.timing import bench_graph


def delta_rule_ms(T: int, hk: int, hv: int, block_v: list[int], d: int = 128) -> None:
    """Prints each form's time and the largest difference of its output from the token-by-token one as it
    goes (a case that faults leaves the ones before it printed)."""
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(T, hk, d, device=dev), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, hk, d, device=dev), dim=-1)
    v = torch.randn(T, hv, d, device=dev)
    g = -0.2 * torch.rand(T, hv, device=dev)
    beta = torch.rand(T, hv, device=dev)
    state = torch.zeros(1, hv, d, d, device=dev)
    zeros = torch.zeros(1, dtype=torch.int32, device=dev)
    starts = torch.tensor([0, T], dtype=torch.int32, device=dev)
    recurrent = lambda: delta_rule_recurrent(q, k, v, g, beta, state, zeros, zeros, starts, True)  # noqa: E731
    want = recurrent()
    cases = [(f"chunked, {b} value columns{' tf32' if p == 'tf32' else ''}", p, b)
             for b in block_v for p in ("tf32x3", "tf32") if p == "tf32x3" or b == block_v[0]]
    def report(name: str, ms: float, err: float) -> None:
        print(f"delta rule {name}, {T} tokens, 16/{hv} heads: {ms:.3f} ms ({ms * 1e3 / T:.2f} us a token), "
              f"largest difference {err:.1e}", flush=True)

    for name, precision, b in cases:
        shipped, delta_rule.DOT_PRECISION = delta_rule.DOT_PRECISION, precision
        try:
            fn = lambda b=b: delta_rule_chunked(q, k, v, g, beta, state, zeros, zeros, starts, T, True, b)  # noqa: E731
            err = (fn() - want).abs().max().item()
            report(name, triton.testing.do_bench(fn, warmup=2, rep=200), err)
        finally:
            delta_rule.DOT_PRECISION = shipped
    report("recurrent", triton.testing.do_bench(recurrent, warmup=2, rep=200), 0.0)


def router_us(rows: int, gate: int, block_e: int, warps: int, hidden: int = 2048, k: int = 8) -> tuple[float, bool]:
    """(microseconds a launch for one token, whether its choice equals route's on torch's logits): 40 launches
    on 40 weight copies (no copy left in L2) captured in a graph and replayed, PDL off."""
    dev = "cuda"
    E = rows - (gate > 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, hidden, device=dev, generator=gen)
    ws = [torch.randn(rows, hidden, device=dev, generator=gen) / 40 for _ in range(40)]
    want_w, want_ids = moe_ops.route((x @ ws[0].T)[:, :E].contiguous(), k, True, True)
    counters = moe_ops.router_counters(x.device)
    logits = torch.empty(1, rows, device=dev)
    width = k + (gate == moe_ops.GATE_EXPERT)
    wo = torch.empty(1, width, device=dev)
    ids = torch.empty(1, width, dtype=torch.int64, device=dev)
    block_h = min(moe_ops.ROUTER_TILE // block_e, hidden)

    def launch(w: torch.Tensor) -> None:
        moe_ops._router_kernel[(1, triton.cdiv(rows, block_e))](
            x, w, w, logits, counters, wo, ids, wo, E, hidden, x.stride(0), K=k, K_P2=triton.next_power_of_2(k),
            E_P2=triton.next_power_of_2(E), SOFTMAX=True, NORM=True, BIAS=False, GATE=gate, BLOCK_E=block_e,
            BLOCK_H=block_h, PDL=False, num_warps=warps)

    launch(ws[0])
    torch.cuda.synchronize()
    right = torch.equal(ids[:, :k], want_ids) and torch.allclose(wo[:, :k], want_w, rtol=1e-5, atol=1e-6)
    return bench_graph([lambda w=w: launch(w) for w in ws]) * 1e3, right


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--block-v", default="32")
    ap.add_argument("--blocks", default="2,4,8,16,32")
    ap.add_argument("--warps", default="1,2,4")
    args = ap.parse_args()
    torch.manual_seed(0)
    for T in map(int, args.tokens.split(",")):
        for hv in (32, 48):
            delta_rule_ms(T, 16, hv, [int(b) for b in args.block_v.split(",")])
    for rows, gate in ((257, moe_ops.GATE_EXPERT), (128, 0)) if args.blocks else ():
        cells = []
        for b in map(int, args.blocks.split(",")):
            for w in map(int, args.warps.split(",")):
                us, right = router_us(rows, gate, b, w)
                cells.append(f"{b} a program x {w} warps {us:.2f} us" + ("" if right else " (WRONG choice)"))
        print(f"router, {rows} rows: " + ", ".join(cells)
              + f"; the launcher takes {moe_ops.ROUTER_BLOCK} x {moe_ops.ROUTER_WARPS}", flush=True)


if __name__ == "__main__":
    main()
