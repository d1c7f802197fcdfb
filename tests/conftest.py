"""Fixtures shared by the whole suite: the embedded SmolLM2 loaded once, its transformers twin, tiny GGUFs."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

# Triton kernels run under its interpreter on a machine without a GPU; it must be chosen before triton loads
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the machine's cores: each runs torch on its share of them. With every worker on
# all the cores (torch's default) the OpenMP threads outnumber the cores and wait for each other at every op:
# test_models.py with test_speculative.py took 255 and 292 s that way against 108 and 96 s so (`-n 2`, 2
# cores, interleaved).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


# llama.cpp's outputs on the embedded model; each file's "source" names the build that wrote it
REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "smollm2"


def llama_cpp_reference(name: str) -> Any:
    """`tests/data/smollm2/{name}.json`, parsed: the one place a test reads llama.cpp's outputs from."""
    return json.loads((REFERENCE_DIR / f"{name}.json").read_text())


LLAMA_CPP_STRINGS = llama_cpp_reference("tokenization")["strings"]


def load_test_module(name: str) -> ModuleType:
    """Helpers beside the tests are loaded by path (the suite runs with --import-mode=importlib)."""
    key = f"vegaserve_tests_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture(scope="session")
def gguf_factory() -> ModuleType:
    return load_test_module("gguf_factory")


@pytest.fixture(scope="session")
def converted() -> ModuleType:
    """Checks against the tiny converted models of tests/data/moe and tests/data/hybrid."""
    return load_test_module("converted_models")


@pytest.fixture(scope="session")
def smollm2_core():
    """The embedded model in an EngineCore with 4 slots of 1024 tokens (f32 reference path, CPU)."""
    from vegaserve.engine.config import EngineConfig
    from vegaserve.engine.engine_core import EngineCore

    return EngineCore(
        EngineConfig.from_dict({"cache": {"context_size": 1024}, "scheduler": {"max_num_seqs": 4}, "device": "cpu",
                                "kernels": {"cpu_int4": False}}),
        show_progress=False,
    )


@pytest.fixture(scope="session")
def hf_smollm2() -> Iterator[torch.nn.Module]:
    """transformers loading the same GGUF in fp32: the independent reference for the model code."""
    transformers = pytest.importorskip("transformers")
    from vegaserve.engine.gguf_file import default_model_path

    transformers.logging.set_verbosity_error()
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    yield model.eval()


@pytest.fixture(scope="session")
def llama_cpp_strings() -> list[dict[str, Any]]:
    """The strings llama.cpp tokenized on the embedded model, each `{"text", "ids"}`."""
    return LLAMA_CPP_STRINGS


@pytest.fixture(params=LLAMA_CPP_STRINGS, ids=lambda case: repr(case["text"]))
def llama_cpp_string(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One of those strings: a test taking it runs once per string."""
    return request.param


@pytest.fixture(scope="session")
def llama_cpp_chat() -> dict[str, Any]:
    """llama.cpp's chat prompt on the embedded model: `messages`, `rendered_prompt` and its `prompt_ids`."""
    return llama_cpp_reference("chat")
