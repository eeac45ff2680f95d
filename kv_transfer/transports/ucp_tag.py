"""Tagged messages straight on libucp (ctypes), for the control frames and every other request whose
completion the event loop waits for (endpoint flushes after puts): one hop from UCX's progress thread to
the loop, where a ucxx request takes two thread hops and three loop iterations (docs/kv_transfer.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.kv_transfer.transports import ucp_rma
from pdserve.kv_transfer.transports.ucp_rma import UCS_INPROGRESS, UCS_OK, lib, status_of

UCS_ERR_CANCELED = -16
_FIELD_CALLBACK = ucp_rma.OP_ATTR_FIELD_CALLBACK
_FIELD_USER_DATA = ucp_rma.OP_ATTR_FIELD_USER_DATA
_NO_IMMEDIATE = 1 << 16  # UCP_OP_ATTR_FLAG_NO_IMM_CMPL: a receive always completes by callback

SendDone = Callable[[int], None]  # status
RecvDone = Callable[[int, int], None]  # status, bytes received


class Op:
    """One request in flight: what its completion needs, and the buffer it must keep alive."""

    __slots__ = ("key", "loop", "worker", "buf", "on_done", "request", "finished")

    def __init__(
        self, key: int, loop: asyncio.AbstractEventLoop, worker: int, buf: np.ndarray | None, on_done: Any
    ):
        self.key = key
        self.loop = loop
        self.worker = worker
        self.buf: np.ndarray | None = buf
        self.on_done = on_done
        self.request = 0  # the ucp request, once the post returned it
        self.finished = False  # its callback ran (the request is complete, not yet freed)

    def cancel(self) -> None:
        """Receives only: stop waiting. ``on_done`` still comes (cancelled, or the message)."""
        if self.request and not self.finished and _ops.get(self.key) is self:
            lib().request_cancel(self.worker, self.request)


# A request's owner: the callback never frees it (a cancel from the loop thread could meet a freed request);
# it tells the loop, and the loop frees it and calls ``on_done``. Buffers stay referenced until then, and a
# closing transport waits (bounded) for ``pending`` to reach 0 before the worker goes.
_ops: dict[int, Op] = {}  # by key (the request's user data); touched under the GIL only
_keys = itertools.count(1)


def pending() -> int:
    """Requests not yet freed (their completion has not reached the loop yet)."""
    return len(_ops)


def _finish(key: int, request: int, status: int, length: int) -> None:
    """On the loop: free the request, then report."""
    op = _ops.pop(key, None)
    if request:
        lib().request_free(request)
    if op is None:
        return
    op.buf = None
    if length < 0:
        op.on_done(status)
    else:
        op.on_done(status, length)


def _hand_over(key: int, request: int, status: int, length: int) -> None:
    """From the callback (the progress thread, or the posting thread itself): to the loop."""
    op = _ops.get(key)
    if op is None:
        return
    op.finished = True
    try:
        op.loop.call_soon_threadsafe(_finish, key, request, status, length)
    except RuntimeError:  # the loop is closed: nobody waits; the worker goes with the process
        _ops.pop(key, None)


@ucp_rma.SendCallback
def _on_sent(request: int, status: int, user_data: int) -> None:
    _hand_over(user_data or 0, request or 0, status, -1)


@ucp_rma.RecvCallback
def _on_received(request: int, status: int, info: Any, user_data: int) -> None:
    length = info.contents.length if status == UCS_OK and info else 0
    _hand_over(user_data or 0, request or 0, status, length)


# One parameter block each, filled once: UCX reads it during the call only, and calls come from the
# event loop thread only (a loop per process, ucx_runtime.py).
@functools.cache
def _send_param() -> ucp_rma.RequestParam:
    param = ucp_rma.RequestParam()
    param.op_attr_mask = _FIELD_CALLBACK | _FIELD_USER_DATA
    param.cb = _on_sent
    return param


@functools.cache
def _recv_param() -> ucp_rma.RecvRequestParam:
    param = ucp_rma.RecvRequestParam()
    param.op_attr_mask = _FIELD_CALLBACK | _FIELD_USER_DATA | _NO_IMMEDIATE
    param.cb = _on_received
    return param


def _new_op(worker: int, buf: np.ndarray | None, on_done: Any) -> Op:
    key = next(_keys)
    op = _ops[key] = Op(key, asyncio.get_running_loop(), worker, buf, on_done)
    return op


def _posted(op: Op, ptr: int | None, *at_once: Any) -> bool:
    """After the call that posted ``op``: True when in flight (its callback will come); otherwise it
    finished or was refused at once, and ``on_done(status, *at_once)`` is scheduled on the loop."""
    status = status_of(ptr)
    if status != UCS_INPROGRESS:
        _ops.pop(op.key, None)
        op.loop.call_soon(op.on_done, status, *at_once)
        return False
    op.request = ptr or 0
    return True


def send(ep: int, worker: int, buf: np.ndarray, tag: int, on_done: SendDone) -> None:
    """Send ``buf`` (contiguous host bytes) with ``tag`` on endpoint ``ep``; ``on_done(status)``
    runs on the running loop once UCX is done with the buffer (never inside this call)."""
    op = _new_op(worker, buf, on_done)
    param = _send_param()
    param.user_data = op.key
    if _posted(op, lib().tag_send_nbx(ep, buf.ctypes.data, buf.nbytes, tag, ctypes.byref(param))):
        # The progress thread may be asleep in epoll with this send queued behind others: wake it.
        lib().worker_signal(worker)


def recv(worker: int, buf: np.ndarray, tag: int, on_done: RecvDone) -> Op:
    """Post a receive of the message with exactly ``tag`` into ``buf``; ``on_done(status, nbytes)``
    runs on the running loop when it arrived, failed or was cancelled (never inside this call)."""
    op = _new_op(worker, buf, on_done)
    param = _recv_param()
    param.user_data = op.key
    ptr = lib().tag_recv_nbx(worker, buf.ctypes.data, buf.nbytes, tag, (1 << 64) - 1, ctypes.byref(param))
    _posted(op, ptr, 0)
    return op


def flush(ep: int, worker: int, on_done: SendDone) -> None:
    """Flush ``ep``: ``on_done(status)`` runs on the running loop once every put issued on it before
    this call has completed remotely (UCS_OK), or failed (never inside this call)."""
    op = _new_op(worker, None, on_done)
    param = _send_param()
    param.user_data = op.key
    _posted(op, lib().ep_flush_nbx(ep, ctypes.byref(param)))
