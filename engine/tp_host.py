"""Collectives of a tensor-parallel group's ranks on one host's CPUs through shared memory, in place of
gloo's TCP loopback for the small activations a step all-reduces (gloo keeps what does not fit a slot).

Each rank copies its tensor into its slot of a shared buffer and rings a doorbell (one byte down a pipe)
to every other rank, waits for a ring from each of them, then reads their slots: an all-reduce sums the
slots in rank order, so every rank holds the same bits. Two sets of slots alternate by round, so a rank may
write the next round's while another still reads this one's: a rank rings round k + 1 only after reading
round k, and nobody writes round k's set again before hearing everyone's round k + 1. The pipe's kernel
buffer orders the slot's writes before the ring. A peer that dies closes its pipes: the next wait reads
end of file and fails at once; one that hangs fails the wait after ``COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass

import torch

from pdserve.engine.hugepages import SharedTensor

# Bytes of one rank's slot (one of two sets): a step's [tokens, hidden] partial sums up to this size go
# through shared memory, larger ones through gloo.
SLOT_BYTES = 4 << 20


class PeerLost(RuntimeError):
    """A rank of the group died or stopped answering inside a collective."""


@dataclass
class HostChannels:
    """One rank's ends of its group's channels: the buffer's memfd, and the pipes it rings and hears on,
    by peer rank."""

    buffer_fd: int
    ring_out: dict[int, int]  # peer -> write end of this rank's pipe to it
    ring_in: dict[int, int]  # peer -> read end of its pipe to this rank

    def fds(self) -> list[int]:
        return [self.buffer_fd, *self.ring_out.values(), *self.ring_in.values()]

    def encode(self) -> str:
        """As a follower's command line carries it."""
        out = ",".join(f"{p}:{fd}" for p, fd in self.ring_out.items())
        inn = ",".join(f"{p}:{fd}" for p, fd in self.ring_in.items())
        return f"{self.buffer_fd};{out};{inn}"

    @classmethod
    def decode(cls, text: str) -> HostChannels:
        fd, out, inn = text.split(";")

        def pairs(s: str) -> dict[int, int]:
            return {int(p): int(f) for p, f in (x.split(":") for x in s.split(",") if x)}

        return cls(int(fd), pairs(out), pairs(inn))


def buffer_shape(size: int) -> tuple[int, int, int]:
    return (2, size, SLOT_BYTES)


def make_channels(size: int) -> tuple[SharedTensor, list[HostChannels]]:
    """The shared buffer and every rank's channel ends (rank 0 makes them before starting the others, who
    inherit theirs; it then closes all but its own: ``close_others``)."""
    buffer = SharedTensor(*buffer_shape(size), dtype=torch.uint8)
    ends = [HostChannels(buffer.fd, {}, {}) for _ in range(size)]
    for a in range(size):
        for b in range(size):
            if a != b:
                r, w = os.pipe()
                ends[a].ring_out[b] = w
                ends[b].ring_in[a] = r
    return buffer, ends


def close_others(ends: list[HostChannels], keep: int) -> None:
    """Rank 0, once the followers hold theirs: close every pipe end but rank ``keep``'s, so that a dead
    peer's pipes read end of file."""
    for rank, e in enumerate(ends):
        if rank != keep:
            for fd in (*e.ring_out.values(), *e.ring_in.values()):
                os.close(fd)


class HostCollectives:
    """One rank's all-reduce and all-gather over its group's shared buffer (``make_channels``)."""

    def __init__(
        self, rank: int, size: int, buffer: SharedTensor, channels: HostChannels, timeout_s: float
    ) -> None:
        self.rank, self.size, self.buffer, self.channels = rank, size, buffer, channels
        self.timeout_ms = int(timeout_s * 1000)
        self.round = 0
        self._poll = select.poll()
        self._by_fd = {fd: peer for peer, fd in channels.ring_in.items()}

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= SLOT_BYTES

    def _slot(self, parity: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        return self.buffer.tensor[parity, rank, :nbytes].view(t.dtype).view(t.shape)

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Post ``t`` (contiguous) and wait for every rank's: their slots, by rank."""
        parity = self.round & 1
        self.round += 1
        self._slot(parity, self.rank, t).copy_(t)
        for peer, fd in self.channels.ring_out.items():
            try:
                os.write(fd, b"r")
            except BrokenPipeError as e:
                raise PeerLost(f"tensor-parallel rank {peer} is gone") from e
        waiting = set(self.channels.ring_in.values())
        for fd in waiting:  # (only this round's: a peer a round ahead has rung its next already)
            self._poll.register(fd, select.POLLIN)
        try:
            while waiting:
                ready = self._poll.poll(self.timeout_ms)
                if not ready:
                    peers = sorted(self._by_fd[fd] for fd in waiting)
                    raise PeerLost(f"tensor-parallel ranks {peers} did not answer in {self.timeout_ms} ms")
                for fd, _ in ready:
                    if os.read(fd, 1) != b"r":
                        raise PeerLost(f"tensor-parallel rank {self._by_fd[fd]} is gone")
                    waiting.discard(fd)
                    self._poll.unregister(fd)
        finally:
            for fd in waiting:
                self._poll.unregister(fd)
        return [self._slot(parity, r, t) for r in range(self.size)]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous) over the ranks in place, in rank order on every rank."""
        slots = self._exchange(t)
        t.copy_(slots[0])
        for s in slots[1:]:
            t.add_(s)
        return t

    def close(self) -> None:
        """Close this rank's pipe ends (its peers then read end of file)."""
        for fd in (*self.channels.ring_out.values(), *self.channels.ring_in.values()):
            os.close(fd)
        self.channels.ring_out.clear()
        self.channels.ring_in.clear()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (contiguous, the same shape on each), copied out, by rank."""
        return [s.clone() for s in self._exchange(t)]
