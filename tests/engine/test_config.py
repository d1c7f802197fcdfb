"""engine/config.py and engine/env.py: validation errors that name the setting, merge priority, the
environment switches mapped onto the config tree, and settings and switches of features not implemented yet
refused or reported by name."""

from __future__ import annotations

from typing import Any

import pytest

from vegaserve.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    merge_trees,
)
from vegaserve.engine.env import NOT_YET, SWITCHES, config_from_env, ignored_switches

# -- validation -----------------------------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    c = EngineConfig()
    assert (c.model.load_mode, c.scheduler.max_num_seqs, c.server.port, c.parallel.split_mode) == ("mmap", 1, 8080, "none")


@pytest.mark.parametrize("mode", ["mmap", "read", "dio"])
def test_each_load_mode_is_accepted(mode: str) -> None:
    assert ModelConfig(load_mode=mode).load_mode == mode


@pytest.mark.parametrize("mode", ["direct", "MMAP", ""])
def test_bad_load_mode_is_refused_by_name(mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"load mode must be mmap, read or dio, got '{mode}'"):
        ModelConfig(load_mode=mode)


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_port_outside_1_to_65535_is_refused(port: int) -> None:
    with pytest.raises(ConfigError, match=rf"port must be in 1\.\.65535, got {port}"):
        ServerConfig(port=port)


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_are_accepted(port: int) -> None:
    assert ServerConfig(port=port).port == port


@pytest.mark.parametrize("n", [0, -2])
def test_parallel_sequences_below_one_are_refused_naming_np(n: int) -> None:
    with pytest.raises(ConfigError, match=rf"\(-np\) must be >= 1, got {n}"):
        SchedulerConfig(max_num_seqs=n)


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda: CacheConfig(context_size=-1), "context size must be >= 0"),
        (lambda: SchedulerConfig(max_num_batched_tokens=8), "max_num_batched_tokens must be >= 16"),
        (lambda: ParallelConfig(split_mode="row"), "split mode must be none, layer or tensor, got 'row'"),
        (lambda: ParallelConfig(tensor_parallel_group=-1), "-tps must be >= 0"),
        (lambda: ParallelConfig(sched_n_copies=0), "GGML_SCHED_N_COPIES must be >= 1"),
    ],
    ids=["context", "batch", "split-mode", "tps", "n-copies"],
)
def test_other_impossible_settings_are_refused_by_name(build: Any, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        build()
    assert says in str(e.value)


def test_from_dict_builds_every_section_and_top_level_keys() -> None:
    c = EngineConfig.from_dict(
        {
            "model": {"path": "m.gguf", "load_mode": "read"},
            "cache": {"context_size": 1024},
            "scheduler": {"max_num_seqs": 4},
            "parallel": {"split_mode": "tensor", "tensor_parallel_group": 2},
            "kernels": {"token_graph": False},
            "server": {"port": 9000},
            "device": "cpu",
            "seed": 7,
        }
    )
    assert (c.model.path, c.model.load_mode, c.cache.context_size, c.scheduler.max_num_seqs) == ("m.gguf", "read", 1024, 4)
    assert (c.parallel.split_mode, c.parallel.tensor_parallel_group) == ("tensor", 2)
    assert (c.kernels.token_graph, c.server.port) == (False, 9000)
    assert (c.device, c.seed) == ("cpu", 7)


def test_from_dict_refuses_an_unknown_section_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown configuration section 'modle' \(known: model, cache"):
        EngineConfig.from_dict({"modle": {"path": "m.gguf"}})


def test_from_dict_refuses_unknown_keys_naming_section_and_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) in 'server': api_token, prot"):
        EngineConfig.from_dict({"server": {"prot": 1, "api_token": "k", "port": 80}})


def test_from_dict_refuses_a_section_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"section 'server' must be a mapping"):
        EngineConfig.from_dict({"server": 8080})


def test_from_dict_runs_section_validation() -> None:
    with pytest.raises(ConfigError, match="port must be in 1..65535"):
        EngineConfig.from_dict({"server": {"port": 70000}})


def test_config_is_frozen() -> None:
    c = EngineConfig()
    with pytest.raises(AttributeError):
        c.server.port = 1  # type: ignore[misc]


# -- merge priority -------------------------------------------------------------------------------------


def test_merge_later_tree_wins_and_siblings_survive() -> None:
    yaml_tree = {"server": {"port": 1000, "host": "0.0.0.0"}, "model": {"load_mode": "read"}, "device": "cpu"}
    env_tree = {"server": {"port": 2000}, "parallel": {"sched_n_copies": 2}}
    cli_tree = {"server": {"port": 3000}, "device": "cuda"}
    merged = merge_trees(yaml_tree, env_tree, cli_tree)
    assert merged == {
        "server": {"port": 3000, "host": "0.0.0.0"},
        "model": {"load_mode": "read"},
        "device": "cuda",
        "parallel": {"sched_n_copies": 2},
    }
    assert merge_trees(yaml_tree, env_tree)["server"] == {"port": 2000, "host": "0.0.0.0"}


def test_merge_does_not_modify_its_inputs() -> None:
    low, high = {"server": {"port": 1}}, {"server": {"host": "h"}}
    merge_trees(low, high)
    assert low == {"server": {"port": 1}} and high == {"server": {"host": "h"}}


def test_merge_of_nothing_is_the_default_config() -> None:
    assert EngineConfig.from_dict(merge_trees({}, {}, {})) == EngineConfig()


# -- environment switches -------------------------------------------------------------------------------

# name -> (value set, section, key, expected): each switch set to its non-default value
ENV_CASES: dict[str, tuple[str, str, str, object]] = {
    "GGML_SCHED_N_COPIES": ("4", "parallel", "sched_n_copies", 4),
    "GGML_ENABLE_CUSTOM_AR": ("1", "parallel", "custom_allreduce", True),
    "GGML_TP_AR_TWOSHOT": ("1", "parallel", "allreduce_two_shot", True),
    "GGML_META_TOKEN_GRAPH": ("0", "kernels", "token_graph", False),
    "GGML_CUDA_Q8_1_CACHE": ("0", "kernels", "q8_1_cache", False),
    "VEGASERVE_PDL": ("0", "kernels", "pdl", False),
    "VEGASERVE_CPU_INT4": ("0", "kernels", "cpu_int4", False),
    "LLAMA_SHEXP_SPLIT": ("0", "kernels", "shexp_split", False),
    "VEGASERVE_ASYNC_DECODE": ("0", "scheduler", "async_decode", False),
}
FLAG_SWITCHES = [n for n, (_, _, _, expected) in ENV_CASES.items() if isinstance(expected, bool)]


def test_every_switch_has_a_case_here() -> None:
    assert set(ENV_CASES) == set(SWITCHES)


@pytest.mark.parametrize("name", list(ENV_CASES))
def test_env_switch_maps_onto_its_setting(name: str) -> None:
    value, section, key, expected = ENV_CASES[name]
    tree = config_from_env({name: value})
    assert tree == {section: {key: expected}}
    config = EngineConfig.from_dict(tree)
    assert getattr(getattr(config, section), key) == expected
    assert getattr(getattr(EngineConfig(), section), key) != expected  # the switch changed something


def test_unset_and_unrelated_variables_give_an_empty_tree() -> None:
    assert config_from_env({"HSA_ENABLE_SDMA": "0", "HIP_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}) == {}


def test_all_switches_together_build_one_config() -> None:
    c = EngineConfig.from_dict(config_from_env({n: v for n, (v, *_) in ENV_CASES.items()}))
    assert (c.parallel.sched_n_copies, c.kernels.token_graph, c.kernels.q8_1_cache, c.scheduler.async_decode) == (
        4, False, False, False,
    )


def test_env_is_read_from_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*SWITCHES, *NOT_YET]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GGML_SCHED_N_COPIES", "3")
    monkeypatch.setenv("LLAMA_PLE_SHARD", "1")
    assert config_from_env() == {"parallel": {"sched_n_copies": 3}}
    assert ignored_switches() == [f"LLAMA_PLE_SHARD=1 is set: {NOT_YET['LLAMA_PLE_SHARD']}; ignored"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("ON", True), (" yes ", True), ("0", False), ("off", False), ("", False)],
)
def test_flag_spellings(value: str, expected: bool) -> None:
    assert config_from_env({"GGML_META_TOKEN_GRAPH": value}) == {"kernels": {"token_graph": expected}}


@pytest.mark.parametrize("name", FLAG_SWITCHES)
def test_bad_flag_value_is_refused_naming_the_variable(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} must be 0 or 1, got '2'$"):
        config_from_env({name: "2"})


@pytest.mark.parametrize("value", ["four", "1.5", ""])
def test_bad_integer_value_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^GGML_SCHED_N_COPIES must be an integer, got '{value}'$"):
        config_from_env({"GGML_SCHED_N_COPIES": value})


# -- switches of features not implemented yet ------------------------------------------------------------

THE_FORKS_MI50_ENVIRONMENT = {
    "GGML_CUDA_CUBLAS_COMPUTE_TYPE": "bf16", "LLAMA_ENABLE_MTP_OPT": "1", "LLAMA_PLE_SHARD": "1",
}  # fmt: skip


def test_not_yet_switches_are_the_forks_unimplemented_ones_and_map_onto_nothing() -> None:
    assert set(NOT_YET) == set(THE_FORKS_MI50_ENVIRONMENT)
    assert not set(NOT_YET) & set(SWITCHES)
    assert config_from_env(THE_FORKS_MI50_ENVIRONMENT) == {}


@pytest.mark.parametrize("name", list(NOT_YET))
def test_each_not_yet_switch_gives_one_warning_naming_it_and_its_value(name: str) -> None:
    value = THE_FORKS_MI50_ENVIRONMENT[name]
    assert ignored_switches({name: value, "GGML_SCHED_N_COPIES": "2"}) == [
        f"{name}={value} is set: {NOT_YET[name]}; ignored"
    ]
    assert "not implemented yet" in NOT_YET[name]


@pytest.mark.parametrize("value", ["0", "2", "f32", ""])
def test_a_not_yet_switch_is_reported_whatever_its_value_and_never_refused(value: str) -> None:
    assert ignored_switches({"LLAMA_PLE_SHARD": value}) == [
        f"LLAMA_PLE_SHARD={value} is set: {NOT_YET['LLAMA_PLE_SHARD']}; ignored"
    ]
    assert config_from_env({"LLAMA_PLE_SHARD": value}) == {}


def test_the_custom_allreduce_switches_reach_the_parallel_settings() -> None:
    tree = config_from_env({"GGML_ENABLE_CUSTOM_AR": "1", "GGML_TP_AR_TWOSHOT": "0"})
    assert tree == {"parallel": {"custom_allreduce": True, "allreduce_two_shot": False}}
    par = EngineConfig.from_dict(tree).parallel
    assert par.custom_allreduce is True and par.allreduce_two_shot is False
    assert EngineConfig().parallel.custom_allreduce is False and EngineConfig().parallel.allreduce_two_shot is None
    assert ignored_switches({"GGML_ENABLE_CUSTOM_AR": "1"}) == []


def test_no_not_yet_switch_set_gives_no_warning() -> None:
    assert ignored_switches({"GGML_META_TOKEN_GRAPH": "0", "HSA_ENABLE_SDMA": "0"}) == []


def test_the_speculative_section_configures_speculation() -> None:
    cfg = EngineConfig.from_dict({"speculative": {"type": "draft", "draft_model": "d.gguf", "draft_max": 4,
                                                  "draft_p_min": 0.5}})
    assert (cfg.speculative.type, cfg.speculative.max_draft, cfg.speculative.draft_p_min) == ("draft", 4, 0.5)
    assert not EngineConfig.from_dict({}).speculative.enabled
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) in 'speculative': spec_type"):
        EngineConfig.from_dict({"speculative": {"spec_type": "ngram"}})
