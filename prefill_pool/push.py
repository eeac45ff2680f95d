"""The layer hook of a batch's forward: counts each job's written layers and pushes them to the jobs'
transfers as the forward writes them."""

from __future__ import annotations

import threading

import torch

from pdserve.prefill_pool.scheduler import PrefillJob


class BatchCancelled(Exception):
    """Raised from the layer hook to stop a forward whose every request was given up."""


class PushHook:
    """A batch's ``LayerHook``, on the forward thread. A batch nobody waits for any more stops at the next
    layer, so its blocks come back within one layer's time instead of a whole forward's."""

    def __init__(self, live: list[PrefillJob], push_lock: threading.Lock) -> None:
        self._live = live
        self._push_lock = push_lock  # a late transfer's catch-up either pushed a layer or sees it here

    def __call__(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        self._written(layer, 1)  # right after ``layer`` wrote its K/V into the cache

    def layers_written(self, count: int) -> None:
        """A prefill under a CUDA graph: layers 0 .. count - 1 are all written; one push for them."""
        self._written(0, count)

    def _written(self, first: int, count: int) -> None:
        if all(j.payload.given_up for j in self._live):
            raise BatchCancelled
        with self._push_lock:
            for j in self._live:
                j.payload.layers_done = first + count
            handles = [j.payload.handle for j in self._live if j.payload.handle is not None]
        for h in handles:
            if count == 1:
                h.push_layer(first)
            else:
                h.push_layers(first, count)
