"""POST /tokenize and /detokenize: llama-server's bodies, and vLLM's chat form of /tokenize (`messages`), which
shows the prompt tokens /v1/chat/completions would build, template and quoting included.

Both run off the event loop (server/offload.py): a 16 MB body is millions of tokens, and the response is
written in slices so that no single call holds the GIL for long.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from vegaserve.engine.protocol import EngineClient, Runner
from vegaserve.server.body import json_response, parse_body
from vegaserve.server.offload import json_array
from vegaserve.server.preprocess import chat_prompt_ids, check_token_ids
from vegaserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest


def tokenize(engine: EngineClient, raw: bytes, quote_content: bool, runner: Runner | None = None) -> Response:
    body = parse_body(raw, TokenizeRequest)
    if body.messages is not None:
        ids = chat_prompt_ids(engine, body.messages, body.tools, quote_content=quote_content,
                              add_generation_prompt=body.add_generation_prompt, check_fits=False, runner=runner)
    else:
        assert body.content is not None  # the model's validator leaves one of the two
        ids = engine.tokenizer.encode(body.content, add_special_tokens=body.add_special, parse_special=True,
                                      runner=runner)

    def piece(token_id: object) -> str:
        assert isinstance(token_id, int)
        piece = {"id": token_id, "piece": _piece(engine, token_id)}
        return json.dumps(piece, ensure_ascii=False, separators=(",", ":"))

    parts = json_array(ids, piece) if body.with_pieces else json_array(ids)  # type: ignore[arg-type]
    return Response("".join(['{"tokens":', *parts, "}"]), media_type="application/json")


def detokenize(engine: EngineClient, raw: bytes, runner: Runner | None = None) -> Response:
    body = parse_body(raw, DetokenizeRequest)
    check_token_ids(engine, body.tokens, "tokens")
    return json_response(DetokenizeResponse(content=engine.tokenizer.decode(body.tokens, skip_special_tokens=False)))


def _piece(engine: EngineClient, token_id: int) -> str | list[int]:
    # As llama-server does: the text when the token is whole UTF-8, else its bytes, which a client can
    # join with its neighbours' bytes.
    raw = engine.tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
