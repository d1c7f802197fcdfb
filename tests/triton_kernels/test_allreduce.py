"""The peer-write AllReduce kernels (triton_kernels/allreduce.py), W ranks in one process: each rank's
buffer is memory of this process (host memory under the interpreter, one GPU's where there is one), its
peers' addresses a table as the IPC mapping gives them. The interpreter runs one program at a time and a
rank that waits on another would wait forever, so each phase (push, reduce, gather) runs on every rank in
turn; the phases in one launch, ranks as processes, are in tests/engine/distributed/test_custom_allreduce_gpu.py.

Every rank gets the same bits, the bits of the f32 sum in rank order (reference_all_reduce), within 1e-6 of
the float64 sum; two-shot gives one-shot's bits; the epoch advances once a call, the one-shot halves
alternate, and the int32 epoch wraps without a stale flag passing for a fresh one."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import allreduce as ar

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Ranks:
    """W ranks' buffers in host memory and the peers table (the same addresses for every rank)."""

    def __init__(self, world: int, max_elems: int, max_programs: int = 4) -> None:
        self.layout = ar.PeerLayout(world, max_elems, max_programs)
        self.bufs = [torch.zeros(self.layout.nbytes // 4, dtype=torch.int32, device=DEVICE) for _ in range(world)]
        self.peers = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=DEVICE)

    def all_reduce(self, parts: list[torch.Tensor], two_shot: bool, block: int = 128) -> list[torch.Tensor]:
        xs = [p.to(DEVICE, copy=True) for p in parts]
        for phase in (ar.PUSH, ar.REDUCE, ar.GATHER) if two_shot else (ar.PUSH, ar.REDUCE):
            for r, x in enumerate(xs):
                ar.all_reduce(x, self.peers, self.layout, r, two_shot, block=block, phases=phase)
        return [x.cpu() for x in xs]

    def epochs(self) -> list[int]:
        return [int(b[0]) for b in self.bufs]


def partials(world: int, n: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Mixed magnitudes, so that the order of the additions shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 4, (n,), generator=g)).to(dtype)
            for _ in range(world)]


def check(outs: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
    ref = ar.reference_all_reduce(parts)
    for r, out in enumerate(outs):
        assert torch.equal(out, ref), f"rank {r} differs from the f32 sum in rank order"
    exact = torch.stack([p.double() for p in parts]).sum(0)
    assert float((outs[0].double() - exact).norm() / exact.norm()) < 1e-6


@pytest.mark.parametrize(("world", "n"), [(2, 1000), (4, 777), (5, 1031)])
@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
def test_every_rank_gets_the_bits_of_the_sum_in_rank_order(world, n, two_shot) -> None:
    parts = partials(world, n, seed=world * n)
    check(Ranks(world, 2048).all_reduce(parts, two_shot), parts)


def test_two_shot_matches_one_shot_bitwise() -> None:
    parts = partials(8, 999, seed=8)
    ranks = Ranks(8, 1024)
    one, two = ranks.all_reduce(parts, False), ranks.all_reduce(parts, True)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
def test_a_bf16_activation_travels_in_f32_and_comes_back_in_bf16(two_shot) -> None:
    """The sum in f32, rounded once to bf16 (the interpreter rounds f32 -> bf16 toward zero where GPUs round
    to nearest even, hence one bf16 step of slack); the same bits on every rank either way."""
    parts = partials(3, 500, seed=5, dtype=torch.bfloat16)
    outs = Ranks(3, 512).all_reduce(parts, two_shot)
    exact = torch.stack([p.float() for p in parts]).sum(0)
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, outs[0]) for o in outs)
    assert bool(((outs[0].float() - exact).abs() <= exact.abs() * 2**-7).all())


def test_the_epoch_advances_once_a_call_and_the_one_shot_halves_alternate() -> None:
    ranks = Ranks(2, 256, max_programs=2)
    lay = ranks.layout
    for call in range(1, 5):
        parts = partials(2, 200, seed=call)
        check(ranks.all_reduce(parts, two_shot=call % 2 == 0), parts)
        assert ranks.epochs() == [call, call]
        assert [int(b[1]) for b in ranks.bufs] == [0, 0]  # arrivals reset by the last program
        if call % 2:  # one-shot: this call's partials in half call & 1, slot r of every rank
            half = lay.slots + (call & 1) * 2 * lay.max_elems
            for b in (b.cpu() for b in ranks.bufs):
                for r in range(2):
                    got = b[half + r * lay.max_elems: half + r * lay.max_elems + 200].view(torch.float32)
                    assert torch.equal(got, parts[r])
            flags = ranks.bufs[0][lay.flags: lay.flags + 2 * 2].cpu()  # two programs (200 / 128): both flags of both
            assert flags.tolist() == [call] * 4


def test_calls_across_the_int32_wrap_of_the_epoch_stay_right() -> None:
    ranks = Ranks(3, 256, max_programs=2)
    for b in ranks.bufs:
        b[0] = 2**31 - 2  # the epoch word
    for call in range(3):
        parts = partials(3, 250, seed=100 + call)
        check(ranks.all_reduce(parts, two_shot=call == 1), parts)
    assert ranks.epochs() == [-(2**31) + 1] * 3


@triton.jit
def _behind_kernel(flag_ptr, e_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, ar._behind(tl.load(flag_ptr + i), tl.load(e_ptr + i)).to(tl.int32))


def test_the_kernels_wait_test_agrees_with_the_epoch_arithmetic_across_the_wrap() -> None:
    """A waiter waits while _behind(flag, e): a flag from an older call is behind, one of this call or a
    later one is not, also when the int32 counter wrapped between them."""
    big = 2**31 - 1
    cases = [(0, 1), (1, 1), (2, 1), (big, -(2**31)), (-(2**31), big), (big - 1, big), (-5, -4), (7, 7),
             (-(2**31) + 1, big - 2), (5, big)]
    flag = torch.tensor([c[0] for c in cases], dtype=torch.int32)
    e = torch.tensor([c[1] for c in cases], dtype=torch.int32)
    n = triton.next_power_of_2(len(cases))
    flag = torch.cat([flag, flag.new_zeros(n - len(cases))])
    e = torch.cat([e, e.new_zeros(n - len(cases))])
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _behind_kernel[(1,)](flag.to(DEVICE), e.to(DEVICE), out, N=n)
    out = out.cpu()
    want = [not ar.epoch_reached(f, x) for f, x in cases]
    assert [bool(v) for v in out[: len(cases)]] == want
    assert want == [True, False, False, True, False, True, True, False, False, True]


def test_the_regions_of_a_buffer_do_not_overlap_and_fit_it() -> None:
    for world, m in [(2, 1000), (5, 1031), (8, 1 << 21)]:
        lay = ar.PeerLayout(world, m)
        starts = [lay.flags, lay.flags2, lay.slots, lay.scatter, lay.gather, lay.nbytes // 4]
        sizes = [lay.max_programs * world, lay.max_programs * world, 2 * world * m, world * lay.chunk_cap,
                 world * lay.chunk_cap]
        assert all(a + s <= b for a, s, b in zip(starts, sizes, starts[1:], strict=False))
        assert lay.flags >= 2 and lay.chunk_cap * world >= m and lay.slots % 64 == 0


def test_the_launcher_refuses_what_the_buffers_cannot_take() -> None:
    ranks = Ranks(2, 256)
    with pytest.raises(ValueError, match="257 elements; the peer buffers take 256"):
        ar.all_reduce(torch.zeros(257, device=DEVICE), ranks.peers, ranks.layout, 0, False)
    with pytest.raises(ValueError, match="non-contiguous"):
        ar.all_reduce(torch.zeros(16, 2, device=DEVICE)[:, 0], ranks.peers, ranks.layout, 0, False)
    with pytest.raises(ValueError, match="rank in 0..1"):
        ar.all_reduce(torch.zeros(16, device=DEVICE), ranks.peers, ranks.layout, 2, False)
