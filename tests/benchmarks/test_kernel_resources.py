"""benchmarks/kernel_resources.py: the gfx906 tile kernel at 8 activation rows, as its tuning file launches
the K-quants, compiles without spilling (the only check of that file there is without the GPU), where the
fallback's two super-blocks a tile spilled; the script reports both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_resources.py"


def test_gfx906_k_quant_tile_kernels_at_8_rows_do_not_spill_at_the_shipped_entries() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compilers, not the interpreter
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "hip:gfx906", "--op", "matvec", "--ms", "8",
         "--shapes", "Q4_K:4096x14336,Q5_K:4096x14336,Q6_K:4096x14336", "--extra", '{};{"nb": 16}'],
        capture_output=True, text=True, env=env, timeout=900, cwd=SCRIPT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    shipped = [r for r in rows if r["params"]["nb"] == 8]
    wider = [r for r in rows if r["params"]["nb"] == 16]
    assert len(shipped) == len(wider) == 3
    assert all(r["spill_bytes"] == 0 for r in shipped), shipped
    assert any(r["spill_bytes"] > 0 for r in wider), wider  # why the entries are there
    assert all(s["registers"] < w["registers"] for s, w in zip(shipped, wider, strict=True))
