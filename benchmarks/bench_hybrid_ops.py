"""Two kernels of a hybrid mixture-of-experts decode and prompt, timed alone on one GPU (triton's do_bench,
L2 flushed between calls):

  delta rule   one prompt of --tokens tokens (Qwen3.6's heads: 16 key heads, 32 or 48 value heads of 128)
               through delta_rule_chunked as the engine runs it (f32 products as three tf32 passes), the
               same with one tf32 pass, and token by token (delta_rule_recurrent), each checked against
               the token-by-token result first;
  router       moe_ops.router's launch for one token at each --blocks experts a program (Qwen3.6-35B-A3B: 256
               experts and the shared gate over hidden 2048; Qwen3-30B-A3B: 128), against the block the
               launcher picks.

    python benchmarks/bench_hybrid_ops.py [--tokens 512,2048] [--block-v 32] [--blocks 2,4,8,16,32]

--block-v: the chunked form's value columns a program of its state and output launches, a list (the first is
timed in one tf32 pass too; 32 is the engine's; 16 faults on an H100 under Triton 3.6, docs/PERFORMANCE.md);
--blocks '': no router.

Prints one line a case.
"""

from __future__ import annotations

import argparse

import torch
import triton

from vegaserve.triton_kernels import delta_rule, moe_ops, pdl
from vegaserve.triton_kernels.delta_rule import delta_rule_chunked, delta_rule_recurrent


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


def router_us(rows: int, gate: int, block_e: int, hidden: int = 2048, k: int = 8) -> float:
    dev = "cuda"
    E = rows - (gate > 0)
    x = torch.randn(1, hidden, device=dev)
    w = torch.randn(rows, hidden, device=dev) / 40
    counters = moe_ops.router_counters(x.device)
    logits = torch.empty(1, rows, device=dev)
    width = k + (gate == moe_ops.GATE_EXPERT)
    wo = torch.empty(1, width, device=dev)
    ids = torch.empty(1, width, dtype=torch.int64, device=dev)
    block_h = min(moe_ops.ROUTER_TILE // block_e, hidden)
    launch = lambda: moe_ops._router_kernel[(1, triton.cdiv(rows, block_e))](  # noqa: E731
        x, w, w, logits, counters, wo, ids, wo, E, hidden, x.stride(0), K=k, K_P2=triton.next_power_of_2(k),
        E_P2=triton.next_power_of_2(E), SOFTMAX=True, NORM=True, BIAS=False, GATE=gate, BLOCK_E=block_e,
        BLOCK_H=block_h, **pdl.launch_args(x.device))
    launch()
    return triton.testing.do_bench(launch, warmup=5, rep=100) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--block-v", default="32")
    ap.add_argument("--blocks", default="2,4,8,16,32")
    args = ap.parse_args()
    torch.manual_seed(0)
    for T in map(int, args.tokens.split(",")):
        for hv in (32, 48):
            delta_rule_ms(T, 16, hv, [int(b) for b in args.block_v.split(",")])
    for rows, gate in ((257, moe_ops.GATE_EXPERT), (128, 0)) if args.blocks else ():
        times = {b: router_us(rows, gate, b) for b in map(int, args.blocks.split(","))}
        print(f"router, {rows} rows: " + ", ".join(f"{b} a program {t:.1f} us" for b, t in times.items())
              + f"; the launcher picks {moe_ops.router_block(rows)}")


if __name__ == "__main__":
    main()
