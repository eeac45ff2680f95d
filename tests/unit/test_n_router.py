"""``n`` > 1 at the router, against fake workers (tests/fake_workers.py): every choice streams with its index
through its own detokenizer and stop strings, usage counts the prompt once, the prompt goes to one prefill
and one decode call, a failed decode worker's request moves with every open choice, and the OpenAI front's
shapes. Every cluster ends with the router's leak check."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.proto import worker_pb2
from pdserve.router.openai.mapping import Collected, EventStream, Kind, completion_request
from pdserve.router.openai.protocol import CompletionRequest, OpenAIError
from pdserve.worker.role import Role
from tests.fake_workers import EOS, FakeWorker, Transfers, ids
from tests.unit.test_router_server import cluster, collect, expect_error, model_dir, request, run

__all__ = ["model_dir"]  # (the module's fixture)

OUTPUTS = [ids("hello world the cat"), ids("a b c mat"), ids("sat on the mat")]


def by_choice(msgs: list[g.GenerateResponse]) -> dict[int, tuple[list[int], str, str]]:
    """Each choice's (tokens, text, finish reason) from a stream's messages."""
    out: dict[int, tuple[list[int], str, str]] = {}
    for m in msgs:
        tokens, text, finish = out.get(m.index, ([], "", ""))
        assert not finish, f"choice {m.index} sent a message after its finish"
        out[m.index] = (tokens + list(m.token_ids), text + m.text, m.finish_reason)
    return out


def workers(route: str, **kw) -> tuple[list[FakeWorker], FakeWorker, FakeWorker | None]:
    transfers = Transfers()
    d = FakeWorker(
        "d1", Role.BOTH if route == "colocated" else Role.DECODE, OUTPUTS[0], transfers=transfers, **kw
    )
    d.choice_tokens = OUTPUTS
    if route == "colocated":
        return [d], d, None
    p = FakeWorker("p1", Role.PREFILL, OUTPUTS[0], transfers=transfers)
    p.choice_tokens = OUTPUTS
    return [d, p], d, p


@pytest.mark.parametrize("route", ["colocated", "remote"])
def test_every_choice_streams_with_its_index_and_usage_counts_the_prompt_once(model_dir, route):
    async def main():
        ws, d, p = workers(route)
        async with cluster(model_dir, ws, local_prefill_threshold=1) as (_, stub):
            _, _, msgs = await collect(stub.Generate(request("the cat", n=3, max_tokens=4, seed=5)))
            got = by_choice(msgs)
            assert {i: t for i, (t, _, _) in got.items()} == dict(enumerate(OUTPUTS))
            assert got[1][1] == " a b c mat" and {f for _, _, f in got.values()} == {"length"}
            # The request's usage, on its last message only: the prompt once, every choice's tokens.
            assert [m.HasField("usage") for m in msgs].count(True) == 1 and msgs[-1].HasField("usage")
            assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (2, 12)
            # One decode call (and one prefill) for the request, n in its sampling.
            (dreq,) = d.requests
            assert dreq.sampling.n == 3 and not dreq.resumed_choices
            if p is not None:
                (preq,) = p.requests
                assert preq.sampling.n == 3 and list(preq.prompt_token_ids) == ids("the cat")
                assert dreq.mode == worker_pb2.PREFILL_MODE_REMOTE

    run(main())


def test_one_token_choices_are_the_prefill_workers_answer_alone(model_dir):
    async def main():
        ws, d, p = workers("remote")
        async with cluster(model_dir, ws, local_prefill_threshold=1) as (_, stub):
            _, _, msgs = await collect(stub.Generate(request("the cat", n=3, max_tokens=1)))
            assert {i: (t, f) for i, (t, _, f) in by_choice(msgs).items()} == {
                i: (out[:1], "length") for i, out in enumerate(OUTPUTS)
            }
            assert msgs[-1].usage.completion_tokens == 3 and not d.requests and len(p.requests) == 1

    run(main())


def test_each_choice_has_its_own_stop_strings(model_dir):
    async def main():
        ws, _, _ = workers("colocated")
        async with cluster(model_dir, ws) as (_, stub):
            _, _, msgs = await collect(stub.Generate(request("the cat", n=3, max_tokens=4, stop=["the"])))
            got = by_choice(msgs)
            assert {i: (text, f) for i, (_, text, f) in got.items()} == {
                0: (" hello world ", "stop"),  # (the text before the stop string)
                1: (" a b c mat", "length"),
                2: (" sat on ", "stop"),
            }
            assert msgs[-1].usage.completion_tokens == sum(len(t) for t, _, _ in got.values())

    run(main())


def test_a_failed_decode_worker_moves_every_open_choice_on_from_its_own_tokens(model_dir):
    """Choices of different lengths (one ends on eos): after 6 messages the worker dies; the request moves
    with its two open choices, each going on from what it sent, the finished one left out."""
    outputs = [ids("hello world the cat"), ids("a") + [EOS], ids("sat on the mat")]

    async def main():
        bad = FakeWorker("d1", Role.BOTH, outputs[0], finish="stop", fail_at=6)
        good = FakeWorker("d2", Role.BOTH, outputs[0], finish="stop")
        for w in (bad, good):
            w.choice_tokens = outputs
        async with cluster(model_dir, [bad, good]) as (server, stub):
            _, _, msgs = await collect(stub.Generate(request("the cat", n=3, max_tokens=4, seed=1)))
            got = by_choice(msgs)
            assert {i: t for i, (t, _, _) in got.items()} == dict(enumerate(outputs))
            assert got[1][1:] == (" a", "stop")
            (moved,) = good.requests
            assert moved.mode == worker_pb2.PREFILL_MODE_LOCAL and moved.output_offset == 0
            assert list(moved.prompt_token_ids) == ids("the cat") and moved.sampling.max_tokens == 4
            assert [(c.index, list(c.token_ids)) for c in moved.resumed_choices] == [
                (0, outputs[0][:2]),
                (2, outputs[2][:2]),
            ]
            reg = server.router.metrics.registry
            labels = {"role": "router", "reason": "decode_failed"}
            assert reg.get_sample_value("pdserve_router_migrations_total", labels) == 1

    run(main())


def test_n_is_bounded_by_range_and_by_the_kv_cache(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"), kv_blocks_total=16, block_size=4)  # 64 tokens
        async with cluster(model_dir, [w]) as (_, stub):
            for n in (0, 129):
                details = await expect_error(stub.Generate(request(n=n)), grpc.StatusCode.INVALID_ARGUMENT)
                assert details.startswith("sampling.n must be")
            details = await expect_error(
                stub.Generate(request(n=5, max_tokens=12)), grpc.StatusCode.INVALID_ARGUMENT
            )
            assert details.startswith("n is 5:") and "lower n" in details
            # Unset max_tokens is cut to what n choices fit (64 // 4 - 2 = 14), not refused.
            _, _, msgs = await collect(stub.Generate(request(n=4)))
            assert w.requests[-1].sampling.max_tokens == 14 and msgs[-1].usage.completion_tokens == 8
            assert not w.cancelled

    run(main())


# ---- the OpenAI front's shapes --------------------------------------------------------------------------


def test_openai_n_and_best_of_mapping():
    req = completion_request(CompletionRequest(prompt="x", n=3, best_of=3), "cmpl-1")
    assert req.sampling.n == 3
    for body in (
        {"prompt": "x", "best_of": 2},
        {"prompt": "x", "n": 2, "best_of": 3},
        {"prompt": "x", "n": -1},
    ):
        with pytest.raises(OpenAIError) as info:
            completion_request(CompletionRequest(**body), "cmpl-1")
        assert info.value.info.param == ("n" if body.get("n") == -1 else "best_of")


def _msgs() -> list[g.GenerateResponse]:
    return [
        g.GenerateResponse(text=" a", index=1),
        g.GenerateResponse(text=" b", index=0),
        g.GenerateResponse(text=" c", index=1, finish_reason="stop"),
        g.GenerateResponse(
            text=" d", index=0, finish_reason="length", usage=g.Usage(prompt_tokens=2, completion_tokens=4)
        ),
    ]


@pytest.mark.parametrize("kind", [Kind.COMPLETION, Kind.CHAT])
def test_openai_bodies_and_chunks_carry_every_choice_by_index(kind):
    body = Collected(kind, "id-1", 1700, "m")
    events = EventStream(kind, "id-1", 1700, "m", include_usage=True)
    chunks = b""
    for m in _msgs():
        body.feed(m)
        chunks += events.feed(m)
    chunks += events.end()
    doc = json.loads(body.response())
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    texts = [c["text"] if kind is Kind.COMPLETION else c["message"]["content"] for c in doc["choices"]]
    assert texts == [" b d", " a c"]
    assert [c["finish_reason"] for c in doc["choices"]] == ["length", "stop"]
    assert (doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"]) == (2, 4)
    events_ = [json.loads(e[6:]) for e in chunks.decode().split("\n\n") if e.startswith("data: {")]
    streamed: dict[int, str] = {0: "", 1: ""}
    roles = []
    for e in events_:
        for c in e["choices"]:
            if kind is Kind.COMPLETION:
                streamed[c["index"]] += c["text"]
            else:
                streamed[c["index"]] += c["delta"].get("content") or ""
                if c["delta"].get("role"):
                    roles.append(c["index"])
    assert list(streamed.values()) == texts
    assert kind is Kind.COMPLETION or roles == [1, 0]  # each choice's role chunk before its first text
    assert events_[-1]["choices"] == [] and events_[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("route", ["colocated", "remote"])
def test_every_choice_carries_its_own_logprobs_and_the_prompts_come_once(model_dir, route):
    """n = 2 with logprobs: each choice's entries are of its own tokens (in 1P+1D token 0's from the
    prefill worker's answer, one per choice), and the prompt's come once, on the first message."""

    async def main():
        ws, _, _ = workers(route)
        async with cluster(model_dir, ws, local_prefill_threshold=1) as (_, stub):
            req = request("the cat", n=2, max_tokens=4, seed=5, logprobs=1, prompt_logprobs=0)
            _, _, msgs = await collect(stub.Generate(req))
            lps: dict[int, list[int]] = {}
            for m in msgs:
                assert len(m.logprobs) == len(m.token_ids)
                lps.setdefault(m.index, []).extend(e.token_id for e in m.logprobs)
            assert lps == {i: t for i, (t, _, _) in by_choice(msgs).items()} == dict(enumerate(OUTPUTS[:2]))
            assert [bool(m.prompt_logprobs) for m in msgs].count(True) == 1 and msgs[0].prompt_logprobs

    run(main())


@pytest.mark.parametrize("route", ["colocated", "remote"])
def test_a_prompt_only_request_ends_every_choice_once(model_dir, route):
    """max_tokens 0 (the prompt alone) with n = 2: a finish per choice, the prompt's logprobs once."""

    async def main():
        ws, _, _ = workers(route)
        async with cluster(model_dir, ws, local_prefill_threshold=1) as (_, stub):
            req = request("the cat", n=2, max_tokens=0, prompt_logprobs=0)
            _, _, msgs = await collect(stub.Generate(req))
            assert [(m.index, m.finish_reason, list(m.token_ids)) for m in msgs] == [
                (0, "length", []),
                (1, "length", []),
            ]
            assert bool(msgs[0].prompt_logprobs) and not msgs[1].prompt_logprobs
            assert msgs[1].usage.completion_tokens == 0 and not msgs[0].HasField("usage")

    run(main())
