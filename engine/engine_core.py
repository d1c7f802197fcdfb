"""EngineCore: the step loop. `step()` is schedule -> execute -> update; everything else feeds it.

Async decode (scheduler.async_decode, on by default on a GPU): execute is launch, draw, result. Between a
decode step's draw (its tokens queued on the device) and its result (the host waits for them), the next
decode step is launched on those tokens (Scheduler.schedule_next), so the device computes it while the host
reads, detokenizes and streams the step before. The next step() then starts from that launched step. A
request that ended meanwhile (stop string, EOS, abort) has its extra token dropped.

Not thread safe: one thread (the AsyncEngine's loop thread, or a plain caller) drives it.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from vegaserve.engine.chat_template import ChatTemplate
from vegaserve.engine.config import EngineConfig
from vegaserve.engine.env import torchrun_rank
from vegaserve.engine.executor import start_executor
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.engine.gguf_file import GGUFFile, default_model_path
from vegaserve.engine.grammar import Grammars, MaskFiller, mask_threads
from vegaserve.engine.launch import engine_shape, pick_device, plan_launch
from vegaserve.engine.model_runner import ModelRunner, StepInFlight, StepOutput
from vegaserve.engine.models.arch_config import arch_config_from_gguf
from vegaserve.engine.output_processor import OutputProcessor
from vegaserve.engine.protocol import EngineStats
from vegaserve.engine.request import ContextLengthError, GenerateRequest, InvalidRequestError, RequestOutput
from vegaserve.engine.kv_cache import BlockPool, BlockTable
from vegaserve.engine.scheduler import Request, ScheduledBatch, Scheduler, Status
from vegaserve.engine.speculative import check_speculative, make_speculator
from vegaserve.engine.state_pool import StatePool, StateSnapshots
from vegaserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        path = config.model.path or default_model_path()
        t0 = time.monotonic()
        self.gguf = GGUFFile(path, config.model.load_mode)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        template = self.gguf.metadata.get("tokenizer.chat_template")
        self.chat_template = (
            ChatTemplate(template, self.tokenizer.bos_token, self.tokenizer.eos_token) if template else ChatTemplate.default()
        )
        self.max_model_len, num_blocks = engine_shape(config, self.gguf)
        self.device = pick_device(config.device)
        self.loaded_on = threading.get_ident()  # the thread whose OpenMP pool the load's CPU ops started
        self.arch = arch_config_from_gguf(self.gguf.metadata, set(self.gguf.tensors), str(self.gguf.path))
        check_speculative(config, self.arch, self.gguf)  # before any weights load
        n_seqs = config.scheduler.max_num_seqs
        bs = config.cache.block_size
        started = torchrun_rank()  # rank 0 of a torchrun job: the other ranks were started by torchrun
        self.launch = plan_launch(config, self.gguf, self.arch, self.max_model_len, num_blocks * bs, self.device,
                                  torchrun_world=started[1] if started else 0)
        # (a cache of the automatic size shrinks to fit the device)
        self.max_model_len, num_blocks = self.launch.max_model_len, self.launch.num_slots // bs
        self.executor = start_executor(self.launch, self.device, self.gguf, show_progress)
        self.pool = BlockPool(num_blocks, bs)
        # constrained decoding: grammars compiled for this tokenizer (the server compiles on its threads too)
        self.grammars = Grammars(self.tokenizer, self.arch.vocab_size)
        masks = MaskFiller(self.grammars.vocab_size, mask_threads(self.device))
        self.runner = ModelRunner(self.executor, bs, masks)
        # hybrid models: a recurrent-state slot per running sequence (the workers hold n_seqs of them), and the
        # snapshots prefix caching resumes from
        self.states = StatePool(n_seqs) if self.arch.hybrid is not None else None
        n_saved = config.state_snapshots if self.states is not None else 0
        self.snapshots = StateSnapshots(n_saved) if n_saved else None
        self.scheduler = Scheduler(self.pool, n_seqs, max(config.scheduler.max_num_batched_tokens, 16), self.states,
                                   self.snapshots)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.spec = make_speculator(config, self.gguf, self.device, num_blocks, self.max_model_len, show_progress,
                                    self.executor)
        async_decode = config.scheduler.async_decode
        if async_decode is None:
            async_decode = self.device.type != "cpu"
        # a verify step's kept guesses must be on the host before the next step is scheduled
        self.async_decode = async_decode and self.executor.takes_device_ids and self.spec is None
        self.in_flight: tuple[ScheduledBatch, StepInFlight] | None = None  # the step launched ahead
        self.model_name = config.model.served_model_name or self.gguf.path.name.removesuffix(".gguf")
        log.info(
            "loaded %s (%s, %d layers) on %s in %.1f s; context %d, %d sequence(s), KV cache %.0f MiB",
            self.gguf.path.name, self.arch.architecture, self.arch.n_layers, self.device,
            time.monotonic() - t0, self.max_model_len, n_seqs, self.runner.cache.nbytes / 2**20,
        )
        if config.kernels.warmup and self.device.type == "cuda":
            t1 = time.monotonic()
            steps = self.warm_up()
            log.info("warmed up the prompt path (%d steps) in %.1f s", steps, time.monotonic() - t1)

    # -- requests in ------------------------------------------------------------------------------------
    def check(self, req: GenerateRequest) -> int:
        """Validate a request; returns how many tokens it may generate."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.arch.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is out of range: the vocabulary has {vocab} tokens")
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens, but the context holds {self.max_model_len}: shorten the prompt"
            )
        room = self.max_model_len - n
        return min(req.params.max_tokens or room, room)

    def add_request(self, req: GenerateRequest) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id} is already in use")
        r = Request.from_generate(req, self.check(req))
        if req.params.guide is not None:  # compiled already by the server: a cache hit
            r.matcher = self.grammars.compile(req.params.guide).matcher()
        self.outputs.attach(r)
        self.requests[r.request_id] = r
        self.scheduler.add(r)

    def abort(self, request_id: str) -> RequestOutput | None:
        r = self.requests.get(request_id)
        if r is None:
            return None
        self._finished(r)
        return self.outputs.aborted(r)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.in_flight is None:
            batch = self.scheduler.schedule()
            if batch.empty:
                return []
            if self.spec is not None:
                batch = self.spec.extend(batch, self.scheduler.token_budget)
            launched = self.runner.launch(batch)
        else:
            (batch, launched), self.in_flight = self.in_flight, None
        launched.draw()
        self.in_flight = self._launch_next(batch, launched)
        result = launched.result()
        if self.spec is not None:  # rows computed for good: a drafted one's last token and guesses kept
            self.spec.observe(batch, [len(res.token_ids) if s.drafts else len(s.tokens)
                                      for s, res in zip(batch.seqs, result.results, strict=True)])
        return self.update(batch, result)

    def _launch_next(self, batch: ScheduledBatch, launched: StepInFlight) -> tuple[ScheduledBatch, StepInFlight] | None:
        """Async decode: the decode step after `batch`, launched on its drawn tokens (see the module doc)."""
        if not self.async_decode or launched.tokens is None:
            return None
        nxt = self.scheduler.schedule_next(batch)
        if nxt is None:
            return None
        return nxt, self.runner.launch(nxt, input_ids=launched.tokens)

    def update(self, batch: ScheduledBatch, result: StepOutput) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for s, res in zip(batch.seqs, result.results, strict=True):
            r = s.request
            if r.status is Status.FINISHED:  # ended (or aborted) while this step ran ahead of it
                continue
            if s.drafts:
                # the last token and the guesses kept are computed; the rest of the guesses' slots go back
                kept = len(res.token_ids) - 1
                self.spec.record(len(s.drafts), kept)
                r.num_computed += 1 + kept
            else:
                r.num_computed += len(s.tokens)
            self.scheduler.computed(r)
            if res.prompt_logprobs is not None:
                r.state.prompt_logprobs.extend(res.prompt_logprobs)
            if not res.token_ids:
                continue
            out = self.outputs.on_tokens(r, res.token_ids, res.logprobs)
            if out.finished:
                self._finished(r)
            elif s.drafts:
                r.table.truncate(r.num_tokens)
            outs.append(out)
        return outs

    def _finished(self, r: Request) -> None:
        self.scheduler.finish(r)
        self.requests.pop(r.request_id, None)
        if self.spec is not None:
            self.spec.forget(r.request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries=self.pool.queries,
            prefix_cache_hits=self.pool.hits,
            num_preemptions=self.scheduler.num_preemptions,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        st = self.spec.stats
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens, spec_accepted_per_pos=tuple(st.accepted_per_pos))

    def close(self) -> None:
        """Stop the other ranks (if any). The engine serves nothing after this."""
        if self.spec is not None:
            self.spec.close()
        self.runner.masks.close()
        self.executor.close()

    def forward_logits(self, token_ids: list[int], all_rows: bool = True) -> torch.Tensor:
        """Logits of one sequence from an empty cache (perplexity, teacher forcing, tests): its blocks come
        from the pool like a request's and go back uncached, so served requests are never disturbed."""
        table = BlockTable(self.pool)
        table.append_slots(len(token_ids))
        state = (self.states.allocate(),) if self.states is not None else ()
        try:
            plan = StepPlan([(table.blocks_of(len(token_ids)), 0, token_ids)], [all_rows], self.pool.block_size, state)
            return self.executor.forward(plan)
        finally:
            table.release()
            if state:
                self.states.free(state[0])

    def warm_up(self) -> int:
        """Run the prompt path at the shapes a server's first traffic takes, so that its kernels compile here
        rather than during the first requests (the decode graphs compiled theirs at capture). On a 27B (H200,
        2026-12-07) it took 28.9 s and the first 64 prompts' median time to first token went from 23.2 s to
        5.7 s, against about 1.7 s once warm: some first-use cost is left, not yet found. A step of one prompt as long as a step holds, one of many 128-token prompts, one of a few
        single tokens beside a chunk of a prompt (rows in the quantized GEMM's range, not a multiple of 16),
        and that prompt's next chunk, after tokens already in its cache. Its blocks and state slots come from
        the pools as a request's do and go back uncached, as forward_logits'; nothing a request sees changes.
        Returns the steps run."""
        bs = self.pool.block_size
        # a step's tokens, within the context and what the pool holds with room for the other sequences
        budget = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1,
                     (self.pool.num_free - 16) * bs)
        if budget < 16:
            return 0
        seqs = self.config.scheduler.max_num_seqs
        chunk = min(100, budget)
        steps: list[list[tuple[str, int]]] = [  # (sequence, new tokens); "chunked" runs in two steps
            [("long", budget)],
            [(f"burst {i}", min(128, budget)) for i in range(max(1, min(seqs, budget // 128)))],
            [("chunked", chunk)] + [(f"one {i}", 1) for i in range(min(5, seqs - 1))],
        ]
        if chunk + 37 < self.max_model_len:
            steps.append([("chunked", 37)])
        vocab = self.arch.vocab_size
        held: dict[str, tuple[BlockTable, int | None]] = {}  # sequence -> its blocks and state slot

        def release(keep: str | None) -> None:
            for key in [k for k in held if k != keep]:
                table, slot = held.pop(key)
                table.release()
                if slot is not None:
                    self.states.free(slot)

        try:
            for step in steps:
                plan = []
                for key, n in step:
                    if key not in held:
                        held[key] = (BlockTable(self.pool), self.states.allocate() if self.states is not None else None)
                    table, _ = held[key]
                    start = table.num_slots
                    table.append_slots(n)
                    plan.append((table.blocks_of(start + n), start, [(7 * (start + j) + 1) % vocab for j in range(n)]))
                slots = tuple(held[key][1] for key, _ in step) if self.states is not None else ()
                self.executor.forward(StepPlan(plan, [False] * len(plan), bs, slots))
                release(keep="chunked")
        finally:
            release(keep=None)
        return len(steps)

    def generate_sync(self, req: GenerateRequest) -> list[RequestOutput]:
        """Run one request to completion (perplexity, tests, benchmarks)."""
        self.add_request(req)
        outs: list[RequestOutput] = []
        while req.request_id in self.requests:
            outs.extend(o for o in self.step() if o.request_id == req.request_id)
        return outs
