"""`vegaserve` command line: `serve` (the default), `perplexity`, `tune`, `bench`.

Flags keep llama-server's spellings so existing launch lines work. Every flag defaults to None, so only
the flags given end up in the config tree, above the environment and the `--config` YAML file. A setup
that cannot run (e.g. `--spec-type draft-mtp` on a model without an MTP block) stops the start with one line
saying so; `-ngl`, `-fa`,
`--jinja` and `--seed` are accepted for llama-server's launch lines and change nothing in serving (their help says why).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from vegaserve.engine.config import ConfigError, EngineConfig, merge_trees
from vegaserve.engine.env import config_from_env, ignored_switches

log = logging.getLogger(__name__)

_KV_TYPES = {"auto": "auto", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}  # -ctk / -ctv spellings

# flag dest -> (section, key); section None: top level
_FLAG_TARGETS: dict[str, tuple[str | None, str]] = {
    "model": ("model", "path"),
    "load_mode": ("model", "load_mode"),
    "no_repack": ("model", "no_repack"),
    "warmup": ("kernels", "warmup"),
    "alias": ("model", "served_model_name"),
    "ctx_size": ("cache", "context_size"),
    "cache_type_k": ("cache", "kv_dtype"),
    "prefix_states": ("cache", "prefix_states"),
    "parallel": ("scheduler", "max_num_seqs"),
    "batch_size": ("scheduler", "max_num_batched_tokens"),
    "split_mode": ("parallel", "split_mode"),
    "tps": ("parallel", "tensor_parallel_group"),
    "n_devices": ("parallel", "n_devices"),
    "device_memory": ("parallel", "device_memory_gib"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "api_key": ("server", "api_key"),
    "log_level": ("server", "log_level"),
    "drain_timeout": ("server", "drain_timeout_s"),
    "header_timeout": ("server", "header_timeout_s"),
    "timeout": ("server", "body_timeout_s"),
    "special_tokens_in_content": ("server", "special_tokens_in_content"),
    "spec_type": ("speculative", "type"),
    "model_draft": ("speculative", "draft_model"),
    "draft_max": ("speculative", "draft_max"),
    "draft_min": ("speculative", "draft_min"),
    "draft_p_min": ("speculative", "draft_p_min"),
    "spec_ngram_size_n": ("speculative", "ngram_size"),
    "device": (None, "device"),
    "seed": (None, "seed"),
}

def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", help="GGUF file (first part of a split model); default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("-lm", "--load-mode", choices=["mmap", "read", "dio"], help="how weights are read (default mmap)")
    g.add_argument("--no-repack", action="store_const", const=True, help="keep canonical GGUF blocks on the device")
    g.add_argument("--no-warmup", dest="warmup", action="store_const", const=False,
                   help="skip the start's run of the prompt path on a GPU (its kernels then compile during the "
                   "first requests)")
    g.add_argument("-c", "--ctx-size", type=int, help="context length a sequence may reach (0: the model's, "
                   "or what fits the device)")
    g.add_argument("-ctk", "--cache-type-k", choices=list(_KV_TYPES), help="KV cache type (default: f32 on a CPU; "
                   "bf16 on GPUs with native bf16, f16 on others such as gfx906)")
    g.add_argument("-ctv", "--cache-type-v", choices=list(_KV_TYPES), help="must equal -ctk: keys and values share one type")
    g.add_argument("--prefix-states", type=int, metavar="N", help="hybrid models: recurrent states saved for "
                   "prefix caching, each the size of a sequence's state (0: a shared prefix is recomputed; default: "
                   "-np, at least 4)")
    g.add_argument("--device", help="cpu, cuda, cuda:N (default: a GPU if present)")
    g.add_argument("-t", "--threads", type=int, help="torch's CPU threads in this process (the N CPU processes of "
                   "-ndev N take the cores / N each)")
    g.add_argument("--config", type=Path, help="YAML file of settings (configs/); flags override it")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int,
                   help="accepted for llama-server compatibility and ignored: every layer runs on --device")


def _counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vegaserve", description="OpenAI-compatible GGUF inference server")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="serve the OpenAI API (default command)")
    _model_flags(serve)
    g = serve.add_argument_group("serving")
    g.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 to listen on all)")
    g.add_argument("--port", type=int, help="port (default 8080)")
    g.add_argument("--api-key", help="require `Authorization: Bearer KEY` on the API routes")
    g.add_argument("-a", "--alias", help="model name reported by /v1/models (default: the file name)")
    g.add_argument("-np", "--parallel", type=int, help="sequences served at once (default 1)")
    g.add_argument("-b", "--batch-size", type=int, help="tokens computed per step at most (default 2048)")
    g.add_argument("--seed", type=int, help="accepted for compatibility and ignored: a request's own seed makes "
                   "its sampling repeatable")
    g.add_argument("-fa", "--flash-attn", nargs="?", const="on", help="accepted for compatibility and ignored: "
                   "attention is always fused")
    g.add_argument("--jinja", action="store_true", default=None, help="accepted for compatibility and ignored: "
                   "the GGUF's chat template always renders tools, and replies are read for calls and reasoning")
    g.add_argument("-sm", "--split-mode", choices=["none", "layer", "tensor", "row"], help="how to use several GPUs")
    g.add_argument("-tps", type=int, dest="tps", help="tensor-parallel group size inside -sm tensor (0: all GPUs)")
    g.add_argument("-ndev", "--n-devices", type=int, help="devices to split over (default: every visible GPU; "
                   "with --device cpu, that many CPU processes)")
    g.add_argument("--device-memory", type=float, metavar="GIB", help="memory per device the split must fit in, "
                   "checked at start (default: what the device reports)")
    g.add_argument("--spec-type", choices=["none", "ngram", "draft", "draft-mtp"],
                   help="speculative decoding: ngram (prompt lookup), draft (a draft model, -md), draft-mtp (the "
                   "model's own MTP block: the qwen35 family, one device or -sm tensor) (default none)")
    g.add_argument("-md", "--model-draft", "--spec-draft-model", metavar="FILE",
                   help="the draft model's GGUF for --spec-type draft; it must share the model's vocabulary")
    g.add_argument("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", type=int, metavar="N",
                   help="tokens guessed per step at most (default: 8 for ngram, 16 for draft)")
    g.add_argument("--draft-min", "--draft-n-min", "--spec-draft-n-min", type=int, metavar="N",
                   help="fewer guesses than N are not verified (default 0)")
    g.add_argument("--draft-p-min", "--spec-draft-p-min", type=float, metavar="P",
                   help="the draft model stops guessing where its top token is less likely than P (default 0.75)")
    g.add_argument("--spec-ngram-size-n", type=int, metavar="N",
                   help="ngram: the longest suffix looked up in the request's tokens (default 3)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    g.add_argument("--drain-timeout", type=float, help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    g.add_argument("--header-timeout", type=float, metavar="S", help="a request's line and headers must arrive "
                   "within S seconds, or its connection is closed (default 10)")
    g.add_argument("-to", "--timeout", type=float, metavar="S", help="a request's body must arrive within S seconds "
                   "of its headers, or it is answered 408 (default 60)")
    g.add_argument("--special-tokens-in-content", action="store_const", const=True, help="read control-token text "
                   "in messages (<|im_start|>, ...) as the control tokens, as llama-server does (default: plain text)")

    ppl = sub.add_parser("perplexity", help="llama-perplexity's measurement on a text file")
    _model_flags(ppl)
    ppl.add_argument("-f", "--file", required=True, type=Path, help="text file to score")
    ppl.add_argument("--chunks", type=int, help="score at most this many chunks")

    bench = sub.add_parser("bench", help="llama-bench's prefill (pp) and decode (tg) speeds in tokens/s")
    _model_flags(bench)
    bench.add_argument("-p", "--n-prompt", type=_counts, default=[512], help="prompt lengths, e.g. 512,2048 (0: none)")
    bench.add_argument("-n", "--n-gen", type=_counts, default=[128], help="tokens to generate, e.g. 128 (0: none)")
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs of each test, after a warm-up")

    tune = sub.add_parser("tune", help="measure the decode kernels and their launch parameters on this GPU; "
                                       "writes configs/kernels/<target>.json")
    tune.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,IQ4_NL,MXFP4")
    tune.add_argument("--classes", default="small,medium,large", help="shape classes to measure")
    tune.add_argument("--rows", default="1,2,4,8", help="activation row counts (mat-vec)")
    tune.add_argument("--out", type=Path, help="file to write (default: configs/kernels/<target>.json)")
    return parser


def config_tree_from_args(args: argparse.Namespace) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    k_type, v_type = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    if v_type is not None and v_type != (k_type or v_type):
        raise ConfigError(f"-ctk {k_type} and -ctv {v_type} differ: keys and values share one cache type")
    if k_type is None and v_type is not None:
        args.cache_type_k = v_type
    for dest, (section, key) in _FLAG_TARGETS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "cache_type_k":
            value = _KV_TYPES[value]
        if dest == "split_mode" and value == "row":
            value = "tensor"  # llama.cpp's row split is a tensor split
        if section is None:
            tree[key] = value
        else:
            tree.setdefault(section, {})[key] = value
    return tree


def load_config(args: argparse.Namespace) -> EngineConfig:
    yaml_tree: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        import yaml

        try:
            yaml_tree = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{args.config}: cannot read the config file: {e}") from e
        if not isinstance(yaml_tree, dict):
            raise ConfigError(f"{args.config}: the config file must be a mapping of sections")
    config = EngineConfig.from_dict(merge_trees(yaml_tree, config_from_env(), config_tree_from_args(args)))
    for warning in ignored_switches():
        log.warning("%s", warning)
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=(getattr(args, "log_level", None) or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    from vegaserve.engine.gguf_file import ModelLoadError

    try:
        config = load_config(args)
        if args.command == "tune":
            from vegaserve.triton_kernels.tune import tune

            try:
                out = tune(args.types.split(","), args.classes.split(","), [int(r) for r in args.rows.split(",")], args.out)
            except (RuntimeError, ValueError, KeyError) as e:
                print(f"vegaserve tune: error: {e}", file=sys.stderr)
                return 2
            print(f"wrote {out}")
            return 0
        if args.command == "bench":
            from vegaserve.server.bench_cmd import run_bench

            return run_bench(config, args.n_prompt, args.n_gen, args.repetitions)
        if args.command == "perplexity":
            from vegaserve.server.perplexity_cmd import run_perplexity

            return run_perplexity(config, args.file, args.chunks)
        from vegaserve.server.serve_cmd import run_server

        return run_server(config)
    except (ConfigError, ModelLoadError) as e:
        print(f"vegaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
