"""Addresses and control framing of the UCX transport: worker addresses, control tags, and the
length-prefixed frames that carry control messages and connect requests.
"""

from __future__ import annotations

import base64
import binascii
import struct

import numpy as np

ADDRESS_PREFIX = "ucx-worker:"

# Control tags (bit 63 clear; KV data tags set it, plan.py):
#   bit 62      1: control
#   bit 61      direction: 1 towards the prefill side
#   bits 0-60   channel id, random per connection; 0: the decode side's queue of connect frames
CONTROL = 1 << 62
TO_PREFILL = 1 << 61
CHANNEL_BITS = 61
CONNECT_TAG = CONTROL

# Frames: a little-endian u32 payload length, then the payload. CLOSED in place of a length: the peer
# closed the connection. An Open with the tag layout's 65,536 segment lengths (at most 5 bytes of msgpack
# each) fits.
LEN = struct.Struct("<I")
CLOSED = 0xFFFFFFFF
MAX_CONTROL_BYTES = 1 << 20
CLOSED_FRAME = np.frombuffer(LEN.pack(CLOSED), dtype=np.uint8)
# A connect frame's payload: the channel id, then the prefill side's UCX worker address.
CHANNEL = struct.Struct("<Q")
MAX_CONNECT_BYTES = 1 << 16


def worker_address_string(blob: bytes) -> str:
    return ADDRESS_PREFIX + base64.urlsafe_b64encode(blob).decode()


def parse_worker_address(address: str) -> bytes:
    """The UCX worker address blob in a ``ucx-worker:`` address; ValueError if it is not one."""
    if not address.startswith(ADDRESS_PREFIX):
        raise ValueError(f"not a UCX worker address: {address[:40]!r}")
    try:
        blob = base64.urlsafe_b64decode(address.removeprefix(ADDRESS_PREFIX).encode())
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"bad UCX worker address: {exc}") from exc
    if not blob or len(blob) > MAX_CONNECT_BYTES - CHANNEL.size:
        raise ValueError(f"bad UCX worker address: {len(blob)} bytes")
    return blob


def parse_address(address: str) -> tuple[str, int]:
    """``ucx://host:port``: a listener's address (the raw baseline's, testing/baseline.py)."""
    if not address.startswith("ucx://"):
        raise ValueError(f"not a UCX address: {address!r}")
    host, _, port = address.removeprefix("ucx://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad UCX address: {address!r}")
    return host.strip("[]"), int(port)
