"""The process's ucxx runtime, the only module of pdserve that imports ucxx: one context per process, made
on first use inside the running event loop (its futures belong to that loop), with a progress thread and
Python-future notification, so waiting costs no polling.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from typing import Any

import numpy as np

from pdserve.kv_transfer.config import TransferConfig, apply_ucx_env
from pdserve.kv_transfer.kvbuf import as_bytes
from pdserve.kv_transfer.plan import MAX_TRANSFER_ID

log = logging.getLogger(__name__)


class Runtime:
    """Reference-counted ucxx context (ucxx itself keeps one per process)."""

    def __init__(self) -> None:
        self.users = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ucxx: Any = None
        self.worker: Any = None
        # A random start keeps a restarted process from reusing recent transfer ids.
        self._ids = itertools.count(random.randrange(1, MAX_TRANSFER_ID // 2))

    def acquire(self, config: TransferConfig) -> Any:
        """The ucxx module, started on first use; UCX's devices follow the first user's ``config``."""
        loop = asyncio.get_running_loop()
        if self.users == 0:
            apply_ucx_env(config)
            import ucxx

            try:
                ucxx.init(progress_mode="thread", enable_python_future=True)
            except RuntimeError:
                log.info("ucxx was already initialised by someone else in this process")
            if not ucxx.core._get_ctx().worker.enable_python_future:  # ucxx offers no public accessor
                raise RuntimeError("kv_transfer needs ucxx with Python-future notification enabled")
            self.ucxx, self.loop = ucxx, loop
            self.worker = ucxx.core._get_ctx().worker
            ucxx.continuous_ucx_progress()  # the progress thread; a worker-level receive needs it running
        elif loop is not self.loop:
            raise RuntimeError("ucxx is bound to the event loop it started in; use one loop per process")
        self.users += 1
        return self.ucxx

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        ucxx, worker = self.ucxx, self.worker
        self.ucxx, self.loop, self.worker = None, None, None
        # The notifier thread must stop while its loop still exists, else exit hangs. It reads ucxx's
        # shutdown message only between waits: waking its wait first keeps every close (each worker's
        # stop, each scale-down) from waiting out the rest of one.
        worker.stop_request_notifier_thread()
        ucxx.stop_notifier_thread()
        try:
            ucxx.reset()
        except Exception as exc:  # objects still referenced: UCX is torn down at exit instead
            log.warning("ucxx.reset() failed: %s", exc)

    def next_transfer_id(self) -> int:
        return next(self._ids) % MAX_TRANSFER_ID + 1

    def context_handle(self) -> int:
        """The process's ucp_context_h, for memory registration (ucp_rma.py)."""
        return int(self.ucxx.core._get_ctx().context.handle)

    def refill_futures(self) -> None:
        # Every request takes a Python future from a small pool that the notifier
        # thread refills only now and then; a transfer posts hundreds at once, so top
        # it up here (a no-op while enough are left) instead of letting ucxx warn per request.
        self.worker.populate_python_futures_pool()


runtime = Runtime()


def ucx_buffer(ucxx: Any, buf: Any) -> Any:
    """``buf`` (a contiguous uint8 numpy array or torch tensor) as ucxx's buffer type."""
    if isinstance(buf, np.ndarray):  # host memory, from kvbuf.KVSpans: the hot path
        return ucxx._lib.arr.Array(buf)
    raw = as_bytes(buf)  # [nbytes]
    # Host memory goes through numpy's buffer protocol; device memory through __cuda_array_interface__.
    return ucxx._lib.arr.Array(raw.numpy() if raw.device.type == "cpu" else raw)
