"""``pdserve bench`` against an in-process fake ``Generation`` server (grpc.aio, no engine).

The fake (``tests.bench_fakes``) fixes each request's fate from the request
itself, so a test predicts it from the seeded plan; every test stops it, even
on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.datasets import DatasetName, WorkloadConfig
from pdserve.bench.metrics import Slo
from pdserve.bench.plan import plan_run
from pdserve.bench.serve import BenchConfig, main, run_benchmark
from pdserve.proto import generation_pb2 as g
from tests.bench_fakes import (
    RECORD_KEYS,
    SPACE,
    VLLM_KEYS,
    FakeGeneration,
    chunk_sizes,
    fake_router,
    fate,
    recompute_figures,
)


@pytest.fixture
def fake():
    servicer = FakeGeneration()
    with fake_router(servicer) as address:
        yield servicer, address


def _config(address: str, **kw) -> BenchConfig:
    base = dict(
        router=address,
        workload=WorkloadConfig(input_len=16, output_len=6, range_ratio=0.5),
        arrivals=ArrivalConfig(request_rate=400.0),
        num_prompts=24,
        seed=7,
        connect_timeout_s=10.0,
        request_timeout_s=30.0,
    )
    base.update(kw)
    return BenchConfig(**base)


def _measured(servicer: FakeGeneration) -> dict[int, g.GenerateRequest]:
    """Measured requests by index (their ids end in -<index>; warmup ids in -w-<index>)."""
    return {int(r.request_id.rsplit("-", 1)[1]): r for r in servicer.received if "-w-" not in r.request_id}


def test_saved_result_matches_figures_recomputed_from_timestamps(fake, tmp_path):
    servicer, address = fake
    slo = {"ttft": 20.0, "tpot": 10.0}
    config = _config(address, warmup=3, max_concurrency=5, slo=Slo(ttft_ms=20.0, tpot_ms=10.0))
    result = asyncio.run(run_benchmark(config, token_space=SPACE))
    path = tmp_path / "out" / "result.json"
    result.save(path)
    doc = json.loads(path.read_text())

    for key in VLLM_KEYS:
        assert key in doc, key
    assert doc["config"]["seed"] == 7 and doc["config"]["request_rate"] == 400.0
    assert doc["config"]["cpu_count"] == os.cpu_count() and doc["config"]["max_concurrency"] == 5
    assert doc["client_machine"]["cores"] == os.cpu_count() and doc["client_machine"]["isa"]
    assert doc["goodput_slo"] == slo and doc["warmup_requests"] == 3

    # The server saw the warmup first, then exactly the planned measured stream.
    plan = plan_run(config.workload, config.arrivals, 24, 3, 7, SPACE)
    assert sum("-w-" in r.request_id for r in servicer.received) == 3
    assert all("-w-" in r.request_id for r in servicer.received[:3])
    sent = _measured(servicer)
    assert sorted(sent) == list(range(24))
    for i, sample in enumerate(plan.requests):
        assert tuple(sent[i].prompt_token_ids.ids) == sample.prompt_token_ids
        assert sent[i].sampling.max_tokens == sample.output_len and sent[i].sampling.ignore_eos

    records = doc["requests"]
    assert [r["index"] for r in records] == list(range(24))
    for r, sample, at in zip(records, plan.requests, plan.send_times, strict=True):
        assert RECORD_KEYS <= set(r)
        assert r["scheduled_time"] == at
        expected = fate(sent[r["index"]])
        if expected == "ok":
            assert r["error"] is None and r["finish_reason"] == "length"
            assert r["token_counts"] == chunk_sizes(sample.output_len)
            assert r["output_tokens"] == sample.output_len and r["prompt_tokens"] == sample.prompt_len
        elif expected == "fail":
            assert r["error"].startswith("UNAVAILABLE") and "decode worker died" in r["error"]
        else:
            assert "abort" in r["error"]
        # Each record's own figures follow from its timestamps.
        if r["error"] is None:
            assert r["ttft_ms"] == pytest.approx((r["token_times"][0] - r["start_time"]) * 1e3)
            assert r["e2el_ms"] == pytest.approx((r["end_time"] - r["start_time"]) * 1e3)
            assert len(r["itl_ms"]) == r["output_tokens"] - 1
            assert sum(r["itl_ms"]) == pytest.approx((r["token_times"][-1] - r["token_times"][0]) * 1e3)
    fates = [fate(sent[i]) for i in range(24)]
    assert 0 < doc["failed"] == sum(f != "ok" for f in fates) < 24

    expected = recompute_figures(records, slo)
    for key, value in expected.items():
        assert doc[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key

    # --max-concurrency: never more than 5 streams open at once.
    events = sorted([(r["start_time"], 1) for r in records] + [(r["end_time"], -1) for r in records])
    assert max(np.cumsum([d for _, d in events])) <= 5


def test_same_seed_same_request_stream(fake):
    servicer, address = fake

    def run(seed: int) -> tuple[list, list[float]]:
        servicer.received.clear()
        config = _config(address, num_prompts=8, seed=seed, arrivals=ArrivalConfig(200.0, burstiness=0.5))
        result = asyncio.run(run_benchmark(config, token_space=SPACE))
        sent = _measured(servicer)
        stream = [(tuple(sent[i].prompt_token_ids.ids), sent[i].sampling.max_tokens) for i in range(8)]
        return stream, [r.scheduled_time for r in result.records]

    first, second, other = run(3), run(3), run(4)
    assert first == second
    assert first[0] != other[0] and first[1] != other[1]


def test_timeouts_and_errors_are_recorded_not_raised(fake, tmp_path):
    servicer, address = fake
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "hang"},
        {"prompt": "fail"},
        {"prompt": "one two three", "output_len": 5},
        {"messages": [{"role": "user", "content": "hi there"}], "output_len": 2},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = _config(
        address,
        workload=WorkloadConfig(DatasetName.JSONL, output_len=3, dataset_path=path),
        arrivals=ArrivalConfig(),
        num_prompts=4,
        request_timeout_s=0.5,
    )
    result = asyncio.run(run_benchmark(config))
    sent = _measured(servicer)
    by_kind = {(sent[r.index].prompt or "chat"): r for r in result.records}
    hung = by_kind["hang"]
    assert hung.error is not None and ("timeout" in hung.error or "DEADLINE_EXCEEDED" in hung.error)
    assert by_kind["fail"].error is not None and by_kind["fail"].error.startswith("UNAVAILABLE")
    assert by_kind["one two three"].ok and by_kind["one two three"].output_tokens == 5
    assert by_kind["one two three"].prompt_tokens == 3  # from the server's usage
    chat = by_kind["chat"]
    assert chat.ok and chat.output_tokens == 2 and chat.prompt_tokens == 2
    assert [(m.role, m.content) for m in sent[chat.index].messages.messages] == [("user", "hi there")]
    assert result.metrics["completed"] == 2 and result.metrics["failed"] == 2
    # The stuck stream was cancelled: the server saw it go.
    assert servicer.cancel_seen.wait(timeout=10)
    assert servicer.cancelled == [hung.request_id]


def test_cli_prints_summary_and_saves(fake, tmp_path, capsys):
    from pdserve.deploy.local.cluster import ClusterState, ProcessEntry, save_state

    servicer, address = fake
    data = tmp_path / "w.jsonl"
    data.write_text('{"prompt": "a b"}\n{"prompt": "c d e", "output_len": 2}\n')
    state_dir = tmp_path / "cluster"
    entry = ProcessEntry(id="router", pid=1, start=0, log="router.log")
    save_state(
        state_dir, ClusterState(address, entry, model="tiny-model", dtype="float32", threads=1, host="h")
    )
    out = tmp_path / "r.json"
    argv = ["--state-dir", str(state_dir), "--dataset-path", str(data), "--num-prompts", "5", "--warmup", "1"]
    argv += [
        "--no-progress",
        "--request-rate",
        "100",
        "--goodput",
        "ttft:1000",
        "tpot:1000",
        "--save-result",
        str(out),
    ]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "Serving Benchmark Result" in stdout and "Request goodput (req/s):" in stdout
    doc = json.loads(out.read_text())
    assert doc["completed"] == 5 and len(doc["requests"]) == 5 and doc["config"]["router"] == address
    assert doc["config"]["model"] == "tiny-model" and doc["config"]["dataset_name"] == "jsonl"
    assert len(servicer.received) == 6


def test_cli_reports_an_unreachable_router(tmp_path, capsys):
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        argv = [
            "--router",
            f"127.0.0.1:{port}",
            "--dataset-path",
            str(_one_line(tmp_path)),
            "--num-prompts",
            "1",
        ]
        assert main([*argv, "--connect-timeout", "0.5", "--no-progress"]) == 1
    assert "not reachable" in capsys.readouterr().err
    assert main(["--state-dir", str(tmp_path / "none"), "--no-progress"]) == 1
    assert "no cluster in" in capsys.readouterr().err


def _one_line(tmp_path: Path) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "x"}\n')
    return path


def test_request_timeouts_past_what_grpc_can_hold_are_refused():
    """``--request-timeout 1e10`` (or inf) overflowed gRPC's deadline: every request failed at once."""
    import math

    for bad in (1e10, math.inf, 0.0, math.nan):
        with pytest.raises(ValueError, match="request_timeout_s"):
            _config("unset", request_timeout_s=bad)
    assert _config("unset", request_timeout_s=86400.0).request_timeout_s == 86400.0


# ---- multi-turn ---------------------------------------------------------------------------------------


def _multi_turn(**kw) -> WorkloadConfig:
    base = dict(dataset=DatasetName.MULTI_TURN, input_len=5, output_len=3, turns=4)
    base.update(kw)
    return WorkloadConfig(**base)


def test_multi_turn_prompts_resend_the_history():
    from pdserve.bench.datasets import sample_requests

    reqs = sample_requests(_multi_turn(prefix_len=6), 10, np.random.default_rng(3), SPACE)
    # Conversation by conversation; the last one is cut short at 10 requests.
    assert [(r.conversation, r.turn) for r in reqs] == [(c, t) for c in range(3) for t in range(4)][:10]
    for prev, cur in zip(reqs, reqs[1:], strict=False):
        assert cur.prompt_token_ids is not None and prev.prompt_token_ids is not None
        assert cur.prompt_len == len(cur.prompt_token_ids) and cur.output_len == 3 and cur.ignore_eos
        if cur.turn == 0:
            assert cur.prompt_len == 6 + 5
            continue
        # Turn k = turn k-1's prompt + a stand-in answer of turn k-1's output length + a new user message.
        assert cur.prompt_token_ids[: prev.prompt_len] == prev.prompt_token_ids
        assert cur.prompt_len == prev.prompt_len + prev.output_len + 5
    firsts = [r.prompt_token_ids for r in reqs if r.turn == 0]
    assert len({p[:6] for p in firsts}) == 1  # the prefix every conversation shares
    assert len({p[6:] for p in firsts}) == 3  # each its own first message
    assert all(3 <= t < 500 for r in reqs for t in r.prompt_token_ids)


def test_multi_turn_lengths_follow_the_range_ratio():
    from pdserve.bench.datasets import sample_requests

    reqs = sample_requests(
        _multi_turn(input_len=10, output_len=8, range_ratio=0.5, turns=3), 30, np.random.default_rng(0), SPACE
    )
    for prev, cur in zip(reqs, reqs[1:], strict=False):
        assert 4 <= cur.output_len <= 12
        if cur.turn:
            assert 5 <= cur.prompt_len - prev.prompt_len - prev.output_len <= 15
    with pytest.raises(ValueError):
        _multi_turn(turns=0)


def test_send_chains_keep_each_conversation_in_turn_order():
    from pdserve.bench.datasets import SampleRequest
    from pdserve.bench.serve import send_chains

    s = [
        SampleRequest(prompt="a", conversation=1, turn=1),
        SampleRequest(prompt="b"),
        SampleRequest(prompt="c", conversation=1, turn=0),
        SampleRequest(prompt="d", conversation=0, turn=0),
    ]
    assert send_chains(s) == [[1], [2, 0], [3]]  # by the index of each chain's first request


class _OrderedStub:
    """A ``Generation`` stub without a server: each call yields to the loop a few times, then streams its
    tokens; it logs when each request started and ended."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.open = self.most_open = 0

    def Generate(self, req, timeout=None):  # noqa: N802 - the gRPC method's name
        async def stream():
            self.log.append(("start", req.request_id))
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            for _ in range(3):
                await asyncio.sleep(0)
            yield g.GenerateResponse(token_ids=[7] * req.sampling.max_tokens, finish_reason="length")
            self.open -= 1
            self.log.append(("end", req.request_id))

        return stream()


def test_multi_turn_turns_go_one_after_the_other_and_conversations_share_the_slots():
    from pdserve.bench.serve import _send_all

    plan = plan_run(_multi_turn(turns=3), ArrivalConfig(), 12, 0, 0, SPACE)  # 4 conversations of 3
    stub = _OrderedStub()
    config = _config("unset", workload=_multi_turn(turns=3), num_prompts=12, max_concurrency=2)
    records = asyncio.run(_send_all(stub, plan.requests, plan.send_times, config, "r", "bench"))
    assert [r.index for r in records] == list(range(12)) and all(r.ok for r in records)
    position = {event: k for k, event in enumerate(stub.log)}
    for i, sample in enumerate(plan.requests):
        if sample.turn:
            assert position[("end", f"r-{i - 1}")] < position[("start", f"r-{i}")]
    assert stub.most_open == 2  # two conversations at a time, never more
    first_turns = [position[("start", f"r-{i}")] for i, s in enumerate(plan.requests) if s.turn == 0]
    assert first_turns == sorted(first_turns)  # conversations start in order
    # The third conversation waits for a slot: one of the first two has finished all its turns.
    done = min(position[("end", "r-2")], position[("end", "r-5")])
    assert first_turns[2] > done


def test_multi_turn_arguments_set_the_request_count():
    import argparse

    from pdserve.bench.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--dataset-name", "multi-turn", "--num-conversations", "5", "--turns", "3", "--input-len", "8"]
    )
    cfg = config_from_args(args, router="unset", model="m")
    assert cfg.num_prompts == 15 and cfg.workload.turns == 3
    assert cfg.workload.dataset == DatasetName.MULTI_TURN
    doc = cfg.as_dict()
    assert doc["turns"] == 3 and doc["num_conversations"] == 5 and doc["dataset_name"] == "multi-turn"
    args = parser.parse_args(["--dataset-name", "multi-turn", "--num-prompts", "7", "--turns", "3"])
    assert config_from_args(args, router="unset", model="m").as_dict()["num_conversations"] == 3
    plain = config_from_args(parser.parse_args([]), router="unset", model="m").as_dict()
    assert plain["turns"] is None and plain["num_conversations"] is None
