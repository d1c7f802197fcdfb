"""Launch parameters come from the tuning file, else from the backend's fixed rule."""

from __future__ import annotations

import json

from vegaserve.triton_kernels.tuning import CONFIG_DIR, load_tuning, shape_class


def test_lookup_takes_the_nearest_measured_row_count_at_or_above(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"matvec": {"Q4_K": {"large": {"1": {"block_n": 8}, "4": {"block_n": 32}}}}}))
    t = load_tuning("cuda_sm90", f)
    assert t.matvec("Q4_K", 16384, 8192, 1) == {"block_n": 8}
    assert t.matvec("Q4_K", 16384, 8192, 3) == {"block_n": 32}
    assert t.matvec("Q4_K", 16384, 8192, 8) == {"block_n": 32}  # beyond the largest: the largest


def test_an_exact_shape_comes_before_its_class_and_the_rule_fills_what_an_entry_leaves_out(tmp_path):
    import torch

    from vegaserve.triton_kernels.layout import repack
    from vegaserve.triton_kernels.matvec_flat import flat_params, rule

    f = tmp_path / "t.json"
    f.write_text(json.dumps({"matvec_int8": {"Q4_K": {"medium": {"1": {"block_n": 16, "num_warps": 8}},
                                                      "4096x14336": {"1": {"block_n": 64}}}}}))
    t = load_tuning("cuda_sm90", f)
    assert t.measured("matvec_int8", "Q4_K", 4096, 14336, 1) == {"block_n": 64}
    assert t.measured("matvec_int8", "Q4_K", 5120, 4096, 1) == {"block_n": 16, "num_warps": 8}
    assert t.measured("matvec_int8", "Q6_K", 5120, 4096, 1) is None
    w = repack(torch.zeros(5120, 16 * 144, dtype=torch.uint8), 12, 5120, 4096)
    base = rule(12, 5120, 4096, 1, 132)
    assert flat_params(w, 1, t, op="matvec_int8") == {**base, "block_n": 16, "num_warps": 8}
    assert flat_params(w, 1, t, op="matvec_flat") == base


def test_missing_entries_fall_back_to_the_backend_rule(tmp_path):
    t = load_tuning("hip_gfx906", tmp_path / "absent.json")
    assert t.matvec("Q6_K", 4096, 4096, 1)["block_n"] >= 8
    assert t.scratch_dtype == "float16"  # gfx906: fp16, no bf16 units
    assert load_tuning("cuda_sm90", tmp_path / "absent.json").scratch_dtype == "bfloat16"


def test_shipped_tuning_files_parse_and_use_known_keys():
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert {p.stem for p in files} >= {"cuda_sm90", "hip_gfx906"}
    for p in files:
        table = json.loads(p.read_text())
        assert table["target"] == p.stem
        for by_class in table.get("matvec", {}).values():
            for cls, by_m in by_class.items():
                assert cls in ("small", "medium", "large")
                for cfg in by_m.values():
                    assert set(cfg) <= {"block_n", "nb", "split_k", "num_warps", "num_stages"}
                    assert cfg.get("block_n", 8) >= 8
        for op, extra in (("matvec_flat", set()),
                          ("matvec_int8", {"carry", "stage", "flat", "pieces", "unpack", "mma", "pipe", "gather"})):
            for by_shape in table.get(op, {}).values():
                for shape, by_m in by_shape.items():
                    assert shape in ("small", "medium", "large") or all(v.isdigit() for v in shape.split("x"))
                    for cfg in by_m.values():
                        assert set(cfg) <= {"block_n", "nb", "split_k", "num_warps"} | extra
                        assert cfg.get("block_n", 8) >= 8
                        assert all(cfg.get(key, 0) in (0, 1) for key in ("carry", "stage", "flat", "pieces", "unpack", "gather"))
                        assert cfg.get("pipe", 0) in (0, 1, 2)
                        assert cfg.get("mma", 0) in (0, 1, 2)  # 1: the tl.dot kernel, 2: the lanes kernels
        assert set(table.get("matvec_kernel", {}).values()) <= {"tiles", "flat", "int8"}


def test_shape_classes():
    assert shape_class(576, 576) == "small"
    assert shape_class(14336, 4096) == "medium"
    assert shape_class(128256, 4096) == "large"


def test_tuning_file_picks_the_decode_kernel_per_type_and_the_layer_runs_it(tmp_path, monkeypatch):
    """"matvec_kernel" chooses the flat kernel for Q4_0 and the int8 one for Q4_K; a layer of Q4_0, Q8_0
    and Q4_K stacked then runs one kernel of each (counted) and still equals the reference products; it
    takes a q8_1 copy of x from its caller instead of quantizing x itself."""
    from dataclasses import replace

    import torch

    from vegaserve.engine.gguf_file import TensorInfo
    from vegaserve.engine.layers.linear import QuantLinear, TritonMethod, WeightSource
    from vegaserve.triton_kernels import matmul, matvec_flat, matvec_int8
    from vegaserve.triton_kernels.quants.random_blocks import random_blocks

    f = tmp_path / "t.json"
    f.write_text(json.dumps({"matvec_kernel": {"Q4_0": "flat", "Q4_K": "int8"},
                             "matvec_flat": {"Q4_0": {"small": {"8": {"block_n": 16, "nb": 2, "split_k": 2,
                                                                       "num_warps": 1}}}}}))
    t = load_tuning("cuda_sm90", f)
    assert [t.matvec_kernel(n) for n in ("Q4_0", "Q8_0", "Q4_K")] == ["flat", "tiles", "int8"]
    gen = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k = 256
    sources = []
    for tid, name, block in ((2, "Q4_0", 32), (8, "Q8_0", 32), (12, "Q4_K", 256)):
        raw = random_blocks(tid, 24, k // block, gen).to(device)
        sources.append(WeightSource(TensorInfo(name, tid, name, (24, k), raw.numel(), 0, 0), raw.reshape(-1), "t.gguf"))
    layer = QuantLinear(k, [24, 24, 24], TritonMethod(tuning_file=str(f)))
    layer.load(sources, torch.device(device))
    calls = []
    for mod, fn in ((matvec_flat, "matvec_flat"), (matmul, "matvec"), (matvec_int8, "matvec_int8")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _r=real, _n=fn, **kw: calls.append(_n) or _r(*a, **kw))
    layer.tuned = [[layer.method._matvec_for(w, m) for m in range(1, 9)] for w in layer.packed]
    x = torch.randn(3, k, generator=gen)
    y = layer(x.to(device)).cpu().double()
    assert sorted(calls) == ["matvec", "matvec_flat", "matvec_int8"]
    assert layer.tuned[0][2][1] == {"block_n": 16, "nb": 2, "split_k": 2, "num_warps": 1}
    cpu = [replace(w, data=w.data.cpu()) for w in layer.packed]
    for part, w in zip(y.split(24, dim=-1)[:2], cpu[:2], strict=True):
        ref = matmul.reference_matmul(x, w)
        assert float((part - ref).norm() / ref.norm()) < 1e-5
    q, d, _ = matvec_int8.quantize_q8_1(x.to(device))
    ref = matvec_int8.reference_matvec_q8_1(q.cpu(), d.cpu(), cpu[2])
    assert float((y[:, 48:] - ref).norm() / ref.norm()) < 1e-5
    # a q8_1 copy handed over (as the norm before writes it) is used, not made again
    assert layer.wants_q8_1(3) and not layer.wants_q8_1(9)
    q8 = matvec_int8.quantize_q8_1(x.to(device))
    made = []
    real_q = matvec_int8.quantize_q8_1
    monkeypatch.setattr(matvec_int8, "quantize_q8_1", lambda *a: made.append(1) or real_q(*a))
    assert torch.equal(layer(x.to(device), q8).cpu().double(), y) and not made
    assert torch.equal(layer(x.to(device)).cpu().double(), y) and made == [1]


def _mixed_qkv(gen, device: str, k: int, sizes: list[int]) -> list:
    """WeightSources of a Q4_K_M mixed q/k/v: random Q4_K q and k and a Q6_K v of `sizes` rows and k columns."""
    from vegaserve.engine.gguf_file import TensorInfo
    from vegaserve.engine.layers.linear import WeightSource
    from vegaserve.triton_kernels.quants.random_blocks import random_blocks

    sources = []
    for (tid, name), rows in zip(((12, "Q4_K"), (12, "Q4_K"), (14, "Q6_K")), sizes, strict=True):
        raw = random_blocks(tid, rows, k // 256, gen).to(device)
        sources.append(WeightSource(TensorInfo(name, tid, name, (rows, k), raw.numel(), 0, 0), raw.reshape(-1), "t.gguf"))
    return sources


def test_one_row_through_stacked_int8_matrices_of_two_types_needs_no_cat(tmp_path, monkeypatch):
    """Q4_K q/k with a Q6_K v (the Q4_K_M mix): at one row each int8 mat-vec writes its columns of the
    layer's output in place (no torch.cat), and each part equals the reference product on the same q8_1
    activation; at two rows the outputs are concatenated, with the same values per row."""
    from dataclasses import replace

    import torch

    from vegaserve.engine.layers import linear
    from vegaserve.engine.layers.linear import QuantLinear, TritonMethod
    from vegaserve.triton_kernels import matvec_int8

    gen = torch.Generator().manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, sizes = 256, [16, 8, 8]
    sources = _mixed_qkv(gen, device, k, sizes)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"matvec_kernel": {"Q4_K": "int8", "Q6_K": "int8"}}))
    layer = QuantLinear(k, sizes, TritonMethod(tuning_file=str(f)))
    layer.load(sources, torch.device(device))
    assert [w.type_name for w in layer.packed] == ["Q4_K", "Q6_K"]
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(linear.torch, "cat", lambda *a, **kw: cats.append(1) or real_cat(*a, **kw))
    x = torch.randn(2, k, generator=gen).to(device)
    one = layer(x[:1])
    assert not cats and one.shape == (1, 32)
    both = layer(x)
    assert cats and both.shape == (2, 32)
    q, d, _ = matvec_int8.quantize_q8_1(x)
    for rows, y in ((1, one), (2, both)):
        for part, w in zip(y.split([24, 8], dim=-1), layer.packed, strict=True):
            ref = matvec_int8.reference_matvec_q8_1(q[:rows].cpu(), d[:rows].cpu(), replace(w, data=w.data.cpu()))
            assert float((part.cpu().double() - ref).norm() / ref.norm()) < 1e-5


def test_tuning_file_pairs_a_layers_two_k_quant_matrices_into_one_launch(tmp_path, monkeypatch):
    """"matvec_int8_pairs": a layer of Q4_K q/k and a Q6_K v takes one launch at one row (matvec_int8_pair,
    no matvec_int8 call), with the same output bit for bit as its two launches without the key; at two
    rows the two launches stay. Without the key nothing pairs."""
    import torch

    from vegaserve.engine.layers.linear import QuantLinear, TritonMethod
    from vegaserve.triton_kernels import matvec_int8

    gen = torch.Generator().manual_seed(6)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, sizes = 512, [16, 8, 8]
    sources = _mixed_qkv(gen, device, k, sizes)
    layers = {}
    for pairs_on in (False, True):
        f = tmp_path / f"t{int(pairs_on)}.json"
        f.write_text(json.dumps({"matvec_kernel": {"Q4_K": "int8", "Q6_K": "int8"}, "matvec_int8_pairs": pairs_on}))
        layers[pairs_on] = QuantLinear(k, sizes, TritonMethod(tuning_file=str(f)))
        layers[pairs_on].load(sources, torch.device(device))
    assert layers[True].pair and not layers[False].pair
    calls = []
    for fn in ("matvec_int8", "matvec_int8_pair"):
        real = getattr(matvec_int8, fn)
        monkeypatch.setattr(matvec_int8, fn, lambda *a, _r=real, _n=fn, **kw: calls.append(_n) or _r(*a, **kw))
    for layer in layers.values():  # the counted kernel, as the layer looks it up at load
        layer.tuned = [[layer.method._matvec_for(w, m) for m in range(1, 9)] for w in layer.packed]
    x = torch.randn(2, k, generator=gen).to(device)
    paired = layers[True](x[:1])
    assert calls == ["matvec_int8_pair"]
    calls.clear()
    assert torch.equal(paired, layers[False](x[:1])) and calls == ["matvec_int8", "matvec_int8"]
    calls.clear()
    assert torch.equal(layers[True](x), layers[False](x)) and calls == ["matvec_int8"] * 4
