"""Decode graphs' static batch (engine/cuda_graphs.py) against the eager step, on a CPU: nothing is
captured here, but the staging, the int64 widening, the padding to a bucket and the spare KV block are the
same code a GPU replays. The attention kernels run under the interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.cuda_graphs import DecodeGraphs, buckets_for
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.layers.attention import KVCache, kv_cache_dtype

BLOCK = 16
POISON = 1e3


def test_buckets_stop_at_the_first_that_holds_max_seqs() -> None:
    assert buckets_for(1) == (1,)
    assert buckets_for(3) == (1, 2, 4)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_for(1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_kv_cache_type_follows_the_setting_and_the_device() -> None:
    cpu = torch.device("cpu")
    assert kv_cache_dtype("auto", cpu) == torch.float32
    assert kv_cache_dtype("float16", cpu) == torch.float16
    assert kv_cache_dtype("bfloat16", cpu) == torch.bfloat16


@pytest.fixture(scope="module")
def core(gguf_factory, tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path = gguf_factory.write_tiny_gguf(tmp_path_factory.mktemp("graphs") / "tiny.gguf", gguf_factory.TinySpec())
    # f32 products: the int4 CPU kernel's bf16 activations would turn the Triton attention's last-bit
    # differences from the torch path's (the eager step's) into a visible one now and then
    cfg = {"model": {"path": str(path)}, "cache": {"context_size": 256, "block_size": BLOCK},
           "scheduler": {"max_num_seqs": 4}, "device": "cpu", "kernels": {"cpu_int4": False}}
    return EngineCore(EngineConfig.from_dict(cfg), show_progress=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton attention "
                    "kernels, which only the interpreter takes; on a GPU the replay test below covers it")
@pytest.mark.parametrize("lengths", [[5, 17, 33], [40], [3, 16, 1, 9]], ids=["padded-3-of-4", "one", "full-4"])
def test_static_decode_batch_equals_the_eager_step(core: EngineCore, lengths: list[int]) -> None:
    worker = core.runner.executor.worker
    gen = torch.Generator().manual_seed(len(lengths))
    vocab = core.arch.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + 1) // BLOCK)) for n in lengths]
    try:
        worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * len(lengths), BLOCK))
        nxt = torch.randint(0, vocab, (len(lengths),), generator=gen).tolist()
        plan = StepPlan([(b, n, [t]) for b, n, t in zip(blocks, lengths, nxt, strict=True)], [False] * len(lengths), BLOCK)
        # the graphs' cache: the same KV plus a spare block, poisoned, that only padded rows may touch
        cache = worker.cache
        spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                        cache.k.device, spare=BLOCK)
        for mine, theirs in ((spare.k, cache.k), (spare.v, cache.v)):
            mine[:, : cache.num_slots] = theirs
            mine[:, cache.num_slots :] = float("nan")
        graphs = DecodeGraphs(worker.model, spare, 4, core.max_model_len, BLOCK, torch.device("cpu"))
        static = graphs.run(plan.seqs).clone()
        # the same step with its tokens given on the device (async decode) over placeholder ids: the same
        # logits (it rewrites the same k/v into the same slots)
        ahead = graphs.run([(b, n, [0]) for b, n, _ in plan.seqs], input_ids=torch.tensor(nxt))
        assert torch.equal(ahead, static)
        eager = worker.run(plan)
        assert static.shape == eager.shape == (len(lengths), vocab)
        assert rel(static, eager) < 1e-4
        # every sequence's new k/v landed in its own slot, and nothing else in the pool changed
        assert rel(spare.k[:, : cache.num_slots], cache.k) < 1e-6 and rel(spare.v[:, : cache.num_slots], cache.v) < 1e-6
        # padded rows (a batch smaller than its bucket) write to the spare block, and only there
        bucket = next(b for b in graphs.buckets if b >= len(lengths))
        assert bool(torch.isfinite(spare.k[:, cache.num_slots :]).any()) == (len(lengths) < bucket)
    finally:
        for b in blocks:
            core.pool.free(b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton attention "
                    "kernels, which only the interpreter takes; on a GPU the replay test below covers it")
@pytest.mark.parametrize("case", [
    ([5, 17, 33], [5, 1, 3], [True, False, True]),  # a bucket of 4, one padded sequence, one decode row
    ([14], [5], [True]),  # the guesses cross a block boundary; no padded row
    ([3, 16, 1, 12], [2, 4, 5, 1], [True, True, False, False]),  # the last one's padded rows pass its blocks  # full; a short chunk wants only its last row
], ids=["padded-3-of-4", "one-across-blocks", "full-4"])
def test_static_verify_batch_equals_the_eager_step(core: EngineCore, case) -> None:
    """Verify graphs (R = 5 rows a sequence): a step of sequences bringing 1 to 5 tokens each, with the
    logits of every row or of the last, equals the eager step; padded rows write to the spare block only,
    and no real row sees a key there (a poison of 1e3 would show)."""
    lengths, counts, every = case
    R = 5
    worker = core.runner.executor.worker
    gen = torch.Generator().manual_seed(sum(lengths))
    vocab = core.arch.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + c) // BLOCK)) for n, c in zip(lengths, counts, strict=True)]
    try:
        worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * len(lengths), BLOCK))
        nxt = [torch.randint(0, vocab, (c,), generator=gen).tolist() for c in counts]
        plan = StepPlan([(b, n, t) for b, n, t in zip(blocks, lengths, nxt, strict=True)], every, BLOCK)
        cache = worker.cache
        spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                        cache.k.device, spare=BLOCK)
        for mine, theirs in ((spare.k, cache.k), (spare.v, cache.v)):
            mine[:, : cache.num_slots] = theirs
            # finite: a verify row's last key tile may hold padded rows' keys, masked (times 0), which a NaN
            # would poison; every key the graphs write is finite, so the spare block never holds one
            mine[:, cache.num_slots :] = POISON
        graphs = DecodeGraphs(worker.model, spare, 4, core.max_model_len, BLOCK, torch.device("cpu"), rows=R)
        assert graphs.fits(plan.seqs, plan.all_logits)
        static = graphs.run(plan.seqs, all_logits=plan.all_logits).clone()
        eager = worker.run(plan)
        wanted = sum(c if e else 1 for c, e in zip(counts, every, strict=True))
        assert static.shape == eager.shape == (wanted, vocab)
        assert rel(static, eager) < 1e-4
        assert rel(spare.k[:, : cache.num_slots], cache.k) < 1e-6 and rel(spare.v[:, : cache.num_slots], cache.v) < 1e-6
        # padded rows (short sequences, or a batch smaller than its bucket) write to the spare block, and only there
        bucket = next(b for b in graphs.buckets if b >= len(lengths))
        padded = len(lengths) < bucket or min(counts) < R
        assert bool((spare.k[:, cache.num_slots :] != POISON).any()) == padded
    finally:
        for b in blocks:
            core.pool.free(b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton attention "
                    "kernels, which only the interpreter takes; on a GPU the replay tests cover it")
def test_a_smaller_verify_step_after_a_larger_gathers_only_its_own_rows(core: EngineCore) -> None:
    """A step of 4 sequences wanting 10 logits rows, then one of a sequence wanting its last row: the graph
    gathers logits rows over its whole bucket, so the second step's unused entries must name rows of its
    own bucket (left from the first step they named rows 5-8, past the 5 rows it has: an out-of-range
    gather, a device-side assert on a GPU), and its logits equal the eager step's."""
    R = 5
    worker = core.runner.executor.worker
    gen = torch.Generator().manual_seed(4)
    vocab = core.arch.vocab_size
    lengths, counts = [3, 16, 1, 12], [2, 4, 5, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + c + 2) // BLOCK)) for n, c in zip(lengths, counts, strict=True)]
    try:
        worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 4, BLOCK))
        cache = worker.cache
        spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                        cache.k.device, spare=BLOCK)
        spare.k[:, : cache.num_slots], spare.v[:, : cache.num_slots] = cache.k, cache.v
        graphs = DecodeGraphs(worker.model, spare, 4, core.max_model_len, BLOCK, torch.device("cpu"), rows=R)
        nxt = [torch.randint(0, vocab, (c,), generator=gen).tolist() for c in counts]
        first = StepPlan([(b, n, t) for b, n, t in zip(blocks, lengths, nxt, strict=True)], [True, True, False, False],
                         BLOCK)
        assert graphs.run(first.seqs, all_logits=first.all_logits).shape == (2 + 4 + 1 + 1, vocab)
        worker.run(first)  # the same keys in the worker's own cache
        second = StepPlan([(blocks[1], lengths[1] + counts[1], [7, 8])], [False], BLOCK)
        static = graphs.run(second.seqs, all_logits=second.all_logits).clone()
        assert rel(static, worker.run(second)) < 1e-4
    finally:
        for b in blocks:
            core.pool.free(b)


def test_verify_graphs_fit_up_to_r_tokens_and_stop_at_max_rows(core: EngineCore) -> None:
    worker = core.runner.executor.worker
    cache = KVCache(2, 64, 2, 64, torch.float32, torch.device("cpu"), spare=BLOCK)
    graphs = DecodeGraphs(worker.model, cache, 64, core.max_model_len, BLOCK, torch.device("cpu"), rows=5, max_rows=40)
    assert graphs.buckets == (1, 2, 4, 8)  # 16 x 5 rows would pass 40
    assert graphs.fits([([0], 3, [1, 2, 3, 4, 5]), ([1], 0, [2])], [True, False])
    assert not graphs.fits([([0], 3, [1] * 6)], [True])  # more tokens than rows
    assert not graphs.fits([([i], 0, [1]) for i in range(9)], [False] * 9)  # more than the largest bucket
    assert not graphs.fits([([0], core.max_model_len - 2, [1, 2, 3])], [True])  # past the context


def test_only_one_token_decode_steps_fit(core: EngineCore) -> None:
    worker = core.runner.executor.worker
    graphs = DecodeGraphs(worker.model, KVCache(2, 64, 2, 64, torch.float32, torch.device("cpu"), spare=BLOCK),
                          4, core.max_model_len, BLOCK, torch.device("cpu"))
    assert graphs.fits([([0], 3, [1]), ([1], 0, [2])], [False, False])
    assert not graphs.fits([([0], 3, [1, 2])], [False])  # a chunk
    assert not graphs.fits([([0], 3, [1])], [True])  # prompt logprobs want every row
    assert not graphs.fits([([i], 0, [1]) for i in range(5)], [False] * 5)  # more than the largest bucket
    with pytest.raises(ValueError, match="spare KV block"):
        DecodeGraphs(worker.model, KVCache(2, 64, 2, 64, torch.float32, torch.device("cpu")), 4, 256, BLOCK,
                     torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU")
def test_replayed_graphs_equal_eager_decode_on_gpu(gguf_factory, tmp_path: Path) -> None:
    """Captured graphs against the same engine with its graphs set aside: logits of a padded decode step,
    then 16 greedy tokens of three concurrent streams, with async decode (the default here) and without."""
    path = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec())
    cfg = {"model": {"path": str(path)}, "cache": {"context_size": 256, "block_size": BLOCK},
           "scheduler": {"max_num_seqs": 4}, "device": "cuda"}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    worker = core.runner.executor.worker
    graphs = worker.graphs
    assert graphs is not None and set(graphs.graphs) == {1, 2, 4}
    assert worker.cache.k.dtype == kv_cache_dtype("auto", torch.device("cuda")) != torch.float32

    def greedy(prompts: list[list[int]]) -> list[list[int]]:
        from vegaserve.engine.request import GenerateRequest, SamplingParams

        reqs = [GenerateRequest(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in prompts]
        for r in reqs:
            core.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while core.has_work:
            for o in core.step():
                out[o.request_id].extend(o.token_ids)
        return [out[r.request_id] for r in reqs]

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, core.arch.vocab_size, (n,), generator=gen).tolist() for n in (5, 19, 40)]
    blocks = [core.pool.allocate(-(-(len(p) + 1) // BLOCK)) for p in prompts]
    worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, BLOCK))
    plan = StepPlan([(b, len(p), [7]) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, BLOCK)
    replayed = worker.run(plan).clone()
    worker.graphs = None
    eager = worker.run(plan)
    assert rel(replayed, eager) < 1e-4
    for b in blocks:
        core.pool.free(b)
    eager_tokens = greedy(prompts)
    worker.graphs = graphs
    assert core.async_decode  # the default on a GPU: the replays above ran on device-side tokens
    assert greedy(prompts) == eager_tokens
    core.async_decode = False
    assert greedy(prompts) == eager_tokens




def test_under_tensor_parallelism_only_buckets_the_peer_write_allreduce_takes_are_captured() -> None:
    """The vendor AllReduce (NCCL / RCCL, gloo) runs eagerly: a bucket whose AllReduce of [rows, hidden] f32
    would pass the peer-write kernels' size gate, or a group without them, gets no graph."""
    from types import SimpleNamespace

    from vegaserve.engine.cuda_graphs import graph_buckets
    from vegaserve.engine.distributed.allreduce_policy import AllReduceSwitches
    from vegaserve.engine.distributed.communicator import TorchCommunicator
    from vegaserve.engine.distributed.topology import Topology

    comm = TorchCommunicator.__new__(TorchCommunicator)  # the policy only: no process group
    comm.topo, comm.rank, comm.switches = Topology(2, 1), 0, AllReduceSwitches(custom=True)
    comm.custom = SimpleNamespace(max_bytes=512 * 1024)
    model = SimpleNamespace(comm=comm, cfg=SimpleNamespace(hidden_size=4096))
    assert graph_buckets(model, 256) == (1, 2, 4, 8, 16, 32)  # 32 x 4096 x 4 bytes = the gate
    assert graph_buckets(model, 256, rows=5) == (1, 2, 4)
    assert graph_buckets(model, 256, rows=40) == ()
    comm.custom = None  # refused at start, or off
    assert graph_buckets(model, 256) == ()
    comm.topo = Topology(1, 1)
    assert graph_buckets(model, 256) == buckets_for(256)
