"""`pdserve up --http-port` serves the OpenAI API and shows its URL in status."""

from __future__ import annotations

import json
import socket

import openai

from pdserve.cli import main as cli
from tests.fake_workers import make_model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_with_http_port_shows_the_url_in_status(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    base = ["--state-dir", str(tmp_path / "state")]
    http_port = free_port()
    up = ["up", "--prefill", "0", "--decode", "1", "--model", str(model), "--port", str(free_port())]
    up += ["--http-port", str(http_port), "--worker-module", "tests.fake_workers", "--timeout", "60", *base]
    assert cli.main(up) == 0
    try:
        assert f"http://127.0.0.1:{http_port}/v1" in capsys.readouterr().err
        assert cli.main(["status", "--json", *base]) == 0
        url = json.loads(capsys.readouterr().out)["router"]["http_url"]
        assert url == f"http://127.0.0.1:{http_port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        r = client.completions.create(model=str(model), prompt="hello", max_tokens=4)
        assert r.choices[0].text == " hello world the cat" and r.usage.completion_tokens == 4
        client.close()
    finally:
        assert cli.main(["down", *base]) == 0
