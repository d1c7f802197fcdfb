"""What of the custom AllReduce's setup (engine/distributed/custom_allreduce.py) runs without a GPU: which
runtime library it calls (the one torch mapped), and why a group is refused peer access. The rest is in
test_custom_allreduce_gpu.py."""

from __future__ import annotations

from vegaserve.engine.distributed.custom_allreduce import loaded_library, peer_access_refused

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000100000-7f0000200000 r-xp 00000000 08:01 2 /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.13
7f0000300000-7f0000301000 rw-p 00000000 00:00 0
7f0000400000-7f0000500000 r-xp 00000000 08:01 3 /opt/rocm/lib/libamdhip64.so.6.2.60200
"""


def test_the_runtime_called_is_the_library_torch_mapped() -> None:
    assert loaded_library("libcudart", MAPS) == "/opt/venv/nvidia/cuda_runtime/lib/libcudart.so.13"
    assert loaded_library("libamdhip64", MAPS) == "/opt/rocm/lib/libamdhip64.so.6.2.60200"
    assert loaded_library("libnccl", MAPS) is None


def test_peer_access_is_refused_across_hosts_to_invisible_gpus_and_without_p2p() -> None:
    visible = {"gpu-a": 0, "gpu-b": 1, "gpu-c": 2}
    ok = peer_access_refused([("h", "gpu-a"), ("h", "gpu-b"), ("h", "gpu-c")], "gpu-a", visible, lambda i: True)
    assert ok is None
    shared = peer_access_refused([("h", "gpu-a"), ("h", "gpu-a")], "gpu-a", {}, lambda i: False)
    assert shared is None  # several ranks on one GPU: IPC within the device, no peer access needed
    assert "spans hosts (h1, h2)" in peer_access_refused([("h1", "gpu-a"), ("h2", "gpu-b")], "gpu-a", visible,
                                                         lambda i: True)
    assert "GPU gpu-z of a peer is not visible" in peer_access_refused([("h", "gpu-a"), ("h", "gpu-z")], "gpu-a",
                                                                       visible, lambda i: True)
    assert "no peer access from this GPU to GPU 2" in peer_access_refused(
        [("h", "gpu-a"), ("h", "gpu-b"), ("h", "gpu-c")], "gpu-a", visible, lambda i: i != 2)
