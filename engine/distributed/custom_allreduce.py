"""The custom AllReduce's peer buffers: at start each rank of a tensor-parallel group allocates one buffer
(flags and slots, triton_kernels/allreduce.py's PeerLayout), exchanges its CUDA / HIP IPC handle over the
process group, and maps its peers' buffers into its own address space. The kernels then write into the
peers' memory directly.

    open_custom_allreduce(...)  -> (CustomAllReduce, None) on every rank, or (None, reason) on every rank

Every step that can be refused is checked on every rank, and the ranks agree before any uses the result
(`agree`): the runtime library, the allocation, the group on one host, peer access between every pair of
its GPUs, each IPC handle opened, and a first AllReduce checked against the known sum. Where one rank is
refused, every rank falls back to NCCL / RCCL with the same reason.

Torch exposes neither IPC handles of raw allocations opened on the current device nor fine-grained
allocations, so the runtime library that torch loaded (libcudart / libamdhip64) is called through ctypes
(vLLM does the same). On AMD the buffer is allocated fine-grained (hipExtMallocWithFlags), which peer
writes over PCIe need to be coherent without relying on HSA_FORCE_FINE_GRAIN_PCIE.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vegaserve.engine.distributed.allreduce_policy import agree
from vegaserve.triton_kernels import allreduce as kernels

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and hipIpcMemHandle_t
LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess, hipIpcMemLazyEnablePeerAccess
HIP_FINE_GRAINED = 1  # hipDeviceMallocFinegrained


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]


def loaded_library(stem: str, maps: str | None = None) -> str | None:
    """The path of the shared library whose file name starts with `stem` that this process has mapped
    (/proc/self/maps), so that ctypes calls the very runtime torch uses."""
    text = maps if maps is not None else Path("/proc/self/maps").read_text()
    for line in text.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith(stem):
            return path
    return None


class GpuRuntime:
    """The few runtime calls torch does not expose, on the runtime torch loaded (CUDA or HIP)."""

    def __init__(self) -> None:
        self.hip = torch.version.hip is not None
        stem = "libamdhip64" if self.hip else "libcudart"
        path = loaded_library(stem) or ctypes.util.find_library(stem.removeprefix("lib"))
        if path is None:
            raise RuntimeError(f"no {stem} in this process or on the library path")
        self.lib = ctypes.CDLL(path)
        p = "hip" if self.hip else "cuda"
        self._fn = {name: getattr(self.lib, p + name) for name in (
            "Free", "Memset", "IpcGetMemHandle", "IpcOpenMemHandle", "IpcCloseMemHandle", "GetErrorString",
            "DeviceSynchronize")}
        self._fn["GetErrorString"].restype = ctypes.c_char_p
        self._malloc = self.lib.hipExtMallocWithFlags if self.hip else self.lib.cudaMalloc

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what}: {self._fn['GetErrorString'](err).decode()}")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        if self.hip:  # fine-grained: peers' writes over PCIe coherent with this GPU's reads
            self._check(self._malloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), HIP_FINE_GRAINED),
                        "hipExtMallocWithFlags")
        else:
            self._check(self._malloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
        assert ptr.value is not None
        self._check(self._fn["Memset"](ptr, 0, ctypes.c_size_t(nbytes)), "memset")
        self._check(self._fn["DeviceSynchronize"](), "synchronize")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._fn["Free"](ctypes.c_void_p(ptr))

    def ipc_handle(self, ptr: int) -> bytes:
        h = _Handle()
        self._check(self._fn["IpcGetMemHandle"](ctypes.byref(h), ctypes.c_void_p(ptr)), "IPC handle")
        return bytes(h.reserved)

    def ipc_open(self, handle: bytes) -> int:
        h = _Handle()
        ctypes.memmove(h.reserved, handle, IPC_HANDLE_BYTES)
        ptr = ctypes.c_void_p()
        self._check(self._fn["IpcOpenMemHandle"](ctypes.byref(ptr), h, LAZY_ENABLE_PEER_ACCESS), "IPC open")
        assert ptr.value is not None
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._fn["IpcCloseMemHandle"](ctypes.c_void_p(ptr))


def _device_id(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", device.index))


class CustomAllReduce:
    """This rank's side of the peer-write AllReduce over one tensor-parallel group."""

    def __init__(self, runtime: GpuRuntime, own: int, opened: list[int], peers: torch.Tensor,
                 layout: kernels.PeerLayout, lane: int, block: int, num_warps: int) -> None:
        self.runtime, self.own, self.opened = runtime, own, opened
        self.peers, self.layout, self.lane = peers, layout, lane
        self.block, self.num_warps = block, num_warps

    @property
    def max_bytes(self) -> int:
        return 4 * self.layout.max_elems

    def all_reduce(self, t: torch.Tensor, two_shot: bool) -> torch.Tensor:
        return kernels.all_reduce(t, self.peers, self.layout, self.lane, two_shot, self.block, self.num_warps)

    def close(self) -> None:
        torch.cuda.synchronize()
        for p in self.opened:
            self.runtime.ipc_close(p)
        self.runtime.free(self.own)
        self.opened = []


def open_custom_allreduce(tp_ranks: list[int], rank: int, device: torch.device, max_bytes: int,
                          block: int, num_warps: int, control: Any = None) -> tuple[CustomAllReduce | None, str | None]:
    """Collective over `control` (a gloo group of every rank; each rank passes its own TP group's ranks):
    the peer buffers of each group, or None and the reason on every rank."""
    layout = kernels.PeerLayout(len(tp_ranks), max(1, max_bytes // 4))
    runtime, own, handle, reason = None, None, None, None
    try:
        runtime = GpuRuntime()
        own = runtime.malloc(layout.nbytes)
        handle = runtime.ipc_handle(own)
        me = (socket.gethostname(), _device_id(device), handle)
    except Exception as exc:  # noqa: BLE001 - any refusal becomes the fallback's reason
        reason, me = f"peer buffers: {exc}", None
    everyone: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(everyone, me, group=control)
    group = [everyone[r] for r in tp_ranks]
    opened: list[int] = []
    if reason is None and any(g is None for g in group):
        reason = "a peer has no buffer"
    if reason is None:
        visible = {_device_id(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
        reason = peer_access_refused([(host, gpu) for host, gpu, _ in group], _device_id(device), visible,
                                     lambda i: torch.cuda.can_device_access_peer(device, i))
    if reason is None:
        try:
            for r, (_, _, h) in zip(tp_ranks, group, strict=True):
                opened.append(own if r == rank else runtime.ipc_open(h))  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001
            reason = f"opening a peer's IPC handle: {exc}"
    reason = agree(reason, control)
    custom = None
    if reason is None:
        peers = torch.tensor(opened, dtype=torch.int64, device=device)
        custom = CustomAllReduce(runtime, own, [p for p in opened if p != own], peers, layout,  # type: ignore[arg-type]
                                 tp_ranks.index(rank), block, num_warps)
        reason = agree(_self_test(custom, len(tp_ranks), device), control)
    if reason is not None:
        if custom is not None:
            custom.close()
        elif runtime is not None:
            for p in opened:
                if p != own:
                    runtime.ipc_close(p)
            if own is not None:
                runtime.free(own)
        return None, reason
    return custom, None


def peer_access_refused(group: list[tuple[str, str]], mine: str, visible: dict[str, int],
                        can_access: Callable[[int], bool]) -> str | None:
    """Why this rank cannot map the buffers of its group [(host, GPU id)] (None: it can): the group spans
    hosts, a peer's GPU is not visible here, or this GPU has no peer access to it. Ranks on this rank's
    own GPU need none (IPC within one device)."""
    hosts = {host for host, _ in group}
    if len(hosts) > 1:
        return f"the tensor-parallel group spans hosts ({', '.join(sorted(hosts))}): no IPC between them"
    for _, other in group:
        if other == mine:
            continue
        if other not in visible:
            return f"GPU {other} of a peer is not visible to this process"
        if not can_access(visible[other]):
            return f"no peer access from this GPU to GPU {visible[other]}"
    return None


def _self_test(custom: CustomAllReduce, world: int, device: torch.device) -> str | None:
    """One AllReduce of each rank's lane + 1: wrong where peers' writes do not land (no coherence)."""
    for two_shot in (False, True):
        t = torch.full((min(4096, custom.layout.max_elems),), float(custom.lane + 1), device=device)
        custom.all_reduce(t, two_shot)
        want = world * (world + 1) / 2
        if not bool((t == want).all()):
            return f"the first {'two' if two_shot else 'one'}-shot AllReduce gave {t.unique().tolist()[:4]}, not {want}"
    return None
