"""The step plans' shared-memory ring (engine/distributed/plan_ring.py) with real reader processes: every
plan reaches every reader in order, plans larger than a slot or than the whole ring arrive whole, an idle
reader sleeps rather than spins while one between steady plans spins through the gaps, a dead writer or
reader is noticed instead of waited on forever, and no shared-memory name is left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vegaserve.engine.distributed import plan_ring
from vegaserve.engine.distributed.plan_ring import PeerGone, PlanRing

CTX = mp.get_context("fork")  # the readers need nothing but the ring module


def _count_reader(name: str, reader: int, out) -> None:
    """Reads until None: (plans read, all in order and intact)."""
    ring = PlanRing.attach(name, reader)
    n, ok = 0, True
    while (msg := ring.get()) is not None:
        i, payload = msg
        ok &= i == n and payload == ("x" * (i % 7), i * 3)
        n += 1
    out.send((n, ok))
    ring.close()


def _open(n_readers: int, target, *args, **shape):
    ring = PlanRing.create(n_readers, **shape)
    pipes = [CTX.Pipe(duplex=False) for _ in range(n_readers)]
    procs = [CTX.Process(target=target, args=(ring.name, r, *args, pipes[r][1]), daemon=True) for r in range(n_readers)]
    for p in procs:
        p.start()
    return ring, procs, [p[0] for p in pipes]


def _recv(conn, timeout: float = 60):
    """A reader's report, or a failure (not a hang) when it never comes."""
    assert conn.poll(timeout), "a reader sent nothing: it hangs"
    return conn.recv()


def _raised_within(fn, seconds: float) -> BaseException | None:
    """What fn raised, run in a thread that may block: a failure, not a hang, where it blocks too long."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return box[0]


def _wait_attached(ring: PlanRing, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(ring.reader_pids()):
        assert time.monotonic() < deadline, "the readers did not attach"
        time.sleep(0.01)
    ring.unlink()
    ring.check_peers()


def test_100000_plans_reach_4_readers_in_order() -> None:
    ring, procs, outs = _open(4, _count_reader)
    _wait_attached(ring)

    def write() -> None:
        for i in range(100_000):
            ring.put((i, ("x" * (i % 7), i * 3)))
        ring.put(None)

    assert _raised_within(write, 120) is None
    got = [_recv(o) for o in outs]
    for p in procs:
        p.join(timeout=30)
    ring.close()
    assert got == [(100_000, True)] * 4


def _echo_reader(name: str, reader: int, out) -> None:
    ring = PlanRing.attach(name, reader)
    while (msg := ring.get()) is not None:
        out.send(msg)
    out.send(None)
    ring.close()


def test_plans_larger_than_a_slot_and_than_the_ring_arrive_whole() -> None:
    slot = 1024  # payload 1008 bytes a slot, 4 slots: a ring holds 4032 bytes
    ring, procs, outs = _open(2, _echo_reader, n_slots=4, slot_bytes=slot)
    _wait_attached(ring)
    sizes = [1, 1008 - 40, 1008, 1009, 2 * 1008, 3 * 4032 + 5, 7, 100_000, 3]
    sent = [os.urandom(n) for n in sizes]
    for s in sent:
        ring.put(s)
    ring.put(None)
    for o in outs:
        got = []
        while (m := _recv(o)) is not None:
            got.append(m)
        assert got == sent
    for p in procs:
        p.join(timeout=30)
    ring.close()


def _idle_reader(name: str, reader: int, out) -> None:
    ring = PlanRing.attach(name, reader)
    cpu = time.process_time()
    msg = ring.get()
    out.send((msg, time.process_time() - cpu))
    ring.close()


def test_an_idle_reader_sleeps_and_wakes_for_the_next_plan(monkeypatch) -> None:
    monkeypatch.setattr(plan_ring, "CHECK_S", 5.0)  # only the writer's wake can end a sleep early
    ring, procs, outs = _open(2, _idle_reader)
    _wait_attached(ring)
    time.sleep(1.0)
    t = time.monotonic()
    ring.put("late plan")
    got = [_recv(o) for o in outs]
    woke = time.monotonic() - t
    for p in procs:
        p.join(timeout=30)
    ring.close()
    assert [g[0] for g in got] == ["late plan"] * 2
    assert max(g[1] for g in got) < 0.2, f"a waiting reader burnt {max(g[1] for g in got):.2f} s of CPU in 1 s"
    assert woke < 0.5


def _sleep_counting_reader(name: str, reader: int, out) -> None:
    """Reads until None: (plans read, how many waits ended on the futex rather than spinning)."""
    ring = PlanRing.attach(name, reader)
    sleeps = 0
    wait = plan_ring._futex.wait

    def counted(*args):
        nonlocal sleeps
        sleeps += 1
        return wait(*args)

    plan_ring._futex.wait = counted
    n = 0
    while ring.get() is not None:
        n += 1
    out.send((n, sleeps))
    ring.close()


def test_a_reader_spins_through_the_gaps_between_steady_plans() -> None:
    """Plans 1 ms apart (a step's time): after the first, the reader spins for twice the last gap and sees
    each plan as it lands; with the 50 us spin alone every one of them would find it asleep."""
    ring, procs, outs = _open(1, _sleep_counting_reader)
    if not ring.spin:
        ring.close()
        pytest.skip("one core: readers do not spin")
    _wait_attached(ring)
    for i in range(200):
        ring.put(i)
        pause = time.perf_counter() + 1e-3
        while time.perf_counter() < pause:
            pass
    ring.put(None)
    n, sleeps = _recv(outs[0])
    procs[0].join(timeout=30)
    ring.close()
    assert n == 200
    assert sleeps < 100, f"the reader slept through {sleeps} of 200 plans 1 ms apart"


def _writer_that_dies(name_out, n_readers: int) -> None:
    ring = PlanRing.create(n_readers)
    name_out.send(ring.name)
    name_out.recv()  # the reader attached
    ring.unlink()
    ring.put("first")
    os._exit(0)  # gone without a stop plan


def test_a_reader_notices_that_the_writer_died(monkeypatch) -> None:
    monkeypatch.setattr(plan_ring, "CHECK_S", 0.05)
    here, there = CTX.Pipe()
    writer = CTX.Process(target=_writer_that_dies, args=(there, 1), daemon=True)
    writer.start()
    ring = PlanRing.attach(here.recv(), 0)
    ring.check_peers()
    here.send("attached")
    assert ring.get() == "first"
    err = _raised_within(ring.get, 5)  # the writer is a zombie until joined: counted as dead
    assert isinstance(err, PeerGone) and f"the writer (pid {writer.pid}) is gone" in str(err), err
    writer.join(timeout=10)
    ring.close()


def _reader_that_dies(name: str, reader: int, out) -> None:
    PlanRing.attach(name, reader)
    out.send("attached")
    os._exit(0)  # never reads


def test_the_writer_notices_that_a_reader_died(monkeypatch) -> None:
    monkeypatch.setattr(plan_ring, "CHECK_S", 0.05)
    ring, procs, outs = _open(1, _reader_that_dies, n_slots=2)
    assert _recv(outs[0]) == "attached"
    _wait_attached(ring)
    ring.put(1)
    ring.put(2)  # the ring is full now
    err = _raised_within(lambda: ring.put(3), 5)
    assert isinstance(err, PeerGone) and f"reader 0 (pid {procs[0].pid}) is gone" in str(err), err
    procs[0].join(timeout=10)
    ring.close()


def test_a_reader_exits_without_leaking_or_removing_the_segment() -> None:
    """A reader in a process of its own: no resource-tracker warning at its exit, the segment still there
    for the others; after the writer unlinks, nothing is left in /dev/shm."""
    ring = PlanRing.create(1)
    code = ("import sys; from vegaserve.engine.distributed.plan_ring import PlanRing; "
            "r = PlanRing.attach(sys.argv[1], 0); print(r.get()); r.close()")
    ring.put("hello")
    done = subprocess.run([sys.executable, "-c", code, ring.name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "hello", done.stderr
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
    if sys.platform == "linux":
        assert Path("/dev/shm", ring.name).exists()
    ring.unlink()
    ring.close()
    assert not Path("/dev/shm", ring.name).exists()


def test_a_bad_reader_index_or_segment_is_refused() -> None:
    ring = PlanRing.create(2)
    with pytest.raises(ValueError, match="reader 2 of a ring with 2 readers"):
        PlanRing.attach(ring.name, 2)
    with pytest.raises(ValueError, match="bad ring shape"):
        PlanRing.create(1, n_slots=1)
    ring.unlink()
    ring.close()
