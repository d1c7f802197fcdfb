"""Constrained decoding: a request's grammar compiled once for the tokenizer, a matcher that follows the
request's tokens, and each step's masks of the tokens the grammar allows.

    GuideSpec (plain data in SamplingParams: a JSON schema, any JSON object, GBNF, a regex or a choice)
      -> Grammars.compile -> Guide (the compiled grammar; cached per spec)   on the server's worker threads
      -> Guide.matcher() -> Matcher, one per request                          engine/output_processor.py
      -> MaskFiller.start(matchers): the step's bitmask rows, filled on a worker thread while the forward runs
      -> apply_masks: disallowed logits to -inf on the device, in the batched sampler (engine/sampling.py)

The library is xgrammar (docs/ARCHITECTURE.md, Structured output, says why, with the figures of
benchmarks/bench_grammar.py). Its calls release the GIL, so the fill overlaps the step on a CPU too.
A bitmask row holds 32 tokens a word, bit j of word w allowing token 32 w + j, xgrammar's layout; ids past the
tokenizer's vocabulary (a padded LM head) are never allowed.

The vocabulary is given to xgrammar as each token's raw bytes; control tokens are given as empty (xgrammar's
mark for a special token), so no grammar can emit one, except the stop tokens, which end a finished grammar.
"""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from vegaserve.engine.request import GuideSpec, InvalidRequestError

class _Vocabulary(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...


# xgrammar's messages start with a time and a source position: "[05:36:03] /project/cpp/x.cc:94: ..."
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(e: Exception) -> str:
    return _SOURCE_PREFIX.sub("", str(e).strip()).strip()


class Grammars:
    """Compiles GuideSpecs for one tokenizer. Thread safe: the server compiles on its worker threads. The
    tokenizer's table is built on the first compile (0.2 s at 152k tokens), compiled grammars are cached."""

    def __init__(self, tokenizer: _Vocabulary, vocab_size: int | None = None, threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)  # the LM head may be padded past the vocabulary
        self.threads = threads
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: dict[GuideSpec, Guide] = {}

    def _xgr(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self.tokenizer
                stops = sorted(tok.stop_token_ids)
                raw = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            return self._compiler

    def compile(self, spec: GuideSpec) -> Guide:
        """The compiled grammar; InvalidRequestError naming what is wrong with a schema, grammar or regex."""
        guide = self._cache.get(spec)
        if guide is not None:
            return guide
        compiler = self._xgr()
        try:
            if spec.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                compiled = compiler.compile_grammar(_json_schema_grammar('{"type": "object"}'))
            elif spec.kind == "json_schema":
                compiled = compiler.compile_grammar(_json_schema_grammar(spec.text))
            elif spec.kind == "grammar":
                compiled = compiler.compile_grammar(spec.text)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            else:
                compiled = compiler.compile_grammar(_choice_grammar(spec.text))
        except Exception as e:  # noqa: BLE001 - whatever the library refuses in request data is the request's fault
            raise InvalidRequestError(f"the {_WHAT[spec.kind]} does not compile: {_message(e)}") from None
        guide = Guide(spec, compiled)
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = guide
        return guide


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON grammar", "grammar": "grammar", "regex": "regex",
         "choice": "choice"}
_CACHE_SIZE = 256


# xgrammar (0.2.9) writes the characters of a string with a length bound as [^"\\\r\n], which lets raw control
# characters through (its unbounded strings exclude \0-\x1f); JSON forbids them and strict parsers (Python's,
# pydantic's) refuse such a document, so the class is narrowed in the grammar's text.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'


def _json_schema_grammar(schema: str) -> str:
    """The schema's grammar as EBNF: compact separators (with free whitespace a small model can loop on
    newlines and never close the object), strict (no properties or items the schema does not name)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return str(grammar).replace(_LOOSE_CHARS, _JSON_CHARS)


def _choice_grammar(text: str) -> str:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("the choices must be a non-empty list of non-empty strings")
    # a JSON string literal is an EBNF string literal (the same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Guide:
    """A compiled grammar; any number of requests match against it at once."""

    def __init__(self, spec: GuideSpec, compiled: Any) -> None:
        self.spec = spec
        self.compiled = compiled

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self.compiled))


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl
        self.accepted = 0  # tokens accepted so far: the request's output tokens the mask is current for

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False when the grammar does not allow it (then nothing moved)."""
        ok = bool(self.impl.accept_token(token_id))
        self.accepted += ok
        return ok

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return bool(self.impl.is_terminated())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_threads(device: torch.device) -> int:
    """Threads xgrammar fills a step's masks with: on a GPU host half the cores, up to 8; on a CPU one (the
    cores are the model's). xgrammar holds the GIL while it fills (a fill beside Python work on 2 cores took
    the sum of both), so the fill overlaps the device's work but not the host's: with async decode it sits
    between a step's update and its draw. On an H100 host at 64 streams (bench_grammar.py --engine
    --mask-threads 1,8, one call) the step waited 0.81 ms for its masks on 8 threads against 1.44 ms on one;
    more than 8 is not measured."""
    if device.type == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class MaskFiller:
    """Fills the constrained rows' bitmask on a worker thread: `start` returns at once, `PendingMasks.wait`
    gives the rows on the logits' device. Two pinned host buffers used in turn, grown in powers of two, so a
    step's fill never writes the buffer the previous step's copy to the device may still read. `threads`:
    xgrammar's own, for each fill (mask_threads)."""

    def __init__(self, vocab_size: int, threads: int = 1) -> None:
        self.words = bitmask_words(vocab_size)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first guided step
        self._batch = None
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def _buffer(self, rows: int) -> torch.Tensor:
        if not self._buffers or self._buffers[0].shape[0] < rows:
            size = 1 << max(3, (rows - 1).bit_length())
            pin = torch.cuda.is_available()
            self._buffers = [torch.empty((size, self.words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:rows]

    def start(self, matchers: list[Matcher], rows: list[int], batch: int) -> PendingMasks:
        """Fill `matchers[i]`'s mask into row `rows[i]` of a [batch, words] bitmask (other rows: unused)."""
        host = self._buffer(batch)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks(self._pool.submit(self._fill, [m.impl for m in matchers], rows, host), rows)

    def _fill(self, impls: list[Any], rows: list[int], host: torch.Tensor) -> torch.Tensor:
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(self.threads)
        self._batch.batch_fill_next_token_bitmask(impls, host, rows)
        return host

    def close(self) -> None:
        """Stop the worker thread; a later guided step starts a new one (an engine core may be driven again
        after its loop closed it, as the tests do)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class PendingMasks:
    """A step's masks on their way: `rows` are the constrained rows of the step's sampling batch."""

    def __init__(self, future: Future, rows: list[int]) -> None:
        self._future = future
        self.rows = rows

    def wait(self, device: torch.device) -> torch.Tensor:
        """The [batch, words] bitmask on `device` (its copy queued behind the step's work there)."""
        host = self._future.result()
        return host.to(device, non_blocking=True) if device.type != "cpu" else host


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
    """In place: logits[r, t] = -inf for each r in `rows` where bit t of bitmask[r] is clear, and for every id
    past the mask. xgrammar's kernel: its C++ loop on a CPU (3-5x faster than unpacking the bits in torch ops
    there), its Triton kernel on a GPU; on the logits' device either way. `rows` on a GPU: an int32 tensor
    there (sampling.py makes it without waiting), which xgrammar takes as it is; from a list it would copy
    them from pageable memory, which waits for the device. With the rows as that tensor nothing here waits for
    the device (the sampler's GPU test draws a masked row under torch's sync debug mode)."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    covered = bitmask.shape[1] * 32
    if covered < vocab:  # ids past the grammar's vocabulary (a padded output layer): never allowed
        # index_fill_ on the tail's view; indexing with the rows (logits[rows, covered:] = ...) waits for the device
        tail_rows = rows.long() if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long)
        logits[:, covered:].index_fill_(0, tail_rows.to(logits.device, non_blocking=True), float("-inf"))
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, covered), indices=rows)
