"""Regenerates tests/data/hybrid/: tiny random hybrid linear-attention models (gated DeltaNet layers beside
gated full attention) and the outputs of two independent implementations on them, `transformers` (fp32, eager
attention) and a llama.cpp CPU build.

    python benchmarks/hybrid_references.py --llama-cpp SRC --llama-build BUILD [--out tests/data/hybrid] [--work DIR]

SRC and BUILD as for benchmarks/moe_references.py, whose tokenizer, conversion, logits tool and summaries this
script reuses (run it from the repository root or from benchmarks/). About three minutes on two cores.

For each of qwen35 (dense), qwen35moe and qwen3next it writes
  <name>-f32.gguf   converted by llama.cpp's own convert_hf_to_gguf.py (--outtype f32); qwen35 and qwen35moe
                    with one MTP (NextN) block: the transformers models have none, so random `mtp.*` tensors in
                    the layout of the published checkpoints are added to the safetensors before conversion
                    (transformers ignores them; the converter maps them to blk.N.nextn.* and the block's own
                    tensors); qwen3next without one (--no-mtp), as files converted without the head are
  <name>-q8_0.gguf  the same through llama-quantize Q8_0
  <name>.json       config, prompts, transformers' greedy continuation and logits, llama.cpp's teacher-forced
                    results on the F32 file, on the Q8_0 file, and on the Q8_0 file's weights dequantized
                    into an F32 file (the quantized reference without llama.cpp's 8-bit activations), the
                    agreement figures, and the F32 file's metadata and tensor shapes
and q4_k_m_types.json: the type llama-quantize Q4_K_M gives every tensor of benchmarks/synth_gguf.py's presets
qwen3.6-27b and qwen3.6-35b-a3b at their full layer counts (the presets' files written in F32 at small dims).

Every model has linear-attention layers on both sides of a full-attention layer, fewer key heads than value
heads (so the converter's head order matters: qwen35/qwen35moe tile the value heads over the key heads,
qwen3next groups them), and decays slow enough that the recurrent state carries about 20 tokens. qwen35 ties
its head to the embedding, as the small Qwen3.5 models do.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_references import (  # noqa: E402 - a sibling script
    QWEN2_REGEX, QWEN_CHAT, SEED, VOCAB, Family, LlamaCpp, agreement, b64, command_line, cpp_version, dumps, forward,
    gguf_layout, gguf_py, greedy, llama_summary, print_agreement, topk, write_tokenizer,
)
import synth_gguf  # noqa: E402 - a sibling script

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "hybrid"
# Qwen3.5's pre-tokenizer (tokenizer.ggml.pre "qwen35"): qwen2's, with combining marks kept inside words
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>")
QWEN_TAGS = QWEN_SPECIALS[3:]
LAYERS = ["linear_attention", "full_attention", "linear_attention"]
COMMON = dict(hidden_size=64, num_hidden_layers=3, layer_types=LAYERS, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=4096)
WITH_MTP = {"qwen35": True, "qwen35moe": False, "qwen3next": False}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# partial rotary 0.25 of 32: 8 rotated dimensions; Qwen3.5's interleaved M-RoPE sections must cover their 4 pairs
ROPE35 = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2],
          "mrope_interleaved": True}

FAMILIES = {
    "qwen35": Family(
        "qwen35", dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", intermediate_size=64,
                       rope_parameters=ROPE35, tie_word_embeddings=True, **COMMON),
        QWEN35_REGEX, "qwen35", QWEN_SPECIALS, QWEN_TAGS, {"eos": "<|im_end|>", "pad": "<|endoftext|>"},
        "templates/Qwen3.5-4B.jinja", QWEN_CHAT),
    "qwen35moe": Family(
        "qwen35moe", dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", intermediate_size=64,
                          rope_parameters=ROPE35, tie_word_embeddings=False, **MOE, **COMMON),
        QWEN35_REGEX, "qwen35", QWEN_SPECIALS, QWEN_TAGS, {"eos": "<|im_end|>", "pad": "<|endoftext|>"},
        "templates/Qwen3.5-4B.jinja", QWEN_CHAT),
    "qwen3next": Family(
        "qwen3next", dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=64,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                          **MOE, **COMMON),
        QWEN2_REGEX, "qwen2", QWEN_SPECIALS, QWEN_TAGS, {"eos": "<|im_end|>", "pad": "<|endoftext|>"},
        "templates/Qwen-Qwen3-0.6B.jinja", QWEN_CHAT),
}

INIT = ("seed 1234; A_log log(U(0.02, 0.12)) (per-token decay exp(-A softplus(a + dt_bias)), about 0.95); dt_bias "
        "N(0, 0.05); conv1d N(0, 0.5); the Gemma-style (1 + w) norms w ~ N(0, 0.1), the gated norm 1 + N(0, 0.1); "
        "routers N(0, 0.3); every other matrix N(0, 0.1)")


def init_weights(model: torch.nn.Module) -> None:
    """Seeded weights: slow enough decays that the recurrent state spans chunks, a convolution that matters."""
    gen = torch.Generator().manual_seed(SEED)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            value = torch.log(0.02 + 0.1 * torch.rand(p.shape, generator=gen))
        elif name.endswith("dt_bias"):
            value = 0.05 * noise
        elif name.endswith("conv1d.weight"):
            value = 0.5 * noise
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + 0.1 * noise  # a plain RMSNorm weight (initialized to ones)
        elif name.endswith("norm.weight"):
            value = 0.1 * noise  # Qwen3-Next / Qwen3.5 norms multiply by 1 + w (the converter stores 1 + w)
        elif name.endswith("mlp.gate.weight"):
            value = 0.3 * noise
        else:
            value = 0.1 * noise
        with torch.no_grad():
            p.copy_(value)


def add_mtp_block(model: torch.nn.Module, hf_dir: Path) -> list[str]:
    """Random `mtp.*` tensors as the published checkpoints carry them: one decoder block shaped like the full
    attention layer (the trunk's own names under mtp.layers.0), the fc projection of [embedding, hidden] and
    its two input norms, and the block's final norm. Returns their names."""
    full = model.config.layer_types.index("full_attention")
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(SEED + 1)
    hidden = model.config.hidden_size
    extra = {f"mtp.layers.0.{k.split('.', 3)[3]}": v for k, v in tensors.items()
             if k.startswith(f"model.layers.{full}.")}
    extra |= {"mtp.fc.weight": torch.empty(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": torch.empty(hidden),
              "mtp.pre_fc_norm_hidden.weight": torch.empty(hidden), "mtp.norm.weight": torch.empty(hidden)}
    for k in sorted(extra):
        std = 0.1
        extra[k] = (std * torch.randn(extra[k].shape, generator=gen)).contiguous()
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    return sorted(extra)


def build_model(fam: Family, hf_dir: Path) -> tuple[torch.nn.Module, list[str]]:
    config = transformers.AutoConfig.for_model(vocab_size=VOCAB, **fam.config)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    init_weights(model)
    model.save_pretrained(hf_dir)
    mtp = add_mtp_block(model, hf_dir) if WITH_MTP[fam.name] else []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    return loaded, mtp


def dequantized_copy(src_gguf: Path, out: Path, src: Path) -> None:
    """`src_gguf` with every tensor dequantized to F32 and the metadata unchanged: llama.cpp on it computes
    with the quantized file's weights in f32 arithmetic, as our CPU path does."""
    gguf = gguf_py(src)
    r = gguf.GGUFReader(src_gguf)
    w = gguf.GGUFWriter(out, arch=r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    for t in r.tensors:
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w.add_tensor(t.name, data.reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@torch.no_grad()
def state_diagnostics(model: torch.nn.Module, ids: list[int]) -> dict[str, Any]:
    """How much the recurrent state carries here: the logits' change when every linear-attention layer starts
    over (zero state, empty convolution) at position 32, against the full sequence."""
    base = forward(model, ids)
    cut = 32
    tail = forward(model, ids[cut:])  # the same tokens with no state from before `cut` (positions shifted too)
    return {"max_abs_logit_change_without_the_state_before_position_32": float(f"{np.abs(base[cut:] - tail).max():.3g}")}


def make(fam: Family, cpp: LlamaCpp, out: Path, work: Path) -> dict[str, Any]:
    hf_dir = work / fam.name
    tok = write_tokenizer(fam, cpp.src, hf_dir)
    model, mtp_names = build_model(fam, hf_dir)
    f32, q8, dq = out / f"{fam.name}-f32.gguf", out / f"{fam.name}-q8_0.gguf", work / f"{fam.name}-q8_0-as-f32.gguf"
    cpp.convert(fam, hf_dir, f32, *([] if WITH_MTP[fam.name] else ["--no-mtp"]))
    cpp.quantize(f32, q8)
    dequantized_copy(q8, dq, cpp.src)

    prompts, seqs, hf_all, cpp_all = [], [], [], {"f32": [], "q8_0": [], "q8_0_dequantized": []}
    for i, text in enumerate(fam.prompts):
        prompt = tok.encode(text, add_special_tokens=False)
        assert 20 <= len(prompt) <= 40, (fam.name, len(prompt))
        gen, cached_agrees = greedy(model, prompt)
        ids = prompt + gen
        hf = forward(model, ids)
        entry = {
            "text": text, "prompt_ids": prompt, "greedy_ids": gen, "greedy_text": tok.decode(gen),
            "llama_cpp_tokenizes_text_alike": [int(x) for x in cpp.run(f32, "tokenize", text).split()] == prompt,
            "greedy_kv_cache_agrees": cached_agrees,
            "transformers": {"top8": [topk(r, 8) for r in hf], "prompt_last_logits_b64": b64(hf[len(prompt) - 1]),
                             "last_logits_b64": b64(hf[-1])} | ({"prompt_logits_b64": b64(hf[: len(prompt)])} if i == 0 else {}),
        }
        for kind, path in (("f32", f32), ("q8_0", q8), ("q8_0_dequantized", dq)):
            c = cpp.logits(path, ids, VOCAB)
            cpp_all[kind].append(c)
            entry[f"llama_cpp_{kind}"] = llama_summary(c)
        entry["llama_cpp_q8_0_dequantized"]["last_logits_b64"] = b64(cpp_all["q8_0_dequantized"][-1][-1])
        prompts.append(entry)
        seqs.append(ids)
        hf_all.append(hf)

    margins = np.concatenate([np.diff(np.sort(h, -1)[:, -2:], axis=-1).ravel() for h in hf_all])
    return {
        "name": fam.name,
        "files": {"f32": f32.name, "q8_0": q8.name},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "llama_cpp": cpp_version(cpp.src)},
        "hf_config": {k: getattr(model.config, k) for k in (*fam.config, "vocab_size") if k != "model_type"},
        "init": INIT,
        "mtp_tensors_added": mtp_names,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in fam.specials},
        "rows": "row i of every logits array predicts ids[i + 1], ids = prompt_ids + greedy_ids",
        "transformers_top1_top2_margin": {"median": float(f"{np.median(margins):.3g}"),
                                          "min": float(f"{margins.min():.3g}"),
                                          "fraction_below_0.01": float(f"{(margins < 1e-2).mean():.3g}")},
        "agreement": {"llama_cpp_f32_vs_transformers": agreement(hf_all, cpp_all["f32"]),
                      "llama_cpp_q8_0_vs_llama_cpp_q8_0_dequantized": agreement(cpp_all["q8_0_dequantized"],
                                                                                cpp_all["q8_0"]),
                      "llama_cpp_q8_0_dequantized_vs_transformers": agreement(hf_all, cpp_all["q8_0_dequantized"])},
        "diagnostics": state_diagnostics(model, seqs[0]),
        "prompts": prompts,
        "gguf_f32": gguf_layout(f32, cpp.src),
    }


# llama-quantize's Q4_K_M mix follows tensor kinds and layer counts, not sizes: the presets at small dims (whole
# 256-element blocks everywhere, so no type falls back) and 4 experts (its 8-expert rules left out of play)
Q4_K_M_PRESETS = {"qwen3.6-27b": {}, "qwen3.6-35b-a3b": dict(experts=4, experts_used=2, expert_ff=256, shared_ff=256)}
SMALL = dict(hidden=256, n_heads=2, n_kv_heads=1, head_dim_override=128, rope_dim_override=32, ffn=256,
             linear_heads=(2, 4), linear_head_dim=64)


def q4_k_m_types(cpp: LlamaCpp, work: Path) -> dict[str, Any]:
    """{preset: {"dims": the small dims, "types": {tensor: the type llama-quantize Q4_K_M gives it}}}."""
    import gguf

    out: dict[str, Any] = {}
    for name, extra in Q4_K_M_PRESETS.items():
        preset = replace(synth_gguf.PRESETS[name], **SMALL, **extra)
        f32, q = work / f"{name}-f32.gguf", work / f"{name}-q4_k_m.gguf"
        synth_gguf.write_synth_gguf(f32, preset, "F32")
        cpp.quantize(f32, q, "Q4_K_M")
        out[name] = {"dims": SMALL | extra, "types": {t.name: t.tensor_type.name for t in gguf.GGUFReader(q).tensors}}
    return out


def main() -> None:
    args, work, cpp = command_line(__doc__, OUT, list(FAMILIES), "hybrid_references_")
    for name in args.models:
        ref = make(FAMILIES[name], cpp, args.out, work)
        (args.out / f"{name}.json").write_text(dumps(ref) + "\n")
        print_agreement("hybrid_references", name, ref["agreement"], ref["diagnostics"])
    (args.out / "q4_k_m_types.json").write_text(json.dumps(q4_k_m_types(cpp, work), indent=0) + "\n")
    print(f"wrote {args.out}; Hugging Face models in {work}")


if __name__ == "__main__":
    main()
