"""The backends behind ``kv_transfer.transport``'s Protocols, and :func:`make_transport`, which picks one:
UCX (``ucx.py`` and its ``ucx_*``/``ucp_*`` modules) or ``inproc``, a same-process fake for unit tests.
Neither is imported until a config asks for it.
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
