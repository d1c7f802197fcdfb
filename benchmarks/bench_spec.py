"""Speculative decoding over HTTP: the same server with and without speculation, in one run, on a prompt
that asks the model to repeat a paragraph (where n-gram lookup has something to find).

Each round starts `vegaserve serve` once per mode (`--spec-type none`, then the mode under test), waits for
/health, sends the prompt `--requests` times one after another (temperature 0, `--max-tokens`), and stops
the server. Rounds alternate the modes so a machine that speeds up or slows down during the run touches
both. Tokens/s of a request is completion_tokens / its wall time from send to the last byte; the report is
the median over every request of a mode, the ratio of the medians, and the server's spec_decode counters.

    python benchmarks/bench_spec.py --spec-type ngram [--rounds 2] [--requests 4] [--max-tokens 128] \\
        [-- extra serve flags, e.g. -m model.gguf -t 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

PARAGRAPH = (
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. The process takes place mainly in the leaves, where "
    "cells hold many chloroplasts that capture the energy of light."
)
PROMPT = f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(spec: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "vegaserve.server", "serve", "--port", str(port), "--spec-type", spec, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server ({' '.join(cmd)}) exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def _round(spec: str, extra: list[str], requests: int, max_tokens: int) -> tuple[list[float], list[str], dict]:
    proc, url = _start(spec, extra)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                "max_tokens": max_tokens}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)  # warm-up
        rates, texts = [], []
        for _ in range(requests):
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            data = r.json()
            rates.append(data["usage"]["completion_tokens"] / dt)
            texts.append(data["choices"][0]["message"]["content"])
        return rates, texts, _spec_counters(url)
    finally:
        _stop(proc)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec-type", default="ngram", choices=["ngram", "draft", "draft-mtp"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    rates: dict[str, list[float]] = {"none": [], args.spec_type: []}
    texts: dict[str, set[str]] = {"none": set(), args.spec_type: set()}
    counters: dict = {}
    for _ in range(args.rounds):
        for mode in rates:
            r, t, c = _round(mode, extra, args.requests, args.max_tokens)
            rates[mode] += r
            texts[mode] |= set(t)
            counters = c or counters
    med = {m: statistics.median(v) for m, v in rates.items()}
    report = {
        "spec_type": args.spec_type, "tokens_per_s_median": med,
        "tokens_per_s_all": rates, "ratio": med[args.spec_type] / med["none"],
        "same_text": texts["none"] == texts[args.spec_type], "spec_decode": counters,
        "serve_flags": extra, "cpus": os.cpu_count(),
    }
    print(f"none {med['none']:.1f} tok/s, {args.spec_type} {med[args.spec_type]:.1f} tok/s: "
          f"{report['ratio']:.2f}x; same text: {report['same_text']}; {counters}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
