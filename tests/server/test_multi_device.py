"""Several processes over gloo on the CPU, served end to end: `-sm tensor` with 2 and 4 processes, `-sm layer`
with 2 stages, `-sm tensor -tps 2` with 4. Each gives the logits of one process within 1e-4, the same 32
greedy tokens, and the same texts to concurrent HTTP streams. Then the failures: a topology that cannot
work stops the CLI with one error line, and a worker killed mid-stream ends the server within 10 s."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.server.app import create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gguf_factory as factory  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
N_TOKENS = 32

# qwen2 (q/k/v biases) with its own output matrix; llama with the head tied to the embedding, and KV heads
# fewer than 4 lanes (replicated)
MODELS = {
    "qwen2": factory.TinySpec(arch="qwen2", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, tied=False, seed=3),
    "llama": factory.TinySpec(arch="llama", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, tied=True, seed=4),
}
TOPOLOGIES = [  # (id, model, flags as a config tree)
    ("tensor-2", "qwen2", {"split_mode": "tensor", "n_devices": 2}),
    ("layer-2", "qwen2", {"split_mode": "layer", "n_devices": 2}),
    ("tensor-4", "llama", {"split_mode": "tensor", "n_devices": 4}),
    ("tensor-4-tps-2", "llama", {"split_mode": "tensor", "tensor_parallel_group": 2, "n_devices": 4}),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("multi")
    return {name: factory.write_tiny_gguf(d / f"{name}.gguf", spec) for name, spec in MODELS.items()}


def config(path: Path, parallel: dict | None = None) -> EngineConfig:
    """On the CPU's f32 path (VEGASERVE_CPU_INT4=0): the int4 kernel rounds each lane's partial product of a
    K-split matrix to bf16, which alone moves a tiny model's logits by about 1e-2 from one process."""
    return EngineConfig.from_dict({
        "model": {"path": str(path)}, "cache": {"context_size": 256}, "scheduler": {"max_num_seqs": 4},
        "parallel": parallel or {}, "device": "cpu", "kernels": {"cpu_int4": False},
    })


def greedy(core: EngineCore, prompt: str) -> list[int]:
    ids = core.tokenizer.encode(prompt)
    req = GenerateRequest(ids, SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True))
    return [t for out in core.generate_sync(req) for t in out.token_ids]


def served_texts(core: EngineCore, serve) -> list[str]:
    """The prompts streamed at once through the HTTP server (they share steps: -np 4)."""
    engine = AsyncEngine(core)
    try:
        with serve(create_app(engine)) as server:
            def one(prompt: str) -> str:
                body = {"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
                text = ""
                with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line.removeprefix("data: "))
                            assert "error" not in event, event
                            text += event["choices"][0]["text"]
                return text

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                return list(pool.map(one, PROMPTS))
    finally:
        engine.shutdown(timeout=30)


@pytest.fixture(scope="module")
def single(models: dict[str, Path], serve) -> dict[str, tuple]:
    """Per model, one process: (logits of the first prompt, greedy tokens per prompt, served texts)."""
    out = {}
    for name, path in models.items():
        core = EngineCore(config(path), show_progress=False)
        logits = core.forward_logits(core.tokenizer.encode(PROMPTS[0]))
        tokens = [greedy(core, p) for p in PROMPTS]
        out[name] = (logits, tokens, served_texts(core, serve))
    return out


@pytest.mark.parametrize(("name", "model", "parallel"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES])
def test_split_matches_one_process(name, model, parallel, models, single, serve) -> None:
    ref_logits, ref_tokens, ref_texts = single[model]
    core = EngineCore(config(models[model], parallel), show_progress=False)
    assert core.launch.topo.world_size == parallel["n_devices"]
    try:
        logits = core.forward_logits(core.tokenizer.encode(PROMPTS[0]))
        err = float((logits - ref_logits).norm() / ref_logits.norm())
        assert err < 1e-4, f"{name}: logits differ from one process by {err:.2e}"
        assert [greedy(core, p) for p in PROMPTS] == ref_tokens
        assert len(ref_tokens[0]) == N_TOKENS
    except BaseException:
        core.close()
        raise
    assert served_texts(core, serve) == ref_texts  # closes the core (its workers) at the end


def vegaserve_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vegaserve.server", "serve", "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("flags", "message"), [
    (["-sm", "tensor", "-ndev", "4", "-tps", "3"], "-tps 3 must divide the number of devices"),
    (["-sm", "tensor", "-ndev", "2", "-tps", "4"], "only 2 are visible"),
    (["-sm", "layer", "-ndev", "2", "-tps", "2"], "-tps 2 needs -sm tensor"),
    (["-sm", "tensor", "-ndev", "3"], "4 attention heads do not divide over 3"),
    (["-sm", "layer", "-ndev", "3"], "3 pipeline stages but the model has only 2 layers"),
    (["-sm", "tensor", "-ndev", "2", "--device-memory", "0.0001"], "GiB on each device of stage 0"),
])
def test_an_impossible_topology_stops_with_one_clear_line(flags, message, models) -> None:
    r = vegaserve_cli("-m", str(models["llama"]), "-c", "256", *flags)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("vegaserve: error: ") and message in lines[0], r.stderr


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_worker_fails_the_stream_gives_503_and_the_server_exits(models) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vegaserve.server", "serve", "--device", "cpu", "-m", str(models["llama"]), "-c", "256",
         "-sm", "tensor", "-ndev", "2", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        # spawned workers run multiprocessing's spawn_main; the resource tracker is a child too
        family = children(proc.pid)
        workers = [c for c in family if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) == 1

        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(line)
                    break
            os.kill(workers[0], signal.SIGKILL)
            killed = time.monotonic()
            try:
                events.extend(line for line in lines if line.startswith("data: "))
            except httpx.HTTPError:
                pass  # the connection may drop as the server goes; the error event came first or not at all
        assert any('"error"' in e for e in events), events[-3:]
        late = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=5)
        assert late.status_code == 503, late.text
        assert httpx.get(base + "/health", timeout=5).status_code == 503
        code = proc.wait(timeout=max(0.1, 10 - (time.monotonic() - killed)))
        assert code != 0
        assert time.monotonic() - killed < 10
        assert "exited with code -9" in proc.stderr.read()
        time.sleep(0.5)
        assert not [c for c in family if alive(c)], "processes left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_torchrun_starts_the_ranks_and_rank_0_serves(models, single) -> None:
    """Several nodes are launched by torchrun; here two ranks on one host, the same code path."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, rdzv = a.getsockname()[1], b.getsockname()[1]
    proc = subprocess.Popen(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "-m", "vegaserve.server", "serve", "--device", "cpu",
         "-m", str(models["qwen2"]), "-c", "256", "-np", "4", "-sm", "tensor", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"prompt": PROMPTS[1], "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == single["qwen2"][2][1]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
