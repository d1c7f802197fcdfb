"""Constrained decoding (engine/grammar.py, the masks in engine/sampling.py) on a real byte-level vocabulary (the
tiny Qwen3 test model's 320 tokens): whatever the logits, the tokens drawn under the masks spell a document the
grammar accepts; rows without a grammar are untouched; bad grammars are refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from vegaserve.engine.gguf_file import GGUFFile
from vegaserve.engine.grammar import Grammars, MaskFiller, apply_masks
from vegaserve.engine.request import GuideSpec, InvalidRequestError, SamplingParams
from vegaserve.engine.sampling import Sampler, TokenMasks
from vegaserve.engine.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "moe"

SCHEMA = {
    "type": "object",
    "properties": {
        # random logits would run a free string for long, and may draw bytes that are no UTF-8 (which the
        # library lets through inside a string): the strings are bounded ASCII patterns
        "name": {"type": "string", "pattern": "^[a-zA-Z ]{1,12}$"},
        "kind": {"enum": ["cat", "dog"]},
        "ages": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{0,8}$"}},
                 "required": ["city"]},
    },
    "required": ["name", "kind", "ages", "home"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(DATA / "qwen3moe-f32.gguf").metadata)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, vocab_size=tokenizer.vocab_size + 8)  # a padded LM head, as models have


def _decode(tokenizer, guide_spec, grammars, seed: int, temperature: float, rows: int = 4, max_tokens: int = 200):
    """Draw `rows` constrained sequences from random logits; each row's text when its grammar finished."""
    guide = grammars.compile(guide_spec)
    matchers = [guide.matcher() for _ in range(rows)]
    filler = MaskFiller(grammars.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=temperature, guide=guide_spec)] * rows
    generators = [torch.Generator().manual_seed(seed + i) for i in range(rows)]
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(max_tokens):
        live = [i for i, m in enumerate(matchers) if not m.finished]
        if not live:
            break
        logits = torch.randn((rows, grammars.vocab_size), generator=gen) * 4
        pending = filler.start([matchers[i] for i in live], live, rows)
        masks = TokenMasks(pending.wait(logits.device), live)
        tokens = Sampler().draw(logits, params, [[]] * rows, out, generators, masks).tolist()
        for i in live:
            assert matchers[i].accept(tokens[i]), "a token drawn under the mask was refused by its grammar"
            out[i].append(tokens[i])
    filler.close()
    assert all(m.finished for m in matchers), "a grammar did not finish within max_tokens"
    stops = tokenizer.stop_token_ids
    return [tokenizer.decode([t for t in ids if t not in stops]) for ids in out]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_draws_always_validate(tokenizer, grammars, temperature):
    texts = _decode(tokenizer, GuideSpec.json_schema(SCHEMA), grammars, seed=1, temperature=temperature)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_choice_and_gbnf_draws_match(tokenizer, grammars):
    for text in _decode(tokenizer, GuideSpec("json_object"), grammars, seed=2, temperature=1.0, rows=2, max_tokens=4000):
        assert isinstance(json.loads(text), dict)
    for text in _decode(tokenizer, GuideSpec("regex", r"[a-c]{2,4}-\d"), grammars, seed=3, temperature=1.0):
        assert len(text) in (4, 5, 6) and text[-2] == "-" and text[-1].isdigit() and set(text[:-2]) <= set("abc")
    choices = ['say "hi"', "naïve", "n"]
    for text in _decode(tokenizer, GuideSpec.choice(choices), grammars, seed=4, temperature=1.0, rows=8):
        assert text in choices
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+'
    for text in _decode(tokenizer, GuideSpec("grammar", gbnf), grammars, seed=5, temperature=1.0):
        assert text.startswith("(") and text.endswith(")") and all(p.isdigit() for p in text[1:-1].split(","))


@pytest.mark.parametrize("spec, reason", [
    (GuideSpec("json_schema", '{"type": "florp"}'), "florp"),
    (GuideSpec("json_schema", '{"$ref": "#/missing"}'), "missing"),
    (GuideSpec("json_schema", "{not json"), "JSON schema"),
    (GuideSpec("grammar", 'root ::= "a" |'), "grammar"),
    (GuideSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
    (GuideSpec("regex", "a("), "regex"),
    (GuideSpec("choice", "[]"), "choice"),
])
def test_bad_grammars_are_refused_with_the_reason(grammars, spec, reason):
    with pytest.raises(InvalidRequestError, match=reason) as info:
        grammars.compile(spec)
    assert "/project/" not in str(info.value)  # the library's source position is not the client's business


@pytest.mark.parametrize("rows", [[1], torch.tensor([1], dtype=torch.int32)], ids=["list", "int32-tensor"])
def test_masks_touch_only_constrained_rows_and_ids_past_the_mask(rows):
    logits = torch.randn(3, 70)
    bitmask = torch.zeros((3, 2), dtype=torch.int32)  # covers 64 ids
    bitmask[1, 0] = 0b1010  # row 1 allows tokens 1 and 3
    bitmask[1, 1] = -(2**31)  # and token 63 (the sign bit)
    masked = logits.clone()
    apply_masks(masked, bitmask, rows)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == [1, 3, 63]
    assert torch.equal(masked[1, allowed], logits[1, allowed])


def test_unconstrained_batch_is_sampled_as_without_masks():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0)] * 4
    plain = Sampler().draw(logits, params, [[]] * 4, [[]] * 4, [None] * 4)
    empty = Sampler().draw(logits, params, [[]] * 4, [[]] * 4, [None] * 4, TokenMasks(torch.zeros(4, 2, dtype=torch.int32), []))
    assert torch.equal(plain, empty) and torch.equal(plain, logits.argmax(-1))


def test_compiled_grammars_are_cached_per_spec(grammars):
    spec = GuideSpec.json_schema({"type": "integer"})
    assert grammars.compile(spec) is grammars.compile(GuideSpec.json_schema({"type": "integer"}))


def test_masks_fill_on_one_thread_on_a_cpu_and_half_the_cores_up_to_8_beside_a_gpu(monkeypatch):
    from vegaserve.engine import grammar

    for cores, want in ((None, 1), (2, 1), (6, 3), (16, 8), (128, 8)):
        monkeypatch.setattr(grammar.os, "cpu_count", lambda c=cores: c)
        assert grammar.mask_threads(torch.device("cuda")) == want, cores
        assert grammar.mask_threads(torch.device("cpu")) == 1
