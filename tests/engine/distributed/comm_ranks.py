"""One rank of the multi-process communicator tests (test_allreduce_policy.py), run as a script:

    python comm_ranks.py RANK WORLD PORT SCENARIO

A TorchCommunicator on the CPU over gloo with the custom AllReduce asked for; 200 small step plans and
one larger than a ring slot broadcast, an AllReduce, two agreements; one JSON line of what this rank saw.
SCENARIO `ring-refused` makes the last rank fail to attach the plan ring.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from vegaserve.engine.distributed import plan_ring
from vegaserve.engine.distributed.allreduce_policy import AllReduceSwitches, agree
from vegaserve.engine.distributed.communicator import TorchCommunicator
from vegaserve.engine.distributed.topology import Topology
from vegaserve.engine.forward_batch import StepPlan


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    lines = _Lines()
    logging.getLogger("vegaserve").addHandler(lines)
    if scenario == "ring-refused" and rank == world - 1:
        def refuse(name: str, reader: int) -> plan_ring.PlanRing:
            raise OSError("planted")

        plan_ring.PlanRing.attach = refuse  # type: ignore[method-assign]
    comm = TorchCommunicator(Topology(world, 1), rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"),
                             allreduce=AllReduceSwitches(custom=True))
    plans = [StepPlan([([i, i + 1], 16 + i, [i % 50])], [False], 16) for i in range(200)]
    plans.append(StepPlan([(list(range(20_000)), 0, list(range(2048)))], [True], 16))  # several 64 KiB slots
    got = [comm.broadcast_plan(p if rank == 0 else None) for p in plans]
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(t)
    out = {
        "ring": comm.ring is not None, "custom": comm.custom is not None, "plans_ok": got == plans,
        "sum_ok": torch.equal(t, torch.arange(1000, dtype=torch.float32) * (world * (world + 1) // 2)),
        "agree_none": agree(None, comm.control),
        "agree_planted": agree("planted refusal" if rank == world - 1 else None, comm.control),
    }
    comm.broadcast_plan(None)
    comm.close()
    out["warnings"] = lines.lines
    print(json.dumps(out))


if __name__ == "__main__":
    main()
