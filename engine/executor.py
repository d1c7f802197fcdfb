"""The executor: rank 0's handle on the model, on one device or one process per device.

    Executor.forward(plan)   broadcast the step plan to every rank, run rank 0's share, return the logits

With one device there is no other process and no broadcast: the plan runs in place. With several, the
server process is global rank 0 (HTTP front, scheduler, sampler, stage 0 lane 0). On one node it spawns
ranks 1 .. n-1 (`WorkerGroup`); across nodes torchrun starts every rank and ranks other than 0 go straight
to `worker_main` (server/serve_cmd.py). Each rank loads its own share from the GGUF file and repacks it on
its own device (`build_rank`).

A worker that dies is fatal: the monitor thread hears it at once (process sentinels), tells the callbacks
(the AsyncEngine fails every stream and answers 503 from then on), and after a short grace kills the other
workers and exits the process non-zero. Rank 0 may be blocked inside a collective that will never finish,
so no orderly shutdown is attempted.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.distributed.communicator import LocalCommunicator, TorchCommunicator
from vegaserve.engine.distributed.topology import (
    Topology, check_model_splits, kv_heads_per_lane, partition_layers, plan_topology,
)
from vegaserve.engine.distributed.worker import StageWorker, StepPlan, worker_main
from vegaserve.engine.gguf_file import GGUFFile
from vegaserve.engine.layers.attention import kv_cache_dtype
from vegaserve.engine.models.arch_config import ArchConfig
from vegaserve.engine.models.registry import load_model
from vegaserve.triton_kernels.dequant import spec_for

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 3.0  # after a worker dies: time for the error to reach the clients (and 503s) before the exit


@dataclass(frozen=True)
class Launch:
    """How every rank builds its share; the same on every rank (it pickles to spawned workers)."""

    config: EngineConfig
    path: str
    topo: Topology
    stages: tuple[range, ...]  # layers of each pipeline stage
    max_model_len: int
    num_slots: int
    device_type: str  # cpu | cuda (ROCm's torch calls its GPUs cuda too)
    init_method: str
    threads: int  # torch CPU threads per rank (CPU ranks)
    torchrun: bool = False
    shared_gpus: bool = False  # more ranks than GPUs (a test setup): ranks share GPUs round-robin, over gloo


def count_devices(config: EngineConfig) -> int:
    """Devices to use: -ndev if given, else every visible GPU (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES
    choose them), else one (the CPU)."""
    if config.parallel.n_devices:
        return config.parallel.n_devices
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer_bytes(gguf: GGUFFile, arch: ArchConfig) -> list[int]:
    sizes = [0] * arch.n_layers
    for name, info in gguf.tensors.items():
        if name.startswith("blk."):
            sizes[int(name.split(".")[1])] += info.n_bytes
    return sizes


def _rank_bytes(gguf: GGUFFile, arch: ArchConfig, launch: Launch, stage: int) -> int:
    """Weights and KV cache one rank of `stage` holds (tensor-parallel slices are 1/tp of each matrix)."""
    layers = launch.stages[stage]
    sizes = _layer_bytes(gguf, arch)
    n = sum(sizes[i] for i in layers)
    embd = gguf.info("token_embd.weight").n_bytes
    if stage == 0:
        n += embd
    if stage == launch.topo.pp - 1:
        n += gguf.info("output.weight").n_bytes if "output.weight" in gguf else (embd if stage else 0)
    itemsize = torch.empty(0, dtype=kv_cache_dtype(launch.config.cache.kv_dtype, torch.device(launch.device_type))).element_size()
    kv = 2 * len(layers) * launch.num_slots * kv_heads_per_lane(arch.n_kv_heads, launch.topo.tp) * arch.head_dim * itemsize
    return n // launch.topo.tp + kv


def _device_memory(config: EngineConfig, device_type: str, world: int) -> tuple[int, str]:
    """Bytes one rank may use, and where the figure comes from."""
    if config.parallel.device_memory_gib:
        return int(config.parallel.device_memory_gib * 2**30), "--device-memory"
    if device_type == "cuda":
        n = min(world, torch.cuda.device_count())
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) * n // world, "the smallest GPU"
    with open("/proc/meminfo") as f:
        avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)
    return (avail // world, "available host memory") if avail else (0, "")


def plan_launch(config: EngineConfig, gguf: GGUFFile, arch: ArchConfig, max_model_len: int, num_slots: int,
                device: torch.device, torchrun_world: int = 0) -> Launch:
    """The topology, layer split and memory check for this config; every impossible request fails here."""
    n = torchrun_world or count_devices(config)
    topo = plan_topology(config.parallel.split_mode, config.parallel.tensor_parallel_group, n)
    if topo.world_size < n and config.parallel.split_mode != "none":
        log.warning("%d devices visible, %s uses %d", n, topo.describe(), topo.world_size)
    block = {k: spec_for(gguf.info(f"blk.0.{k}.weight").type_id).block_size for k in ("attn_output", "ffn_down")}
    for i in range(arch.n_layers):  # the largest block of each, over all layers (mixes differ per layer)
        for k in block:
            block[k] = max(block[k], spec_for(gguf.info(f"blk.{i}.{k}.weight").type_id).block_size)
    check_model_splits(arch, topo, block, str(gguf.path))
    embd = gguf.info("token_embd.weight").n_bytes
    head = gguf.info("output.weight").n_bytes if "output.weight" in gguf else embd
    stages = tuple(partition_layers(_layer_bytes(gguf, arch), topo.pp, embd, head))
    cores = os.cpu_count() or 1
    launch = Launch(
        config=config, path=str(gguf.path), topo=topo, stages=stages, max_model_len=max_model_len,
        num_slots=num_slots, device_type=device.type,
        # torchrun's rendezvous is in the environment (MASTER_ADDR, MASTER_PORT); one node: a local port
        init_method="env://" if torchrun_world else f"tcp://127.0.0.1:{_free_port()}",
        threads=max(1, cores // topo.world_size), torchrun=bool(torchrun_world),
    )
    if device.type == "cuda" and not torchrun_world and topo.world_size > torch.cuda.device_count():
        log.warning("%d ranks on %d GPU(s): ranks share GPUs and talk over gloo (for testing; slow)",
                    topo.world_size, torch.cuda.device_count())
        launch = dataclasses.replace(launch, shared_gpus=True)
    limit, source = _device_memory(config, device.type, topo.world_size)
    if limit:
        for stage in range(topo.pp):
            need = _rank_bytes(gguf, arch, launch, stage)
            if need > limit:
                raise ConfigError(
                    f"{gguf.path}: {topo.describe()} needs {need / 2**30:.2f} GiB on each device of stage {stage} "
                    f"(weights and KV cache for {num_slots} tokens), but {source} gives {limit / 2**30:.2f} GiB: "
                    f"use more devices, a smaller context (-c) or fewer sequences (-np)"
                )
    return launch


def rank_device(launch: Launch, rank: int) -> torch.device:
    if launch.device_type != "cuda":
        return torch.device("cpu")
    from vegaserve.engine.env import local_rank

    return torch.device("cuda", local_rank() if launch.torchrun else rank % torch.cuda.device_count())


def build_rank(launch: Launch, rank: int, show_progress: bool = False) -> StageWorker:
    """Join the process group, load this rank's share of the model, and return its worker."""
    device = rank_device(launch, rank)
    if device.type == "cpu":
        torch.set_num_threads(launch.threads)
    else:
        torch.cuda.set_device(device)
    comm = TorchCommunicator(launch.topo, rank, launch.init_method, device, gloo=launch.shared_gpus)
    cfg = launch.config
    gguf = GGUFFile(launch.path, cfg.model.load_mode)
    loaded = load_model(
        gguf, device, launch.max_model_len, show_progress, repack=not cfg.model.no_repack,
        tuning_file=cfg.kernels.tuning_file, decode_rope=cfg.kernels.decode_rope, comm=comm,
        layers=launch.stages[comm.stage],
    )
    return make_worker(launch, loaded.model, comm, device, show_progress)


def make_worker(launch: Launch, model, comm, device: torch.device, show_progress: bool = False) -> StageWorker:
    """The rank's worker: its KV cache in the configured type and, on a single GPU, its decode graphs."""
    cfg = launch.config
    bs = cfg.cache.block_size
    if device.type == "cuda":
        from vegaserve.triton_kernels import pdl

        pdl.set_enabled(cfg.kernels.pdl)
    graphs = device.type == "cuda" and cfg.kernels.token_graph and launch.topo.world_size == 1
    worker = StageWorker(model, comm, launch.num_slots, device, cfg.parallel.sched_n_copies,
                         kv_cache_dtype(cfg.cache.kv_dtype, device), spare_slots=bs if graphs else 0)
    if graphs:
        from vegaserve.engine.cuda_graphs import DecodeGraphs

        worker.graphs = DecodeGraphs(model, worker.cache, cfg.scheduler.max_num_seqs, launch.max_model_len, bs, device)
        worker.graphs.capture(show_progress)
    return worker


class WorkerGroup:
    """Ranks 1 .. n-1 as child processes of the server, watched by a monitor thread."""

    def __init__(self, launch: Launch) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter per worker: no forked CUDA or thread state
        self.procs = [
            ctx.Process(target=worker_main, args=(r, launch), name=f"vegaserve-rank{r}", daemon=True)
            for r in range(1, launch.topo.world_size)
        ]
        self.callbacks: list[Callable[[str], None]] = []
        self._closing = False
        for p in self.procs:
            p.start()
        log.info("started %d worker(s): %s", len(self.procs), ", ".join(f"rank {r + 1} pid {p.pid}" for r, p in enumerate(self.procs)))
        threading.Thread(target=self._monitor, name="worker-monitor", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _monitor(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(timeout=1)  # reap it, so that its exit code is known
        msg = f"worker {dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
        log.error("%s: the server cannot go on and stops", msg)
        for cb in self.callbacks:
            try:
                cb(msg)
            except Exception:  # noqa: BLE001 - the exit below must happen whatever a callback does
                log.exception("failure callback")
        time.sleep(FAILURE_GRACE_S)
        self.kill()
        logging.shutdown()
        os._exit(1)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=2)

    def close(self, timeout: float = 10.0) -> None:
        """After rank 0 broadcast the stop plan: wait for the workers, then make sure they are gone."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


class Executor:
    """Runs step plans on every rank; the logits come back to rank 0."""

    def __init__(self, worker: StageWorker, workers: WorkerGroup | None = None) -> None:
        self.worker = worker
        self.workers = workers
        self.distributed = worker.comm.topo.world_size > 1
        self._closed = False

    @property
    def model(self):
        return self.worker.model

    @property
    def cache(self):
        return self.worker.cache

    @property
    def takes_device_ids(self) -> bool:
        """forward() accepts input ids already on the device (one process: nothing to broadcast them with)."""
        return not self.distributed

    def forward(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: one per sequence of a one-token-each plan, on the device, in place of the plan's."""
        if input_ids is not None and not self.takes_device_ids:
            raise ValueError("input ids on the device need a single-process executor")
        if self.distributed:
            self.worker.comm.broadcast_plan(plan)
        out = self.worker.run(plan, input_ids)
        assert out is not None  # rank 0 always gets the logits
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.distributed:
            try:
                if self.workers is not None:
                    self.workers._closing = True
                self.worker.comm.broadcast_plan(None)
            except Exception:  # noqa: BLE001 - a peer already gone: close what is left
                log.warning("could not tell the workers to stop; killing them")
            if self.workers is not None:
                self.workers.close()
            self.worker.comm.close()


def start_executor(launch: Launch, device: torch.device, gguf: GGUFFile, show_progress: bool = True) -> Executor:
    """Rank 0: spawn the other ranks (one node), load rank 0's share, return the executor."""
    if launch.topo.world_size == 1:
        cfg = launch.config
        loaded = load_model(
            gguf, device, launch.max_model_len, show_progress, repack=not cfg.model.no_repack,
            tuning_file=cfg.kernels.tuning_file, decode_rope=cfg.kernels.decode_rope,
        )
        return Executor(make_worker(launch, loaded.model, LocalCommunicator(), device, show_progress))
    workers = None if launch.torchrun else WorkerGroup(launch)
    log.info("%s over %d processes; layers per stage: %s", launch.topo.describe(), launch.topo.world_size,
             ", ".join(f"{r.start}-{r.stop - 1}" for r in launch.stages))
    return Executor(build_rank(launch, 0, show_progress), workers)


def run_torchrun_worker(config: EngineConfig, rank: int, world: int) -> None:
    """A rank other than 0 under torchrun: plan the same launch as rank 0 does, then serve steps."""
    from vegaserve.engine.engine_core import engine_shape, pick_device
    from vegaserve.engine.gguf_file import default_model_path
    from vegaserve.engine.models.arch_config import arch_config_from_gguf

    gguf = GGUFFile(config.model.path or default_model_path(), config.model.load_mode)
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    max_len, num_blocks = engine_shape(config, gguf)
    launch = plan_launch(config, gguf, arch, max_len, num_blocks * config.cache.block_size,
                         pick_device(config.device), torchrun_world=world)
    del gguf
    worker_main(rank, launch, spawned=False)
