"""The AllReduce policy (engine/distributed/allreduce_policy.py) as the llama.cpp fork states it, the tuning
entry it reads its gate from, and, over gloo in several CPU processes, the fallback: the custom AllReduce
asked for on the CPU leaves gloo's in place with one warning line, a refusal on one rank is every rank's,
and the step plans travel through the shared-memory ring (or over gloo where a rank cannot attach it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vegaserve.engine.distributed.allreduce_policy import choose, fallback_warning, refusal
from vegaserve.triton_kernels.tuning import load_tuning

GATE = 512 * 1024


@pytest.mark.parametrize(("tp", "pp", "variant"), [
    (2, 1, "one_shot"), (3, 1, "one_shot"), (4, 1, "one_shot"), (6, 1, "one_shot"), (7, 1, "one_shot"),
    (9, 1, "one_shot"), (5, 1, "two_shot"), (8, 1, "two_shot"), (10, 1, "two_shot"),
    (4, 2, "two_shot"), (2, 2, "one_shot"), (8, 2, "two_shot"), (1, 1, "device"), (1, 4, "device"),
])
def test_decode_size_messages_take_the_forks_variant_for_their_tp_size(tp, pp, variant) -> None:
    assert choose(tp, pp, 16 * 1024, GATE) == variant


def test_messages_above_the_gate_take_the_device_allreduce_even_when_forced() -> None:
    assert choose(2, 1, GATE, GATE) == "one_shot"
    assert choose(2, 1, GATE + 1, GATE) == "device"
    assert choose(8, 1, GATE + 4, GATE, two_shot=True) == "device"


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (4, 2), (8, 1)])
def test_the_twoshot_switch_forces_either_variant_below_the_gate(tp, pp) -> None:
    assert choose(tp, pp, 4096, GATE, two_shot=False) == "one_shot"
    assert choose(tp, pp, 4096, GATE, two_shot=True) == "two_shot"


def test_the_custom_allreduce_is_refused_on_the_cpu_and_without_lanes_and_tried_on_a_gpu() -> None:
    assert "needs GPUs" in refusal(torch.device("cpu"), 2)
    assert "one lane" in refusal(torch.device("cuda", 0), 1)
    assert refusal(torch.device("cuda", 0), 2) is None
    assert fallback_warning("why", torch.device("cpu")) == "GGML_ENABLE_CUSTOM_AR=1: why; gloo's AllReduce is used"


def test_the_gate_and_launch_parameters_come_from_the_tuning_file_else_the_fallback(tmp_path: Path) -> None:
    assert load_tuning("hip_gfx906", tmp_path / "none.json").allreduce == {"gate_bytes": GATE, "block": 1024,
                                                                           "num_warps": 4}
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"target": "cuda_sm90", "allreduce": {"gate_bytes": 2 << 20}}))
    assert load_tuning("cuda_sm90", f).allreduce == {"gate_bytes": 2 << 20, "block": 1024, "num_warps": 4}


@pytest.fixture(scope="module")
def cpu_ranks(run_ranks) -> list[dict]:
    return run_ranks("comm_ranks.py", 3, "custom-on-cpu")


def test_asked_for_on_the_cpu_the_custom_allreduce_falls_back_to_gloo_with_one_warning(cpu_ranks) -> None:
    assert [r["custom"] for r in cpu_ranks] == [False] * 3
    assert all(r["sum_ok"] for r in cpu_ranks)
    warned = [w for r in cpu_ranks for w in r["warnings"]]
    assert warned == ["GGML_ENABLE_CUSTOM_AR=1: the peer-write AllReduce needs GPUs and this run is on the CPU; "
                      "gloo's AllReduce is used"]
    assert cpu_ranks[0]["warnings"] == warned


def test_step_plans_reach_every_rank_through_the_shared_memory_ring(cpu_ranks) -> None:
    assert [(r["ring"], r["plans_ok"]) for r in cpu_ranks] == [(True, True)] * 3


def test_a_refusal_on_one_rank_is_every_ranks(cpu_ranks) -> None:
    assert [r["agree_none"] for r in cpu_ranks] == [None] * 3
    assert [r["agree_planted"] for r in cpu_ranks] == ["rank 2: planted refusal"] * 3


def test_a_rank_that_cannot_attach_the_ring_sends_every_rank_to_gloo(run_ranks) -> None:
    ranks = run_ranks("comm_ranks.py", 3, "ring-refused")
    assert [(r["ring"], r["plans_ok"], r["sum_ok"]) for r in ranks] == [(False, True, True)] * 3
    assert ranks[0]["warnings"][0] == "step plans go over gloo: rank 2: attaching the ring: planted"
