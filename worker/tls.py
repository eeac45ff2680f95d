"""TLS on gRPC, an option: server certificates, and mutual TLS between the router and its workers (each
both a server and a client) when a CA is given; the OpenAI front takes the same certificate for HTTPS."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


class TLSError(ValueError):
    """TLS files that cannot be used; the message says why."""


@dataclass(frozen=True)
class TLSConfig:
    """PEM files and their contents. Nothing given: plain gRPC. gRPC checks the server's name: a
    certificate must name the address its process is dialled at among its subject alternative names."""

    cert_file: str = ""  # this process's certificate (chain)
    key_file: str = ""  # its private key
    ca_file: str = ""  # peers' certificates must chain to this CA; on a server it makes TLS mutual
    cert: bytes = field(default=b"", repr=False)
    key: bytes = field(default=b"", repr=False)
    ca: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TLSError("--tls-cert and --tls-key go together")

    @classmethod
    def load(
        cls, cert_file: str | Path | None, key_file: str | Path | None, ca_file: str | Path | None
    ) -> TLSConfig:
        """Read the given files (None or "": not given); TLSError when one cannot be read or lacks PEM."""

        def read(path: str | Path | None, what: str) -> tuple[str, bytes]:
            if not path:
                return "", b""
            path = Path(path).resolve()
            try:
                data = path.read_bytes()
            except OSError as e:
                raise TLSError(f"cannot read the TLS {what} {path}: {e.strerror}") from e
            if b"-----BEGIN " not in data:
                raise TLSError(f"the TLS {what} {path} is not PEM")
            return str(path), data

        cert_file, cert = read(cert_file, "certificate")
        key_file, key = read(key_file, "key")
        ca_file, ca = read(ca_file, "CA file")
        if key_file and Path(key_file).stat().st_mode & 0o077:
            log.warning("TLS key %s is readable by other users (chmod 600 it)", key_file)
        if cert_file and key_file:
            # gRPC would only say "Failed to bind to address" for a key of another certificate.
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
            except ssl.SSLError as e:
                raise TLSError(
                    f"the TLS key {key_file} does not go with the certificate {cert_file} ({e.reason})"
                ) from e
        return cls(cert_file, key_file, ca_file, cert, key, ca)

    @property
    def enabled(self) -> bool:
        """True when calls use TLS (as a client: a CA or a certificate was given)."""
        return bool(self.cert or self.ca)

    @property
    def serves(self) -> bool:
        """True when a server of this process serves TLS (it has a certificate)."""
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.cert and self.ca)

    def check_server(self) -> None:
        """A process that serves gRPC and was given a CA needs its own certificate to serve TLS."""
        if self.ca and not self.cert:
            raise TLSError("--tls-ca on a router or worker needs --tls-cert and --tls-key too")

    def cli_flags(self) -> list[str]:
        """The flags that hand these files to another pdserve process."""
        flags = []
        for flag, path in (
            ("--tls-cert", self.cert_file),
            ("--tls-key", self.key_file),
            ("--tls-ca", self.ca_file),
        ):
            if path:
                flags += [flag, path]
        return flags

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca or None, require_client_auth=bool(self.ca)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca or None,
            private_key=self.key or None,
            certificate_chain=self.cert or None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """An HTTPS server context with this certificate (the OpenAI front; no client certificates)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """An HTTPS client context that trusts this cluster's CA and presents this certificate (None:
        plain HTTP). For a pdserve tool calling the cluster's OpenAI front."""
        if not self.enabled:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


NO_TLS = TLSConfig()


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig) -> int:
    """Bind ``address`` on ``server``, over TLS when ``tls`` has a certificate; returns the port."""
    if tls.serves:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def aio_channel(address: str, tls: TLSConfig, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def channel(address: str, tls: TLSConfig, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)
