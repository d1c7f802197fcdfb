"""server/app.py: the small routes (models, health, tokenize, detokenize) and the app's assembly."""

from __future__ import annotations

from fastapi.testclient import TestClient

from vegaserve.server.app import create_app


def test_models_lists_exactly_the_engine_model_with_its_context(client, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [(engine.model_name, engine.max_model_len)]


def test_health_follows_engine_liveness(client, engine):
    assert (client.get("/health").status_code, client.get("/health").json()) == (200, {"status": "ok"})
    engine.alive = False
    dead = client.get("/health")
    assert dead.status_code == 503
    assert dead.json()["error"]["type"] == "service_unavailable_error"
    engine.alive = True
    assert client.get("/health").status_code == 200


def test_tokenize_returns_the_tokenizer_ids_without_special_tokens_by_default(client, engine):
    text = "hi <|user|> there"
    got = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert got == engine.tokenizer.encode(text, add_special_tokens=False, parse_special=True)
    with_bos = client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == engine.tokenizer.encode(text, add_special_tokens=True, parse_special=True)
    assert len(with_bos) == len(got) + 1


def test_tokenize_with_pieces_gives_text_or_raw_bytes_per_token(client, engine):
    text = "aé"  # é is two byte-tokens, neither valid UTF-8 alone
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert [p["id"] for p in pieces] == ids
    assert pieces[0]["piece"] == "a"
    assert [p["piece"] for p in pieces[1:]] == [list(engine.tokenizer.token_bytes(t)) for t in ids[1:]]
    rebuilt = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert rebuilt.decode() == text


def test_tokenize_then_detokenize_gives_back_the_text(client):
    text = "Grüße, <|system|> 世界!"
    ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": text}


def test_detokenize_refuses_ids_outside_the_vocabulary(client, engine):
    bad = engine.tokenizer.vocab_size
    response = client.post("/detokenize", json={"tokens": [1, bad]})
    assert response.status_code == 400
    assert str(bad) in response.json()["error"]["message"]


def test_two_apps_in_one_process_keep_separate_state(fake):
    first, second = fake.FakeEngine(model_name="a"), fake.FakeEngine(model_name="b")
    with TestClient(create_app(first)) as c1, TestClient(create_app(second)) as c2:
        assert c1.get("/v1/models").json()["data"][0]["id"] == "a"
        assert c2.get("/v1/models").json()["data"][0]["id"] == "b"
        c1.post("/v1/completions", json={"prompt": "abc"})
        assert len(first.requests) == 1 and not second.requests
