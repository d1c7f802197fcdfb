"""The custom AllReduce's rank test (tests/engine/distributed/custom_ar_ranks.py) at any size and length, as a
script: WORLD processes on the GPUs there are (several to a GPU share it over CUDA / HIP IPC), ITERS
AllReduces back to back. Prints one JSON line: every check of every rank passed or not, the time per call
each rank saw, the largest relative error against the float64 sum.

    python benchmarks/bench_allreduce_ranks.py WORLD ITERS [--timeout S]

Ranks sharing one GPU by time slices wait whole slices for each other (4 ranks took more than a minute for
2,000 calls); under NVIDIA MPS (`nvidia-cuda-mps-control -d` first) they run side by side.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

RANKS = Path(__file__).resolve().parents[1] / "tests" / "engine" / "distributed" / "custom_ar_ranks.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("world", type=int)
    ap.add_argument("iters", type=int)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.time()
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), str(args.world), str(port), str(args.iters)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(args.world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, args.timeout - (time.time() - t)))
            if p.returncode != 0:
                sys.exit(f"a rank failed ({p.returncode}): {err[-3000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        sys.exit(f"{args.world} ranks did not finish {args.iters} AllReduces in {args.timeout:.0f} s")
    finally:
        for p in procs:
            p.kill()
    ok = all(o["reason"] is None and o["communicator_custom"] and o["back_to_back_ok"] and o["graph_ok"]
             and o["communicator_ok"] and all(c["bitwise_rank_order"] and c["same_on_every_rank"]
                                              and c["rel_err"] < 1e-6 for c in o["checks"]) for o in outs)
    print(json.dumps({"world": args.world, "iters": args.iters, "wall_s": round(time.time() - t, 1), "all_ok": ok,
                      "back_to_back_us": [round(o["back_to_back_us"], 1) for o in outs],
                      "max_rel_err": max(c["rel_err"] for o in outs for c in o["checks"]),
                      "reasons": [o["reason"] for o in outs]}))


if __name__ == "__main__":
    main()
