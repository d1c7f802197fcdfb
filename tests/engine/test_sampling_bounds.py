"""SamplingParams refuses values the float32 sampler cannot compute (they made the draw NaN, the token id
fall outside the vocabulary and the engine loop die, found by fuzzing the server), and values at the
bounds still sample tokens of the vocabulary."""

from __future__ import annotations

import pytest

from vegaserve.engine.request import GenerateRequest, InvalidRequestError, SamplingParams


def request(core, **params) -> GenerateRequest:
    ids = core.tokenizer.encode("Hello Hello Hello world", add_special_tokens=True)
    return GenerateRequest(ids, SamplingParams(max_tokens=4, ignore_eos=True, **params))


@pytest.mark.parametrize("params,word", [
    ({"temperature": 1e-310}, "temperature"),
    ({"temperature": 9.9e-6}, "temperature"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
])
def test_values_beyond_float32_sampling_are_invalid_requests(params, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**params)


@pytest.mark.parametrize("params", [
    {"temperature": 1e-5, "repetition_penalty": 1e-6, "logit_bias": {5: 100.0}},
    {"temperature": 1e-5, "repetition_penalty": 1e6, "logit_bias": {5: -100.0}, "top_p": 0.5, "min_p": 0.1},
    {"temperature": 0.0, "repetition_penalty": 1e-6},
])
def test_values_at_the_bounds_sample_tokens_of_the_vocabulary(smollm2_core, params):
    outs = smollm2_core.generate_sync(request(smollm2_core, **params))
    tokens = [t for out in outs for t in out.token_ids]
    assert len(tokens) == 4 and all(0 <= t < smollm2_core.arch.vocab_size for t in tokens)
