"""`pdserve up` serves the OpenAI API (on 8000 unless --http-port says otherwise) and shows its URL in status;
a port in use is an error naming --http-port."""

from __future__ import annotations

import json
import socket

import openai

from pdserve.cli import main as cli
from pdserve.deploy.local import cluster
from tests.fake_workers import make_model_dir
from tests.ports import free_port


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


def test_up_on_an_http_port_in_use_fails_naming_the_flag_and_leaves_nothing(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    state_dir = tmp_path / "state"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = ["up", "--prefill", "0", "--decode", "0", "--model", str(model), "--port", str(free_port())]
        up += ["--http-port", str(port), "--timeout", "60", "--state-dir", str(state_dir)]
        assert cli.main(up) == 1
    err = capsys.readouterr().err
    assert f"cannot serve the HTTP API on port {port} (--http-port" in err and "Traceback" not in err
    assert cluster.load_state(state_dir) is None
