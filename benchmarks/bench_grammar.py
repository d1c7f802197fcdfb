"""Grammar libraries compared as the engine would use them: the per-step token masks of 64 concurrent
JSON-schema streams at a 152k-token vocabulary (Qwen2/3's size), and what compiling one schema costs.

No tokenizer of that size can be fetched here, so one is trained: a byte-level BPE of 151,643 tokens (Qwen2's
count of ordinary tokens) over the Python sources of this interpreter's library and installed packages, a mix of code, English and
punctuation runs close to what a real vocabulary holds (cached in the temp folder after the first run, ~1-2
minutes). Each stream is teacher-forced through its own JSON document (the tokens of a valid instance of the
schema, as a model that follows the schema would emit them); every step fills the 64 masks (the library's
batched or parallel call where it has one) and advances every stream by one token.

    python benchmarks/bench_grammar.py                      # xgrammar, llguidance, outlines-core
    python benchmarks/bench_grammar.py --libs xgrammar --streams 64 --steps 40

`--engine` measures what the engine pays instead: the decode step of 64 streams of the embedded model (or
`-m FILE`), all guided by a JSON schema, against the same 64 unguided, on this machine's device: the median
step while all 64 decode, each mode's runs interleaved, and the median time of the parts the guided rows add
to (the wait for the masks; the sampler's draw, which applies them, and the output processor, where the
matchers take the tokens), which a shared machine does not blur as it does whole steps. `--mask-threads 1,8`
runs the guided mode once per count of threads filling the masks.

    python benchmarks/bench_grammar.py --engine --streams 64 --steps 24 [--mask-threads 1,8]

Prints a table and one JSON line. The libraries are not project dependencies except the one chosen
(docs/ARCHITECTURE.md, Structured output); install the others to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 151_643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "scores", "active"],
    "additionalProperties": False,
}


def train_vocab(path: Path):
    """A 151,643-token byte-level BPE (plus a few control tokens), trained once and cached at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.exists():
        return Tokenizer.from_file(str(path))
    lib = Path(os.__file__).parent
    files = sorted(str(p) for p in lib.rglob("*.py"))[:40_000]  # the standard library and what is installed
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.perf_counter()
    texts = []
    for f in files:
        try:
            texts.append(Path(f).read_text("utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    tok.train_from_iterator(texts, trainer)
    print(f"trained a {tok.get_vocab_size()}-token BPE on {len(texts)} files in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    tok.save(str(path))
    return tok


def token_bytes(tok) -> tuple[list[bytes], list[int]]:
    """Every id's raw bytes (control tokens: empty) and the control ids."""
    from vegaserve.engine.tokenizer import gpt2_byte_alphabet

    alphabet = gpt2_byte_alphabet()
    vocab = tok.get_vocab()
    out = [b""] * len(vocab)
    specials = []
    for text, i in vocab.items():
        if text in SPECIALS:
            specials.append(i)
        else:
            out[i] = bytes(alphabet[c] for c in text)
    return out, sorted(specials)


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "Paris", "Main Street", "north", "value", "x-ray", "zeta"]
    docs = []
    for _ in range(n):
        doc = {
            "name": " ".join(rng.choices(words, k=rng.randint(1, 3))),
            "age": rng.randint(1, 99),
            "role": rng.choice(["admin", "editor", "viewer"]),
            "address": {"street": f"{rng.randint(1, 999)} {rng.choice(words)}", "city": rng.choice(words),
                        "zip": f"{rng.randint(10000, 99999)}"},
            "tags": rng.choices(words, k=rng.randint(0, 4)),
            "scores": [round(rng.uniform(0, 100), rng.randint(0, 3)) for _ in range(rng.randint(0, 4))],
            "active": rng.random() < 0.5,
        }
        docs.append(json.dumps(doc, indent=rng.choice([None, 2])))
    return docs


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, raw: list[bytes], eos: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(threads)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, raw: list[bytes], eos: int, threads: int) -> None:
        import llguidance
        from llguidance import LLExecutor, LLTokenizer, TokenizerWrapper

        self.ll = llguidance
        specials = set(i for i, b in enumerate(raw) if not b)

        class Source:  # what llguidance's TokenizerWrapper reads
            eos_token_id = eos
            bos_token_id = None
            tokens = [b if b else b"\xff" + tok.id_to_token(i).encode() for i, b in enumerate(raw)]
            special_token_ids = sorted(specials)

            def __call__(self, s):
                return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s,
                                  add_special_tokens=False).ids

        t0 = time.perf_counter()
        self.tokenizer = LLTokenizer(TokenizerWrapper(Source()))
        self.setup_s = time.perf_counter() - t0
        self.executor = LLExecutor(threads)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        m = self.ll.LLMatcher(self.tokenizer, grammar)  # the first matcher builds the grammar's lexer
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matchers(self, compiled, n: int) -> list:
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, raw: list[bytes], eos: int, threads: int) -> None:
        import outlines_core as oc

        self.oc = oc
        t0 = time.perf_counter()
        self.vocab = oc.Vocabulary(eos, {r: [i] for i, r in enumerate(raw) if r})  # raw bytes -> ids
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[\n ]{0,16}")
        return self.oc.Index(regex, self.vocab)

    def matchers(self, compiled, n: int) -> list:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for i, g in enumerate(matchers):  # no batched call: one mask after another
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def accept(self, m, token: int) -> bool:
        m.advance(token)
        return True


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def run(lib_cls, tok, raw, eos, streams: int, steps: int, threads: int) -> dict:
    lib = lib_cls(tok, raw, eos, threads)
    t0 = time.perf_counter()
    compiled = lib.compile(SCHEMA)
    compile_s = time.perf_counter() - t0
    docs = documents(streams)
    forced = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    matchers = lib.matchers(compiled, streams)
    bitmask = torch.full((streams, (len(raw) + 31) // 32), -1, dtype=torch.int32)
    times, allowed = [], []
    for step in range(steps):
        t = time.perf_counter()
        lib.fill(matchers, bitmask)
        times.append(time.perf_counter() - t)
        allowed.append(_count_bits(bitmask[0]))
        for m, ids in zip(matchers, forced):
            if step < len(ids) and not lib.accept(m, ids[step]):
                raise RuntimeError(f"{lib.name} refused token {step} of a valid document")
        if all(step + 1 >= len(ids) for ids in forced):
            break
    times = times[1:]  # the first step sees the empty prefix, where caches warm
    return {
        "library": lib.name,
        "setup_s": round(lib.setup_s, 3),
        "compile_ms": round(compile_s * 1e3, 1),
        "step_ms_median": round(statistics.median(times) * 1e3, 3),
        "step_ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
        "mask_us_per_stream": round(statistics.median(times) * 1e6 / streams, 1),
        "steps": len(times),
        "allowed_median": int(statistics.median(allowed)),
    }


def _count_bits(row: torch.Tensor) -> int:
    return int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in row.tolist()))


LONG_SCHEMA = {  # keeps a stream decoding for as many steps as are measured
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["report", "note", "letter"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 40},
    },
    "required": ["title", "kind", "lines"],
}


def engine_steps(model: str | None, streams: int, steps: int, rounds: int,
                 mask_threads: list[int] | None = None) -> dict:
    """Median decode step (ms) of `streams` unguided requests and of `streams` guided ones, the guided ones once
    per count of mask-filling threads (default: the engine's own, grammar.mask_threads)."""
    from vegaserve.engine import grammar
    from vegaserve.engine.config import EngineConfig
    from vegaserve.engine.engine_core import EngineCore
    from vegaserve.engine.request import GenerateRequest, GuideSpec, SamplingParams

    cfg = {"cache": {"context_size": 512}, "scheduler": {"max_num_seqs": streams}}
    if model:
        cfg["model"] = {"path": model}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    tok = core.tokenizer
    subjects = ["Paris", "the sea", "a cat", "winter", "trains", "bread", "rain", "music"]
    spec = GuideSpec.json_schema(LONG_SCHEMA)
    core.grammars.compile(spec)
    masks = core.runner.masks
    counts = mask_threads or [masks.threads]

    # the work guided rows add sits in the wait for the masks, the sampler's draw (applying them) and the
    # output processor (the matchers taking each token): timed per step apart from the step, whose wall time
    # on a shared CPU moves by tens of percent between runs
    spent, waited, drawing = [0.0], [0.0], [0.0]

    def clocked(fn, into):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into[0] += time.perf_counter() - t
        return run

    core.runner.sampler.draw = clocked(clocked(core.runner.sampler.draw, drawing), spent)
    core.outputs.on_tokens = clocked(core.outputs.on_tokens, spent)
    grammar.PendingMasks.wait = clocked(grammar.PendingMasks.wait, waited)

    def run(guided: bool) -> tuple[list[float], list[float], list[float], list[float]]:
        for i in range(streams):
            text = f"<|im_start|>user\nWrite a long report on {subjects[i % len(subjects)]} as JSON.<|im_end|>\n<|im_start|>assistant\n"
            ids = tok.encode(text, add_special_tokens=False)
            params = SamplingParams(max_tokens=steps + 8, temperature=0.7, seed=i, ignore_eos=True,
                                    guide=spec if guided else None)
            core.add_request(GenerateRequest(ids, params))
        times, tails, waits, draws = [], [], [], []
        while core.has_work:
            decoding = len(core.scheduler.running) == streams and all(r.num_pending == 1 for r in core.scheduler.running)
            t = time.perf_counter()
            spent[0] = waited[0] = drawing[0] = 0.0
            core.step()
            if decoding:
                times.append(time.perf_counter() - t)
                tails.append(spent[0])
                waits.append(waited[0])
                draws.append(drawing[0])
        return times[2:steps], tails[2:steps], waits[2:steps], draws[2:steps]  # the first steps after the prompts warm caches

    modes = [0] + counts  # 0: unguided; n: guided, masks filled on n threads
    wall: dict[int, list[float]] = {m: [] for m in modes}
    tail: dict[int, list[float]] = {m: [] for m in modes}
    wait: dict[int, list[float]] = {m: [] for m in modes}
    draw: dict[int, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            if m:
                masks.threads, masks._batch = m, None  # xgrammar's pool is made with its thread count
            w, s, q, d = run(bool(m))
            draw[m] += d
            wall[m] += w
            tail[m] += s
            wait[m] += q
        print("so far: " + ", ".join(f"{'guided on ' + str(m) + ' threads' if m else 'unguided'} "
                                     f"{statistics.median(wall[m]) * 1e3:.1f} ms" for m in modes), file=sys.stderr)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    p = med(wall[0])
    return {"device": str(core.device), "streams": streams, "steps": len(wall[0]), "plain_step_ms": round(p, 2),
            "plain_sample_ms": round(med(tail[0]), 2), "plain_draw_ms": round(med(draw[0]), 3),
            "guided": [{"mask_threads": m, "step_ms": round(med(wall[m]), 2),
                        "overhead_pct": round((med(wall[m]) / p - 1) * 100, 1),
                        "sample_ms": round(med(tail[m]), 2), "draw_ms": round(med(draw[m]), 3),
                        "mask_wait_ms": round(med(wait[m]), 3)}
                       for m in counts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads a library may use")
    ap.add_argument("--vocab-cache", type=Path, default=Path(tempfile.gettempdir()) / "vegaserve-bpe-151643.json")
    ap.add_argument("--engine", action="store_true", help="the engine's decode step, guided against unguided")
    ap.add_argument("-m", "--model", default=None, help="--engine: a GGUF (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=2, help="--engine: runs of each mode, interleaved")
    ap.add_argument("--mask-threads", default=None,
                    help="--engine: guided runs with these counts of mask-filling threads, e.g. 1,8 (default: the "
                         "engine's own)")
    args = ap.parse_args()
    if args.engine:
        counts = [int(n) for n in args.mask_threads.split(",")] if args.mask_threads else None
        r = engine_steps(args.model, args.streams, args.steps, args.rounds, counts)
        print(f"{r['streams']} streams on {r['device']}, medians of {r['steps']} decode steps: unguided "
              f"{r['plain_step_ms']} ms (sampling and output processing {r['plain_sample_ms']} ms, of which the "
              f"sampler's draw {r['plain_draw_ms']} ms)")
        for g in r["guided"]:
            print(f"  guided, masks on {g['mask_threads']} threads: {g['step_ms']} ms ({g['overhead_pct']:+.1f}%); "
                  f"waiting for the masks {g['mask_wait_ms']} ms, sampling and output processing {g['sample_ms']} ms "
                  f"(the draw {g['draw_ms']} ms)")
        print(json.dumps(r))
        return
    tok = train_vocab(args.vocab_cache)
    raw, specials = token_bytes(tok)
    eos = tok.token_to_id("<|endoftext|>")
    rows = []
    for name in args.libs.split(","):
        try:
            rows.append(run(LIBS[name], tok, raw, eos, args.streams, args.steps, args.threads))
        except ImportError as e:
            print(f"{name}: not installed ({e})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one library failing leaves the others' figures
            print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"vocabulary {len(raw)} tokens, {args.streams} streams, {args.threads} threads, schema: nested object, "
          f"enum, arrays")
    print(f"{'library':<14} {'setup s':>8} {'compile ms':>11} {'step ms':>8} {'p90 ms':>8} {'us/mask':>8}")
    for r in rows:
        print(f"{r['library']:<14} {r['setup_s']:>8} {r['compile_ms']:>11} {r['step_ms_median']:>8} "
              f"{r['step_ms_p90']:>8} {r['mask_us_per_stream']:>8}")
    print(json.dumps({"vocab": len(raw), "streams": args.streams, "threads": args.threads, "results": rows}))


if __name__ == "__main__":
    main()
