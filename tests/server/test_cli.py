"""server/cli.py: llama-server spellings into the config tree, CLI > env > YAML, `serve` as the default
command, one-line errors, flags and switches of features not implemented yet refused or warned about, and
`vegaserve perplexity` end to end on a tiny model."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from types import ModuleType

import pytest

import vegaserve.server.cli as cli
import vegaserve.server.serve_cmd as serve_cmd
from vegaserve.engine.config import ConfigError, EngineConfig, SpeculativeConfig
from vegaserve.engine.env import NOT_YET, SWITCHES


@pytest.fixture(autouse=True)
def no_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's GGML_*/LLAMA_* switches must not leak into these configs."""
    for name in [*SWITCHES, *NOT_YET]:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> EngineConfig:
    return cli.load_config(cli.build_parser().parse_args(list(argv)))


# -- spellings ------------------------------------------------------------------------------------------


def test_llama_server_spellings_land_in_the_config_tree() -> None:
    c = parse(
        "serve", "-m", "model.gguf", "-c", "4096", "-np", "4", "-lm", "dio", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "sekrit", "-sm", "row", "-tps", "2", "--no-repack", "-a", "my-model", "-b", "512",
        "--seed", "5", "--device", "cpu", "--log-level", "debug", "-ndev", "4", "--device-memory", "15.5",
        "--no-warmup",
    )  # fmt: skip
    assert (c.model.path, c.model.load_mode, c.model.no_repack) == ("model.gguf", "dio", True)
    assert c.kernels.warmup is False and EngineConfig().kernels.warmup is True
    assert c.model.served_model_name == "my-model"
    assert c.cache.context_size == 4096
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (4, 512)
    assert (c.server.host, c.server.port, c.server.api_key, c.server.log_level) == ("0.0.0.0", 9000, "sekrit", "debug")
    assert (c.parallel.split_mode, c.parallel.tensor_parallel_group) == ("tensor", 2)
    assert (c.parallel.n_devices, c.parallel.device_memory_gib) == (4, 15.5)
    assert (c.device, c.seed) == ("cpu", 5)


def test_long_spellings_match_the_short_ones() -> None:
    short = parse("serve", "-m", "m.gguf", "-c", "64", "-np", "2", "-lm", "read", "-a", "x", "-ndev", "2")
    long = parse(
        "serve", "--model", "m.gguf", "--ctx-size", "64", "--parallel", "2", "--load-mode", "read", "--alias", "x",
        "--n-devices", "2",
    )  # fmt: skip
    assert short == long != EngineConfig()


def test_the_fronts_timeouts_and_special_token_reading_land_in_the_server_config() -> None:
    c = parse("serve", "-to", "5", "--header-timeout", "2.5", "--special-tokens-in-content", "--drain-timeout", "3")
    s = c.server
    assert (s.body_timeout_s, s.header_timeout_s, s.special_tokens_in_content, s.drain_timeout_s) == (5, 2.5, True, 3)
    assert parse("serve", "--timeout", "5") == parse("serve", "-to", "5")
    d = parse("serve").server
    assert (d.body_timeout_s, d.header_timeout_s, d.special_tokens_in_content) == (60, 10, False)
    with pytest.raises(ConfigError, match="body_timeout_s must be > 0"):
        parse("serve", "-to", "0")


@pytest.mark.parametrize(
    ("given", "split_mode"), [("row", "tensor"), ("tensor", "tensor"), ("layer", "layer"), ("none", "none")]
)
def test_split_mode_row_is_a_tensor_split(given: str, split_mode: str) -> None:
    assert parse("serve", "-sm", given).parallel.split_mode == split_mode


@pytest.mark.parametrize(("argv", "kv_dtype"), [
    (["-ctk", "f16"], "float16"), (["-ctk", "bf16", "-ctv", "bf16"], "bfloat16"), (["-ctv", "f32"], "float32"),
    ([], "auto"),
])
def test_cache_type_flags_set_the_kv_dtype(argv: list[str], kv_dtype: str) -> None:
    assert parse("serve", *argv).cache.kv_dtype == kv_dtype


def test_different_key_and_value_cache_types_are_refused() -> None:
    with pytest.raises(ConfigError, match="-ctk f16 and -ctv bf16 differ"):
        parse("serve", "-ctk", "f16", "-ctv", "bf16")


@pytest.mark.parametrize(
    "argv", [["-ngl", "99"], ["--gpu-layers", "0"], ["-fa"], ["-fa", "off"], ["--spec-type", "none"], ["--jinja"]]
)
def test_compatibility_flags_change_nothing(argv: list[str]) -> None:
    assert parse("serve", *argv) == EngineConfig()


def test_flags_not_given_leave_the_defaults() -> None:
    assert parse("serve") == EngineConfig()
    args = cli.build_parser().parse_args(["serve", "--port", "1234"])
    assert cli.config_tree_from_args(args) == {"server": {"port": 1234}}


def test_perplexity_takes_the_model_flags() -> None:
    args = cli.build_parser().parse_args(["perplexity", "-m", "m.gguf", "-f", "wiki.txt", "-c", "128", "--chunks", "3"])
    assert (args.command, args.file, args.chunks) == ("perplexity", Path("wiki.txt"), 3)
    c = cli.load_config(args)
    assert (c.model.path, c.cache.context_size) == ("m.gguf", 128)


def test_an_invalid_flag_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"-np\) must be >= 1, got 0"):
        parse("serve", "-np", "0")


# -- priority -------------------------------------------------------------------------------------------


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "settings.yaml"
    path.write_text(
        "server:\n  port: 1000\n  host: 0.0.0.0\n"
        "model:\n  load_mode: read\n"
        "parallel:\n  sched_n_copies: 2\n  tensor_parallel_group: 4\n"
        "kernels:\n  token_graph: true\n"
    )
    return path


def test_cli_beats_env_beats_yaml(yaml_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_SCHED_N_COPIES", "3")
    monkeypatch.setenv("GGML_META_TOKEN_GRAPH", "0")
    c = parse("serve", "--config", str(yaml_file), "--port", "3000", "-lm", "dio")
    assert (c.server.port, c.model.load_mode) == (3000, "dio")  # CLI over YAML
    assert (c.parallel.sched_n_copies, c.kernels.token_graph) == (3, False)  # env over YAML
    assert (c.server.host, c.parallel.tensor_parallel_group) == ("0.0.0.0", 4)  # YAML over defaults


def test_cli_beats_env_on_the_same_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # no switch shares a setting with a flag today, so the env source is stood in for
    monkeypatch.setattr(cli, "config_from_env", lambda: {"server": {"port": 2000, "host": "10.0.0.1"}})
    c = parse("serve", "--port", "3000")
    assert (c.server.port, c.server.host) == (3000, "10.0.0.1")


def test_yaml_without_overrides_is_taken_as_is(yaml_file: Path) -> None:
    c = parse("serve", "--config", str(yaml_file))
    assert (c.server.port, c.model.load_mode, c.parallel.sched_n_copies) == (1000, "read", 2)


def test_bad_env_value_fails_config_loading_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_SCHED_N_COPIES", "many")
    with pytest.raises(ConfigError, match="GGML_SCHED_N_COPIES must be an integer"):
        parse("serve")


@pytest.mark.parametrize(
    ("content", "says"),
    [("server: [1, 2\n", "cannot read the config file"), ("- a\n- b\n", "must be a mapping of sections"),
     ("servr:\n  port: 1\n", "unknown configuration section 'servr'")],
    ids=["bad-yaml", "a-list", "unknown-section"],
)  # fmt: skip
def test_bad_yaml_is_a_config_error(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse("serve", "--config", str(path))


# -- main -----------------------------------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """run_server replaced by a recorder: main's choice of command and config, without a server."""
    calls: list[EngineConfig] = []

    def record(config: EngineConfig) -> int:
        calls.append(config)
        return 0

    monkeypatch.setattr(serve_cmd, "run_server", record)
    return calls


@pytest.mark.parametrize("argv", [[], ["-m", "m.gguf", "--port", "9001"], ["--port", "9001", "-m", "m.gguf"]])
def test_no_subcommand_means_serve(served: list[EngineConfig], argv: list[str]) -> None:
    assert cli.main(argv) == 0
    assert served == [parse("serve", *argv)]
    if argv:
        assert (served[0].model.path, served[0].server.port) == ("m.gguf", 9001)


def test_help_is_not_taken_for_serve(served: list[EngineConfig], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and not served
    assert "{serve,perplexity,bench,tune}" in capsys.readouterr().out


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("vegaserve: error: ") and "Traceback" not in err
    return lines[0]


def test_missing_model_file_exits_2_with_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.gguf"
    assert cli.main(["-m", str(missing)]) == 2
    line = _one_error_line(capsys)
    assert f"{missing}: no such file" in line


def test_config_error_exits_2_with_one_error_line(capsys: pytest.CaptureFixture[str], served: list[EngineConfig]) -> None:
    assert cli.main(["--port", "0"]) == 2
    assert "port must be in 1..65535, got 0" in _one_error_line(capsys)
    assert not served


def test_prefix_states_reach_the_cache_config(served: list[EngineConfig]) -> None:
    assert cli.main(["serve", "-np", "3", "--prefix-states", "5"]) == 0
    assert cli.main(["serve", "-np", "3"]) == 0
    assert cli.main(["serve", "-np", "6"]) == 0
    assert [(c.cache.prefix_states, c.state_snapshots) for c in served] == [(5, 5), (None, 4), (None, 6)]


# -- speculative decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--spec-type", "ngram"], SpeculativeConfig(type="ngram")),
        (["--spec-type", "ngram", "--draft-max", "4", "--spec-ngram-size-n", "5"],
         SpeculativeConfig(type="ngram", draft_max=4, ngram_size=5)),
        (["--spec-type", "draft", "-md", "d.gguf", "--draft-max", "8", "--draft-min", "2", "--draft-p-min", "0.5"],
         SpeculativeConfig(type="draft", draft_model="d.gguf", draft_max=8, draft_min=2, draft_p_min=0.5)),
        # llama-server's newer spellings of the same flags
        (["--spec-type", "draft", "--spec-draft-model", "d.gguf", "--spec-draft-n-max", "3", "--spec-draft-n-min", "1",
          "--spec-draft-p-min", "0.9"],
         SpeculativeConfig(type="draft", draft_model="d.gguf", draft_max=3, draft_min=1, draft_p_min=0.9)),
        (["--spec-type", "draft", "--model-draft", "d.gguf", "--draft", "6"],
         SpeculativeConfig(type="draft", draft_model="d.gguf", draft_max=6)),
    ],
)  # fmt: skip
def test_speculative_flags_reach_the_engine_config(
    argv: list[str], want: SpeculativeConfig, served: list[EngineConfig]
) -> None:
    assert cli.main(["serve", *argv]) == 0
    assert [c.speculative for c in served] == [want]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--spec-type", "ngram", "--draft-max", "0"], "--draft-max must be at least 1, got 0"),
        (["--spec-type", "draft"], "--spec-type draft needs a draft model: -md FILE"),
        (["-md", "d.gguf"], "-md (a draft model) needs --spec-type draft, not none"),
        (["--spec-type", "ngram", "--draft-min", "9", "--draft-max", "4"], "--draft-min 9 exceeds --draft-max 4"),
        (["--spec-type", "draft", "-md", "d.gguf", "--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1], got 1.5"),
        (["--spec-type", "ngram", "--spec-ngram-size-n", "1"], "--spec-ngram-size-n must be at least 2, got 1"),
        (["--prefix-states", "-1"], "--prefix-states must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_bad_speculative_flags_exit_2_with_one_line_before_any_model_loads(
    argv: list[str], says: str, served: list[EngineConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert says in _one_error_line(capsys)
    assert not served  # run_server, which loads the model, was never reached


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("speculative:\n  spec_type: ngram\n", "unknown setting(s) in 'speculative': spec_type"),
        ("speculative:\n  type: ngram\n  draft_max: 0\n", "--draft-max must be at least 1, got 0"),
        ("parallel:\n  split_mode: tensor\n  custom_allreduce: maybe\n",
         "parallel.custom_allreduce must be true or false, got 'maybe'"),
    ],
    ids=["misspelt-key", "draft-max-0", "custom-allreduce-not-a-flag"],
)  # fmt: skip
def test_bad_or_not_yet_settings_in_the_config_file_exit_2_with_one_line(
    tmp_path: Path, content: str, says: str, served: list[EngineConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(content)
    assert cli.main(["serve", "--config", str(path)]) == 2
    assert says in _one_error_line(capsys)
    assert not served


def test_speculative_settings_in_the_config_file_reach_the_engine_config(
    tmp_path: Path, served: list[EngineConfig]
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("speculative:\n  type: ngram\n  draft_max: 5\n")
    assert cli.main(["serve", "--config", str(path), "--draft-max", "3"]) == 0
    assert [c.speculative for c in served] == [SpeculativeConfig(type="ngram", draft_max=3)]  # the flag wins


@pytest.mark.parametrize("name", list(NOT_YET))
def test_a_not_yet_switch_warns_once_by_name_and_the_config_still_builds(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(name, "1")
    with caplog.at_level(logging.WARNING):
        assert parse("serve") == EngineConfig()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"{name}=1 is set: {NOT_YET[name]}; ignored"]
    assert "not implemented yet" in warnings[0]


def test_the_mi50_environment_starts_with_one_warning_per_not_yet_switch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, served: list[EngineConfig]
) -> None:
    for name in NOT_YET:
        monkeypatch.setenv(name, "bf16" if name == "GGML_CUDA_CUBLAS_COMPUTE_TYPE" else "1")
    monkeypatch.setenv("GGML_META_TOKEN_GRAPH", "1")  # a real switch, set to its default: no warning
    with caplog.at_level(logging.WARNING):
        assert cli.main([]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(w.split("=")[0] for w in warnings) == sorted(NOT_YET)
    assert served == [EngineConfig()]


def test_perplexity_with_a_missing_text_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.txt"
    assert cli.main(["perplexity", "-m", str(tmp_path / "m.gguf"), "-f", str(missing)]) == 2
    assert f"{missing}: cannot read the text" in _one_error_line(capsys)


# -- perplexity end to end ------------------------------------------------------------------------------

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold, and not all those who wander are lost. The early bird catches the worm, "
    "but the second mouse gets the cheese. Actions speak louder than words; a picture is worth a thousand "
    "words. When in Rome, do as the Romans do. Fortune favours the bold, and practice makes perfect. "
) * 2


def test_perplexity_prints_a_finite_final_estimate(
    gguf_factory: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec(n_layers=1))
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert cli.main(["perplexity", "-m", str(model), "-f", str(text), "-c", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"^Final estimate: PPL = (\S+) \+/- (\S+)$", out, re.MULTILINE)
    assert m is not None, out
    ppl, err = float(m[1]), float(m[2])
    assert math.isfinite(ppl) and ppl > 1  # random weights: large, but a number
    assert math.isfinite(err) and err >= 0


def test_tune_without_a_gpu_is_one_clear_error(capsys):
    import torch

    from vegaserve.server.cli import main

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU: tune would run")
    assert main(["tune", "--types", "Q8_0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vegaserve tune: error: vegaserve tune needs a GPU"]
