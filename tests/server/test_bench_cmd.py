"""`vegaserve bench`: llama-bench's table with one row per pp/tg test and a JSON line of positive rates, on
the synthetic tiny model; wrong counts are one-line errors before any model loads."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import ModuleType

import pytest

import vegaserve.server.cli as cli


@pytest.fixture(scope="module")
def bench_output(gguf_factory: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    """stdout of `vegaserve bench -m tiny.gguf -p 16 -n 4 -r 2` on the CPU."""
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    gguf_factory.synth_gguf.write_synth_gguf(path, "tiny", "Q4_K_M")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["bench", "-m", str(path), "-p", "16", "-n", "4", "-r", "2", "--device", "cpu"])
    assert rc == 0
    return out.getvalue()


def test_table_has_llama_bench_columns_and_one_row_per_test(bench_output: str) -> None:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in bench_output.splitlines() if line.startswith("|")]
    assert rows[0] == ["model", "size", "params", "backend", "test", "t/s"]
    assert [r[4] for r in rows[2:]] == ["pp16", "tg4"]
    for r in rows[2:]:
        assert r[0] == "llama Q4_K_M" and r[1].endswith(" GiB") and r[2].endswith(" B") and r[3] == "CPU"
        median, stddev = (float(x) for x in r[5].split(" ± "))
        assert median > 0 and stddev >= 0


def test_last_line_is_json_with_positive_rates_per_repetition(bench_output: str) -> None:
    line = json.loads(bench_output.strip().splitlines()[-1])
    assert [(r["test"], r["n_prompt"], r["n_gen"]) for r in line["results"]] == [("pp16", 16, 0), ("tg4", 0, 4)]
    for r in line["results"]:
        assert len(r["samples"]) == 2 and all(s > 0 for s in r["samples"])
        assert r["t_s_median"] > 0
    assert line["size_bytes"] > 0 and line["params"] > 0 and line["repetitions"] == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["-p", "16", "-n", "4", "-c", "20"], "-c 20 is too small for these tests: they need 28 tokens"),
     (["-p", "0", "-n", "0"], "nothing to measure"),
     (["-r", "0"], "-r must be >= 1, got 0")],
    ids=["small-context", "no-tests", "no-repetitions"],
)  # fmt: skip
def test_bad_counts_are_one_error_line_before_loading(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the model file does not exist: the check has to come before loading it
    assert cli.main(["bench", "-m", str(tmp_path / "none.gguf"), *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("vegaserve: error: ") and says in err[0]


def test_counts_that_are_not_numbers_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "-p", "16,x"])
    assert e.value.code == 2
    assert "expected comma-separated integers, got '16,x'" in capsys.readouterr().err
