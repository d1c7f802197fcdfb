"""Where the engine's step loop runs on a CPU, and with how many torch threads (engine/async_engine.py
run_loop): on the thread that loaded the model, the configured count; on any other, one, restored when the
loop ends. libgomp keeps a worker pool per thread that runs parallel ops, and with two pools on the
cores its workers sleep between ops: SmolLM2's decode step took 28-36 ms with 2 threads on a second thread
against 15 ms on the loading thread and 20 ms with 1 thread there (2 cores)."""

from __future__ import annotations

import asyncio
import threading

import torch

from tests import gguf_factory
from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams


def _core(tmp_path) -> EngineCore:
    path = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec(n_layers=1, context=64))
    return EngineCore(EngineConfig.from_dict({"model": {"path": str(path)}, "device": "cpu"}), False)


def _record_threads(core: EngineCore) -> list[int]:
    """torch's thread count at each step, as the step loop sees it."""
    seen: list[int] = []
    step = core.step

    def recorded():
        seen.append(torch.get_num_threads())
        return step()

    core.step = recorded
    return seen


async def _one_request(engine: AsyncEngine) -> None:
    req = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    async for _ in engine.generate(req):
        pass


def test_a_loop_on_another_thread_steps_with_one_torch_thread_and_restores_the_count(tmp_path):
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        core = _core(tmp_path)  # loaded here
        seen = _record_threads(core)
        engine = AsyncEngine(core)  # its loop on a thread of its own
        asyncio.run(_one_request(engine))
        engine.shutdown()
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_a_loop_on_the_loading_thread_keeps_the_configured_count(tmp_path):
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        core = _core(tmp_path)
        seen = _record_threads(core)
        engine = AsyncEngine(core, start_loop=False)
        def client_side():
            started = threading.Event()
            while not engine.is_alive:  # the loop is running before the request goes in
                started.wait(0.01)
            asyncio.run(_one_request(engine))
            engine.shutdown()

        client = threading.Thread(target=client_side)
        client.start()
        engine.run_loop()  # here, where the model was loaded (the server's main thread does this)
        client.join(10)
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(saved)
