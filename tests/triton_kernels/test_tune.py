"""`vegaserve tune` (triton_kernels/tune.py): the candidates it times for each type and row count, that a
candidate off the reference never wins however fast, and on a GPU one whole small run into a file."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from vegaserve.triton_kernels import matvec_int8, matvec_mma, matvec_pieces, tune
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec import KERNELS, Choice, choose
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.tuning import load_tuning

IDS = {s.name: t for t, s in GGML_TYPES.items()}


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "Q5_K"])
def test_candidates_are_every_kernel_that_serves_the_type(name):
    """The tile configs for every type; the int8 kernel's for its types; the pieces kernel's at one row
    only; the lanes kernel's only where the GPU has matrix units. Each kernel's configs are its own
    module's candidates, the whole list each config once."""
    tid = IDS[name]
    for m in (1, 8):
        for units in (False, True):
            got = tune.candidates(tid, 28672, 4096, m, 132, units)
            by_kernel = {k: [c.params for c in got if c.kernel is KERNELS[k]] for k in KERNELS}
            assert {c.kernel.name for c in got} <= set(KERNELS)
            assert by_kernel["tiles"] == tune.TILE_CANDIDATES
            want_int8 = matvec_int8.candidates(tid, 28672, 4096, m, 132) if tid in matvec_int8.TYPES else []
            assert by_kernel["int8"] == want_int8
            assert by_kernel["pieces"] == (matvec_pieces.candidates(tid, 28672, 4096, m, 132)
                                           if tid in matvec_pieces.TYPES else [])
            assert bool(by_kernel["pieces"]) == (m == 1 and tid in matvec_pieces.TYPES)
            assert by_kernel["lanes"] == (matvec_mma.candidates(tid, 28672, 4096, 132)
                                          if units and tid in matvec_mma.TYPES else [])
            keys = [(c.kernel.name, tuple(sorted(c.params.items()))) for c in got]
            assert len(set(keys)) == len(keys)


@pytest.mark.usefixtures("poisoned_empty")
def test_a_candidate_off_the_reference_never_wins_however_fast(monkeypatch):
    """_fastest checks each candidate's result before timing it: one that computes a wrong product (as a
    miscompile would) is discarded and one the launcher refuses is skipped, both with a line in the log,
    though either would have been the fastest; the int8 kernels' times include the quantize launch."""
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(1)), tid, 16, 256)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    params = {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1}
    tiles, int8 = KERNELS["tiles"], KERNELS["int8"]

    def refuse(*a):
        raise ValueError("refused launch")

    wrong = Choice(replace(int8, launch=lambda *a: int8.launch(*a) * 1.001), params)
    choices = [Choice(tiles, params), wrong, Choice(replace(int8, launch=refuse), params), Choice(int8, params)]
    times = iter([5.0, 3.0])  # the tile config, then the int8 one: the only two timed
    monkeypatch.setattr(tune, "bench_graph", lambda fns: next(times))
    log: list[str] = []
    t, best = tune._fastest("Q4_K", choices, x, [w], 1.5, log.append)
    assert best is choices[3] and t == 3.0 + 1.5
    assert len(log) == 2 and "discarded" in log[0] and "refused" in log[1]
    with pytest.raises(RuntimeError, match="no candidate computed the right result"):
        tune._fastest("Q4_K", [wrong], x, [w], 1.5, log.append)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tune_writes_the_fastest_kernel_and_the_fastest_tile_config(tmp_path):
    """One type, class and row count: the "matvec" entry names the fastest kernel of all with its launch
    parameters, "matvec_canonical" the tile kernel's fastest; entries tuned elsewhere are kept; the file
    loads and every entry resolves through matvec.choose."""
    out = tmp_path / "t.json"
    kept = {"Q4_0": {"small": {"1": {"kernel": "tiles", "block_n": 16}}}}
    out.write_text(json.dumps({"matvec": kept}))
    lines: list[str] = []
    tune.tune(["Q8_0"], ["small"], [1], out, log=lines.append)
    table = json.loads(out.read_text())
    assert table["matvec"]["Q4_0"] == kept["Q4_0"]
    best = table["matvec"]["Q8_0"]["small"]["1"]
    assert best["kernel"] in KERNELS and {"block_n", "nb", "split_k"} <= set(best)
    assert table["matvec_canonical"]["Q8_0"]["small"]["1"]["kernel"] == "tiles"
    t = load_tuning(table["target"], out)
    n, k = tune.SHAPES["small"]
    raw = random_blocks(IDS["Q8_0"], n, k // 32, torch.Generator().manual_seed(0)).cuda()
    assert choose(repack(raw, IDS["Q8_0"], n, k), 1, t).kernel.name == best["kernel"]
    assert any(best["kernel"] in line for line in lines)
