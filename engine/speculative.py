"""Speculative decoding: a proposer guesses up to k next tokens of a decoding request, the target computes
the request's last token and the k guesses in one step (k + 1 logits rows), and keeps the longest prefix of
the guesses its own sampling agrees with, plus one token of its own. Nothing changes in what is generated:

    greedy rows     a guess is kept while it is the target's argmax (after logit_bias and the penalties,
                    which see the guesses before it as generated tokens)
    sampled rows    rejection sampling. The proposers guess one token (their argmax), so the draft
                    distribution q is a point mass: guess x is kept with probability min(1, p(x) / q(x)) =
                    p(x), and at the first guess not kept the token is drawn from max(p - q, 0) normalized,
                    which is p without x. Every emitted token then follows the target's p exactly
                    (Leviathan et al., 2023), p being what the sampler itself draws from
                    (sampling.probabilities: temperature, top-k, top-p, min-p).

The pieces:

    Speculator          the engine's handle: `extend` puts drafts into a scheduled batch, `record`
                        counts what verification kept (vLLM's spec_decode counters), `forget` drops a
                        finished request's proposer state
    NgramProposer       prompt lookup over the request's own tokens (prompt and output), on the host: an
                        index from each n-gram to where it last ended, kept up to date token by token, so a
                        proposal costs a few dictionary lookups however long the request is
    DraftModelProposer  a second GGUF with the target's vocabulary, its own executor, KV blocks and decode
                        graphs; it catches up on the tokens it has not seen, then drafts greedily until
                        --draft-max or until its top token is less likely than --draft-p-min
    verify              the acceptance rule above over every drafted sequence of a step

The target's rejected positions need no undo: their KV slots lie past the request's computed tokens and
are written over by the next step; the blocks wholly past the request's tokens go back to the pool
(BlockTable.truncate). The draft model's cache is rolled back the same way, by its computed count.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vegaserve.engine.config import ConfigError, EngineConfig, ParallelConfig
from vegaserve.engine.forward_batch import MtpPlan, StepPlan
from vegaserve.engine.kv_cache import BlockPool, BlockTable, NoFreeBlocks
from vegaserve.engine.request import SamplingParams, TokenLogprob
from vegaserve.engine.sampling import logprob_records, draw_uniforms, adjust_logits, greedy_argmax, probabilities
from vegaserve.engine.scheduler import Request, ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)


def _cover(table: BlockTable, n: int) -> bool:
    """The table grown to hold n positions; False where the pool has no block left for it."""
    try:
        if n > table.num_slots:
            table.append_slots(n - table.num_slots)
    except NoFreeBlocks:
        return False
    return True


# -- proposers ------------------------------------------------------------------------------------------
class _NgramIndex:
    """Where each n-gram (n in sizes) of one request's tokens last ended, for positions < `indexed`."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0

    def propose(self, req: Request, k: int) -> list[int]:
        total = req.num_tokens
        longest = max(self.maps)
        # index every n-gram ending before the last position (the suffix itself must not match itself)
        if self.indexed < total - 1:
            first = max(0, self.indexed - longest + 1)
            ids = req.token_slice(first, total - 1 - first)
            for end in range(self.indexed, total - 1):
                for n, m in self.maps.items():
                    if end + 1 >= n:
                        m[tuple(ids[end + 1 - n - first : end + 1 - first])] = end
            self.indexed = total - 1
        tail = req.token_slice(max(0, total - longest), min(longest, total))
        for n in sorted(self.maps, reverse=True):
            if n > len(tail):
                continue
            end = self.maps[n].get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return req.token_slice(end + 1, min(k, total - 1 - end))
        return []


class NgramProposer:
    """Prompt lookup: the tokens that followed the last earlier occurrence of the request's final n tokens,
    n from `ngram_size` down to 2 (the longest match wins)."""

    def __init__(self, ngram_size: int) -> None:
        self.sizes = range(2, ngram_size + 1)
        self.index: dict[str, _NgramIndex] = {}

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, ks, strict=True):
            idx = self.index.get(r.request_id)
            if idx is None:
                idx = self.index[r.request_id] = _NgramIndex(self.sizes)
            out.append(idx.propose(r, k))
        return out

    def forget(self, request_id: str) -> None:
        self.index.pop(request_id, None)

    def close(self) -> None:
        pass


@dataclass
class _DraftState:
    table: BlockTable
    computed: int = 0  # positions whose k/v are in the draft's cache, all of them the request's tokens


class DraftModelProposer:
    """A smaller model of the same vocabulary drafts greedily. Its own executor (one device: the target's
    first), block pool and, on a GPU, decode graphs; as many KV blocks as the target's pool."""

    def __init__(self, config: EngineConfig, target_tokens: Sequence[str], device: torch.device, num_blocks: int,
                 max_model_len: int, show_progress: bool = False) -> None:
        # imported here: the executor pulls in the models, which a CPU-only ngram setup never needs
        from vegaserve.engine.executor import start_executor
        from vegaserve.engine.gguf_file import GGUFFile
        from vegaserve.engine.launch import plan_launch

        spec = config.speculative
        path = spec.draft_model
        assert path is not None  # SpeculativeConfig requires it for type draft
        gguf = GGUFFile(path, config.model.load_mode)
        arch = _checked_draft(gguf, target_tokens)
        # canonical blocks, as DESIGN.md has drafts load: no repack pass, the canonical-layout kernels
        draft_config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, path=path, no_repack=True), parallel=ParallelConfig(n_devices=1),
            speculative=dataclasses.replace(spec, type="none", draft_model=None),
        )
        bs = config.cache.block_size
        launch = plan_launch(draft_config, gguf, arch, max_model_len, num_blocks * bs, device)
        self.executor = start_executor(launch, device, gguf, show_progress)
        self.pool = BlockPool(num_blocks, bs)
        self.p_min = spec.draft_p_min
        self.non_finite = 0  # drafts dropped for non-finite logits
        self.states: dict[str, _DraftState] = {}
        log.info("draft model %s (%s, %d layers)", gguf.path.name, arch.architecture, arch.n_layers)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, _DraftState, list[int]]] = []  # (index, state, tokens fed this round)
        for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            st = self.states.get(r.request_id)
            if st is None:
                st = self.states[r.request_id] = _DraftState(BlockTable(self.pool))
            # what the last verification rejected is past the request's tokens: those positions are stale
            st.computed = min(st.computed, r.num_tokens - 1)
            if not _cover(st.table, r.num_tokens + k - 1):  # slots for the catch-up and k - 1 fed guesses
                continue
            live.append((i, st, r.token_slice(st.computed, r.num_tokens - st.computed)))
        while live:
            plan = StepPlan([(st.table.blocks_of(st.computed + len(t)), st.computed, t) for _, st, t in live],
                            [False] * len(live), self.pool.block_size)
            logits = self.executor.forward(plan).float()
            best, ids = torch.softmax(logits, dim=-1).max(dim=-1)
            finite = torch.isfinite(logits).all(dim=-1)
            best_l, ids_l, finite_l = best.tolist(), ids.tolist(), finite.tolist()
            nxt = []
            for (i, st, fed), p, tok, ok in zip(live, best_l, ids_l, finite_l, strict=True):
                st.computed += len(fed)
                if not ok:  # the fail-safe: a draft with non-finite logits is dropped whole, never verified
                    drafts[i] = []
                    self.non_finite += 1
                    continue
                if p < self.p_min:
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < ks[i]:
                    nxt.append((i, st, [tok]))
            live = nxt
        return drafts

    def forget(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            st.table.release()

    def close(self) -> None:
        self.executor.close()


@dataclass
class _MtpState:
    done: int = 0  # positions whose MTP KV is written for good (token and paired hidden state final)
    h_from: int = 0  # the trunk's hidden states kept: of positions h_from .. h_from + len - 1
    h: list[Tensor] = field(default_factory=list)


class MtpProposer:
    """draft-mtp: the target's own MTP (NextN) block drafts (models/hybrid.py NextNHead), on the target's
    device, its KV in a cache layer beside the trunk's (the same slots: the request's blocks cover it, and
    the KV length rolls back with the target's). After each target step `observe` keeps the rows the step
    computed for good (a verify step's: those kept) of the trunk's output-normed hidden states. `propose`
    then, per request, catches the block up (position p pairs token p with the hidden state of p - 1; a
    request's first position with zeros), its last row the request's newest token, whose logits give the
    first guess; each further guess feeds the guess before with the block's own output hidden state.
    Greedy; a draft with non-finite logits is dropped whole. One device, or every lane of tensor
    parallelism (Executor.forward_mtp)."""

    needs_slots = True  # propose writes KV at the guesses' positions: extend gives the slots first

    def __init__(self, executor, block_size: int) -> None:
        self.executor = executor  # every rank of a tensor-parallel group runs the block (forward_mtp)
        self.model = executor.worker.model  # rank 0's: its hidden states after each step
        self.block_size = block_size
        self.states: dict[str, _MtpState] = {}

    def observe(self, batch: ScheduledBatch, kept_rows: list[int]) -> None:
        """After a target step: kept_rows[i] of batch.seqs[i]'s rows are computed for good."""
        hidden = self.model.hidden
        at = 0
        for s, kept in zip(batch.seqs, kept_rows, strict=True):
            st = self.states.get(s.request.request_id)
            if st is None:  # its first step; one resuming a cached prefix (a hybrid model's saved state) finds
                # the block's k/v of that prefix in the adopted blocks, written as the request that computed
                # them caught up (none where it ended before proposing: the guesses suffer, not the output)
                st = self.states[s.request.request_id] = _MtpState(done=s.start, h_from=s.start)
            if s.start != st.h_from + len(st.h):  # recomputed from an earlier position (preempted)
                st.done = min(st.done, s.start)
                st.h_from, st.h = s.start, []
            st.h.extend(hidden[at : at + kept].float().clone().unbind())  # (a graph's buffer: copied)
            at += len(s.tokens)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        model, bs = self.model, self.block_size
        dev = self.executor.worker.device
        drafts: list[list[int]] = [[] for _ in reqs]
        seqs, h_in, live = [], [], []
        for i, r in enumerate(reqs):
            st = self.states.get(r.request_id)
            start = r.num_computed  # the step to verify starts at the request's newest token
            if st is None or st.h_from + len(st.h) != start:
                continue  # (its hidden states are not all seen: no guess this step)
            rows = [st.h[p - 1 - st.h_from] if p - 1 >= st.h_from else torch.zeros(model.cfg.hidden_size, device=dev)
                    for p in range(st.done, start + 1)]
            seqs.append((r.table.blocks_of(start + 1), st.done, r.token_slice(st.done, start + 1 - st.done)))
            h_in.extend(rows)
            live.append((i, r, start))
            st.done = start + 1  # the newest token is the target's own: its MTP row is final
            st.h_from, st.h = start, []
        step = 0
        while live:
            h = torch.stack(h_in)
            out, logits = self.executor.forward_mtp(MtpPlan(StepPlan(seqs, [False] * len(seqs), bs), len(h)), h)
            # each row's guess, -1 where its logits are not all finite: one read from the device
            ids = torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1), -1).tolist()
            last = list(itertools.accumulate(len(t) for _, _, t in seqs))  # each sequence's last row, + 1
            seqs, h_in, nxt = [], [], []
            step += 1
            for (i, r, start), tok, end in zip(live, ids, last, strict=True):
                if tok < 0:  # the fail-safe: dropped whole
                    drafts[i] = []
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < ks[i]:
                    pos = start + step
                    seqs.append((r.table.blocks_of(pos + 1), pos, [tok]))
                    h_in.append(out[end - 1])
                    nxt.append((i, r, start))
            live = nxt
        return drafts

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def close(self) -> None:
        pass


def _checked_draft(gguf, target_tokens: Sequence[str]):
    """The draft GGUF's architecture, once its vocabulary is the target's and it is not a hybrid model."""
    from vegaserve.engine.models.arch_config import arch_config_from_gguf

    check_same_vocabulary(list(gguf.metadata.get("tokenizer.ggml.tokens", [])), target_tokens, str(gguf.path))
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    if arch.hybrid is not None:
        raise ConfigError(f"{gguf.path}: a hybrid linear-attention draft model ({arch.architecture}) is not supported yet")
    return arch


def check_speculative(config: EngineConfig, arch, gguf) -> None:
    """Every speculative setup that cannot work fails here with one line, before any weights load: draft-mtp
    without an MTP head, on an architecture whose head is not run, or over several devices; a draft of
    another vocabulary or a hybrid one."""
    from vegaserve.engine.gguf_file import GGUFFile

    spec = config.speculative
    if not spec.enabled:
        return
    if spec.type == "draft-mtp":
        nextn = int(gguf.metadata.get(f"{arch.architecture}.nextn_predict_layers", 0) or 0)
        if not nextn:
            raise ConfigError(f"{gguf.path}: --spec-type draft-mtp needs an MTP (NextN) head, and this model has none "
                              f"({arch.architecture}.nextn_predict_layers is not set)")
        if arch.hybrid is None:
            raise ConfigError(f"{gguf.path}: --spec-type draft-mtp is not supported yet for {arch.architecture} (it runs "
                              f"the MTP block of qwen35, qwen35moe and qwen3next)")
        from vegaserve.engine.distributed.topology import plan_topology
        from vegaserve.engine.launch import count_devices

        par = config.parallel
        if plan_topology(par.split_mode, par.tensor_parallel_group, count_devices(config)).pp > 1:
            raise ConfigError("--spec-type draft-mtp over a pipeline (-sm layer, -tps): not supported yet (one device, "
                              "or -sm tensor alone)")
    if spec.type == "draft":
        assert spec.draft_model is not None  # SpeculativeConfig requires it for type draft
        _checked_draft(GGUFFile(spec.draft_model, config.model.load_mode),
                       list(gguf.metadata.get("tokenizer.ggml.tokens", [])))


def check_same_vocabulary(draft: Sequence[str], target: Sequence[str], path: str) -> None:
    """A draft's token ids must mean the target's: same size, same tokens."""
    if len(draft) != len(target):
        raise ConfigError(
            f"{path}: the draft model's vocabulary has {len(draft)} tokens, the target's {len(target)}: "
            "a draft model must share the target's vocabulary"
        )
    bad = next((i for i, (a, b) in enumerate(zip(draft, target)) if a != b), None)
    if bad is not None:
        raise ConfigError(
            f"{path}: the draft model's token {bad} is {draft[bad]!r}, the target's {target[bad]!r}: "
            "a draft model must share the target's vocabulary"
        )


# -- verification ---------------------------------------------------------------------------------------
@dataclass
class Verified:
    """One drafted sequence after its verify step: the tokens to emit (the kept guesses, then the target's
    own) and their logprobs where asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]

    @property
    def accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(logits: Tensor, first_rows: list[int], drafts: list[list[int]], params: list[SamplingParams],
           prompt_ids: list[list[int]], output_ids: list[list[int]],
           generators: list[torch.Generator | None]) -> list[Verified]:
    """Sequence i's rows are logits[first_rows[i] : first_rows[i] + len(drafts[i]) + 1]: row j scores the
    token after guess j - 1 (row 0: after the request's last token). A seeded request draws len(draft) + 1
    numbers from its generator: one per guess, then one for the token of its own."""
    device = logits.device
    spans = [(first, len(d)) for first, d in zip(first_rows, drafts, strict=True)]
    index = torch.tensor([first + j for first, k in spans for j in range(k + 1)], dtype=torch.long, device=device)
    raw = logits.index_select(0, index)
    # the penalties of row j see guesses 0 .. j - 1 as generated
    row_params, row_prompts, row_outputs, row_gens = [], [], [], []
    for p, prompt, out, d, g in zip(params, prompt_ids, output_ids, drafts, generators, strict=True):
        history = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        for j in range(len(d) + 1):
            row_params.append(p)
            row_prompts.append(prompt)
            row_outputs.append(out + d[:j] if history and j else out)
            row_gens.append(g)
    adjusted = adjust_logits(raw, row_params, row_prompts, row_outputs)

    offsets = [0]
    for _, k in spans:
        offsets.append(offsets[-1] + k + 1)
    chosen: list[list[int]] = [[] for _ in drafts]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = [r for i in greedy for r in range(offsets[i], offsets[i + 1])]
        best = greedy_argmax(adjusted[torch.tensor(rows, device=device)]).tolist()
        at = 0
        for i in greedy:
            d, n = drafts[i], len(drafts[i]) + 1
            mine = best[at : at + n]
            at += n
            a = next((j for j, (x, y) in enumerate(zip(d, mine)) if x != y), len(d))
            chosen[i] = d[:a] + [mine[a]]
    if sampled:
        chosen_s = _rejection_sample(adjusted, offsets, sampled, drafts, row_params, row_gens)
        for i, toks in zip(sampled, chosen_s, strict=True):
            chosen[i] = toks

    logprobs: list[list[TokenLogprob | None]] = [[None] * len(c) for c in chosen]
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        rows = [offsets[i] + j for i in asked for j in range(len(chosen[i]))]
        toks = [t for i in asked for t in chosen[i]]
        ns = [params[i].logprobs or 0 for i in asked for _ in chosen[i]]
        records = logprob_records(raw[torch.tensor(rows, device=device)], torch.tensor(toks, device=device), ns)
        at = 0
        for i in asked:
            logprobs[i] = list(records[at : at + len(chosen[i])])
            at += len(chosen[i])
    return [Verified(c, lp) for c, lp in zip(chosen, logprobs, strict=True)]


def _keep(u: Tensor, p_guess: Tensor) -> Tensor:
    """The acceptance rule for a point-mass draft: keep guess x with probability p(x)."""
    return u < p_guess


def _rejection_sample(adjusted: Tensor, offsets: list[int], seqs: list[int], drafts: list[list[int]],
                      row_params: list[SamplingParams], row_gens: list[torch.Generator | None]) -> list[list[int]]:
    """The sampled sequences' tokens: guesses kept with probability p(guess), then one draw from p without
    the first guess not kept (or from the last row's p when every guess was kept)."""
    device = adjusted.device
    rows = [r for i in seqs for r in range(offsets[i], offsets[i + 1])]
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    probs = probabilities(adjusted[rows_t], [row_params[r] for r in rows])
    uniforms = draw_uniforms([row_gens[r] for r in rows], device)
    # guess j of a sequence against its row j; its last row has no guess
    guess_at, guesses = [], []
    at = 0
    for i in seqs:
        guess_at.extend(range(at, at + len(drafts[i])))
        guesses.extend(drafts[i])
        at += len(drafts[i]) + 1
    kept: list[bool] = []
    if guesses:
        at_t = torch.tensor(guess_at, dtype=torch.long, device=device)
        p_guess = probs[at_t, torch.tensor(guesses, dtype=torch.long, device=device)]
        kept = _keep(uniforms[at_t], p_guess).tolist()
    finals, excluded, final_u = [], [], []
    chosen: list[list[int]] = []
    at, g = 0, 0
    for i in seqs:
        d = drafts[i]
        a = next((j for j in range(len(d)) if not kept[g + j]), len(d))
        chosen.append(d[:a])
        finals.append(at + a)
        excluded.append(d[a] if a < len(d) else -1)
        final_u.append(at + len(d))  # the sequence's last number is for its own token
        at += len(d) + 1
        g += len(d)
    weights = probs[torch.tensor(finals, dtype=torch.long, device=device)].clone()
    excl = torch.tensor(excluded, dtype=torch.long, device=device)
    rejected = [n for n, x in enumerate(excluded) if x >= 0]
    if rejected:
        weights[rejected, [excluded[n] for n in rejected]] = 0.0
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1:]
    u = uniforms[torch.tensor(final_u, dtype=torch.long, device=device)][:, None]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    own = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    # a rejected guess that held all of p's mass up to rounding leaves nothing to draw from: keep the guess
    own = torch.where(total.squeeze(1) > 0, own, excl.clamp(min=0))
    for c, t in zip(chosen, own.tolist(), strict=True):
        c.append(t)
    return chosen


# -- the engine's handle --------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """vLLM's spec_decode counters: verify steps of a drafted sequence, guesses, guesses kept, and kept by
    position (kept[j]: times guess j was kept)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    """Drafts for the decoding requests of a scheduled batch (engine_core.py calls it between schedule and
    launch) and the counters of what verification kept."""

    def __init__(self, config: EngineConfig, proposer, max_model_len: int) -> None:
        self.config = config.speculative
        self.k = self.config.max_draft
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    def extend(self, batch: ScheduledBatch, token_budget: int) -> ScheduledBatch:
        """The batch with guesses after each decoding request's token, within the token budget; a request
        whose KV blocks cannot grow, or whose guesses are fewer than --draft-min, decodes plainly."""
        room = token_budget - batch.num_tokens
        picked: list[int] = []
        ks: list[int] = []
        slots_first = getattr(self.proposer, "needs_slots", False)  # it writes KV at the guesses' positions
        for i, s in enumerate(batch.seqs):
            r = s.request
            # a guided request decodes plainly: each guess would need the grammar's mask at its position
            if not s.samples or len(s.tokens) != 1 or room <= 0 or r.matcher is not None:
                continue
            # every guess kept plus the target's token must stay within max_tokens (and so the context)
            k = min(self.k, r.max_new_tokens - len(r.output_ids) - 1, room)
            if k < max(1, self.config.draft_min):
                continue
            if slots_first and not _cover(r.table, s.start + 1 + k):
                continue
            picked.append(i)
            ks.append(k)
            room -= k
        if not picked:
            return batch
        proposals = self.proposer.propose([batch.seqs[i].request for i in picked], ks)
        seqs = list(batch.seqs)
        for i, d in zip(picked, proposals, strict=True):
            if not d or len(d) < self.config.draft_min:
                continue
            s = seqs[i]
            r, n = s.request, s.start + 1 + len(d)
            if not _cover(r.table, n):
                continue
            seqs[i] = ScheduledSeq(r, s.start, s.tokens + d, r.table.blocks_of(n), samples=True, drafts=tuple(d))
        return ScheduledBatch(seqs)

    def observe(self, batch: ScheduledBatch, kept_rows: list[int]) -> None:
        """After a target step: how many rows of each sequence it computed for good (a proposer that drafts
        from the target's hidden states keeps them)."""
        watch = getattr(self.proposer, "observe", None)
        if watch is not None:
            watch(batch, kept_rows)

    def record(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_pos[j] += 1

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def close(self) -> None:
        self.proposer.close()


def make_speculator(config: EngineConfig, gguf, device: torch.device, num_blocks: int,
                    max_model_len: int, show_progress: bool = False, executor=None) -> Speculator | None:
    """The configured speculation, or None; check_speculative, run before the model loaded, has refused
    every setup that cannot work. executor: the target's (draft-mtp drafts with its model)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.type == "ngram":
        proposer = NgramProposer(spec.ngram_size)
    elif spec.type == "draft-mtp":
        proposer = MtpProposer(executor, config.cache.block_size)
    else:
        proposer = DraftModelProposer(config, list(gguf.metadata.get("tokenizer.ggml.tokens", [])), device,
                                      num_blocks, max_model_len, show_progress)
    return Speculator(config, proposer, max_model_len)
