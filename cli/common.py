"""What every command shares: progress lines on stderr, and the cluster token and TLS files its flags name."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.worker.auth import read_token_file
from pdserve.worker.tls import TLSConfig

TOKEN_FILE_VAR = "PDSERVE_CLUSTER_TOKEN_FILE"


def say(text: str) -> None:
    """Progress goes to stderr; stdout carries only results (the router address)."""
    print(text, file=sys.stderr, flush=True)


def cluster_token(args: argparse.Namespace) -> str:
    """The token from --cluster-token-file or $PDSERVE_CLUSTER_TOKEN_FILE ("" when neither is set)."""
    path = args.cluster_token_file or os.environ.get(TOKEN_FILE_VAR, "").strip()
    return read_token_file(path) if path else ""


def tls_config(args: argparse.Namespace) -> TLSConfig:
    """The TLS files of --tls-cert/--tls-key/--tls-ca, read (NO_TLS when none is given)."""
    return TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)
