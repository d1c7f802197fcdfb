"""Rank 0's step plans to the other ranks of one host through a ring of slots in host shared memory (as
vLLM's shared-memory message queue): one writer, N readers, no collective and no socket between two steps.

Layout (every field 8 bytes, every record on a cache line of its own, so that a reader's counter and the
writer's slot headers never share a line):

    line 0              magic, slots, slot bytes, readers, writer pid
    line 1 + r          reader r: slots it has consumed, its pid, whether it sleeps on the futex
    slot k (k mod n)    seq (k + 1 once written; 0 never), message length, payload (slot bytes - 16)

A message is pickled and written over as many consecutive slots as it needs (a plan larger than a slot, or
than the whole ring, streams through it while the readers consume). The writer may write slot k once every
reader has consumed slot k - n; it writes the payload, then the seq. A reader of slot k waits for seq k + 1,
copies the payload, then raises its counter. Counters only grow, so a slot is never read half-written
and never overwritten unread. Fences between the payload and the counters keep that order on weakly
ordered CPUs (aarch64); x86 keeps stores in order by itself.

A reader waits by spinning where every end of the ring has a core of its own (with fewer cores the spinning
would only delay the others): for twice the last interval between two plans, from 50 us to 20 ms, so that
while steps follow each other the next plan is seen as it lands (bench_plan_ring.py, 16 sequences 1 ms apart
on a 2-core VM: 89-93 us median from encoding to decoded, against 184-201 us when the reader sleeps after
50 us); then it sleeps on a futex on the slot's seq word, which the writer wakes when the reader's record
says it sleeps (a store then a fence on each side, so that either the reader sees the seq or the writer sees
the flag): an idle server costs no CPU after its last 20 ms, and a host with fewer cores than ranks still
hands a plan over. The writer waits (a full ring) by sleeping in growing steps. Every waiter checks now and then
that the process it waits on is alive (its pid) and raises PeerGone rather than wait forever on a dead one.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import platform
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing import shared_memory

MAGIC = 0x5645_4741_5249_4E47  # "VEGARING"
LINE = 64  # bytes: one cache line per record
SLOT_HEADER = 16  # seq, message length

SPIN_S = 50e-6  # a reader spins at least this long before it sleeps on the futex (where every end has a core),
SPIN_MAX_S = 20e-3  # and up to twice the last interval between two plans, at most this long
MAX_SLEEP_S = 1e-3  # the writer's sleeps, on a full ring, grow to this
CHECK_S = 0.5  # how often a waiter checks that its peer is alive


class PeerGone(RuntimeError):
    """The process on the other side of the ring died."""


_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: taking a lock is an atomic read-modify-write, which orders memory on every
    CPU (vLLM's trick; Python has no fence of its own)."""
    with _fence_lock:
        pass


def _alive(pid: int) -> bool:
    """pid runs and is not a zombie (a dead child its parent has not reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X", b"x")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class _Futex:
    """futex(2) on a word of a shared mapping (Linux); elsewhere `wait` sleeps 100 us and `wake` does
    nothing, which is correct too, only slower."""

    WAIT, WAKE = 0, 1
    NUMBERS = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}

    def __init__(self) -> None:
        self.nr = self.NUMBERS.get(platform.machine()) if sys.platform.startswith("linux") else None
        if self.nr is not None:
            self.syscall = ctypes.CDLL(None, use_errno=True).syscall
            self.syscall.restype = ctypes.c_long

    def wait(self, addr: int, value: int, timeout_s: float) -> None:
        """Sleep while the 32-bit word at addr holds value, up to timeout_s (or a spurious wake)."""
        if self.nr is None:
            time.sleep(1e-4)
            return
        ts = (ctypes.c_long * 2)(int(timeout_s), int(timeout_s % 1 * 1e9))
        self.syscall(ctypes.c_long(self.nr), ctypes.c_void_p(addr), ctypes.c_int(self.WAIT),
                     ctypes.c_uint32(value), ts, None, ctypes.c_int(0))

    def wake(self, addr: int) -> None:
        if self.nr is not None:
            self.syscall(ctypes.c_long(self.nr), ctypes.c_void_p(addr), ctypes.c_int(self.WAKE),
                         ctypes.c_int(1 << 30), None, None, ctypes.c_int(0))


_futex = _Futex()


@contextmanager
def _untracked():
    """Open a segment without registering it with this process's resource tracker: the creator owns it
    (Python before 3.13 registers every opener, whose tracker then unlinks it and warns at exit)."""
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None if rtype == "shared_memory" else register(name, rtype)
    try:
        yield
    finally:
        resource_tracker.register = register


class PlanRing:
    """One end of the ring: `create` (the writer, rank 0) or `attach` (reader r). `put` and `get` move
    any picklable object; `None` is an object like any other (the executor's stop plan)."""

    def __init__(self, shm: shared_memory.SharedMemory, reader: int | None, owner: bool) -> None:
        self.shm = shm
        self.owner = owner
        self.reader = reader
        self.words = shm.buf.cast("Q")
        magic, self.n_slots, self.slot_bytes, self.n_readers, writer_pid = self.words[0:5]
        if magic != MAGIC:
            raise ValueError(f"shared memory {shm.name!r} is not a plan ring")
        self.payload = self.slot_bytes - SLOT_HEADER
        self.slots_at = LINE * (1 + self.n_readers)
        self.next = 0  # the next slot this end writes or reads (a global count, not an index)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
        self.writer_pid = writer_pid
        self.watch = True  # check peers' pids (off where they are not visible: another pid namespace)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.spin = cores > self.n_readers  # every end has a core: a reader spins before it sleeps
        self.spin_s = SPIN_S if self.spin else 0.0  # how long: twice the last interval, SPIN_S .. SPIN_MAX_S
        self.last_plan = time.perf_counter()

    @classmethod
    def create(cls, n_readers: int, n_slots: int = 16, slot_bytes: int = 64 * 1024) -> PlanRing:
        if n_readers < 1 or n_slots < 2 or slot_bytes % LINE or slot_bytes <= SLOT_HEADER:
            raise ValueError(f"bad ring shape: {n_readers} readers, {n_slots} slots of {slot_bytes} bytes")
        size = LINE * (1 + n_readers) + n_slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[: LINE * (1 + n_readers)] = bytes(LINE * (1 + n_readers))
        for k in range(n_slots):  # every seq 0: never written
            off = LINE * (1 + n_readers) + k * slot_bytes
            shm.buf[off: off + SLOT_HEADER] = bytes(SLOT_HEADER)
        words = shm.buf.cast("Q")
        words[1], words[2], words[3], words[4] = n_slots, slot_bytes, n_readers, os.getpid()
        _fence()
        words[0] = MAGIC
        words.release()
        return cls(shm, None, owner=True)

    @classmethod
    def attach(cls, name: str, reader: int) -> PlanRing:
        if sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, track=False)
        else:
            with _untracked():
                shm = shared_memory.SharedMemory(name=name)
        ring = cls(shm, reader, owner=False)
        if not 0 <= reader < ring.n_readers:
            ring.close()
            raise ValueError(f"reader {reader} of a ring with {ring.n_readers} readers")
        ring.words[ring._reader_word(reader) + 1] = os.getpid()
        return ring

    @property
    def name(self) -> str:
        return self.shm.name

    def unlink(self) -> None:
        """Remove the name once every reader has attached: the mapping lives on, nothing is left behind
        whoever dies first."""
        if self.owner:
            self.shm.unlink()

    def check_peers(self) -> None:
        """After every end attached: watch pids only if this process can see them all."""
        pids = [self.writer_pid] if self.reader is not None else self.reader_pids()
        self.watch = all(p and _alive(p) for p in pids)

    def reader_pids(self) -> list[int]:
        return [self.words[self._reader_word(r) + 1] for r in range(self.n_readers)]

    # -- writer --------------------------------------------------------------------------------------

    @property
    def written(self) -> int:
        """Slots written so far."""
        return self.next

    def consumed(self) -> int:
        """Slots every reader has consumed."""
        return self._min_consumed()

    def put(self, obj: object) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        total, done = len(data), 0
        while True:
            k = self.next
            if self._min_consumed() <= k - self.n_slots:  # slot k still holds k - n for a reader
                self._wait(lambda k=k: self._min_consumed() > k - self.n_slots, self._dead_reader)
            off = self._slot(k)
            part = min(self.payload, total - done)
            buf = self.shm.buf
            buf[off + SLOT_HEADER: off + SLOT_HEADER + part] = data[done: done + part]
            self.words[off // 8 + 1] = total
            _fence()
            self.words[off // 8] = k + 1
            _fence()
            if any(self.words[self._reader_word(r) + 2] for r in range(self.n_readers)):
                _futex.wake(self.base + off)
            self.next = k + 1
            done += part
            if done >= total:
                return

    def _min_consumed(self) -> int:
        return min(self.words[self._reader_word(r)] for r in range(self.n_readers))

    def _dead_reader(self) -> str | None:
        for r, pid in enumerate(self.reader_pids()):
            if pid and not _alive(pid):
                return f"reader {r} (pid {pid}) is gone"
        return None

    # -- reader --------------------------------------------------------------------------------------

    def get(self) -> object:
        chunks: list[bytes] = []
        total, got = 0, 0
        mine = self._reader_word(self.reader)  # type: ignore[arg-type]
        while True:
            k = self.next
            off = self._slot(k)
            seq_at = off // 8
            if self.words[seq_at] != k + 1:
                self._sleep_on(seq_at, k + 1, mine)
            _fence()
            if not chunks:
                total = self.words[seq_at + 1]
            part = min(self.payload, total - got)
            chunks.append(bytes(self.shm.buf[off + SLOT_HEADER: off + SLOT_HEADER + part]))
            got += part
            _fence()
            self.words[mine] = k + 1
            self.next = k + 1
            if got >= total:
                now = time.perf_counter()
                if self.spin:
                    self.spin_s = min(SPIN_MAX_S, max(SPIN_S, 2 * (now - self.last_plan)))
                self.last_plan = now
                return pickle.loads(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _sleep_on(self, at: int, seq: int, mine: int) -> None:
        """Until words[at] == seq: spin spin_s, then sleep on the futex with the sleeping flag raised."""
        start = time.perf_counter()
        while time.perf_counter() - start < self.spin_s:
            if self.words[at] == seq:
                return
        check = time.perf_counter() + CHECK_S
        while True:
            self.words[mine + 2] = 1
            _fence()
            current = self.words[at]
            if current == seq:
                break
            _futex.wait(self.base + 8 * at, current & 0xFFFF_FFFF, CHECK_S)
            if time.perf_counter() >= check:
                check = time.perf_counter() + CHECK_S
                why = self._dead_writer() if self.watch else None
                if why is not None:
                    self.words[mine + 2] = 0
                    raise PeerGone(f"plan ring {self.name}: {why}")
        self.words[mine + 2] = 0

    def _dead_writer(self) -> str | None:
        if not _alive(self.writer_pid):
            return f"the writer (pid {self.writer_pid}) is gone"
        return None

    # -- both ----------------------------------------------------------------------------------------

    def _reader_word(self, r: int) -> int:
        return LINE * (1 + r) // 8

    def _slot(self, k: int) -> int:
        return self.slots_at + (k % self.n_slots) * self.slot_bytes

    def _wait(self, ready, dead) -> None:
        """The writer on a full ring: sleeps growing from 10 us to MAX_SLEEP_S."""
        check = time.perf_counter() + CHECK_S
        sleep = 10e-6
        while not ready():
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)
            if time.perf_counter() >= check:
                check = time.perf_counter() + CHECK_S
                why = dead() if self.watch else None
                if why is not None:
                    raise PeerGone(f"plan ring {self.name}: {why}")

    def close(self) -> None:
        self.words.release()
        self.shm.close()
