"""The decode mat-vec's entry point (triton_kernels/matvec.py): every shipped tuning file's entries name a
kernel that serves their type and layout, with a launch that kernel takes; every shipped kernel is selected
by some file or the fallback; the engine reaches the kernels only through the entry point; and `matvec`
with each kernel against `reference_matvec` (float64; the q8_1 activation for the int8 kernels), with the
output poisoned with NaN. Under the interpreter on a CPU, natively on a GPU."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vegaserve.triton_kernels import matvec as entry
from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import canonical, repack
from vegaserve.triton_kernels.matvec import KERNELS, Choice, choose, matvec, reference_matvec
from vegaserve.triton_kernels.matvec_launch import plan
from vegaserve.triton_kernels.matvec_launch import rule as launch_rule
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.tune import SHAPES
from vegaserve.triton_kernels.tuning import _FALLBACK, CONFIG_DIR, TABLES, load_tuning

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IDS = {s.name: t for t, s in GGML_TYPES.items()}
REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.json"))


def _entries(table: dict):
    """(table, type, shape key, rows, entry) of every entry of a tuning file's mat-vec tables."""
    for table_name in TABLES:
        for type_name, by_shape in table.get(table_name, {}).items():
            for shape, by_m in by_shape.items():
                for m, found in by_m.items():
                    yield table_name, type_name, shape, int(m), found


def _meta_weight(type_name: str, n: int, k: int, repacked: bool):
    """An [n, k] matrix of `type_name` in either layout on the meta device: its fields, no bytes."""
    tid = IDS[type_name]
    spec = GGML_TYPES[tid]
    raw = torch.empty(n * (k // spec.block_size) * spec.type_size, dtype=torch.uint8, device="meta")
    return (repack if repacked else canonical)(raw, tid, n, k)


def _shapes(by_shape: dict) -> list[tuple[int, int]]:
    """The exact shapes of a type's entries, and a shape of each class (tune.py's), which reach the class
    and `any` entries."""
    exact = [tuple(int(v) for v in shape.split("x")) for shape in by_shape if "x" in shape]
    return exact + list(SHAPES.values())


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_shipped_entry_names_a_kernel_that_serves_its_type_and_layout(path):
    tuning = load_tuning(path.stem, path)
    entries = list(_entries(tuning.table))
    assert entries
    for table_name, type_name, shape, m, found in entries:
        where = f"{path.name} {table_name} {type_name} {shape} {m}"
        kernel = KERNELS.get(found.get("kernel"))
        assert kernel is not None, f"{where}: kernel {found.get('kernel')!r}"
        assert IDS[type_name] in kernel.types, f"{where}: {kernel.name} does not serve {type_name}"
        if table_name == "matvec_canonical":
            assert kernel.canonical, f"{where}: {kernel.name} does not read canonical blocks"
    for w, m, choice in _choices(tuning):
        assert w.type_id in choice.kernel.types


def _choices(tuning):
    """(weight on the meta device, rows, matvec.choose's choice) for every exact shape of the file's tables
    at 1..8 rows."""
    for table_name in TABLES:
        for type_name, by_shape in tuning.table.get(table_name, {}).items():
            for n, k in _shapes(by_shape):
                w = _meta_weight(type_name, n, k, table_name == "matvec")
                for m in range(1, 9):
                    yield w, m, choose(w, m, tuning)


# the launch parameters each kernel's launcher reads
PARAMETERS = {"tiles": {"block_n", "nb", "split_k", "num_warps", "num_stages"},
              "int8": {"block_n", "nb", "split_k", "num_warps", "carry"},
              "pieces": {"block_n", "nb", "split_k", "num_warps", "carry", "unpack"},
              "lanes": {"block_n", "nb", "split_k", "num_warps", "carry"}}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_shipped_entry_is_a_launch_its_kernel_takes(path):
    """Each entry's parameters are ones its kernel reads (a leftover knob would be ignored without a word),
    and at the shapes it is looked up for, the chosen launch passes the launcher's checks (matvec_launch.plan,
    the lanes kernel's 16 rows a warp), so no model load picks a launch that fails at its first step."""
    tuning = load_tuning(path.stem, path)
    assert set(PARAMETERS) == set(KERNELS)
    for table_name, type_name, shape, m, found in _entries(tuning.table):
        extra = set(found) - {"kernel"} - PARAMETERS[found["kernel"]]
        assert not extra, f"{path.name} {table_name} {type_name} {shape} {m}: {sorted(extra)}"
    for w, m, choice in _choices(tuning):
        params = choice.params
        assert params["block_n"] >= 8 and params["block_n"] & (params["block_n"] - 1) == 0
        if choice.kernel.name != "tiles":
            plan(choice.kernel.name, torch.empty(m, w.k, device="meta"), w, params)
        if choice.kernel.name == "lanes":
            assert params["block_n"] % (16 * params["num_warps"]) == 0, (w.type_name, w.n, w.k, m, params)


def test_every_shipped_kernel_is_selected_by_a_tuning_file_or_the_fallback():
    named = {backend["matvec"]["kernel"] for backend in _FALLBACK.values()}
    for path in CONFIG_FILES:
        named |= {found.get("kernel") for *_, found in _entries(json.loads(path.read_text()))}
    assert set(KERNELS) <= named, f"no file selects {sorted(set(KERNELS) - named)}"


# modules of the decode mat-vec behind the entry point, and the tile kernel's launcher
BEHIND_THE_ENTRY = {f"vegaserve.triton_kernels.{m}" for m in ("matvec_int8", "matvec_pieces", "matvec_mma",
                                                               "matvec_launch")}
ROOTS = {"engine": "vegaserve.engine", "server": "vegaserve.server"}


def decode_matvec_imports(repo: Path) -> tuple[list[str], set[str]]:
    """(each import or use of a module behind the entry point, or of matmul.tile_matvec, in engine/ and
    server/ as "file:line what"; the files that import vegaserve.triton_kernels.matvec), from the source."""
    bad, users = [], set()
    for folder, package in ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo)
            parts = [*package.split("."), *path.relative_to(repo / folder).with_suffix("").parts]
            anchor = parts[:-1]  # the file's package, for relative imports
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join([*anchor[: len(anchor) - (node.level - 1)], *([base] if base else [])])
                    names = [base] + [f"{base}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Attribute) and node.attr == "tile_matvec":
                    bad.append(f"{rel}:{node.lineno} .tile_matvec")
                for name in names:
                    if any(name == m or name.startswith(m + ".") for m in BEHIND_THE_ENTRY):
                        bad.append(f"{rel}:{node.lineno} {name}")
                    elif name == "vegaserve.triton_kernels.matmul.tile_matvec":
                        bad.append(f"{rel}:{node.lineno} {name}")
                    elif name == "vegaserve.triton_kernels.matvec":
                        users.add(str(rel))
    return bad, users


def test_the_engine_reaches_the_decode_matvec_only_through_its_entry_point():
    """engine/ and server/ import no kernel module of the decode mat-vec and not the tile kernel's launcher:
    the tuning file's choice (matvec.choose) is the only way a layer picks a kernel. The linear layer is
    the entry point's user (so the scan sees the imports it is looking for)."""
    bad, users = decode_matvec_imports(REPO)
    assert not bad, bad
    assert "engine/layers/linear.py" in users


def _q4_k(n: int, k: int, seed: int, layout=repack):
    tid = IDS["Q4_K"]
    raw = random_blocks(tid, n, k // 256, torch.Generator().manual_seed(seed))
    return layout(raw.to(DEVICE), tid, n, k)


def _cpu(w):
    return replace(w, data=w.data.cpu())


CHOICES = {"tiles": {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1},
           "int8": {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1},
           "pieces": {"block_n": 8, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 0, "unpack": 1},
           "lanes": {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}}


@pytest.mark.usefixtures("poisoned_empty")
def test_each_kernel_through_the_entry_point_matches_its_reference():
    """matvec with a Choice of each kernel on one Q4_K matrix (all four serve it) at 1 and 3 rows: within 1e-5
    of reference_matvec, which is the float product for the tile kernel and the product on x's q8_1 form
    for the int8 kernels (the two differ by the q8_1 rounding, far more than 1e-5); the tile kernel also on
    canonical blocks."""
    w = _q4_k(21, 512, 1)
    gen = torch.Generator().manual_seed(2)
    for m in (1, 3):
        x = torch.randn(m, 512, generator=gen).to(DEVICE)
        float_ref = reference_matvec(x.cpu(), _cpu(w), Choice(KERNELS["tiles"], {}))
        q8_ref = reference_matvec(x.cpu(), _cpu(w), Choice(KERNELS["int8"], {}))
        assert float((q8_ref - float_ref).norm() / float_ref.norm()) > 1e-4
        for name, params in CHOICES.items():
            choice = Choice(KERNELS[name], params)
            y = matvec(x, w, choice)
            assert torch.isfinite(y).all() and y.shape == (m, 21)
            ref = q8_ref if KERNELS[name].int8 else float_ref
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, (name, m)
        y = matvec(x, _q4_k(21, 512, 1, canonical), Choice(KERNELS["tiles"], CHOICES["tiles"]))
        assert float((y.double().cpu() - float_ref).norm() / float_ref.norm()) < 1e-5


def test_matvec_without_a_choice_takes_the_tuning_files(tmp_path, monkeypatch):
    """choice left out: matvec looks the matrix up in the active target's file (choose), the entry's
    parameters over its kernel's rule."""
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"matvec": {"Q4_K": {"any": {"2": {"kernel": "int8", "block_n": 8, "carry": 0}}}}}))
    monkeypatch.setattr(entry, "load_tuning", lambda: load_tuning("cuda_sm90", f))
    ran = []
    real = KERNELS["int8"]
    monkeypatch.setitem(KERNELS, "int8", replace(real, launch=lambda *a: ran.append(a[2]) or real.launch(*a)))
    w = _q4_k(16, 256, 3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = matvec(x, w)
    assert ran == [{**launch_rule(IDS["Q4_K"], 16, 256, 2, *entry.device_shape(w.data.device)), "block_n": 8,
                    "carry": 0}]
    assert torch.equal(y, real.launch(x, w, ran[0]))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("name", ["int8", "pieces", "lanes"])
def test_int8_kernels_write_one_row_into_a_column_slice_of_a_wider_output(name):
    """out: at M = 1 the product goes to a column slice of a wider f32 output (the stacked matrices of one
    activation write one output, no cat), its other columns untouched; a wrongly shaped, typed or strided
    out is refused, as is a column slice for more than one row (its rows are not N apart)."""
    w = _q4_k(24, 256, 3)
    choice = Choice(KERNELS[name], {**CHOICES[name], "split_k": 1})
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    q8 = quantize_q8_1(x)
    wide = torch.full((1, 40), -7.0, device=DEVICE)
    got = matvec(x, w, choice, q8_1=q8, out=wide[:, 10:34])
    assert got.data_ptr() == wide[:, 10:].data_ptr()
    assert torch.equal(wide[:, 10:34], matvec(x, w, choice, q8_1=q8))
    assert (wide[:, :10] == -7.0).all() and (wide[:, 34:] == -7.0).all()
    for bad in (torch.empty(1, 23, device=DEVICE), torch.empty(1, 24, dtype=torch.float16, device=DEVICE),
                torch.empty(24, 2, device=DEVICE)[:, 0][None]):
        with pytest.raises(ValueError, match="out must be"):
            matvec(x, w, choice, q8_1=q8, out=bad)
    x3 = torch.randn(3, 256, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        matvec(x3, w, choice, out=torch.empty(3, 40, device=DEVICE)[:, :24])


def _shipped_exact_entries() -> list[tuple[str, int, int, int]]:
    table = load_tuning(target="cuda_sm90").table.get("matvec", {})
    return [(name, *(int(v) for v in shape.split("x")), int(m))
            for name, shapes in sorted(table.items()) for shape, by_m in sorted(shapes.items())
            if "x" in shape for m in sorted(by_m)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name, n, k, m", _shipped_exact_entries())
def test_every_shipped_entry_is_right_at_its_own_shape(name, n, k, m):
    """Each exact-shape entry of the H200 tuning file, at that shape, chosen as a linear layer chooses it
    (matvec.choose from the device's file): variants that passed the interpreter's small shapes were wrong
    on the H200 at an engine shape twice, so the shapes the engine runs are checked here as they run."""
    tid = IDS[name]
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n + k)).cuda()
    w = repack(raw, tid, n, k)
    choice = choose(w, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).cuda()
    q8 = quantize_q8_1(x)
    xd = (q8[0].float().view(m, -1, 32) * q8[1][..., None]).view(m, k) if choice.kernel.int8 else x
    ref = xd @ dequantize(raw.reshape(-1), tid, (n, k)).T
    y = matvec(x, w, choice, q8_1=q8 if choice.kernel.int8 else None)
    assert float((y - ref).norm() / ref.norm()) < 1e-4
