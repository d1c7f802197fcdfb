"""Turns sampled tokens into RequestOutputs: incremental text, stop tokens, stop strings, length limits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vegaserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from vegaserve.engine.request import FinishReason, RequestOutput, TokenLogprob
from vegaserve.engine.scheduler import Request

log = logging.getLogger(__name__)


@dataclass
class OutputState:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(tokenizer.stop_token_ids)

    def attach(self, req: Request) -> None:
        req.state = OutputState(
            IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_ids),
            StopMatcher(tuple(req.params.stop), req.params.include_stop_str_in_output),
        )

    def on_tokens(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Append a step's tokens to req.output_ids one by one (a verify step gives several) until one ends the
        request; the rest are dropped. One output for them all."""
        outs = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            req.output_ids.append(token)
            outs.append(self.on_token(req, token, logprob))
            if outs[-1].finished:
                break
        if len(outs) == 1:
            return outs[0]
        last = outs[-1]
        last.text = "".join(o.text for o in outs)
        last.token_ids = [t for o in outs for t in o.token_ids]
        if last.logprobs is not None:
            last.logprobs = [e for o in outs for e in o.logprobs or ()]
        first_prompt = outs[0].prompt_logprobs
        if first_prompt is not None:
            last.prompt_logprobs = first_prompt
        return last

    def on_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Account for one sampled token (already appended to req.output_ids)."""
        st: OutputState = req.state
        p = req.params
        if req.matcher is not None and self._grammar_ends(req, token):
            return self._output(req, self._drain(st), [token], logprob, FinishReason.STOP)
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            # the stop token's own text is not part of the answer; text held back for stop strings is
            return self._output(req, self._drain(st), [token], logprob, FinishReason.STOP)
        text, stopped = st.stops.feed(st.detok.push(token))
        if stopped:
            return self._output(req, text, [token], logprob, FinishReason.STOP)
        if len(req.output_ids) >= req.max_new_tokens or req.num_tokens >= self.max_model_len:
            return self._output(req, text + self._drain(st), [token], logprob, FinishReason.LENGTH)
        return self._output(req, text, [token], logprob, None)

    def _grammar_ends(self, req: Request, token: int) -> bool:
        """The matcher takes the token; a guided request ends when its grammar took a stop token (even
        with ignore_eos: nothing may follow a finished grammar), or on a token the grammar refuses, which
        the masks make impossible (its text is dropped, so the output still matches)."""
        if not req.matcher.accept(token):
            log.warning("request %s: token %d is outside its grammar; the request ends there", req.request_id, token)
            return True
        return req.matcher.finished

    @staticmethod
    def _drain(st: OutputState) -> str:
        """Everything still held: incomplete UTF-8 (as replacement characters) and possible stop prefixes."""
        text, stopped = st.stops.feed(st.detok.flush())
        return text if stopped else text + st.stops.flush()

    def aborted(self, req: Request) -> RequestOutput:
        return self._output(req, "", [], None, FinishReason.ABORT)

    def _output(
        self, req: Request, text: str, tokens: list[int], logprob: TokenLogprob | None, finish: FinishReason | None
    ) -> RequestOutput:
        st: OutputState = req.state
        prompt_lp = None
        if req.params.prompt_logprobs is not None and not st.sent_prompt_logprobs:
            prompt_lp, st.sent_prompt_logprobs = st.prompt_logprobs, True
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=tokens,
            logprobs=[logprob] if logprob is not None else ([] if req.params.logprobs is not None else None),
            prompt_logprobs=prompt_lp,
            finish_reason=finish,
            num_prompt_tokens=len(req.prompt_ids),
            num_generated_tokens=len(req.output_ids),
        )
