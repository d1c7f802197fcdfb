"""benchmarks/bench_attention.py --tiny runs its correctness part end to end (under the interpreter on a
CPU): every row within tolerance, one JSON line per row, also with --max-seq-len above the contexts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def test_tiny_bench_checks_every_row_and_reports_json():
    done = subprocess.run([sys.executable, str(BENCH), "--tiny"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["op"] for r in rows].count("decode") == 4 and [r["op"] for r in rows].count("prefill") == 2
    assert all(r["relerr"] < 3e-3 for r in rows)


def test_tiny_bench_gives_decode_the_max_seq_len_asked_above_the_context():
    """The decode graphs' case: a grid for 1024 keys, sequences of 17 and 40."""
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--max-seq-len", "1024"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    decode = [r for r in rows if r["op"] == "decode"]
    assert len(decode) == 4 and all(r["max_seq_len"] == 1024 and r["relerr"] < 3e-3 for r in decode)
