"""Raw ucxx baseline for the benchmark: plain ucxx moving the same bytes over the same kind of endpoints,
so that a comparison isolates the cost of pdserve's protocol.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.transports.ucx import UcxTransport
from pdserve.kv_transfer.transports.ucx_connection import CLOSE_PERIOD_NS
from pdserve.kv_transfer.transports.ucx_framing import parse_address


def _tags(nbytes: int, count: int = 1) -> tuple[list[int], int]:
    # Tag matching is per worker: every message size gets its own tags, or a receive
    # still posted for another size would take the message.
    if count == 1:
        return [(0x5EED << 44) | nbytes], (0xACC << 44) | nbytes
    if not 1 < count <= 256 or nbytes >= 1 << 44:
        raise ValueError(f"cannot split {nbytes} bytes into {count} messages")
    data = [(0x5 << 60) | ((count - 1) << 52) | (i << 44) | nbytes for i in range(count)]
    return data, (0xACD << 44) | nbytes


def _split(buf: Any, count: int) -> list[Any]:
    """``count`` consecutive slices covering ``buf`` (the last one takes the remainder)."""
    step = len(buf) // count
    return [buf[i * step : (i + 1) * step if i < count - 1 else len(buf)] for i in range(count)]


class RawBaseline:
    """ucxx through the transport's runtime (``ucx_runtime`` owns the only ``import ucxx``): a control
    endpoint with error handling and, on one host, a data endpoint without it (where UCX may use shared
    memory). Unlike pdserve it connects through a ucxx listener, which binds every interface while a
    benchmark runs. One message of N bytes is answered by a one-byte ack; connections and buffers are
    made once and reused, like pdserve's. ``count > 1`` splits the bytes into that many messages posted
    at once and answered by one ack: a reference for as many messages as pdserve sends, not the
    baseline. ``device="cuda"``: CUDA data buffers (``__cuda_array_interface__``), host-memory acks.
    """

    def __init__(self, config: TransferConfig, device: str = "cpu") -> None:
        self._transport = UcxTransport(config)  # holds the ucxx runtime
        self._ucxx = self._transport.ucxx
        self._config = config
        self._listeners: dict[tuple[int, int], Any] = {}  # (nbytes, count) -> listener
        self._clients: dict[str, tuple[Any, Any]] = {}  # address -> (control ep, data ep)
        self._server_eps: list[Any] = []
        self._device = torch.device(device)
        self._buffers: dict[tuple[str, int], Any] = {}  # numpy arrays, or CUDA tensors
        self.starts: list[float] = []  # the last run's round starts (perf_counter)
        self.landed: list[float] = []  # served rounds: when every byte had arrived (perf_counter)

    def _buffer(self, side: str, nbytes: int) -> Any:
        buf = self._buffers.get((side, nbytes))
        if buf is None:
            if self._device.type == "cpu":
                buf = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults later
            else:
                buf = torch.ones(nbytes, dtype=torch.uint8, device=self._device)
                # The fill is queued on torch's stream, UCX copies on its own: let it finish first.
                torch.cuda.synchronize(self._device)
            self._buffers[(side, nbytes)] = buf
        return buf

    async def serve(self, nbytes: int, count: int = 1) -> str:
        """Listen for one client sending ``nbytes`` in ``count`` messages; returns its address."""
        listener = self._listeners.get((nbytes, count))
        if listener is None:
            buf = self._buffer("recv", nbytes)
            worker_address = bytes(self._ucxx.get_worker_address())
            data_tags, ack_tag = _tags(nbytes, count)
            parts = _split(buf, count)

            async def handler(ep: Any) -> None:
                self._server_eps.append(ep)
                await ep.am_send(np.frombuffer(worker_address, dtype=np.uint8))
                ack = np.zeros(1, dtype=np.uint8)
                try:
                    while True:
                        if count == 1:
                            await ep.recv(buf, tag=data_tags[0], force_tag=True)
                        else:
                            pairs = zip(parts, data_tags, strict=True)
                            await asyncio.gather(*(ep.recv(b, tag=t, force_tag=True) for b, t in pairs))
                        self.landed.append(time.perf_counter())
                        await ep.send(ack, tag=ack_tag, force_tag=True)
                except Exception:  # the client went away: this baseline is over
                    return

            listener = self._listeners[(nbytes, count)] = self._ucxx.create_listener(handler, port=0)
        return f"ucx://{self._config.host}:{listener.port}"

    async def _client(self, address: str) -> tuple[Any, Any]:
        eps = self._clients.get(address)
        if eps is None:
            host, port = parse_address(address)
            ep = await self._ucxx.create_endpoint(host, port, endpoint_error_handling=True)
            preamble = bytes(await ep.am_recv())
            data_ep = ep
            if self._config.same_host:
                worker = self._ucxx.get_ucx_address_from_buffer(preamble)
                data_ep = await self._ucxx.create_endpoint_from_worker_address(
                    worker, endpoint_error_handling=False
                )
            eps = self._clients[address] = (ep, data_ep)
        return eps

    async def run(self, address: str, nbytes: int, reps: int, count: int = 1) -> list[float]:
        """Seconds per round (send to ack) for ``reps`` rounds of ``nbytes`` in ``count`` messages."""
        ep, data_ep = await self._client(address)
        src = self._buffer("send", nbytes)
        parts = _split(src, count)
        ack = np.zeros(1, dtype=np.uint8)
        data_tags, ack_tag = _tags(nbytes, count)
        times: list[float] = []
        self.starts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.starts.append(t0)
            if count == 1:
                await data_ep.send(src, tag=data_tags[0], force_tag=True)
            else:
                await asyncio.gather(
                    *(data_ep.send(b, tag=t, force_tag=True) for b, t in zip(parts, data_tags, strict=True))
                )
            await ep.recv(ack, tag=ack_tag, force_tag=True)
            times.append(time.perf_counter() - t0)
        return times

    async def close(self) -> None:
        for ep, data_ep in self._clients.values():
            for e in {id(ep): ep, id(data_ep): data_ep}.values():
                e.abort(period=CLOSE_PERIOD_NS)
        for ep in self._server_eps:
            ep.abort(period=CLOSE_PERIOD_NS)
        for listener in self._listeners.values():
            listener.close()
        self._clients.clear()
        self._server_eps.clear()
        self._listeners.clear()
        await self._transport.close()
