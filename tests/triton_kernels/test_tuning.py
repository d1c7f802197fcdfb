"""The decode mat-vec's kernel and launch parameters come from the tuning file (triton_kernels/tuning.py),
else from the backend's fallback: the lookup order (exact shape, class, `any`; the nearest measured row
count at or above, else the largest), the canonical table kept apart, and a file naming a kernel that
cannot serve an entry refused with the file's name (matvec.choose)."""

from __future__ import annotations

import json

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import canonical, repack
from vegaserve.triton_kernels.matvec import KERNELS, choose
from vegaserve.triton_kernels.matvec_launch import rule as launch_rule
from vegaserve.triton_kernels.tuning import _FALLBACK, CONFIG_DIR, load_tuning, shape_class

IDS = {s.name: t for t, s in GGML_TYPES.items()}


def _file(tmp_path, table: dict):
    """A tuning file of its own name (files are read once per path)."""
    f = tmp_path / f"t{len(list(tmp_path.glob('t*.json')))}.json"
    f.write_text(json.dumps(table))
    return f


def _meta_weight(type_name: str, n: int, k: int, layout=repack):
    tid = IDS[type_name]
    spec = GGML_TYPES[tid]
    raw = torch.empty(n * (k // spec.block_size) * spec.type_size, dtype=torch.uint8, device="meta")
    return layout(raw, tid, n, k)


def test_an_exact_shape_comes_before_its_class_and_the_class_before_any(tmp_path):
    t = load_tuning("cuda_sm90", _file(tmp_path, {"matvec": {"Q4_K": {
        "4096x14336": {"1": {"kernel": "pieces", "block_n": 64}},
        "medium": {"1": {"kernel": "int8", "block_n": 16}},
        "any": {"1": {"kernel": "tiles", "block_n": 32}}}}}))
    assert t.matvec("Q4_K", 4096, 14336, 1) == {"kernel": "pieces", "block_n": 64}
    assert t.matvec("Q4_K", 14336, 4096, 1) == {"kernel": "int8", "block_n": 16}  # medium, another shape
    assert t.matvec("Q4_K", 28672, 4096, 1) == {"kernel": "tiles", "block_n": 32}  # large: no class entry
    assert t.matvec("Q4_K", 1024, 1024, 1) == {"kernel": "tiles", "block_n": 32}  # small


def test_lookup_takes_the_nearest_measured_row_count_at_or_above_else_the_largest(tmp_path):
    t = load_tuning("cuda_sm90", _file(tmp_path, {"matvec": {"Q4_K": {"large": {
        "1": {"kernel": "pieces"}, "4": {"kernel": "int8", "block_n": 32}, "6": {"kernel": "lanes"}}}}}))
    picked = [t.matvec("Q4_K", 16384, 8192, m)["kernel"] for m in range(1, 9)]
    assert picked == ["pieces", "int8", "int8", "int8", "lanes", "lanes", "lanes", "lanes"]
    assert t.matvec("Q4_K", 16384, 8192, 3) == {"kernel": "int8", "block_n": 32}


@pytest.mark.parametrize("target, scratch, dense_from", [("cuda_sm90", "bfloat16", 129), ("hip_gfx906", "float16", 9),
                                                         ("cpu", "bfloat16", 129)])
def test_missing_entries_fall_back_to_the_backends_tile_kernel(tmp_path, target, scratch, dense_from):
    """No file, or no entry for the type: the backend's fallback, the tile kernel (it serves every type
    and either layout); the quantized GEMM up to 128 rows on NVIDIA, none yet on gfx906 (not measured
    there); prefill's scratch copy in the backend's fastest GEMM type (gfx906 has no bf16 units). The CPU
    (tests, offline compiles) takes NVIDIA's."""
    for t in (load_tuning(target, tmp_path / "absent.json"),
              load_tuning(target, _file(tmp_path, {"matvec": {"Q4_K": {"any": {"1": {"kernel": "int8"}}}}}))):
        assert t.matvec("Q6_K", 4096, 4096, 1) == _FALLBACK[t.backend]["matvec"]
        assert t.matvec("Q6_K", 4096, 4096, 1)["kernel"] == "tiles"
        assert t.scratch_dtype == scratch and t.dense_from_m == dense_from
        assert t.gemm("Q6_K", 4096, 4096, 16) == {}
    assert load_tuning(target, tmp_path / "absent.json").file is None


def test_the_canonical_table_serves_only_weights_kept_in_gguf_blocks(tmp_path):
    f = _file(tmp_path, {"matvec": {"Q4_K": {"any": {"1": {"kernel": "int8", "block_n": 64}}}},
                         "matvec_canonical": {"Q4_K": {"any": {"1": {"kernel": "tiles", "block_n": 8}}}}})
    t = load_tuning("cuda_sm90", f)
    assert t.matvec("Q4_K", 4096, 4096, 1) == {"kernel": "int8", "block_n": 64}
    assert t.matvec("Q4_K", 4096, 4096, 1, repacked=False) == {"kernel": "tiles", "block_n": 8}
    assert choose(_meta_weight("Q4_K", 4096, 4096), 1, t).kernel.name == "int8"
    assert choose(_meta_weight("Q4_K", 4096, 4096, canonical), 1, t).params["block_n"] == 8
    # a type with repacked entries only: canonical weights take the fallback, not the repacked table's kernel
    t = load_tuning("cuda_sm90", _file(tmp_path, {"matvec": {"Q4_K": {"any": {"1": {"kernel": "int8"}}}}}))
    assert choose(_meta_weight("Q4_K", 4096, 4096, canonical), 1, t).kernel.name == "tiles"


def test_choose_fills_what_an_entry_leaves_out_from_its_kernels_rule(tmp_path):
    t = load_tuning("cuda_sm90", _file(tmp_path, {"matvec": {"Q4_K": {"any": {
        "1": {"kernel": "int8", "block_n": 16, "num_warps": 8}, "8": {"kernel": "lanes"}}}}}))
    w = _meta_weight("Q4_K", 5120, 4096)
    one = choose(w, 1, t)
    assert one.kernel is KERNELS["int8"]
    assert one.params == {**launch_rule(IDS["Q4_K"], 5120, 4096, 1, 132), "block_n": 16, "num_warps": 8}
    eight = choose(w, 8, t)
    assert eight.kernel is KERNELS["lanes"]
    assert eight.params == KERNELS["lanes"].rule(IDS["Q4_K"], 5120, 4096, 8, 132, 32)
    assert eight.params["block_n"] == 64 and eight.params["num_warps"] == 2


@pytest.mark.parametrize("table, weight, message", [
    ({"matvec": {"Q4_K": {"any": {"1": {"kernel": "flat"}}}}}, ("Q4_K", repack),
     "names kernel 'flat'; the kernels are"),
    ({"matvec": {"Q5_K": {"any": {"1": {"kernel": "int8"}}}}}, ("Q5_K", repack), "does not serve Q5_K \\(repacked\\)"),
    ({"matvec": {"Q8_0": {"any": {"1": {"kernel": "pieces"}}}}}, ("Q8_0", repack), "does not serve Q8_0"),
    ({"matvec_canonical": {"Q4_K": {"any": {"1": {"kernel": "int8"}}}}}, ("Q4_K", canonical),
     "does not serve Q4_K \\(canonical\\)"),
], ids=["unknown-kernel", "type-int8-lacks", "type-pieces-lacks", "canonical-blocks"])
def test_a_kernel_that_cannot_serve_the_entry_is_refused_naming_the_file(tmp_path, table, weight, message):
    f = _file(tmp_path, table)
    t = load_tuning("cuda_sm90", f)
    type_name, layout = weight
    with pytest.raises(ValueError, match=message) as refused:
        choose(_meta_weight(type_name, 256, 256, layout), 1, t)
    assert str(f) in str(refused.value) and f"{type_name} 256x256" in str(refused.value)


def test_shipped_tuning_files_parse_and_use_known_keys():
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert {p.stem for p in files} >= {"cuda_sm90", "hip_gfx906"}
    for p in files:
        table = json.loads(p.read_text())
        assert table["target"] == p.stem
        assert set(table) <= {"target", "source", "matvec", "matvec_canonical", "experts", "prefill"}
        assert set(table.get("prefill", {})) <= {"dense_from_m", "scratch_dtype", "scratch_mib"}
        for op in ("matvec", "matvec_canonical", "experts"):
            top = 8 if op != "experts" else 1 << 16  # rows a launch; experts: assignments a launch
            for type_name, by_shape in table.get(op, {}).items():
                assert type_name in IDS
                for shape, by_m in by_shape.items():
                    assert shape in ("small", "medium", "large", "any") or all(
                        v.isdigit() for v in shape.split("x")), shape
                    assert by_m and all(m.isdigit() and 1 <= int(m) <= top for m in by_m), (p.name, shape)
                    for cfg in by_m.values():
                        assert cfg.get("kernel", "tiles") in KERNELS
                        assert cfg.get("block_n", 8) >= 8
                        assert all(cfg.get(key, 0) in (0, 1) for key in ("carry", "unpack"))


def test_shape_classes():
    assert shape_class(576, 576) == "small"
    assert shape_class(14336, 4096) == "medium"
    assert shape_class(128256, 4096) == "large"


def test_gemm_entries_are_looked_up_by_shape_then_rows_and_unknown_parameters_are_refused(tmp_path):
    from vegaserve.triton_kernels.layout import repack
    from vegaserve.triton_kernels.gemm import gemm_params, gemm_rule

    f = _file(tmp_path, {"gemm": {"Q8_0": {"4096x4096": {"16": {"block_n": 128}, "64": {"split_k": 2}},
                                           "any": {"32": {"num_warps": 8}}}}})
    t = load_tuning("cuda_sm90", f)
    assert t.gemm("Q8_0", 4096, 4096, 9) == {"block_n": 128}
    assert t.gemm("Q8_0", 4096, 4096, 40) == {"split_k": 2}
    assert t.gemm("Q8_0", 4096, 4096, 128) == {"split_k": 2}  # past the largest: the largest
    assert t.gemm("Q8_0", 1024, 4096, 16) == {"num_warps": 8}
    w = repack(torch.zeros(4096 * 128 * 34, dtype=torch.uint8, device="meta"), 8, 4096, 4096)
    assert gemm_params(w, 16, t, 132) == {**gemm_rule(8, 4096, 4096, 16, 132), "block_n": 128}
    bad = load_tuning("cuda_sm90", _file(tmp_path, {"gemm": {"Q8_0": {"any": {"16": {"block_k": 64}}}}}))
    with pytest.raises(ValueError, match="sets block_k"):
        gemm_params(w, 16, bad, 132)


def test_gemm_rule_takes_q4_k_a_sub_block_at_a_time_only_on_a_wide_grid_at_33_to_64_rows():
    from vegaserve.triton_kernels.gemm import gemm_rule

    assert gemm_rule(12, 28672, 4096, 64, 132)["sub"] == 1
    assert gemm_rule(12, 28672, 4096, 40, 132)["sub"] == 1
    for type_id, n, m in ((12, 28672, 16), (12, 28672, 32), (12, 28672, 128), (12, 6144, 64), (12, 4096, 64),
                          (14, 28672, 64), (8, 28672, 64)):
        assert "sub" not in gemm_rule(type_id, n, 4096, m, 132), (type_id, n, m)


def test_gemm_rule_splits_k_only_where_the_grid_is_small():
    from vegaserve.triton_kernels.gemm import gemm_rule

    assert gemm_rule(12, 4096, 14336, 16, 132) == {"block_m": 16, "block_n": 64, "nb": 8, "split_k": 4,
                                                   "num_warps": 4, "num_stages": 2}
    assert gemm_rule(12, 131072, 4096, 100, 132)["split_k"] == 1  # 4096 programs fill the GPU
    assert gemm_rule(12, 4096, 512, 16, 132)["split_k"] == 1  # two super-blocks a row: nothing to split
    assert gemm_rule(12, 4096, 4096, 9, 132)["block_m"] == 16 and gemm_rule(12, 4096, 4096, 100, 132)["block_m"] == 64
