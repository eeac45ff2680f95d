"""TLS on gRPC (``worker.tls``): a cluster with the cluster token and mutual TLS serves requests end to
end, and a client without a certificate the cluster's CA signed is refused.

A throwaway CA and certificates are made with the ``openssl`` command in a temporary directory: one
certificate for the cluster's processes (server and client use, IP SAN 127.0.0.1), one for the CLI
(client use), and one signed by another CA. The cluster serves the tiny served model (what is checked is
the transport, not the model) and ends with a leak check.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.tls import TLSConfig, TLSError
from tests.e2e.cluster_harness import free_port, generate, pdserve, running_cluster

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, usage: str) -> None:
    (d / f"{name}.ext").write_text(
        f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _leaf(d, "node", "ca", "serverAuth,clientAuth")  # the router and the workers
    _leaf(d, "cli", "ca", "clientAuth")
    _ca(d, "rogue-ca")
    _leaf(d, "rogue", "rogue-ca", "serverAuth,clientAuth")
    return d


def _creds(pki: Path, client: str | None) -> grpc.ChannelCredentials:
    ca = (pki / "ca.pem").read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key, cert = (pki / f"{client}.key").read_bytes(), (pki / f"{client}.pem").read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def test_tls_files_are_checked(pki):
    tls = TLSConfig.load(pki / "node.pem", pki / "node.key", pki / "ca.pem")
    assert tls.serves and tls.mutual and tls.enabled
    want = ["--tls-cert", str(pki / "node.pem"), "--tls-key", str(pki / "node.key")]
    assert tls.cli_flags() == [*want, "--tls-ca", str(pki / "ca.pem")]
    assert not TLSConfig.load(None, None, None).enabled
    assert TLSConfig.load(None, None, pki / "ca.pem").enabled  # a client that checks the router only
    with pytest.raises(TLSError, match="go together"):
        TLSConfig.load(pki / "node.pem", None, None)
    with pytest.raises(TLSError, match="not PEM"):
        TLSConfig.load(pki / "node.ext", pki / "node.key", None)
    with pytest.raises(TLSError, match="needs --tls-cert"):
        TLSConfig.load(None, None, pki / "ca.pem").check_server()
    out = pdserve(
        "worker", "--role", "decode", "--router", "127.0.0.1:1", "--tls-ca", str(pki / "ca.pem"), check=False
    )
    assert out.returncode == 2 and "needs --tls-cert" in out.stderr, out.stderr


def test_a_key_of_another_certificate_and_a_key_others_can_read_are_caught(pki, tmp_path, caplog):
    """A key that does not go with its certificate was reported by the router as a port it could not bind
    (gRPC's "Failed to bind to address"); a key readable by others passed without a word (a token file so
    readable gets a warning)."""
    with pytest.raises(TLSError, match="does not go with the certificate"):
        TLSConfig.load(pki / "node.pem", pki / "cli.key", None)
    loose = tmp_path / "node.key"
    loose.write_bytes((pki / "node.key").read_bytes())
    loose.chmod(0o644)
    with caplog.at_level("WARNING", logger="pdserve.worker.tls"):
        tls = TLSConfig.load(pki / "node.pem", loose, pki / "ca.pem")
    assert "readable by other users" in caplog.text
    # A client context for the HTTPS front: trusts the cluster's CA and presents the certificate.
    ctx = tls.client_ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    assert TLSConfig.load(None, None, None).client_ssl_context() is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_cluster_with_token_and_mutual_tls_serves_and_refuses_clients_without_a_valid_cert(
    tmp_path, pki, tiny_served_model
):
    files = (
        "--tls-cert",
        str(pki / "node.pem"),
        "--tls-key",
        str(pki / "node.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
    )
    http_port = free_port()
    # Threshold 1: the request takes the disaggregated path (router -> decode -> prefill -> KV transfer).
    extra = ("--local-prefill-threshold", "1", "--http-port", str(http_port), *files)
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        state = json.loads((c.state_dir / "cluster.json").read_text())
        assert state["tls_ca"] == str(pki / "ca.pem") and state["token_file"]

        # The CLI with the cluster's files (from the state file), and with its own certificate.
        out = pdserve(
            "generate", "Why is the sky blue?", "--max-tokens", "6", "--state-dir", str(c.state_dir)
        )
        assert out.returncode == 0 and " out]" in out.stderr, out.stderr  # the finish summary
        cli = (
            "--tls-cert",
            str(pki / "cli.pem"),
            "--tls-key",
            str(pki / "cli.key"),
            "--tls-ca",
            str(pki / "ca.pem"),
        )
        out = pdserve("generate", "Hello", "--max-tokens", "4", "--router", c.address, *cli)
        assert out.returncode == 0 and " out]" in out.stderr, out.stderr  # the finish summary
        workers = {w["role"]: w for w in c.workers()}  # `pdserve status` over mutual TLS
        bench = ("bench", "--state-dir", str(c.state_dir), "--num-prompts", "2", "--input-len", "32")
        out = pdserve(*bench, "--output-len", "4", "--no-progress")  # the load generator too
        assert "Successful requests" in out.stdout, out.stdout + out.stderr
        assert set(workers) == {"prefill", "decode"}

        req = generation_pb2.GenerateRequest(
            prompt="Name a large ocean. " * 10, sampling=generation_pb2.SamplingParams(max_tokens=4)
        )
        with grpc.secure_channel(c.address, _creds(pki, "cli")) as ch:
            ids, _, reason, _ = generate(generation_pb2_grpc.GenerationStub(ch), req, timeout=120)
            assert len(ids) == 4 and reason == "length"

        # Refused: plain gRPC, TLS without a client certificate, a certificate another CA signed.
        rogue = grpc.ssl_channel_credentials(
            root_certificates=(pki / "ca.pem").read_bytes(),
            private_key=(pki / "rogue.key").read_bytes(),
            certificate_chain=(pki / "rogue.pem").read_bytes(),
        )
        for name, target, ch in [
            ("plain, router", c.address, grpc.insecure_channel(c.address)),
            ("no client cert, router", c.address, grpc.secure_channel(c.address, _creds(pki, None))),
            ("rogue cert, router", c.address, grpc.secure_channel(c.address, rogue)),
            (
                "plain, decode worker",
                workers["decode"]["address"],
                grpc.insecure_channel(workers["decode"]["address"]),
            ),
            (
                "no client cert, prefill worker",
                workers["prefill"]["address"],
                grpc.secure_channel(workers["prefill"]["address"], _creds(pki, None)),
            ),
        ]:
            with ch, pytest.raises(grpc.RpcError) as err:
                if "worker" in name:
                    worker_pb2_grpc.WorkerStub(ch).GetLoad(
                        worker_pb2.Empty(), timeout=5, metadata=c.token_metadata()
                    )
                else:
                    generate(generation_pb2_grpc.GenerationStub(ch), req, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, target, err.value)
        out = pdserve(
            "generate", "Hello", "--router", c.address, "--tls-ca", str(pki / "ca.pem"), check=False
        )
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out.stderr

        # A worker's gRPC answers a client with the cluster's certificate (and the token).
        with grpc.secure_channel(workers["decode"]["address"], _creds(pki, "node")) as ch:
            load = worker_pb2_grpc.WorkerStub(ch).GetLoad(
                worker_pb2.Empty(), timeout=5, metadata=c.token_metadata()
            )
            assert load.kv_blocks_total > 0

        # The OpenAI front serves HTTPS with the same certificate.
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with urllib.request.urlopen(f"https://127.0.0.1:{http_port}/v1/models", context=ctx, timeout=10) as r:
            assert json.loads(r.read())["data"]
        c.assert_no_leaks()
