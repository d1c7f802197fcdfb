"""server/errors.py, body.py, middleware.py: every failure is OpenAI's envelope with the right status,
and the app keeps serving afterwards."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from vegaserve.engine.request import EngineError, InvalidRequestError
from vegaserve.server.app import create_app

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_still_serves(client) -> None:
    response = client.post(CHAT, json=GOOD_CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


BAD_BODIES = [
    # (body bytes, words the message must contain)
    (b'{"messages": [', ["JSON"]),
    (b"", ["empty"]),
    (b'{"model": "fake-model"}', ["messages", "required"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', ["temperature", "number"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', ["temperature"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', ["max_tokens"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', ["top_p"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', ["Infinity"]),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', ["messages.0.role"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"a": 1}}', ["logit_bias"]),
    (b'{"messages": "\xff\xfe"}', ["UTF-8"]),
    (b"[1, 2]", ["JSON object"]),
]


@pytest.mark.parametrize("raw,words", BAD_BODIES, ids=[w[0] + str(i) for i, (_, w) in enumerate(BAD_BODIES)])
def test_bad_body_is_a_400_whose_message_says_what_is_wrong(client, raw, words):
    error = assert_envelope(client.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"]
    assert_still_serves(client)


def test_validation_error_names_the_field_as_param(client):
    error = assert_envelope(client.post(CHAT, json={**GOOD_CHAT, "top_p": "wide"}), 400)
    assert error["param"] == "top_p"


def test_unknown_fields_are_ignored(client):
    assert client.post(CHAT, json={**GOOD_CHAT, "metadata": {"k": "v"}, "store": False, "zzz": 1}).status_code == 200


def test_form_encoded_content_type_still_parses_as_json(client):
    # curl -d sends application/x-www-form-urlencoded; llama-server users expect JSON bodies to work anyway.
    response = client.post(CHAT, content=b'{"messages": [{"role": "user", "content": "hi"}]}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200


def test_prompt_longer_than_context_is_a_400_with_both_numbers(client, engine):
    prompt = "x" * engine.max_model_len
    error = assert_envelope(client.post("/v1/completions", json={"prompt": prompt}), 400)
    assert error["code"] == "context_length_exceeded"
    assert str(len(prompt) + 1) in error["message"] and str(engine.max_model_len) in error["message"]
    assert_still_serves(client)


@pytest.mark.parametrize("path,body", [(CHAT, GOOD_CHAT), ("/v1/completions", {"prompt": "a"})])
def test_unknown_model_is_a_404_model_not_found(client, path, body):
    error = assert_envelope(client.post(path, json={**body, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    assert_still_serves(client)


@pytest.mark.parametrize("model", [None, "", "fake-model"])
def test_omitted_empty_or_served_model_name_is_accepted(client, model):
    assert client.post(CHAT, json={**GOOD_CHAT, "model": model}).status_code == 200


def test_unknown_route_and_wrong_method_are_enveloped_404_and_405(client):
    assert assert_envelope(client.get("/v2/nothing"), 404)["code"] == "not_found"
    assert assert_envelope(client.get(CHAT), 405)["code"] == "method_not_allowed"


@pytest.mark.parametrize("exc,status,code", [
    (InvalidRequestError("bad sampling"), 400, None),
    (EngineError("engine says no"), 500, None),
])
def test_engine_errors_map_to_their_status(client, engine, exc, status, code):
    engine.fail_with = exc
    error = assert_envelope(client.post(CHAT, json=GOOD_CHAT), status)
    assert error["message"] == str(exc) and error["code"] == code


def test_dead_engine_is_a_503(client, engine):
    engine.alive = False
    assert_envelope(client.post(CHAT, json=GOOD_CHAT), 503)
    engine.alive = True
    assert_still_serves(client)


def test_unexpected_exception_is_a_500_that_reveals_nothing_and_is_logged(client, engine, caplog):
    engine.fail_with = RuntimeError("secret internals")
    error = assert_envelope(client.post(CHAT, json=GOOD_CHAT), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)
    engine.fail_with = None
    assert_still_serves(client)


def test_template_rejection_is_a_400(client):
    error = assert_envelope(client.post(CHAT, json={"messages": [{"role": "assistant", "content": "x"}]}), 400)
    assert "assistant" in error["message"]


def test_body_over_the_limit_is_a_413_declared_or_streamed(engine):
    with TestClient(create_app(engine, max_body_bytes=200)) as client:
        big = {"prompt": "x" * 300}
        assert assert_envelope(client.post("/v1/completions", json=big), 413)["code"] == "body_too_large"
        chunked = iter([b'{"prompt": "', b"x" * 150, b"x" * 150, b'"}'])  # no Content-Length
        assert_envelope(client.post("/v1/completions", content=chunked), 413)
        assert client.post("/v1/completions", json={"prompt": "x" * 100}).status_code == 200


class TestApiKey:
    @pytest.fixture
    def keyed(self, engine):
        with TestClient(create_app(engine, api_key="s3cret")) as client:
            yield client

    @pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                                         {"Authorization": "Basic s3cret"}])
    def test_missing_or_wrong_key_is_a_401(self, keyed, headers):
        error = assert_envelope(keyed.post(CHAT, json=GOOD_CHAT, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        assert_envelope(keyed.get("/v1/models", headers=headers), 401)

    def test_right_key_is_served(self, keyed):
        response = keyed.post(CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer s3cret"})
        assert response.status_code == 200

    def test_health_and_metrics_need_no_key(self, keyed):
        assert keyed.get("/health").status_code == 200
        assert keyed.get("/metrics").status_code == 200
