"""The transport backends behind ``kv_transfer.transport``'s Protocols, and the one factory that picks one.

Two backends. UCX: ``ucx`` (the transport: listen, connect, expose), ``ucx_runtime`` (the process's ucxx
context; the only module in pdserve that imports ucxx), ``ucx_framing`` (addresses, control tags and
frames), ``ucx_connection`` (one side of a connection), ``ucx_puts`` (one-sided puts), and ``ucp_rma`` and
``ucp_tag`` (ctypes over libucp: registration, remote keys and puts; control frames and flushes).
``inproc``: a same-process fake for unit tests, with the same ordering and failure semantics. Neither
backend is imported until a config asks for it. The writers of one host are ``kv_transfer.writers``.
"""

from __future__ import annotations

from pdserve.kv_transfer.config import Backend, TransferConfig
from pdserve.kv_transfer.transport import Transport


def make_transport(config: TransferConfig) -> Transport:
    """The configured backend; call inside the running event loop. ucxx is imported only for UCX."""
    if config.backend is Backend.INPROC:
        from pdserve.kv_transfer.transports.inproc import InprocTransport

        return InprocTransport()
    from pdserve.kv_transfer.transports.ucx import UcxTransport

    return UcxTransport(config)
