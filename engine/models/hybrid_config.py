"""GGUF metadata -> the shape of a hybrid linear-attention model (qwen35, qwen35moe, qwen3next): which blocks
are gated DeltaNet layers, the sizes of their recurrent state, and the trailing NextN (MTP) blocks.

Keys as llama.cpp names them: `{arch}.ssm.conv_kernel` (the short convolution's width K), `.ssm.state_size`
(a key head's width), `.ssm.group_count` (key heads), `.ssm.time_step_rank` (value heads), `.ssm.inner_size`
(all value heads' width), `{arch}.attention.recurrent_layers` (one flag per block) or, without it,
`{arch}.full_attention_interval` (every n-th block is full attention), `{arch}.nextn_predict_layers`.

A file whose layer pattern, state sizes or tensors disagree is refused here, naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vegaserve.engine.gguf_file import ModelLoadError

HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
# value heads laid out tiled over the key heads (head h reads key head h % k_heads): the converter reorders
# Qwen3.5's grouped heads so for ggml's broadcast; qwen3next keeps them grouped (h reads h // (v / k))
_TILED = {"qwen35", "qwen35moe"}

_LINEAR_TENSORS = ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight", "ssm_out.weight",
                   "attn_qkv.weight", "attn_gate.weight")
_FULL_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")


@dataclass(frozen=True)
class HybridConfig:
    recurrent: tuple[bool, ...]  # per block: a gated DeltaNet layer (else gated full attention or NextN)
    conv_kernel: int  # K: each layer keeps the last K - 1 inputs of its convolution per sequence
    k_heads: int
    v_heads: int
    head_dim: int  # key and value heads alike (the delta rule's state is head_dim x head_dim)
    tiled: bool  # value head h reads key head h % k_heads, else h // (v_heads // k_heads)
    nextn: int = 0  # trailing NextN (MTP) blocks: loaded and kept, not run by the trunk

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_dim

    def lane(self, tp: int) -> HybridConfig:
        """A tensor-parallel lane's share: k_heads / tp key heads and v_heads / tp value heads."""
        return replace(self, k_heads=self.k_heads // tp, v_heads=self.v_heads // tp)

    def lane_heads(self, tp: int, lane: int) -> tuple[list[int], list[int]]:
        """(key heads, value heads) of a lane, global indices in the lane's own order: a contiguous share of
        the key heads, and the value heads that read them, so that the lane's value head i reads its key head
        i % k (tiled) or i // (v / k) (grouped) as the whole model does. Tiled, that is every key head's
        repeat: v / k runs of k / tp heads."""
        kk = self.k_heads // tp
        keys = list(range(lane * kk, (lane + 1) * kk))
        if self.tiled:
            values = [j * self.k_heads + h for j in range(self.v_heads // self.k_heads) for h in keys]
        else:
            vv = self.v_heads // tp
            values = list(range(lane * vv, (lane + 1) * vv))
        return keys, values

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def trunk(self) -> int:
        return len(self.recurrent) - self.nextn

    def state_bytes(self, layers: range) -> int:
        """One sequence's recurrent state over `layers` (f32): conv rows and the delta rule's matrices."""
        n = sum(self.recurrent[i] for i in layers)
        return 4 * n * ((self.conv_kernel - 1) * self.conv_dim + self.v_heads * self.head_dim ** 2)


def hybrid_config_from_gguf(arch: str, get: Callable[[str, Any], Any], md: dict[str, Any], tensor_names: set[str],
                            path: str) -> HybridConfig:
    """`get(key, default)` reads `{arch}.key` (default None: required). Refuses a file whose pattern or
    state sizes disagree with its tensors, naming the layer."""
    n_blocks = int(get("block_count", None))
    nextn = int(get("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < n_blocks:
        raise ModelLoadError(f"{path}: {arch}.nextn_predict_layers {nextn} leaves no layer of the {n_blocks}")
    k_heads, v_heads = int(get("ssm.group_count", None)), int(get("ssm.time_step_rank", None))
    head_k, inner, conv = int(get("ssm.state_size", None)), int(get("ssm.inner_size", None)), int(get("ssm.conv_kernel", None))
    if k_heads < 1 or v_heads < 1 or v_heads % k_heads:
        raise ModelLoadError(f"{path}: {v_heads} value heads ({arch}.ssm.time_step_rank) do not share {k_heads} key "
                             f"heads ({arch}.ssm.group_count) evenly")
    if inner != v_heads * head_k:
        raise ModelLoadError(f"{path}: {arch}.ssm.inner_size {inner} is not {v_heads} value heads of {head_k} "
                             f"({arch}.ssm.state_size): the delta rule needs key and value heads of one width")
    if conv < 2:
        raise ModelLoadError(f"{path}: {arch}.ssm.conv_kernel {conv}: the short convolution needs a width of 2 or more")
    key = f"{arch}.attention.recurrent_layers"
    if key in md:
        recurrent = tuple(bool(x) for x in md[key])
        source = key
        if len(recurrent) != n_blocks:
            raise ModelLoadError(f"{path}: {key} has {len(recurrent)} entries for {n_blocks} layers ({arch}.block_count)")
    else:
        every = int(get("full_attention_interval", 4))
        if every < 1:
            raise ModelLoadError(f"{path}: {arch}.full_attention_interval {every} must be at least 1")
        recurrent = tuple(i < n_blocks - nextn and (i + 1) % every != 0 for i in range(n_blocks))
        source = f"{arch}.full_attention_interval {every}"
    for i, linear in enumerate(recurrent):
        _check_layer(i, linear, i >= n_blocks - nextn, tensor_names, source, path)
    return HybridConfig(recurrent=recurrent, conv_kernel=conv, k_heads=k_heads, v_heads=v_heads, head_dim=head_k,
                        tiled=arch in _TILED, nextn=nextn)


def _check_layer(i: int, linear: bool, nextn: bool, names: set[str], source: str, path: str) -> None:
    has = lambda t: f"blk.{i}.{t}" in names  # noqa: E731
    if nextn and linear:
        raise ModelLoadError(f"{path}: layer {i} is a NextN (MTP) block but {source} marks it linear attention")
    if linear:
        if has("ssm_in.weight"):
            raise ModelLoadError(f"{path}: layer {i} has the legacy fused blk.{i}.ssm_in.weight (q/k/v/z interleaved "
                                 f"per key head), which is not supported: convert the model again")
        missing = [t for t in _LINEAR_TENSORS if not has(t)]
        if not (has("ssm_ba.weight") or (has("ssm_beta.weight") and has("ssm_alpha.weight"))):
            missing.append("ssm_beta.weight/ssm_alpha.weight (or ssm_ba.weight)")
        if missing:
            kind = " (it has attn_q: a full-attention layer)" if has("attn_q.weight") else ""
            raise ModelLoadError(f"{path}: layer {i} is linear attention by {source}, but blk.{i}."
                                 f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing{kind}")
    else:
        missing = [t for t in _FULL_TENSORS if not has(t)]
        if missing or has("ssm_conv1d.weight"):
            what = "NextN block" if nextn else "full-attention layer"
            found = " (it has ssm_conv1d: a linear-attention layer)" if has("ssm_conv1d.weight") else ""
            raise ModelLoadError(f"{path}: layer {i} is a {what} by {source}, but "
                                 + (f"blk.{i}.{', '.join(missing)} missing" if missing else "it is not")
                                 + found)
