"""engine/gguf_file.py: metadata and tensor index, the three load modes, split models, and load errors that
name the file (and the tensor and type), including the ones the model loader raises on top of it."""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError


def _load_factory() -> ModuleType:
    # The module tests/conftest.py's `gguf_factory` fixture loads (same key), needed here at import time.
    name = "vegaserve_tests_gguf_factory"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "gguf_factory.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


factory = _load_factory()
SPEC = factory.TinySpec()  # llama, 2 layers, hidden 256, Q8_0 matrices, tied embeddings
N_VOCAB = 512


@contextmanager
def small_vocabulary(n_tokens: int = N_VOCAB) -> Iterator[None]:
    """The factory writes SmolLM2's first `n_tokens` tokens and the merges among them: gguf-py parses the full
    49k-token vocabulary in seconds per open (measured 3 s here), which would dominate these tests."""
    md = dict(factory.smollm2_tokenizer_metadata())
    tokens = md["tokenizer.ggml.tokens"][:n_tokens]
    known = set(tokens)

    def kept(merge: str) -> bool:
        a, b = merge.split(" ")
        return a in known and b in known and a + b in known

    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:n_tokens]
    md["tokenizer.ggml.merges"] = [m for m in md["tokenizer.ggml.merges"] if kept(m)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(factory, "smollm2_tokenizer_metadata", lambda: md)
        yield


def write_tiny(path: Path, spec: object = SPEC) -> Path:
    with small_vocabulary():
        return factory.write_tiny_gguf(path, spec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def rewrite_gguf(
    src: Path,
    dst: Path,
    replace: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    split_max_tensors: int = 0,
) -> list[Path]:
    """Copy `src` through gguf-py's writer, swapping the tensors in `replace` for (raw data, type).

    With `split_max_tensors` the writer splits the way llama.cpp's gguf-split does: parts named
    `stem-0000i-of-0000n.gguf`, all metadata in the first, `split.no` / `split.count` / `split.tensors.count`
    in every part. Returns the written paths.
    """
    replace = replace or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()), split_max_tensors=split_max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    for t in reader.tensors:
        data, dtype = replace.get(t.name, (np.array(t.data), t.tensor_type))
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(dst))


def all_raw(f: GGUFFile) -> dict[str, bytes]:
    return {info.name: raw.contiguous().numpy().tobytes() for info, raw in f.iter_raw()}


def cut(src: Path, dst: Path, n_bytes: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n_bytes])
    return dst


def engine_core(path: Path) -> EngineCore:
    return EngineCore(EngineConfig.from_dict({"model": {"path": str(path)}}), show_progress=False)


# -- metadata and index ---------------------------------------------------------------------------------


def test_metadata_reads_architecture_and_hyperparameters(tiny: Path) -> None:
    f = GGUFFile(tiny)
    assert f.architecture == "llama"
    assert f.metadata["llama.block_count"] == SPEC.n_layers
    assert f.metadata["llama.embedding_length"] == SPEC.hidden
    assert f.metadata["llama.attention.head_count_kv"] == SPEC.n_kv_heads
    assert f.metadata["tokenizer.ggml.model"] == "gpt2"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == f.metadata["llama.vocab_size"] == N_VOCAB
    assert not any(k.startswith("GGUF.") for k in f.metadata)


def test_tensor_index_has_numpy_order_shapes_and_type_names(tiny: Path) -> None:
    f = GGUFFile(tiny)
    head_dim = SPEC.hidden // SPEC.n_heads
    k = f.info("blk.0.attn_k.weight")
    assert (k.shape, k.type_name, k.type_id) == ((SPEC.n_kv_heads * head_dim, SPEC.hidden), "Q8_0", 8)
    assert k.n_bytes == k.shape[0] * (SPEC.hidden // 32) * 34  # Q8_0: 34 bytes per block of 32
    down = f.info("blk.1.ffn_down.weight")
    assert down.shape == (SPEC.hidden, SPEC.ffn)  # rows = outputs: the reverse of ggml's ne
    norm = f.info("output_norm.weight")
    assert (norm.shape, norm.type_name, norm.n_bytes) == ((SPEC.hidden,), "F32", 4 * SPEC.hidden)
    assert "output.weight" not in f  # tied
    assert len(f.tensors) == 1 + 9 * SPEC.n_layers + 1


def test_raw_is_row_shaped_bytes_at_the_indexed_offset(tiny: Path) -> None:
    f = GGUFFile(tiny)
    info = f.info("blk.0.attn_q.weight")
    raw = f.raw(info.name)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (info.shape[0], info.n_bytes // info.shape[0])
    with open(tiny, "rb") as fh:
        fh.seek(info.offset)
        assert raw.numpy().tobytes() == fh.read(info.n_bytes)


def test_missing_tensor_names_file_and_tensor(tiny: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: tensor blk\.7\.attn_q\.weight is missing"):
        GGUFFile(tiny).info("blk.7.attn_q.weight")


# -- load modes -----------------------------------------------------------------------------------------


def test_read_and_dio_give_the_same_bytes_as_mmap(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = all_raw(GGUFFile(tiny, "mmap"))
    assert all_raw(GGUFFile(tiny, "read")) == expected
    flags: list[int] = []
    real_open = os.open

    def spy_open(path, flags_, *args, **kwargs):
        flags.append(flags_)
        return real_open(path, flags_, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy_open)
    assert all_raw(GGUFFile(tiny, "dio")) == expected
    assert flags and all(f & os.O_DIRECT for f in flags)  # dio did ask for O_DIRECT, tensor by tensor


def test_dio_falls_back_to_plain_reads_once_when_open_refuses_o_direct(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # tmpfs refused O_DIRECT at open() before Linux 6.6 (and this kernel's accepts it), so the refusal is
    # simulated: EINVAL is what open(2) returns there.
    expected = all_raw(GGUFFile(tiny, "mmap"))
    real_open = os.open

    def no_direct_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct_open)
    with caplog.at_level(logging.WARNING, logger="vegaserve.engine.gguf_file"):
        got = all_raw(GGUFFile(tiny, "dio"))
    assert got == expected
    warnings = [r for r in caplog.records if "refused O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and str(tiny) in warnings[0].getMessage()


def test_dio_falls_back_when_the_direct_read_is_refused(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # some overlays accept the open and fail the read
    expected = all_raw(GGUFFile(tiny, "mmap"))

    def refuse(*args, **kwargs):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "preadv", refuse)
    with caplog.at_level(logging.WARNING, logger="vegaserve.engine.gguf_file"):
        got = all_raw(GGUFFile(tiny, "dio"))
    assert got == expected
    assert len([r for r in caplog.records if "refused O_DIRECT" in r.getMessage()]) == 1


def test_dio_on_tmpfs_gives_the_same_bytes(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    copy = shm / f"vegaserve-test-{os.getpid()}.gguf"
    copy.write_bytes(tiny.read_bytes())
    try:
        assert all_raw(GGUFFile(copy, "dio")) == all_raw(GGUFFile(tiny, "mmap"))
    finally:
        copy.unlink()


# -- split models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    n = len(GGUFFile(tiny).tensors)
    parts = rewrite_gguf(tiny, tmp_path_factory.mktemp("split") / "x.gguf", split_max_tensors=(n + 1) // 2)
    assert [p.name for p in parts] == ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"]
    return parts


def test_split_parts_are_marked_like_gguf_split(split: list[Path], tiny: Path) -> None:
    n = len(GGUFFile(tiny).tensors)
    for i, part in enumerate(split):
        fields = gguf.GGUFReader(part).fields
        assert fields["split.no"].contents() == i
        assert fields["split.count"].contents() == 2
        assert fields["split.tensors.count"].contents() == n
    assert "general.architecture" not in gguf.GGUFReader(split[1]).fields  # metadata lives in part 1


@pytest.mark.parametrize("given", [0, 1], ids=["first-part", "second-part"])
def test_split_model_opens_from_either_part_with_the_unsplit_bytes(split: list[Path], tiny: Path, given: int) -> None:
    f = GGUFFile(split[given])
    assert f.parts == split
    assert {info.part for info in f.tensors.values()} == {0, 1}
    whole = GGUFFile(tiny)
    assert f.architecture == "llama" and f.metadata["llama.block_count"] == SPEC.n_layers
    assert {n: (i.shape, i.type_name) for n, i in f.tensors.items()} == {
        n: (i.shape, i.type_name) for n, i in whole.tensors.items()
    }
    assert all_raw(f) == all_raw(whole)


def test_split_model_with_a_missing_part_names_it(split: list[Path], tmp_path: Path) -> None:
    lone = tmp_path / split[0].name
    lone.write_bytes(split[0].read_bytes())
    with pytest.raises(ModelLoadError, match="missing part") as e:
        GGUFFile(lone)
    assert str(tmp_path / "x-00002-of-00002.gguf") in str(e.value)


# -- files that are not a loadable GGUF -----------------------------------------------------------------


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file") as e:
        GGUFFile(tmp_path / "nope.gguf")
    assert str(tmp_path / "nope.gguf") in str(e.value)


def test_directory_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory") as e:
        GGUFFile(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
    "content",
    [np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), b"hello, this is a text file\n", b""],
    ids=["random-bytes", "text", "empty"],
)
def test_non_gguf_file_is_refused_by_name(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.95], ids=["version", "first-kv", "tokens", "tensor-infos"])
def test_damaged_header_names_the_file(tiny: Path, tmp_path: Path, fraction: float) -> None:
    header_bytes = gguf.GGUFReader(tiny).data_offset
    path = cut(tiny, tmp_path / "damaged.gguf", 6 + int(fraction * header_bytes))
    with pytest.raises(ModelLoadError, match="damaged or truncated GGUF header") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_garbage_after_the_magic_is_refused_at_the_version(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match=r"version: GGUF version \d+ is not supported") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("tensor", ["token_embd.weight", "blk.1.ffn_down.weight", "output_norm.weight"])
def test_truncated_file_names_the_first_cut_tensor(tiny: Path, tmp_path: Path, tensor: str) -> None:
    info = GGUFFile(tiny).info(tensor)
    path = cut(tiny, tmp_path / "short.gguf", info.offset + info.n_bytes - 1)  # the last byte of `tensor` gone
    with pytest.raises(ModelLoadError, match="truncated") as e:
        GGUFFile(path)
    msg = str(e.value)
    assert str(path) in msg and f"tensor {tensor} ({info.type_name}" in msg


# -- through the model loader ---------------------------------------------------------------------------


def test_unknown_architecture_names_it_and_the_file(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "mamba.gguf", factory.TinySpec(arch="mamba9", n_layers=1))
    with pytest.raises(ModelLoadError, match=r"unknown architecture 'mamba9'") as e:
        engine_core(path)
    assert str(path) in str(e.value)


def test_unsupported_tensor_type_names_the_tensor_and_type(tiny: Path, tmp_path: Path) -> None:
    tq2_0 = gguf.GGMLQuantizationType.TQ2_0  # the ternary type: no kernel serves it
    block, type_size = gguf.GGML_QUANT_SIZES[tq2_0]
    rows = SPEC.hidden  # attn_q: [n_heads * head_dim, hidden]
    raw = np.random.default_rng(2).integers(0, 256, (rows, SPEC.hidden // block * type_size), dtype=np.uint8)
    path = tmp_path / "tq2_0.gguf"
    rewrite_gguf(tiny, path, replace={"blk.0.attn_q.weight": (raw, tq2_0)})
    assert GGUFFile(path).info("blk.0.attn_q.weight").shape == (rows, SPEC.hidden)  # the index takes it
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_q\.weight: unsupported tensor type TQ2_0") as e:
        engine_core(path)
    assert str(path) in str(e.value)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tiny: Path, tmp_path: Path) -> None:
    wrong = (SPEC.hidden, SPEC.ffn + 32)  # ffn_down should be [hidden, ffn]
    raw = np.zeros((wrong[0], wrong[1] // 32 * 34), dtype=np.uint8)
    path = tmp_path / "shape.gguf"
    rewrite_gguf(tiny, path, replace={"blk.1.ffn_down.weight": (raw, gguf.GGMLQuantizationType.Q8_0)})
    with pytest.raises(ModelLoadError) as e:
        engine_core(path)
    msg = str(e.value)
    assert str(path) in msg and "tensor blk.1.ffn_down.weight (Q8_0)" in msg
    assert str(list(wrong)) in msg and str([SPEC.hidden, SPEC.ffn]) in msg


def test_a_block_count_past_the_files_blocks_is_refused_before_the_layers_are_built(tiny: Path, tmp_path: Path) -> None:
    # 65536 layers were built (over 30 s) before the first missing weight was noticed
    reader = gguf.GGUFReader(tiny)
    value = reader.fields["llama.block_count"].parts[-1]
    at = value.ctypes.data - reader.data.ctypes.data
    data = bytearray(tiny.read_bytes())
    data[at : at + value.nbytes] = (1 << 16).to_bytes(value.nbytes, "little")
    path = tmp_path / "blocks.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        engine_core(path)
    assert str(e.value) == (f"{path}: metadata key 'llama.block_count': 65536 blocks, but the file has no tensor "
                            f"of block {SPEC.n_layers} (blk.{SPEC.n_layers}.*)")


def test_tiny_model_loads_through_the_model_loader(tiny: Path) -> None:
    # the baseline the three failures above differ from
    core = engine_core(tiny)
    assert core.arch.architecture == "llama" and core.arch.n_layers == SPEC.n_layers
