"""The one communicator interface: every collective and point-to-point transfer the model and the executor
make goes through a `Communicator`.

    LocalCommunicator   one process: every collective is the identity, nothing is sent
    TorchCommunicator   torch.distributed: NCCL on NVIDIA, RCCL on ROCm (torch's "nccl" backend on both),
                        gloo on CPU, for tensors; beside them
                        - the step plans: through a ring in host shared memory (plan_ring.py) where every
                          rank runs on one host, else over a gloo group of their own (a GPU collective
                          never waits on pickling); a keyed plan as its changes (plan_codec.py);
                        - the AllReduce: the custom peer-write kernels (custom_allreduce.py) for messages
                          the policy gives them (allreduce_policy.py), where they were asked for and every
                          rank opened its peers' buffers; NCCL / RCCL / gloo otherwise.

Groups: one tensor-parallel group per pipeline stage (ranks stage * tp .. stage * tp + tp - 1); pipeline
transfers go from a lane to the same lane of the next stage.
"""

from __future__ import annotations

import datetime
import logging
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vegaserve.engine.distributed.allreduce_policy import (AllReduceSwitches, agree, choose, fallback_warning,
                                                           refusal)
from vegaserve.engine.distributed.plan_codec import PlanDecoder, PlanEncoder
from vegaserve.engine.distributed.plan_ring import PlanRing
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

    def captures_all_reduce(self, numel: int) -> bool:
        """An AllReduce of numel elements can be captured in a CUDA / HIP graph: none is needed, or the
        peer-write kernels take it (NCCL / RCCL and gloo collectives run eagerly)."""
        return self.tp == 1

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

    def broadcast_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's `t` (same shape and type on each), in place; returns t."""
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

    def broadcast_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t


class TorchCommunicator(Communicator):
    def __init__(self, topo: Topology, rank: int, init_method: str, device: torch.device, gloo: bool = False,
                 allreduce: AllReduceSwitches = AllReduceSwitches()) -> None:
        """gloo: tensors over gloo even on GPUs (several ranks sharing one GPU, which NCCL refuses).
        allreduce: GGML_ENABLE_CUSTOM_AR and GGML_TP_AR_TWOSHOT."""
        self.topo = topo
        self.rank = rank
        self.device = device
        backend = "nccl" if device.type == "cuda" and not gloo else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device  # binds NCCL to this rank's GPU at once
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=topo.world_size,
                                timeout=_IDLE_TIMEOUT, **kwargs)
        self.staged = backend == "gloo" and device.type != "cpu"
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
        # the logits' way back to rank 0 is a communicator of its own: NCCL runs one communicator's
        # operations in order, so rank 0's receive would otherwise wait behind its own sends to stage 1
        last = topo.rank_of(topo.pp - 1, 0)
        self.results = dist.new_group(sorted({0, last})) if last != 0 else None
        self.tp_group = None
        for stage in range(topo.pp):  # every rank creates every group, in the same order
            ranks = [topo.rank_of(stage, lane) for lane in range(topo.tp)]
            group = dist.new_group(ranks) if topo.tp > 1 else None
            if stage == self.stage:
                self.tp_group = group
        self.switches = allreduce
        self.ring = self._open_plan_ring()
        # plans go out as changes to the last one (plan_codec.py): rank 0 encodes, the others decode
        self.plans = PlanEncoder() if rank == 0 else PlanDecoder()
        self.custom = self._open_custom_allreduce() if allreduce.custom else None
        log.debug("rank %d of %d up (%s, stage %d lane %d)", rank, topo.world_size, backend, self.stage, self.lane)

    def _open_plan_ring(self) -> PlanRing | None:
        """The step plans' ring, where every rank runs on this host; None (plans over gloo) elsewhere."""
        world = self.topo.world_size
        if world == 1:
            return None
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, _host_id(), group=self.control)
        if len(set(hosts)) > 1:
            return None
        ring, reason, name = None, None, [None]
        try:
            if self.rank == 0:
                ring = PlanRing.create(world - 1)
                name = [ring.name]
        except OSError as exc:
            reason = f"creating the ring: {exc}"
        dist.broadcast_object_list(name, src=0, group=self.control)
        try:
            if self.rank != 0 and name[0] is not None:
                ring = PlanRing.attach(name[0], self.rank - 1)
        except (OSError, ValueError) as exc:
            reason = f"attaching the ring: {exc}"
        reason = agree(reason, self.control)  # after this every reader is attached, or none uses the ring
        if ring is not None and ring.owner:
            ring.unlink()
        if reason is not None:
            if ring is not None:
                ring.close()
            if self.rank == 0:
                log.warning("step plans go over gloo: %s", reason)
            return None
        ring.check_peers()  # type: ignore[union-attr]
        return ring

    def _open_custom_allreduce(self) -> Any:
        """The peer-write AllReduce's buffers (every rank, collectively), or None with one warning line."""
        reason = refusal(self.device, self.tp)
        custom = None
        if reason is None:
            from vegaserve.engine.distributed.custom_allreduce import open_custom_allreduce
            from vegaserve.triton_kernels.tuning import load_tuning

            params = load_tuning().allreduce
            lanes = [self.topo.rank_of(self.stage, lane) for lane in range(self.tp)]
            custom, reason = open_custom_allreduce(lanes, self.rank, self.device, params["gate_bytes"],
                                                   params["block"], params["num_warps"], self.control)
        if reason is not None and self.rank == 0:
            log.warning(fallback_warning(reason, self.device))
        return custom

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.custom is not None and t.is_contiguous():
            variant = choose(self.tp, self.topo.pp, 4 * t.numel(), self.custom.max_bytes, self.switches.two_shot)
            if variant != "device":
                return self.custom.all_reduce(t, variant == "two_shot")
        if self.tp_group is not None:
            w = self._wire(t)
            dist.all_reduce(w, group=self.tp_group)
            if w is not t:
                t.copy_(w)
        return t

    def captures_all_reduce(self, numel: int) -> bool:
        if self.tp == 1:
            return True
        return self.custom is not None and choose(self.tp, self.topo.pp, 4 * numel, self.custom.max_bytes,
                                                  self.switches.two_shot) != "device"

    def gather_vocab(self, t: torch.Tensor, vocab: int) -> torch.Tensor:
        if self.tp_group is None:
            return t[:, :vocab]
        w = self._wire(t)
        parts = [torch.empty_like(w) for _ in range(self.tp)]
        dist.all_gather(parts, w, group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, :vocab].to(t.device)

    # gloo moves CPU tensors only between two ranks: GPU tensors on a gloo group go through host memory
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.staged else t.contiguous()

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int,
              group: Any = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="cpu" if self.staged else device)
        dist.recv(t, src, group=group)
        return t.to(device)

    def send_next(self, t: torch.Tensor) -> Any:
        return _Sent(self._wire(t), self.topo.rank_of(self.stage + 1, self.lane))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.topo.rank_of(self.stage - 1, self.lane))

    def send_to_rank0(self, t: torch.Tensor) -> Any:
        return _Sent(self._wire(t), 0, self.results)

    def recv_from_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.topo.rank_of(self.topo.pp - 1, 0), group=self.results)

    def broadcast_plan(self, plan: object | None = None) -> object:
        if self.rank == 0:
            wire = self.plans.encode(plan)
            if self.ring is not None:
                self.ring.put(wire)
            else:
                dist.broadcast_object_list([wire], src=0, group=self.control)
            return plan
        if self.ring is not None:
            return self.plans.decode(self.ring.get())
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return self.plans.decode(box[0])

    def broadcast_rows(self, t: torch.Tensor) -> torch.Tensor:
        w = self._wire(t)
        dist.broadcast(w, src=0)
        if w is not t:
            t.copy_(w)
        return t

    def close(self) -> None:
        if self.custom is not None:
            self.custom.close()
            self.custom = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _host_id() -> str:
    """This host, as the ranks on it see it: the name and the kernel's boot id (containers on one machine
    share the boot id but not always /dev/shm; those refuse at attach)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Sent:
    """An asynchronous send; holds its tensor until wait() (a staged copy would otherwise be freed)."""

    def __init__(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self.tensor = t
        self.work = dist.isend(t, dst, group=group)

    def wait(self) -> None:
        self.work.wait()
