"""How close a mixture of experts' routing decisions are: for each token and MoE layer of a prompt step on the
CPU path, the gap between its k-th and (k+1)-th router logit (the last expert chosen and the first left out),
in units of that token's router-logit standard deviation. A decision with a small gap follows any change in
the last bits of the layer's input, and on random weights another expert gives another token: so two paths
that differ only in rounding (another row count's launches, bf16 against f32) can part on such models without
either being wrong.

    python benchmarks/router_gaps.py -m FILE [--prompts 8,21,34] [--seed 1]

The prompts are bench_engine.py's greedy-check prompts by default (random ids, its seed). Prints the count of
decisions, the smallest and median gap and the share below 1e-3, 1e-2, 3e-2 and 1e-1.
"""

from __future__ import annotations

import argparse

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.layers import moe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--prompts", default="8,21,34", help="prompt lengths, random ids")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    gaps: list[torch.Tensor] = []
    real = moe.route

    def spy(logits: torch.Tensor, cfg):
        top = torch.topk(logits.float(), cfg.used + 1, dim=-1).values
        gaps.append(((top[:, -2] - top[:, -1]) / logits.float().std(dim=-1)).flatten())
        return real(logits, cfg)

    moe.route = spy
    lengths = [int(n) for n in args.prompts.split(",")]
    tree = {"model": {"path": args.model}, "cache": {"context_size": max(lengths) + 16}, "device": "cpu"}
    core = EngineCore(EngineConfig.from_dict(tree), show_progress=False)
    if core.arch.moe is None:
        raise SystemExit(f"{args.model}: {core.arch.architecture} has no router")
    g = torch.Generator().manual_seed(args.seed)
    for n in lengths:
        core.forward_logits(torch.randint(0, core.arch.vocab_size, (n,), generator=g).tolist())
    gap = torch.cat(gaps)
    print(f"{gap.numel()} routing decisions (tokens x MoE layers); the gap between the k-th and (k+1)-th router "
          f"logit in units of the token's logit std: min {gap.min():.2e}, median {gap.median():.3f}; "
          + ", ".join(f"below {t:g}: {(gap < t).float().mean() * 100:.1f}%" for t in (1e-3, 1e-2, 3e-2, 1e-1)))


if __name__ == "__main__":
    main()
