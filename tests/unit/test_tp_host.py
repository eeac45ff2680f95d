"""A tensor-parallel group's collectives through shared memory (``engine.tp_host``), its ranks as threads
of one process: the same bits on every rank, rounds that overlap, and a dead or silent peer failing the
wait rather than hanging it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine.tp_host import SLOT_BYTES, HostCollectives, PeerLost, make_channels


@pytest.fixture
def groups():
    made: list[HostCollectives] = []

    def make(size: int, timeout_s: float = 30.0) -> list[HostCollectives]:
        buffer, ends = make_channels(size)
        ranks = [HostCollectives(r, size, buffer, ends[r], timeout_s) for r in range(size)]
        made.extend(ranks)
        return ranks

    yield make
    for h in made:
        h.close()


def _run(ranks: list[HostCollectives], body: Callable[[HostCollectives], Any]) -> list[Any]:
    out: list[Any] = [None] * len(ranks)

    def one(h: HostCollectives) -> None:
        try:
            out[h.rank] = body(h)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[h.rank] = e

    threads = [threading.Thread(target=one, args=(h,)) for h in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_every_rank_gets_the_same_sum_in_rank_order_round_after_round(groups) -> None:
    ranks = groups(3)
    gen = torch.Generator().manual_seed(0)
    parts = [[torch.randn(5, 7, generator=gen) for _ in range(3)] for _ in range(20)]

    def body(h: HostCollectives) -> list[torch.Tensor]:
        # Rounds back to back: a rank that is a round ahead writes the other slot set.
        return [h.all_reduce(parts[k][h.rank].clone()) for k in range(20)]

    got = _run(ranks, body)
    for k in range(20):
        want = parts[k][0] + parts[k][1] + parts[k][2]  # rank order, as each rank sums
        for r in range(3):
            assert torch.equal(got[r][k], want), (k, r)


def test_all_gather_returns_every_ranks_tensor_by_rank(groups) -> None:
    ranks = groups(2)
    got = _run(ranks, lambda h: h.all_gather(torch.full((2, 3), float(h.rank), dtype=torch.bfloat16)))
    for parts in got:
        assert [p.dtype for p in parts] == [torch.bfloat16] * 2
        assert [p[0, 0].item() for p in parts] == [0.0, 1.0]


def test_a_tensor_over_a_slot_does_not_fit(groups) -> None:
    h = groups(2)[0]
    assert h.fits(torch.empty(SLOT_BYTES // 4))
    assert not h.fits(torch.empty(SLOT_BYTES // 4 + 1))


def test_a_dead_peer_fails_the_wait_at_once(groups) -> None:
    ranks = groups(2)
    ranks[1].close()  # rank 1 died: the kernel closed its ends
    with pytest.raises(PeerLost, match="rank 1 is gone"):
        ranks[0].all_reduce(torch.ones(4))


def test_a_silent_peer_fails_the_wait_after_the_timeout(groups) -> None:
    ranks = groups(3, timeout_s=0.2)
    with pytest.raises(PeerLost, match=r"ranks \[1, 2\] did not answer in 200 ms"):
        ranks[0].all_reduce(torch.ones(4))
