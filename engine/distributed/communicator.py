"""The one communicator interface: every collective and point-to-point transfer the model and the executor
make goes through a `Communicator`, so the custom peer-write AllReduce (GGML_ENABLE_CUSTOM_AR) plugs in here.

    LocalCommunicator   one process: every collective is the identity, nothing is sent
    TorchCommunicator   torch.distributed: NCCL on NVIDIA, RCCL on ROCm (torch's "nccl" backend on both),
                        gloo on CPU. Tensor traffic uses the device backend; step plans (small Python
                        objects) go over a gloo group of their own, so a GPU collective never waits on pickling.

Groups: one tensor-parallel group per pipeline stage (ranks stage * tp .. stage * tp + tp - 1); pipeline
transfers go from a lane to the same lane of the next stage.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from vegaserve.engine.distributed.topology import Topology

log = logging.getLogger(__name__)

# an idle server sends no step for hours; the workers' wait for the next plan must not time out
_IDLE_TIMEOUT = datetime.timedelta(days=365)


class Communicator:
    """Collectives of one rank. `tp`/`lane`: its tensor-parallel group; `stage`/`pp`: its pipeline place."""

    topo: Topology
    rank: int

    @property
    def tp(self) -> int:
        return self.topo.tp

    @property
    def lane(self) -> int:
        return self.topo.lane_of(self.rank)

    @property
    def stage(self) -> int:
        return self.topo.stage_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.topo.pp - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place; returns t."""
        raise NotImplementedError

    def gather_vocab(self, t: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, per_lane] slices of every lane (each lane's slice padded to one width) -> [rows, vocab]."""
        raise NotImplementedError

    def send_next(self, t: torch.Tensor) -> Any:
        """Start sending t to this lane of the next stage; returns a handle to wait on."""
        raise NotImplementedError

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def send_to_rank0(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def recv_from_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def broadcast_plan(self, plan: object | None = None) -> object:
        """Rank 0 passes the step's plan and every other rank gets it back."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalCommunicator(Communicator):
    def __init__(self) -> None:
        self.topo = Topology(1, 1)
        self.rank = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_vocab(self, t: torch.Tensor, vocab: int) -> torch.Tensor:
        return t[:, :vocab]

    def broadcast_plan(self, plan: object | None = None) -> object:
        return plan


class TorchCommunicator(Communicator):
    def __init__(self, topo: Topology, rank: int, init_method: str, device: torch.device, gloo: bool = False) -> None:
        """gloo: tensors over gloo even on GPUs (several ranks sharing one GPU, which NCCL refuses)."""
        self.topo = topo
        self.rank = rank
        self.device = device
        backend = "nccl" if device.type == "cuda" and not gloo else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device  # binds NCCL to this rank's GPU at once
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=topo.world_size,
                                timeout=_IDLE_TIMEOUT, **kwargs)
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
        self.tp_group = None
        for stage in range(topo.pp):  # every rank creates every group, in the same order
            ranks = [topo.rank_of(stage, lane) for lane in range(topo.tp)]
            group = dist.new_group(ranks) if topo.tp > 1 else None
            if stage == self.stage:
                self.tp_group = group
        log.debug("rank %d of %d up (%s, stage %d lane %d)", rank, topo.world_size, backend, self.stage, self.lane)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def gather_vocab(self, t: torch.Tensor, vocab: int) -> torch.Tensor:
        if self.tp_group is None:
            return t[:, :vocab]
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, :vocab]

    def send_next(self, t: torch.Tensor) -> Any:
        return dist.isend(t.contiguous(), self.topo.rank_of(self.stage + 1, self.lane))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, self.topo.rank_of(self.stage - 1, self.lane))
        return t

    def send_to_rank0(self, t: torch.Tensor) -> Any:
        return dist.isend(t.contiguous(), 0)

    def recv_from_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, self.topo.rank_of(self.topo.pp - 1, 0))
        return t

    def broadcast_plan(self, plan: object | None = None) -> object:
        box = [plan]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
