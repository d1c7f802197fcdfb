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


def test_shape_classes():
    assert shape_class(576, 576) == "small"
    assert shape_class(14336, 4096) == "medium"
    assert shape_class(128256, 4096) == "large"
