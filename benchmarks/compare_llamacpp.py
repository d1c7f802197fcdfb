"""Teacher-forced comparison with llama.cpp's outputs on the embedded model (tests/data/smollm2/greedy.json).

Feeds each prompt plus llama.cpp's greedy completion, and at every generated position compares our argmax
with llama.cpp's and our log-softmax of llama.cpp's top-5 tokens with its values. Prints a table and JSON.

    python benchmarks/compare_llamacpp.py [--reference DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore

DEFAULT_REF = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", type=Path, default=DEFAULT_REF)
    args = ap.parse_args()
    ref = json.loads((args.reference / "greedy.json").read_text())
    core = EngineCore(EngineConfig.from_dict({"cache": {"context_size": 512}, "device": "cpu"}), show_progress=False)
    rows, agree, counted = [], 0, 0
    for p in ref["prompts"]:
        ids = p["prompt_ids"] + p["completion_ids"]
        logits = core.forward_logits(ids)
        logp = torch.log_softmax(logits, -1)
        n_prompt = len(p["prompt_ids"])
        diffs, p_agree, p_counted = [], 0, 0
        for i, top in enumerate(p["top5"]):
            row = logp[n_prompt - 1 + i]
            diffs.append(max(abs(float(row[t]) - lp) for t, lp in top))
            if top[0][1] - top[1][1] > 0.1:
                p_counted += 1
                p_agree += int(int(row.argmax()) == top[0][0])
        agree, counted = agree + p_agree, counted + p_counted
        rows.append({
            "prompt": p["prompt"], "agree": p_agree, "positions": p_counted, "first_top5_max_diff": round(diffs[0], 4),
            "median_top5_max_diff": round(sorted(diffs)[len(diffs) // 2], 4),
        })
    print(f"{'prompt':28s} {'agree':>9s} {'first-token top5 |d|':>21s} {'median |d|':>10s}")
    for r in rows:
        print(f"{r['prompt'][:28]:28s} {r['agree']:4d}/{r['positions']:<4d} {r['first_top5_max_diff']:21.4f} {r['median_top5_max_diff']:10.4f}")
    print(f"pooled agreement where llama.cpp's margin > 0.1: {agree}/{counted} = {agree / counted:.1%}")
    print(json.dumps({"bench": "compare_llamacpp", "agree": agree, "positions": counted, "prompts": rows}))


if __name__ == "__main__":
    main()
