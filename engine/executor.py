"""The executor: rank 0's handle on the model, on one device or one process per device.

    Executor.forward(plan)   broadcast the step plan to every rank, run rank 0's share, return the logits

With one device there is no other process and no broadcast: the plan runs in place. With several, the
server process is global rank 0 (HTTP front, scheduler, sampler, stage 0 lane 0). On one node it spawns
ranks 1 .. n-1 (`WorkerGroup`); across nodes torchrun starts every rank and ranks other than 0 go straight
to `worker_main` (server/serve_cmd.py, `run_torchrun_worker`). Each rank loads its own share from the GGUF
file, as the Launch says (engine/launch.py), and repacks it on its own device (`build_rank`); its
StageWorker (engine/distributed/worker.py) then runs its part of every step.

A worker that dies is fatal: the monitor thread hears it at once (process sentinels), tells the callbacks
(the AsyncEngine fails every stream and answers 503 from then on), and after a short grace kills the other
workers and exits the process non-zero. Rank 0 may be blocked inside a collective that will never finish,
so no orderly shutdown is attempted.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.distributed.allreduce_policy import AllReduceSwitches
from vegaserve.engine.distributed.communicator import LocalCommunicator, TorchCommunicator
from vegaserve.engine.distributed.worker import StageWorker
from vegaserve.engine.forward_batch import MtpPlan, StepPlan
from vegaserve.engine.gguf_file import GGUFFile, default_model_path
from vegaserve.engine.launch import Launch, engine_shape, pick_device, plan_launch, rank_device
from vegaserve.engine.layers.attention import kv_cache_dtype
from vegaserve.engine.models.arch_config import arch_config_from_gguf
from vegaserve.engine.models.registry import load_model

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 3.0  # after a worker dies: time for the error to reach the clients (and 503s) before the exit


def build_rank(launch: Launch, rank: int, show_progress: bool = False) -> StageWorker:
    """Join the process group, load this rank's share of the model, and return its worker."""
    device = rank_device(launch, rank)
    if device.type == "cpu":
        torch.set_num_threads(launch.threads)
    else:
        torch.cuda.set_device(device)
    cfg = launch.config
    switches = AllReduceSwitches(custom=cfg.parallel.custom_allreduce, two_shot=cfg.parallel.allreduce_two_shot)
    comm = TorchCommunicator(launch.topo, rank, launch.init_method, device, gloo=launch.shared_gpus, allreduce=switches)
    gguf = GGUFFile(launch.path, cfg.model.load_mode)
    loaded = load_model(
        gguf, device, launch.max_model_len, show_progress, repack=not cfg.model.no_repack,
        tuning_file=cfg.kernels.tuning_file, q8_1_cache=cfg.kernels.q8_1_cache,
        shared_split=cfg.kernels.shexp_split, comm=comm, cpu_int4=cfg.kernels.cpu_int4,
        layers=launch.stages[comm.stage],
    )
    return make_worker(launch, loaded.model, comm, device, show_progress)


# The most rows a captured verify step holds (speculative decoding: sequences x (draft_max + 1)); larger
# verify steps run eagerly, where the launches are a small part of the step's work.
VERIFY_ROWS = 512


def make_worker(launch: Launch, model, comm, device: torch.device, show_progress: bool = False) -> StageWorker:
    """The rank's worker: its KV cache in the configured type (a hybrid model's recurrent state for
    max_num_seqs sequences and its prefix-caching snapshots beside it) and its decode and verify graphs: on a single GPU, or on each rank of
    tensor parallelism alone with the peer-write AllReduce."""
    cfg = launch.config
    bs = cfg.cache.block_size
    if device.type == "cuda":
        from vegaserve.triton_kernels import pdl

        pdl.set_enabled(cfg.kernels.pdl)
    if cfg.speculative.type == "draft-mtp":  # before the KV cache: the MTP block's layer joins it
        model.use_mtp()
    # one GPU, or tensor parallelism alone with the peer-write AllReduce (capturable, unlike NCCL / RCCL's)
    topo = launch.topo
    graphs = device.type == "cuda" and cfg.kernels.token_graph and (
        topo.world_size == 1 or (topo.pp == 1 and getattr(comm, "custom", None) is not None))
    worker = StageWorker(model, comm, launch.num_slots, device, cfg.parallel.sched_n_copies,
                         kv_cache_dtype(cfg.cache.kv_dtype, device), spare_slots=bs if graphs else 0,
                         state_slots=cfg.scheduler.max_num_seqs, state_backups=cfg.speculative.enabled,
                         state_snapshots=cfg.state_snapshots)
    if graphs:
        from vegaserve.engine.cuda_graphs import DecodeGraphs, MtpGraphs, graph_buckets

        seqs = cfg.scheduler.max_num_seqs
        worker.graphs = DecodeGraphs(model, worker.cache, seqs, launch.max_model_len, bs, device)
        worker.graphs.capture(show_progress)
        rows = cfg.speculative.max_draft + 1
        if cfg.speculative.enabled and graph_buckets(model, seqs, rows, VERIFY_ROWS):
            worker.verify_graphs = DecodeGraphs(model, worker.cache, seqs, launch.max_model_len, bs, device, rows=rows,
                                                max_rows=VERIFY_ROWS)
            worker.verify_graphs.capture(show_progress, pool=worker.graphs.pool)
        if cfg.speculative.type == "draft-mtp":  # the block's further guesses, then its catch-ups
            worker.mtp_graphs = [MtpGraphs(model, model.nextn[0], worker.cache, seqs, launch.max_model_len, bs, device,
                                           rows=r, max_rows=VERIFY_ROWS)
                                 for r in (1, rows) if graph_buckets(model, seqs, r, VERIFY_ROWS)]
            for g in worker.mtp_graphs:
                g.capture(show_progress, pool=worker.graphs.pool)
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

    def forward_mtp(self, plan: MtpPlan, h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over plan on every rank, h_in [plan.rows, hidden] f32 on rank 0's device: (its output
        hidden states, the logits of each sequence's last row), on rank 0."""
        if self.distributed:
            self.worker.comm.broadcast_plan(plan)
            self.worker.comm.broadcast_rows(h_in)
        return self.worker.run_mtp(plan, h_in)

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
            tuning_file=cfg.kernels.tuning_file, q8_1_cache=cfg.kernels.q8_1_cache, cpu_int4=cfg.kernels.cpu_int4,
        )
        return Executor(make_worker(launch, loaded.model, LocalCommunicator(), device, show_progress))
    workers = None if launch.torchrun else WorkerGroup(launch)
    log.info("%s over %d processes; layers per stage: %s", launch.topo.describe(), launch.topo.world_size,
             ", ".join(f"{r.start}-{r.stop - 1}" for r in launch.stages))
    return Executor(build_rank(launch, 0, show_progress), workers)


def run_torchrun_worker(config: EngineConfig, rank: int, world: int) -> None:
    """A rank other than 0 under torchrun: plan the same launch as rank 0 does, then serve steps."""
    gguf = GGUFFile(config.model.path or default_model_path(), config.model.load_mode)
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    max_len, num_blocks = engine_shape(config, gguf)
    launch = plan_launch(config, gguf, arch, max_len, num_blocks * config.cache.block_size,
                         pick_device(config.device), torchrun_world=world)
    del gguf
    worker_main(rank, launch, spawned=False)


def _die_with_parent() -> None:
    """A spawned worker must not outlive the server: the kernel signals it when the parent goes (Linux),
    and a watcher thread covers the rest."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(rank: int, launch: Launch, spawned: bool = True) -> None:
    """Body of ranks 1 .. n-1: join the group, load this rank's share, then run the plans rank 0 sends
    until it sends None."""
    if spawned:
        _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    worker = build_rank(launch, rank)
    comm = worker.comm
    try:
        while True:
            plan = comm.broadcast_plan()
            if plan is None:
                break
            if isinstance(plan, MtpPlan):
                h_in = comm.broadcast_rows(torch.empty(plan.rows, worker.hidden, device=worker.device))
                worker.run_mtp(plan, h_in)
            else:
                worker.run(plan)  # type: ignore[arg-type]
    finally:
        comm.close()
