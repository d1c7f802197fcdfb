"""Recurrent state in the engine (hybrid models): each running sequence holds a state slot beside its KV
blocks; admission needs one, preemption, abort and finish give it back; a prompt's chunks carry the state
from step to step; sequences batched together (prompt chunks beside decodes) each see only their own state;
the slot reaches every rank of a pipeline; a decode graph's static batch stages it; speculative decoding rolls
it back to the guesses kept; tensor-parallel lanes each hold their share of the heads and of the state. Also
what is refused: splits the heads cannot take, and files whose layer pattern or state sizes disagree (named
by layer). Models: the converted tiny ones of tests/data/hybrid."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError
from vegaserve.engine.kv_cache import BlockPool
from vegaserve.engine.request import ContextLengthError, GenerateRequest, SamplingParams
from vegaserve.engine.scheduler import Request, Scheduler, Status
from vegaserve.engine.state_pool import StatePool

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid"


def _side_by_side(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
                  margins: list[list[float]] | None = None) -> list[list[int]]:
    """Each prompt's generated tokens, the requests added together and stepped until all are done; with
    `margins` (params asking 2 logprobs), each token's top-1/top-2 logprob margin appended per prompt."""
    reqs = [GenerateRequest(list(p), params) for p in prompts]
    for r in reqs:
        core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    gaps: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while core.has_work:
        for out in core.step():
            got[out.request_id].extend(out.token_ids)
            gaps[out.request_id].extend(lp.top[0][1] - lp.top[1][1] for lp in out.logprobs or ())
    if margins is not None:
        margins.extend(gaps[r.request_id] for r in reqs)
    return [got[r.request_id] for r in reqs]


def _req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


# -- the pool and the scheduler (pure logic) ---------------------------------------------------------------

def test_the_state_pool_hands_each_slot_out_once_and_refuses_a_double_free():
    pool = StatePool(2)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError, match="all 2 recurrent-state slots are held"):
        pool.allocate()
    pool.free(a)
    with pytest.raises(ValueError, match=f"state slot {a} is not held"):
        pool.free(a)
    assert pool.allocate() == a


def test_admission_waits_for_a_state_slot_and_finish_and_abort_give_it_back():
    states = StatePool(2)
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=4, token_budget=512, states=states)
    reqs = [_req(f"r{i}", 20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert [r.status for r in reqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]  # two slots, not four seats
    assert {reqs[0].state_slot, reqs[1].state_slot} == {0, 1} and reqs[2].state_slot is None
    sched.finish(reqs[0])  # finished or aborted alike
    assert reqs[0].state_slot is None and states.num_free == 1
    sched.schedule()
    assert reqs[2].status is Status.RUNNING and reqs[2].state_slot is not None
    sched.finish(reqs[1])
    sched.finish(reqs[2])
    sched.finish(reqs[2])  # twice is safe
    assert states.num_free == 2


def test_preemption_gives_the_state_slot_back_and_recomputes_from_token_zero():
    states = StatePool(2)
    blocks = BlockPool(4, 16)  # 64 tokens of KV for two requests that will want 40 each
    sched = Scheduler(blocks, max_num_seqs=2, token_budget=512, states=states)
    first, second = _req("a", 30), _req("b", 30)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert len(batch.seqs) == 2
    for s in batch.seqs:
        s.request.num_computed += len(s.tokens)
        s.request.output_ids.append(7)
    # each now needs a block more for its next tokens; only three fit: the later one is preempted
    for r in (first, second):
        r.output_ids.extend([7] * 4)
    sched.schedule()
    assert first.status is Status.RUNNING and second.status is Status.WAITING
    assert second.state_slot is None and second.num_computed == 0 and states.num_free == 1
    assert sched.num_preemptions == 1



def test_an_aborted_request_gives_its_state_slot_and_blocks_back(converted):
    """Through the engine: a request aborted mid-prompt frees its slot and KV blocks; the other one runs on."""
    core = converted.core(DATA, "qwen3next", scheduler={"max_num_batched_tokens": 16})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    keep, drop = GenerateRequest(list(range(1, 40)), params), GenerateRequest(list(range(2, 60)), params)
    free_blocks = core.pool.num_free
    core.add_request(keep)
    core.add_request(drop)
    core.step()
    assert core.states.num_free == core.states.num_slots - 2
    core.abort(drop.request_id)
    assert core.states.num_free == core.states.num_slots - 1
    while core.has_work:
        core.step()
    assert core.states.num_free == core.states.num_slots and core.pool.num_free == free_blocks


# -- the model's state in steps ----------------------------------------------------------------------------

def test_a_3000_token_prompt_prefilled_in_chunks_of_256_gives_the_logits_of_one_chunk(converted):
    core = converted.core(DATA, "qwen35", cache={"context_size": 4096})
    ids = torch.randint(0, 320, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = core.forward_logits(ids)
    bs = core.pool.block_size
    blocks = core.pool.allocate(-(-len(ids) // bs))
    slot = core.states.allocate()
    chunks = []
    for start in range(0, len(ids), 256):
        piece = ids[start : start + 256]
        end = start + len(piece)
        chunks.append(core.executor.forward(StepPlan([(blocks[: -(-end // bs)], start, piece)], [True], bs, (slot,))))
    chunked = torch.cat(chunks)
    assert chunked.shape == whole.shape == (3000, 320)
    worst = max(converted.rel(chunked[i], whole[i]) for i in range(0, 3000, 7))
    assert worst < 1e-4, worst
    assert converted.rel(chunked, whole) < 1e-4


def test_a_batch_of_eight_mixed_prefill_and_decode_sequences_equals_each_alone(converted):
    """Eight requests of 3 to 150 prompt tokens arrive in two waves under a 64-token budget, so steps mix
    prompt chunks with decodes; each request's tokens and top-5 logprobs equal those of its run alone."""
    lengths = [3, 150, 17, 64, 1, 90, 33, 120]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=5)
    solo_core = converted.core(DATA, "qwen35moe", scheduler={"max_num_seqs": 1})
    alone = []
    for p in prompts:
        outs = solo_core.generate_sync(GenerateRequest(list(p), params))
        alone.append(([t for o in outs for t in o.token_ids], [lp for o in outs for lp in o.logprobs]))
    core = converted.core(DATA, "qwen35moe", scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64})
    kinds: list[set[bool]] = []  # per step: which of (prompt chunk, decode) it held
    schedule = core.scheduler.schedule

    def recording():
        batch = schedule()
        kinds.append({s.start < len(s.request.prompt_ids) for s in batch.seqs})
        return batch

    core.scheduler.schedule = recording
    reqs = [GenerateRequest(list(p), params) for p in prompts]
    got: dict[str, tuple[list, list]] = {r.request_id: ([], []) for r in reqs}
    for wave in (reqs[:4], reqs[4:]):
        for r in wave:
            core.add_request(r)
        for _ in range(6 if wave is reqs[:4] else 100):
            for out in core.step():
                got[out.request_id][0].extend(out.token_ids)
                got[out.request_id][1].extend(out.logprobs)
    mixed = sum(k == {True, False} for k in kinds)
    assert mixed > 0 and not core.has_work
    for r, (tokens, lps) in zip(reqs, alone, strict=True):
        mine_tokens, mine_lps = got[r.request_id]
        assert mine_tokens == tokens
        for a, b in zip(mine_lps, lps, strict=True):
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-4
    assert core.states.num_free == 8


def test_the_state_slot_reaches_every_stage_of_a_pipeline(converted):
    """Two CPU processes (-sm layer): the state slots travel in the broadcast plan, and greedy decoding of
    two requests side by side gives one process's tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 200, 33, 9, 41, 120, 7], [64, 250, 3, 88, 12]]

    def run(core: EngineCore) -> list[list[int]]:
        try:
            return _side_by_side(core, prompts, params)
        finally:
            core.close()

    one = run(converted.core(DATA, "qwen3next"))
    two = run(converted.core(DATA, "qwen3next", parallel={"split_mode": "layer", "n_devices": 2}))
    assert two == one and all(len(t) == 6 for t in one)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton kernels, "
                    "which only the interpreter takes")
def test_a_decode_graphs_static_batch_stages_the_state_slots_and_equals_the_eager_step(converted):
    """engine/cuda_graphs.py's static batch (not captured on a CPU: the same staging run eagerly, through the
    Triton kernels under the interpreter): three sequences in a bucket of four, the padded row on the spare
    KV block and the spare state slot; the logits and every slot's new state equal the eager step's."""
    from vegaserve.engine.cuda_graphs import DecodeGraphs
    from vegaserve.engine.layers.attention import KVCache

    core = converted.core(DATA, "qwen3next")
    worker = core.runner.executor.worker
    bs = core.pool.block_size
    lengths = [5, 17, 1]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + 1) // bs)) for n in lengths]
    slots = (2, 0, 3)
    worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, bs, slots))
    nxt = [11, 12, 13]
    plan = StepPlan([(b, n, [t]) for b, n, t in zip(blocks, lengths, nxt, strict=True)], [False] * 3, bs, slots)
    cache = worker.cache
    spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                    cache.k.device, spare=bs)
    spare.k[:, : cache.num_slots], spare.v[:, : cache.num_slots] = cache.k, cache.v
    spare.state = worker.model.recurrent_state(cache.state.slots, torch.device("cpu"), spare=1,
                                               snapshots=cache.state.snapshots)
    spare.state.conv[:, :-1], spare.state.ssm[:, :-1] = cache.state.conv, cache.state.ssm
    spare.state.conv[:, -1], spare.state.ssm[:, -1] = float("nan"), float("nan")  # only a padded row may go there
    graphs = DecodeGraphs(worker.model, spare, 4, core.max_model_len, bs, torch.device("cpu"))
    static = graphs.run(plan.seqs, state_slots=plan.state_slots).clone()
    eager = worker.run(plan)
    assert converted.rel(static, eager) < 1e-4
    for s in slots:
        assert converted.rel(spare.state.ssm[:, s], cache.state.ssm[:, s]) < 1e-5
        assert converted.rel(spare.state.conv[:, s], cache.state.conv[:, s]) < 1e-6
    assert torch.isfinite(spare.state.ssm[:, -1]).all()  # the padded row started from zeros, not the NaNs



@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels on CPU tensors run under the interpreter only")
@pytest.mark.parametrize("name", ["qwen35", "qwen3next"])
def test_a_prompt_step_through_the_kernels_equals_the_torch_path(converted, name, monkeypatch):
    """One step of three prompts (70, 5 and 130 tokens: chunks of the delta rule crossed and part-filled), then
    one decode step, run once on the torch path and once through the layer's Triton kernels under the
    interpreter (the path a GPU takes: the chunked delta rule for the prompts, token by token for the
    decode): the logits and every slot's state agree."""
    from vegaserve.engine.layers.delta_net import GatedDeltaNet

    gen = torch.Generator().manual_seed(5)
    lengths = [70, 5, 130]
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    slots = (2, 0, 1)

    def run() -> tuple[torch.Tensor, ...]:
        core = converted.core(DATA, name)
        worker, bs = core.runner.executor.worker, core.pool.block_size
        blocks = [core.pool.allocate(-(-(n + 1) // bs)) for n in lengths]
        first = worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [True] * 3, bs,
                                    slots)).clone()
        plan = StepPlan([(b, n, [t]) for b, n, t in zip(blocks, lengths, [7, 8, 9], strict=True)], [False] * 3, bs,
                        slots)
        second = worker.run(plan).clone()
        state = worker.cache.state
        return first, second, state.ssm[:, list(slots)].clone(), state.conv[:, list(slots)].clone()

    torch_path = run()
    monkeypatch.setattr(GatedDeltaNet, "on_kernels", staticmethod(lambda x, batch: True))
    kernels = run()
    for what, a, b in zip(("prompt logits", "decode logits", "delta state", "conv state"), torch_path, kernels,
                          strict=True):
        assert converted.rel(b, a) < 1e-4, what


def test_a_step_without_state_slots_is_refused(converted):
    """A plan that names no state slot would read some other sequence's state: refused, not computed."""
    core = converted.core(DATA, "qwen3next")
    blocks = core.pool.allocate(1)
    with pytest.raises(ValueError, match="needs every sequence's state slot"):
        core.executor.forward(StepPlan([(blocks, 0, [1, 2, 3])], [False], core.pool.block_size))


# -- refused ------------------------------------------------------------------------------------------------

class _Oracle:
    """A proposer that knows the plain run's tokens and guesses them with one wrong token at a position that
    moves from step to step, so that verification keeps 0, 1, 2 ... guesses: every partial roll back."""

    def __init__(self, plain: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.plain, self.vocab, self.turn = plain, vocab, 0

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks, strict=True):
            truth = self.plain[tuple(r.prompt_ids)][len(r.output_ids) : len(r.output_ids) + k]
            self.turn += 1
            bad = self.turn % (k + 1)  # k + 1: no wrong token, every guess kept
            out.append([(t + 1) % self.vocab if j == bad else t for j, t in enumerate(truth)])
        return out

    def forget(self, request_id):
        pass

    def close(self):
        pass


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_ON_GPU)])
@pytest.mark.parametrize("name", ["qwen35", "qwen35moe", "qwen3next"])
def test_speculative_decoding_on_a_hybrid_model_rolls_the_state_back_to_the_kept_guesses(converted, name, device,
                                                                                         tmp_path):
    """Greedy, three requests side by side with up to 4 guesses a step from a proposer whose first wrong guess
    moves through every position: the outputs equal plain decoding's token for token, each rejected guess
    taken out of the recurrent state (rolled back to the kept rows from its backup and the rows' inputs), and
    every state slot and KV block given back. On a GPU the verify rows take the prefill kernels (attention,
    conv) where plain decoding takes the decode ones, and the roll back the delta rule's kernel."""
    from vegaserve.engine.layers import delta_net

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(core: EngineCore, margins: list[list[float]] | None = None) -> list[list[int]]:
        return _side_by_side(core, prompts, params, margins)

    margins: list[list[float]] = []
    plain = run(converted.exact_core(DATA, name, device, tmp_path), margins)
    # on a GPU a verify row and a decode row take different kernels, whose f32 sums differ in the last bits:
    # tokens are compared as far as plain decoding's top-1/top-2 margin stays over the f32 bound of the GPU
    # tests against transformers (converted_models.GPU_TOLERANCES); on the CPU, all
    close = converted.GPU_TOLERANCES["float32"][2] if device == "cuda" else -1.0
    clear = [next((j for j, m in enumerate(row) if m <= close), len(row)) for row in margins]
    core = converted.exact_core(DATA, name, device, tmp_path, speculative={"type": "ngram", "draft_max": 4})
    core.spec.proposer = _Oracle({tuple(p): t for p, t in zip(prompts, plain, strict=True)}, core.arch.vocab_size)
    kept: list[int] = []
    roll_back = delta_net.RecurrentState.roll_back

    def spy(self, saved, keep):
        kept.extend(m for _, m in keep)
        return roll_back(self, saved, keep)

    delta_net.RecurrentState.roll_back = spy
    try:
        got = run(core)
        print(f"{name} on {device}: tokens compared {clear} of {[len(b) for b in plain]}")
        for i, (a, b) in enumerate(zip(got, plain, strict=True)):
            at = next((j for j, (x, y) in enumerate(zip(a[: clear[i]], b, strict=False)) if x != y), None)
            assert at is None, f"request {i} parts from plain decoding at token {at}: {a[at:]} against {b[at:]}"
        assert sum(clear) >= 20, f"plain decoding's margins leave {clear} tokens to compare"
    finally:
        delta_net.RecurrentState.roll_back = roll_back
    st = core.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert set(kept) == {1, 2, 3, 4}  # rows kept: the last token and 0 .. 3 guesses
    assert core.states.num_free == 4 and core.pool.num_referenced == 0


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe", "qwen3next"])
def test_tensor_parallel_lanes_give_one_processs_logits_tokens_and_speculation(converted, name):
    """-sm tensor over two CPU processes (gloo): each lane holds one of the two key heads and the value heads
    reading it (qwen35/qwen35moe tiled: value heads 0 and 2 on lane 0, 1 and 3 on lane 1; qwen3next grouped,
    its [beta, alpha] rows interleaved per key head), its attention head, its share of the feed-forward or
    experts, and its share of each sequence's state. A prompt's logits are one process's within 1e-5, and
    greedy decoding (plain, then with guesses rolled back on every lane) gives its tokens."""
    prompt = [5, 17, 200, 33, 9, 41, 120, 7, 64, 250, 3, 88, 12]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(core: EngineCore, oracle: dict | None = None) -> tuple[torch.Tensor, list[int]]:
        try:
            if oracle is not None:
                core.spec.proposer = _Oracle(oracle, core.arch.vocab_size)
            logits = core.forward_logits(prompt)
            outs = core.generate_sync(GenerateRequest(list(prompt), params))
            return logits, [t for o in outs for t in o.token_ids]
        finally:
            core.close()

    tp = {"split_mode": "tensor", "n_devices": 2}
    one_logits, one_tokens = run(converted.core(DATA, name))
    two_logits, two_tokens = run(converted.core(DATA, name, parallel=tp))
    assert converted.rel(two_logits, one_logits) < 1e-5
    assert two_tokens == one_tokens and len(one_tokens) == 12
    _, guessed = run(converted.core(DATA, name, parallel=tp, speculative={"type": "ngram", "draft_max": 4}),
                     oracle={tuple(prompt): one_tokens})
    assert guessed == one_tokens


def test_a_tensor_split_the_linear_attention_heads_cannot_take_is_one_line(converted):
    """qwen35's tiny model has two key heads: four lanes cannot each take a share."""
    with pytest.raises(ConfigError, match="2 key and 4 value heads do not divide over 4 tensor-parallel devices"):
        converted.core(DATA, "qwen35", parallel={"split_mode": "tensor", "n_devices": 4})


def test_a_hybrid_draft_model_is_refused():
    """qwen3next's tiny file shares tests/data/moe's 320-token vocabulary, so only its architecture stops it."""
    target = Path(__file__).resolve().parents[1] / "data" / "moe" / "qwen3moe-f32.gguf"
    cfg = {"model": {"path": str(target)}, "cache": {"context_size": 256}, "device": "cpu",
           "speculative": {"type": "draft", "draft_model": str(DATA / "qwen3next-f32.gguf")}}
    with pytest.raises(ConfigError, match="a hybrid linear-attention draft model \\(qwen3next\\) is not supported yet"):
        EngineCore(EngineConfig.from_dict(cfg), show_progress=False)


def _plan(g: GGUFFile, limit: float, slots: int = 512, context: int = 256, device: str = "cpu", **sections):
    """plan_launch for 4 sequences of `context` tokens and a cache of `slots` on a device of `limit` bytes."""
    from vegaserve.engine.launch import plan_launch
    from vegaserve.engine.models.arch_config import arch_config_from_gguf

    arch = arch_config_from_gguf(g.metadata, set(g.tensors), str(g.path))
    cfg = EngineConfig.from_dict({"model": {"path": str(g.path)}, "scheduler": {"max_num_seqs": 4}, "device": device,
                                  "parallel": {"device_memory_gib": limit / 2**30}, **sections})
    return plan_launch(cfg, g, arch, context, slots, torch.device(device))


def _qwen35_bytes(g: GGUFFile, slots: int, draft: bool = False, saved: int = 4) -> int:
    """qwen35's file: 4 blocks (linear, full, linear, MTP); the KV cache covers the one trunk attention layer,
    and each of max_num_seqs (4) sequences holds two layers' conv rows and delta-rule heads, as does each of
    the `saved` prefix-caching snapshots (default: one a sequence, at least 4). With `draft`, the file
    drafting for itself: its weights and cache twice, and the target's state kept twice for verify steps."""
    weights = sum(t.n_bytes for n, t in g.tensors.items() if n.startswith("blk.") or n == "token_embd.weight")
    kv = 2 * 1 * slots * 1 * 32 * 4  # k and v, one layer, one KV head of 32, f32
    state = 2 * 4 * ((4 - 1) * 128 + 4 * 16 * 16)  # 2 layers: 3 conv rows of 128 channels, 4 heads of 16 x 16
    return weights + kv + (4 + saved) * state + (weights + kv + 2 * 4 * state if draft else 0)


def test_the_memory_check_counts_kv_for_attention_layers_only_and_every_sequences_state():
    """With the cache's size given (-c), a plan one byte over the device fails, naming what it holds (the
    prefix-caching snapshots as --prefix-states sets them: one a sequence, at least 4, by default); a draft
    model's weights and cache count on the first device; on a GPU, the prompt scratches too (the largest of
    these four blocks' matrices together, bf16: the bound launch.scratch_elements gives and the emulated GPU
    path's checks hold the method to)."""
    g = GGUFFile(DATA / "qwen35-f32.gguf")
    need = _qwen35_bytes(g, 512)
    _plan(g, need + 0.5, cache={"context_size": 128})
    with pytest.raises(ConfigError, match="KV cache for 512 tokens and recurrent state for 4 sequences and 4 saved "
                       "for prefix caching.*or fewer saved states \\(--prefix-states\\)"):
        _plan(g, need - 1, cache={"context_size": 128})
    for saved in (1, 0):  # --prefix-states N
        need = _qwen35_bytes(g, 512, saved=saved)
        _plan(g, need + 0.5, cache={"context_size": 128, "prefix_states": saved})
        with pytest.raises(ConfigError, match="for 4 sequences and 1 saved" if saved else "for 4 sequences\\),"):
            _plan(g, need - 1, cache={"context_size": 128, "prefix_states": saved})
    need = _qwen35_bytes(g, 512)
    scratch = 2 * max(sum(math.prod(t.shape) for n, t in g.tensors.items()
                          if n.startswith(f"blk.{i}.") and len(t.shape) == 2) for i in range(4))
    gpu = {"device": "cuda", "cache": {"context_size": 128, "kv_dtype": "float32"}}
    _plan(g, need + scratch + 0.5, **gpu)
    with pytest.raises(ConfigError, match="KV cache for 512 tokens"):
        _plan(g, need + scratch - 1, **gpu)
    draft = {"type": "draft", "draft_model": str(g.path)}
    need = _qwen35_bytes(g, 512, draft=True)
    _plan(g, need + 0.5, cache={"context_size": 128}, speculative=draft)
    with pytest.raises(ConfigError, match="for 4 sequences and 4 saved for prefix caching, with the draft model's"):
        _plan(g, need - 1, cache={"context_size": 128}, speculative=draft)


@pytest.mark.parametrize("draft", [False, True], ids=["alone", "with-a-draft"])
def test_a_cache_of_the_automatic_size_shrinks_to_fit_the_device(draft):
    """Neither -c nor a block count given: a cache that does not fit shrinks to the whole blocks that fit in
    AUTO_FILL of the device (a draft model's weights and cache counted), and the context a sequence may reach
    with it; where not a block a sequence fits, the plan fails as with -c."""
    from vegaserve.engine.launch import AUTO_FILL

    g = GGUFFile(DATA / "qwen35-f32.gguf")
    sections = {"speculative": {"type": "draft", "draft_model": str(g.path)}} if draft else {}
    limit = _qwen35_bytes(g, 512, draft) - 1
    launch = _plan(g, limit, **sections)
    blocks = launch.num_slots // 16
    assert launch.num_slots % 16 == 0 and launch.max_model_len == min(256, launch.num_slots)
    assert _qwen35_bytes(g, blocks * 16, draft) <= AUTO_FILL * limit < _qwen35_bytes(g, (blocks + 1) * 16, draft)
    assert 4 <= blocks < 32
    small = _qwen35_bytes(g, 16 * 4, draft) / AUTO_FILL
    assert _plan(g, small + 1, slots=4096, context=1024, **sections).max_model_len == 64  # 4 blocks: one a sequence
    with pytest.raises(ConfigError, match="KV cache for 4096 tokens"):  # three blocks' worth: fewer than sequences
        _plan(g, small - 16 * 256 * (2 if draft else 1), slots=4096, context=1024, **sections)


def test_the_engine_serves_from_a_shrunk_cache_with_the_context_it_allows():
    """The model's 4,096 tokens for each of 4 sequences do not fit a device of 40 blocks' room: the engine
    starts with those 640 tokens, a prompt over them is refused and one within is served."""
    g = GGUFFile(DATA / "qwen35-f32.gguf")
    from vegaserve.engine.launch import AUTO_FILL

    limit = (_qwen35_bytes(g, 40 * 16) + 100) / AUTO_FILL
    core = EngineCore(EngineConfig.from_dict({
        "model": {"path": str(g.path)}, "scheduler": {"max_num_seqs": 4}, "device": "cpu",
        "parallel": {"device_memory_gib": limit / 2**30}}), show_progress=False)
    try:
        assert (core.max_model_len, core.pool.num_blocks) == (640, 40)
        with pytest.raises(ContextLengthError, match="the context holds 640"):
            core.generate_sync(GenerateRequest([1] * 700, SamplingParams(max_tokens=1)))
        out = [t for o in core.generate_sync(GenerateRequest([1] * 600, SamplingParams(max_tokens=8, ignore_eos=True)))
               for t in o.token_ids]
        assert len(out) == 8
    finally:
        core.close()


def _rewrite(src: Path, dst: Path, metadata: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a GGUF with some metadata replaced (key -> (value, type)) and some tensors left out."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch=arch)
    metadata = metadata or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype = metadata.pop(name, (f.contents(), f.types[0]))
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, vtype, sub)
    for name, (value, vtype) in metadata.items():
        w.add_key_value(name, value, vtype, gguf.GGUFValueType.BOOL if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


ARRAY, U32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("change, drop, message", [
    ({"qwen35.attention.recurrent_layers": ([True, True, True, False], ARRAY)}, (),
     r"layer 1 is linear attention by qwen35.attention.recurrent_layers, but blk.1.ssm_conv1d.weight, .* are missing "
     r"\(it has attn_q: a full-attention layer\)"),
    ({"qwen35.attention.recurrent_layers": ([True, False, False, False], ARRAY)}, (),
     r"layer 2 is a full-attention layer by qwen35.attention.recurrent_layers, but blk.2.attn_q.weight, .* missing"),
    ({"qwen35.attention.recurrent_layers": ([True, False, True], ARRAY)}, (),
     r"qwen35.attention.recurrent_layers has 3 entries for 4 layers"),
    ({"qwen35.attention.recurrent_layers": ([True, False, True, True], ARRAY)}, (),
     r"layer 3 is a NextN \(MTP\) block but qwen35.attention.recurrent_layers marks it linear attention"),
    ({}, ("blk.2.ssm_norm.weight",), r"layer 2 is linear attention .* blk.2.ssm_norm.weight is missing"),
    ({"qwen35.ssm.state_size": (32, U32)}, (),
     r"qwen35.ssm.inner_size 64 is not 4 value heads of 32 \(qwen35.ssm.state_size\)"),
    ({"qwen35.ssm.group_count": (3, U32)}, (), r"4 value heads \(qwen35.ssm.time_step_rank\) do not share 3 key heads"),
    ({"qwen35.ssm.conv_kernel": (5, U32)}, (),
     r"tensor blk.0.ssm_conv1d.weight \(F32\) has shape \[128, 4\], the model expects \[128, 5\]"),
    ({"qwen35.ssm.group_count": (1, U32)}, (),
     r"tensor blk.0.attn_qkv.weight \(F32\) has shape \[128, 64\], the model expects \[96, 64\]"),
], ids=["linear-layer-without-its-tensors", "attention-layer-without-its-tensors", "pattern-length", "nextn-marked-linear",
        "a-missing-state-tensor", "state-size-vs-inner-size", "heads-do-not-divide", "conv-kernel-vs-tensor",
        "key-heads-vs-tensor"])
def test_an_inconsistent_hybrid_gguf_is_refused_at_load_naming_the_layer(tmp_path, change, drop, message):
    path = _rewrite(DATA / "qwen35-f32.gguf", tmp_path / "bad.gguf", dict(change), drop)
    with pytest.raises(ModelLoadError, match=message):
        _core_from(path)


def _core_from(path: Path) -> None:
    from vegaserve.engine.models.registry import load_model

    load_model(GGUFFile(path), torch.device("cpu"), 64, show_progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel on CPU tensors runs under the interpreter only")
def test_the_roll_back_kernel_path_equals_the_torch_path():
    """RecurrentState.roll_back over two layers and two sequences (2 of 4 and 3 of 3 rows kept, grouped value
    heads): the kernel path (every (layer, sequence) one sequence of delta_rule_recurrent's flat batch over the
    stacked states) gives the torch path's conv rows exactly and its delta-rule state within 1e-5; the other
    slots and the backups are untouched."""
    from types import SimpleNamespace

    from vegaserve.engine.layers.delta_net import RecurrentState, SavedRows

    cfg = SimpleNamespace(conv_kernel=4, conv_dim=40, v_heads=4, head_dim=8, tiled=False)
    L, HK = 2, 2
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    states = []
    for _ in range(2):
        st = RecurrentState(L, 3, cfg, torch.device("cpu"), spare=1, backups=True)
        states.append(st)
    for t in (states[0].conv, states[0].ssm):
        t.copy_(rnd(*t.shape))
    states[1].conv.copy_(states[0].conv)
    states[1].ssm.copy_(states[0].ssm)
    k = torch.nn.functional.normalize(rnd(L, 7, HK, 8), dim=-1)
    saved = SavedRows([(1, 0, 4), (2, 4, 3)], rnd(L, 7, 40), k, rnd(L, 7, 4, 8), -rnd(L, 7, 4).abs(),
                      torch.sigmoid(rnd(L, 7, 4)))
    keep = [(1, 2), (2, 3)]
    before = [t.clone() for t in (states[0].conv, states[0].ssm)]
    states[0].roll_back(saved, keep, kernel=False)
    states[1].roll_back(saved, keep, kernel=True)
    assert torch.equal(states[1].conv, states[0].conv)
    assert float((states[1].ssm - states[0].ssm).abs().max()) < 1e-5
    untouched = [0, 4, 5, 6]  # slot 0, the backups 3..5 and the spare
    for a, b in zip((states[0].conv, states[0].ssm), before, strict=True):
        assert torch.equal(a[:, untouched], b[:, untouched])
    # slot 1's conv rows: its backup's last row, then the first two saved rows
    assert torch.equal(states[0].conv[:, 1], torch.cat([before[0][:, 4, 2:], saved.mixed[:, :2]], dim=1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_ON_GPU)])
def test_draft_mtp_drafts_with_the_models_mtp_block_and_changes_no_output(converted, device, tmp_path):
    """qwen35's tiny file ends with an MTP block: greedy output with draft-mtp (2 guesses a step) equals
    plain decoding's token for token (on a GPU as far as the margins allow, as the test above), with guesses
    made and verified (random weights: few kept), and every state slot and KV block given back."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (9, 40, 3)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    margins: list[list[float]] = []
    plain = _side_by_side(converted.exact_core(DATA, "qwen35", device, tmp_path), prompts, params, margins)
    close = converted.GPU_TOLERANCES["float32"][2] if device == "cuda" else -1.0
    clear = [next((j for j, m in enumerate(row) if m <= close), len(row)) for row in margins]
    core = converted.exact_core(DATA, "qwen35", device, tmp_path, speculative={"type": "draft-mtp"})
    got = _side_by_side(core, prompts, params)
    print(f"draft-mtp on {device}: tokens compared {clear} of {[len(b) for b in plain]}")
    assert [a[:n] for a, n in zip(got, clear, strict=True)] == [b[:n] for b, n in zip(plain, clear, strict=True)]
    assert sum(clear) >= 16
    st = core.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens > st.spec_num_drafts  # chains of 2 guesses
    assert core.states.num_free == 4 and core.pool.num_referenced == 0


def test_the_mtp_blocks_first_guess_pairs_each_token_with_the_hidden_state_before_it(converted):
    """The proposer's first guess after a prompt Q, whose greedy token is t, is the MTP block run over
    P = Q + [t] in one batch (row p: token p, the trunk's output-normed hidden state of p - 1, zeros for
    p = 0; each row's own position and KV slot) at its last row: the catch-up, the pairing and the
    positions of the incremental path agree with the whole-sequence computation."""
    from vegaserve.engine.forward_batch import ForwardBatch

    core = converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"})
    worker, model = core.runner.executor.worker, core.runner.executor.worker.model
    head = model.nextn[0]
    seen: list[torch.Tensor] = []
    forward = type(head).forward

    def spy(self, *args):
        out, logits = forward(self, *args)
        seen.append(logits.clone())
        return out, logits

    type(head).forward = spy
    try:
        gen = torch.Generator().manual_seed(11)
        q = torch.randint(0, 320, (21,), generator=gen).tolist()
        outs = core.generate_sync(GenerateRequest(list(q), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        t = outs[0].token_ids[0]
        first = seen[0][-1]  # the first propose call's last row: its first guess
        # the whole sequence at once, in fresh blocks
        p = q + [t]
        bs = core.pool.block_size
        blocks = core.pool.allocate(-(-len(p) // bs))
        plan = StepPlan([(blocks, 0, p)], [True], bs, (0,))
        core.executor.forward(plan)
        hidden = model.hidden.clone()
        h_in = torch.cat([torch.zeros(1, hidden.shape[1]), hidden[:-1]])
        fb = ForwardBatch.build(worker.slots_of(plan), [True], worker.device, bs)
        _, whole = forward(head, model, h_in, worker.cache, fb)
        core.pool.free(blocks)
    finally:
        type(head).forward = forward
    assert converted.rel(first, whole[-1]) < 1e-5
    assert int(first.argmax()) == int(whole[-1].argmax())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton attention "
                    "kernels, which only the interpreter takes; on a GPU the draft-mtp test above replays them")
@pytest.mark.parametrize("rows, counts, dtype", [(1, [1, 1, 1], torch.float32), (3, [3, 1, 2], torch.float32),
                                                 (3, [1, 2, 3], torch.bfloat16)])
def test_an_mtp_graphs_static_batch_equals_the_eager_mtp_step(converted, rows, counts, dtype):
    """engine/cuda_graphs.py's MtpGraphs (not captured on a CPU: the same staging run eagerly): three
    sequences in a bucket of four, each bringing `counts` tokens (rows 3: a catch-up of 1 to 3 tokens, its
    hidden states scattered to the sequences' rows) after a prompt whose MTP KV is written. The output
    hidden states (one a token, in order), the last rows' logits and the MTP layer's KV equal the eager
    step's; padded rows write to the spare block only (a poison of 1e3 would show). Hidden states in another
    type than the graphs' f32 buffer (a guess step's, the block's own output) are converted on the way in."""
    from vegaserve.engine.cuda_graphs import MtpGraphs
    from vegaserve.engine.forward_batch import MtpPlan
    from vegaserve.engine.layers.attention import KVCache

    core = converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"})
    worker = core.runner.executor.worker
    model, cache, bs = worker.model, worker.cache, core.pool.block_size
    hidden = model.cfg.hidden_size
    gen = torch.Generator().manual_seed(rows)
    lengths = [5, 17, 2]
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + c) // bs)) for n, c in zip(lengths, counts, strict=True)]
    first = StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, bs)
    worker.run_mtp(MtpPlan(first, sum(lengths)), torch.randn(sum(lengths), hidden, generator=gen))
    plan = StepPlan([(b, n, torch.randint(0, 320, (c,), generator=gen).tolist())
                     for b, n, c in zip(blocks, lengths, counts, strict=True)], [False] * 3, bs)
    h_in = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    spare = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                    cache.k.device, spare=bs)
    for mine, theirs in ((spare.k, cache.k), (spare.v, cache.v)):
        mine[:, : cache.num_slots] = theirs
        mine[:, cache.num_slots :] = 1e3
    graphs = MtpGraphs(model, model.nextn[0], spare, 4, core.max_model_len, bs, torch.device("cpu"), rows=rows)
    assert graphs.fits(plan.seqs, plan.all_logits)
    out, logits = (t.clone() for t in graphs.run_block(plan.seqs, h_in))
    want_out, want_logits = worker.run_mtp(MtpPlan(plan, len(h_in)), h_in)
    assert out.shape == want_out.shape == (sum(counts), hidden) and logits.shape == want_logits.shape == (3, 320)
    assert converted.rel(out, want_out) < 1e-5 and converted.rel(logits, want_logits) < 1e-5
    assert converted.rel(spare.k[:, : cache.num_slots], cache.k) < 1e-6
    assert converted.rel(spare.v[:, : cache.num_slots], cache.v) < 1e-6
    assert bool((spare.k[:, cache.num_slots :] != 1e3).any())  # the bucket's fourth sequence is padding
    for b in blocks:
        core.pool.free(b)


def test_the_mtp_block_reads_its_tensors_in_llama_cpps_order(converted):
    """NextNHead.forward against its tensors read straight from the GGUF, composed as llama.cpp's qwen35 MTP
    graph: x = eh_proj [enorm(embed(token)); hnorm(h)] (the token's half first), the block, then
    shared_head_norm, and the logits through the tied embedding (the file has no head of its own)."""
    from vegaserve.engine.forward_batch import ForwardBatch

    core = converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"})
    worker = core.runner.executor.worker
    model, head = worker.model, worker.model.nextn[0]
    w = {t.name: torch.from_numpy(np.array(t.data)).float() for t in gguf.GGUFReader(DATA / "qwen35-f32.gguf").tensors}
    eps = 1e-6

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 320, (6,), generator=gen).tolist()
    h = torch.randn(6, 64, generator=gen)
    bs = core.pool.block_size
    blocks = core.pool.allocate(1)
    plan = StepPlan([(blocks, 0, tokens)], [True], bs)
    out, logits = head(model, h, worker.cache, ForwardBatch.build(worker.slots_of(plan), [True], worker.device, bs))
    p = "blk.3.nextn."
    x = torch.cat([rms(w["token_embd.weight"][tokens], w[p + "enorm.weight"]), rms(h, w[p + "hnorm.weight"])], dim=-1)
    fb = ForwardBatch.build(worker.slots_of(plan), [True], worker.device, bs)
    hb, delta = head.block(x @ w[p + "eh_proj.weight"].T, model.rope, worker.cache, fb)
    ref_out = rms(hb + delta, w[p + "shared_head_norm.weight"])
    core.pool.free(blocks)
    assert converted.rel(out, ref_out) < 1e-5
    assert converted.rel(logits, ref_out @ w["token_embd.weight"].T) < 1e-5


@pytest.mark.parametrize(("name", "extra", "says"), [
    ("qwen35moe", {}, "needs an MTP \\(NextN\\) head, and this model has none"),
    ("qwen35", {"parallel": {"split_mode": "layer", "n_devices": 2}}, "draft-mtp over a pipeline .* not supported yet"),
], ids=["no-mtp-block", "pipeline"])
def test_draft_mtp_that_cannot_run_is_one_line_at_start(converted, name, extra, says):
    with pytest.raises(ConfigError, match=says):
        converted.core(DATA, name, speculative={"type": "draft-mtp"}, **extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton kernels, "
                    "which only the interpreter takes")
@pytest.mark.parametrize("name", ["qwen35", "qwen3next"])
def test_a_replayed_verify_step_leaves_the_next_step_what_the_eager_one_does(converted, name):
    """A hybrid model's verify graph (R = 3 rows a sequence, a bucket of 4) on the worker: two drafted
    sequences of 3 and 2 rows beside a plain decode row and a new request's first 2 prompt tokens (its slot
    holding a former owner's state), so every state goes through all 3 rows, padding included. The next step (its plan rolling the drafted ones back to 2 and 1 rows kept; the worker rolls
    the decode row's padding back itself) gives the logits and leaves the states that the same two steps
    give with the verify step run eagerly; the next step, which has no guesses, does not take the verify
    graph (its padding would go into the states with no roll back)."""
    from vegaserve.engine.cuda_graphs import DecodeGraphs
    from vegaserve.engine.layers.attention import KVCache

    core = converted.core(DATA, name, speculative={"type": "ngram", "draft_max": 2})
    worker = core.runner.executor.worker
    bs = core.pool.block_size
    lengths, counts, kept = [5, 17, 9], [3, 1, 2], [2, 1, 1]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    blocks = [core.pool.allocate(-(-(n + 3) // bs)) for n in lengths]
    slots = (2, 0, 3)
    worker.run(StepPlan([(b, 0, p) for b, p in zip(blocks, prompts, strict=True)], [False] * 3, bs, slots))
    nxt = [torch.randint(0, 320, (c,), generator=gen).tolist() for c in counts]
    # and a new request's first 2 prompt tokens, in a slot whose last owner left its state behind
    fresh = core.pool.allocate(1)
    worker.cache.state.conv[:, 1], worker.cache.state.ssm[:, 1] = 5.0, 5.0
    verify = StepPlan([*((b, n, t) for b, n, t in zip(blocks, lengths, nxt, strict=True)), (fresh, 0, [40, 41])],
                      [True, False, True, False], bs, (*slots, 1), snapshot=(0, 2))
    after = StepPlan([*((b, n + k, [7]) for b, n, k in zip(blocks, lengths, kept, strict=True)), (fresh, 2, [42])],
                     [False] * 4, bs, (*slots, 1), rollback=((2, 2), (3, 1)))
    cache = worker.cache
    mine = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                   cache.k.device, spare=bs)
    mine.k[:, : cache.num_slots], mine.v[:, : cache.num_slots] = cache.k, cache.v
    mine.state = worker.model.recurrent_state(cache.state.slots, torch.device("cpu"), spare=1, backups=True,
                                              snapshots=cache.state.snapshots)
    mine.state.conv[:, :-1], mine.state.ssm[:, :-1] = cache.state.conv, cache.state.ssm
    graphs = DecodeGraphs(worker.model, mine, 4, core.max_model_len, bs, torch.device("cpu"), rows=3)
    assert graphs.fits(verify.seqs, verify.all_logits)

    worker.cache, worker.verify_graphs = mine, graphs
    worker.model.keep_hidden = True  # (as draft-mtp has it: every real row's output-normed state, in order)
    replayed = worker.run(verify).clone()
    replayed_hidden = worker.model.hidden.clone()
    assert [n for _, _, n in worker.saved.seqs] == [3, 3, 3, 3] and worker.pending == [(0, 1), (1, 2)]
    replayed_next = worker.run(after).clone()
    worker.cache, worker.verify_graphs = cache, None
    eager = worker.run(verify)
    assert replayed_hidden.shape == worker.model.hidden.shape == (8, 64)
    assert converted.rel(replayed_hidden, worker.model.hidden) < 1e-4
    assert {slot: n for slot, _, n in worker.saved.seqs} == {2: 3, 3: 2}
    eager_next = worker.run(after)
    assert converted.rel(replayed, eager) < 1e-4
    assert converted.rel(replayed_next, eager_next) < 1e-4
    for s in (*slots, 1):
        assert converted.rel(mine.state.ssm[:, s], cache.state.ssm[:, s]) < 1e-5
        assert converted.rel(mine.state.conv[:, s], cache.state.conv[:, s]) < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="a static batch on CPU tensors runs the Triton kernels, "
                    "which only the interpreter takes")
@pytest.mark.parametrize("spec", [{"type": "draft-mtp"}, {"type": "ngram", "draft_max": 2}], ids=["mtp", "oracle"])
def test_speculation_through_the_verify_graphs_static_batch_changes_no_output(converted, spec):
    """The engine end to end with its verify steps on a verify graph's static batch (R = 3, as on a GPU, here
    run eagerly through the Triton kernels under the interpreter): greedy output equals plain decoding's,
    with the MTP block drafting (it reads each sequence's hidden rows from the padded layout) and with the
    oracle proposer whose wrong guess moves through every position."""
    from vegaserve.engine.cuda_graphs import DecodeGraphs
    from vegaserve.engine.layers.attention import KVCache

    gen = torch.Generator().manual_seed(9)
    base = [torch.randint(0, 320, (4,), generator=gen).tolist() for _ in range(2)]
    prompts = [base[0] * 3, base[1] * 2 + [5]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(core: EngineCore) -> list[list[int]]:
        return _side_by_side(core, prompts, params)

    plain = run(converted.core(DATA, "qwen35"))
    core = converted.core(DATA, "qwen35", speculative=spec, scheduler={"max_num_seqs": 2})
    worker = core.runner.executor.worker
    bs = core.pool.block_size
    cache = worker.cache
    mine = KVCache(cache.k.shape[0], cache.num_slots, cache.k.shape[2], cache.k.shape[3], cache.k.dtype,
                   cache.k.device, spare=bs)
    mine.state = worker.model.recurrent_state(cache.state.slots, torch.device("cpu"), spare=1, backups=True,
                                              snapshots=cache.state.snapshots)
    worker.cache = mine
    worker.verify_graphs = DecodeGraphs(worker.model, mine, 2, core.max_model_len, bs, torch.device("cpu"), rows=3)
    if spec["type"] == "ngram":
        core.spec.proposer = _Oracle({tuple(p): t for p, t in zip(prompts, plain, strict=True)}, core.arch.vocab_size)
    replays = []
    run_graph = worker.verify_graphs.run
    worker.verify_graphs.run = lambda *a, **kw: replays.append(1) or run_graph(*a, **kw)
    assert run(core) == plain
    st = core.stats()
    assert replays and st.spec_num_drafts > 0, (len(replays), st.spec_num_drafts)


def test_draft_mtp_under_tensor_parallelism_runs_the_block_on_every_lane(converted):
    """-sm tensor over two CPU processes with draft-mtp: every lane runs its share of the MTP block (rank 0
    broadcasts each MTP step and the hidden rows it pairs with); the output is one process's plain decoding,
    token for token, with the same guesses as one process drafting."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (9, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(core: EngineCore) -> tuple[list[list[int]], list]:
        guesses: list = []
        if core.spec is not None:
            propose = core.spec.proposer.propose
            core.spec.proposer.propose = lambda reqs, ks: guesses.append(propose(reqs, ks)) or guesses[-1]
        try:
            return _side_by_side(core, prompts, params), guesses
        finally:
            core.close()

    plain, _ = run(converted.core(DATA, "qwen35"))
    one, one_guesses = run(converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"}))
    two, two_guesses = run(converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"},
                                          parallel={"split_mode": "tensor", "n_devices": 2}))
    assert one == plain and two == plain
    assert two_guesses == one_guesses and any(d for step in one_guesses for d in step)
