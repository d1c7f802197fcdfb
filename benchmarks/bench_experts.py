"""The decode step's expert mat-vecs on a GPU: one MoE layer's gate+up and down launches at 1..8 tokens,
against copy bandwidth over the bytes of the experts the step chose (the MoE issue's 60% bar).

    python benchmarks/bench_experts.py --preset qwen3-30b-a3b [--tokens 1,8] [--tuning FILE]
        [--sweep '[{"kernel": "int8", "split_k": 8}, ...]']

Each stack is one layer's experts as the engine loads them (layout.stack_experts, repacked), random valid
blocks in the preset's types; the kernel and launch parameters are the ones a model load picks
(matvec.choose_experts at the launch's assignments, the tuning file's). Every call draws its own top-k expert ids
(distinct within a token, random across tokens) and reads its own copy of the stack (timing.copies_for), so
no call finds its experts in L2; calls are replayed in one CUDA graph, x's q8_1 copy made outside the timed
calls, as the layer's norm hands it over. The bytes counted are the GGUF bytes of the experts in use, each
once, averaged over the calls. Each stack's product is checked against the reference dequantizer's first.
--sweep: launch configs laid over the file's choice (as bench_kernels.py's), each checked and timed; the
table shows the fastest, a `sweep` line every config's time; a config a stack's shape cannot take is named
and skipped.
"""

from __future__ import annotations

import argparse
import json

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import expert, stack_experts
from vegaserve.triton_kernels.matvec import choose_experts
from vegaserve.triton_kernels.moe import Experts, expert_matmul, reference_expert_matmul
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for, copy_bandwidth
from vegaserve.triton_kernels.tuning import load_tuning

from bench_kernels import matvec_choice

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}

# preset -> (experts, top-k, hidden, expert ffn, [(stack, type), ...]): the shapes of benchmarks/synth_gguf.py's
# presets; llama-quantize's Q4_K_M mix puts the down projections in Q4_K or Q6_K by layer (both timed)
PRESETS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, [("gate_up", "Q4_K"), ("down", "Q4_K"), ("down", "Q6_K")]),
    "qwen3.6-35b-a3b": (256, 8, 2048, 512, [("gate_up", "Q4_K"), ("down", "Q4_K"), ("down", "Q6_K")]),
    "gpt-oss-20b": (32, 4, 2880, 2880, [("gate_up", "MXFP4"), ("down", "MXFP4")]),
}


def stack_shape(stack: str, hidden: int, ffn: int) -> tuple[int, int, int]:
    """(rows, k, x_div) of a stack: gate and up are one matrix of 2 ffn rows over hidden, read once per
    token (x_div = top-k assignments share a row of x); down is hidden rows over ffn, one row of x each."""
    return (2 * ffn, hidden, 0) if stack == "gate_up" else (hidden, ffn, 1)


def draw_ids(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens * top_k] int64: each token's top_k distinct experts."""
    return torch.cat([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


def gguf_bytes(type_name: str, rows: int, k: int) -> int:
    spec = GGML_TYPES[TYPE_IDS[type_name]]
    return rows * k // spec.block_size * spec.type_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,8", help="tokens a step (decode streams), 1..8")
    ap.add_argument("--tuning", default=None, help="tuning file (default: configs/kernels/<target>.json)")
    ap.add_argument("--sweep", default="[{}]", help="JSON list of launch configs over the file's choice")
    args = ap.parse_args()
    sweep = json.loads(args.sweep)
    experts, top_k, hidden, ffn, stacks = PRESETS[args.preset]
    tuning = load_tuning(path=args.tuning)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s; {args.preset}: {experts} "
          f"experts, top {top_k}, hidden {hidden}, expert ffn {ffn}")
    print("| stack | type | tokens | experts read | us | GB/s | % copy bw | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for stack, type_name in stacks:
        rows, k, x_div = stack_shape(stack, hidden, ffn)
        tid = TYPE_IDS[type_name]
        raw = random_blocks(tid, experts * rows, k // GGML_TYPES[tid].block_size, gen).cuda()
        w0 = stack_experts(raw, tid, experts, rows, k)
        copies = [w0] + [stack_experts(raw.clone(), tid, experts, rows, k)
                         for _ in range(copies_for(w0.data.numel()) - 1)]
        one = gguf_bytes(type_name, rows, k)
        for tokens in (int(t) for t in args.tokens.split(",")):
            div = x_div or top_k
            x = torch.randn(tokens * top_k // div, k, generator=gen).cuda()
            ids = [draw_ids(tokens, top_k, experts, gen).cuda() for _ in copies]
            read = sum(len(e.unique()) for e in ids) / len(ids)
            timed = []
            base = choose_experts(w0, tokens * top_k, tuning)
            for cfg in sweep:
                # a config this stack's shape cannot take (a tile that does not divide it) is skipped; Triton's
                # compile and resource errors too; a wrong product still stops the run (time_choice)
                try:
                    choice = matvec_choice(expert(w0, 0), 1, tuning, cfg, base)
                    err, ms = time_choice(x, copies, ids, div, choice)
                except Exception as e:  # noqa: BLE001
                    if len(sweep) == 1:
                        raise
                    print(f"  sweep {json.dumps(cfg, separators=(',', ':'))}: {str(e).splitlines()[0][:160]}")
                    continue
                timed.append((ms, err, choice))
            if not timed:
                print(f"| {stack} {rows}x{k} | {type_name} | {tokens} | no config of the sweep launched |")
                continue
            if len(timed) > 1:
                print("  sweep " + " ".join(f"{ms * 1e3:.1f}us {c.kernel.name}{json.dumps(c.params, separators=(',', ':'))}"
                                            for ms, _, c in timed))
            ms, err, choice = min(timed, key=lambda t: t[0])
            gbps = read * one / (ms * 1e-3) / 1e9
            print(f"| {stack} {rows}x{k} | {type_name} | {tokens} | {read:.1f} | {ms * 1e3:.1f} | {gbps:.0f} | "
                  f"{gbps * 1e9 / bw * 100:.1f}% | {choice.kernel.name} {json.dumps(choice.params)} |")
            print("JSON " + json.dumps({"preset": args.preset, "stack": stack, "type": type_name, "tokens": tokens,
                                        "experts_read": read, "us": ms * 1e3, "GBps": gbps, "bw_frac": gbps * 1e9 / bw,
                                        "kernel": choice.kernel.name, "params": choice.params, "rel_err": err}))


def time_choice(x: torch.Tensor, copies: list, ids: list[torch.Tensor], div: int, choice) -> tuple[float, float]:
    """(relative error against the reference, ms a call) of one launch choice over the stack's copies; a
    choice off by more than 1e-4 stops the run."""
    q8 = quantize_q8_1(x) if choice.kernel.int8 else None
    y = expert_matmul(x, copies[0], Experts(ids[0], div), choice, grouped=False, q8_1=q8)
    xr = x.cpu().double()
    if q8 is not None:  # the int8 kernels multiply x's q8_1 form
        q, d, _ = q8
        xr = (q.cpu().double().view(x.shape[0], -1, 32) * d.cpu().double()[..., None]).view(x.shape)
    ref = reference_expert_matmul(xr, copies[0], Experts(ids[0].cpu(), div))
    err = float((y.double().cpu() - ref).norm() / ref.norm())
    if err > 1e-4:
        raise SystemExit(f"{choice.kernel.name} {choice.params}: relative error {err:.2e} against the reference")
    calls = [lambda w=w, e=e: expert_matmul(x, w, Experts(e, div), choice, grouped=False, q8_1=q8)
             for w, e in zip(copies, ids, strict=True)]
    return err, bench_graph(calls)


if __name__ == "__main__":
    main()
