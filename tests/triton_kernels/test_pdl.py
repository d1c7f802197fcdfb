"""Programmatic dependent launch (triton_kernels/pdl.py): when it is on, and that a chain of kernels that
overlap each other's ends computes exactly what the same chain computes one kernel after another."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.fused import add_rms_norm, rms_norm, silu_mul
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec import KERNELS, Choice, matvec
from vegaserve.triton_kernels.matvec_launch import rule
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks


@pytest.fixture
def pdl_setting():
    yield pdl.set_enabled
    pdl.set_enabled(True)


def test_off_on_a_cpu_under_the_interpreter_and_when_switched_off(monkeypatch, pdl_setting):
    assert not pdl.enabled(torch.device("cpu"))
    pdl_setting(False)
    assert not pdl.enabled(torch.device("cuda"))
    assert pdl.launch_args(torch.device("cuda")) == {"PDL": False}
    pdl_setting(True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda"))


def test_the_switch_reaches_the_kernels_setting():
    from vegaserve.engine.config import EngineConfig
    from vegaserve.engine.env import config_from_env

    assert config_from_env({"VEGASERVE_PDL": "0"}) == {"kernels": {"pdl": False}}
    assert EngineConfig.from_dict(config_from_env({"VEGASERVE_PDL": "0"})).kernels.pdl is False
    assert EngineConfig.from_dict({}).kernels.pdl is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_captured_layer_chain_is_bitwise_the_same_with_and_without_pdl(pdl_setting):
    """Twelve layers of norm -> q8_1 -> int8 mat-vec (split-K too) -> SiLU-mul -> mat-vec -> residual add,
    captured in one CUDA graph and replayed: a kernel that read its input before the one writing it had
    finished would change the result, and only where launches overlap."""
    tids = {s.name: t for t, s in GGML_TYPES.items()}
    gen = torch.Generator().manual_seed(0)
    d, f = 1024, 2048
    up = [repack(random_blocks(tids["Q4_K"], 2 * f, d // 256, gen).cuda(), tids["Q4_K"], 2 * f, d) for _ in range(3)]
    down = [repack(random_blocks(tids["Q6_K"], d, f // 256, gen).cuda(), tids["Q6_K"], d, f) for _ in range(3)]
    norm_w = torch.rand(d, generator=gen).cuda() + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def int8(type_name: str, n: int, k: int, split_k: int) -> Choice:
        return Choice(KERNELS["int8"], {**rule(tids[type_name], n, k, 1, sms), "split_k": split_k})

    def chain(x: torch.Tensor) -> torch.Tensor:
        h, y = x, rms_norm(x, norm_w, 1e-5)
        for i in range(12):
            g = matvec(y, up[i % 3], int8("Q4_K", 2 * f, d, 2 if i % 2 else 1), q8_1=quantize_q8_1(y))
            a = silu_mul(g)
            o = matvec(a, down[i % 3], int8("Q6_K", d, f, 4 if i % 3 == 0 else 1))
            h, y = add_rms_norm(h, o, norm_w, 1e-5)
        return y

    def replayed(pdl_on: bool) -> torch.Tensor:
        pdl_setting(pdl_on)
        x = torch.randn(1, d, generator=torch.Generator().manual_seed(1)).cuda()
        chain(x)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
        results = []
        for _ in range(5):
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(results)

    serial = replayed(False)
    overlapped = replayed(True)
    assert pdl.enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    assert torch.isfinite(serial).all() and serial.abs().sum() > 0
    assert torch.equal(serial, serial[:1].expand_as(serial))
    assert torch.equal(overlapped, serial)
