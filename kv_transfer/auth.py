"""Both ends of a KV transfer prove the cluster token in the handshake (HMAC-SHA256 over a fresh nonce;
the token never crosses the wire). Pure: hmac and hashlib only. The exchange: docs/kv_transfer.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

_NONCES_KEPT = 65536  # nonces remembered against replay (a new connection per prefill worker and restart)


def new_nonce() -> str:
    return secrets.token_hex(16)


def _mac(token: str, *parts: object) -> str:
    msg = "\0".join(str(p) for p in parts).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def hello_proof(token: str, protocol_version: int, compat_hash: str, sender: str, nonce: str) -> str:
    return _mac(token, "pdserve-kv-hello", protocol_version, compat_hash, sender, nonce)


def reply_proof(token: str, nonce: str, ok: bool, conn_id: int) -> str:
    return _mac(token, "pdserve-kv-hello-reply", nonce, int(ok), conn_id)


def same(expected: str, got: str) -> bool:
    return hmac.compare_digest(expected.encode(), got.encode())


class SeenNonces:
    """The nonces of recent Hellos (bounded, oldest forgotten first): a second use is a replay."""

    def __init__(self, capacity: int = _NONCES_KEPT) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def first_use(self, nonce: str) -> bool:
        if nonce in self._seen:
            return False
        self._seen[nonce] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return True
