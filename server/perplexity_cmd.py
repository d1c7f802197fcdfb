"""`vegaserve perplexity -m FILE -f TEXT -c N`: prints each chunk's running estimate, then the final one."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.perplexity import PerplexityResult, perplexity
from vegaserve.server.serve_cmd import load_core


def run_perplexity(config: EngineConfig, text_file: Path, max_chunks: int | None) -> int:
    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{text_file}: cannot read the text: {e}") from e
    n_ctx = config.cache.context_size or 512
    core = load_core(config)
    tok = core.tokenizer
    tokens = tok.encode(text, add_special_tokens=False, parse_special=False)
    if max_chunks:
        tokens = tokens[: max_chunks * n_ctx]
    bos = tok.bos_token_id if tok.add_bos_token else None
    if n_ctx > core.max_model_len:
        raise ConfigError(f"-c {n_ctx} exceeds the model's context ({core.max_model_len})")
    t0 = time.monotonic()

    def show(done: int, total: int, r: PerplexityResult) -> None:
        print(f"[{done}/{total}] PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}  ({time.monotonic() - t0:.1f} s)", file=sys.stderr)

    print(f"perplexity: {len(tokens)} tokens, {len(tokens) // n_ctx} chunks of {n_ctx}", file=sys.stderr)
    r = perplexity(core.forward_logits, tokens, n_ctx, bos, show)
    print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    return 0
