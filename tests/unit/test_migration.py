"""Migrating a stream off a failed worker: the engine continues a request from an output offset.

The router re-submits a request whose worker died with the prompt plus every token already sent, what is
left of max_tokens / min_tokens, and ``output_offset`` = tokens sent. Greedy and seeded sampling then give
exactly the tokens an undisturbed run gives (seeded noise depends on (seed, output index) only).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.params import SamplingParams

PROMPT = [5, 9, 33, 7, 100, 41]
N = 12


def _run(engine: LLMEngine, rid, prompt, params, offset=0):
    engine.add_request(rid, prompt, params, output_offset=offset)
    toks, counts = [], []
    while engine.has_unfinished():
        for d in engine.step():
            toks.extend(d.new_token_ids)
            counts.append(d.num_output_tokens)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return toks, counts


def _first_new_token(tokens: list[int], k: int) -> tuple[int, int]:
    """(index, token): the first token of ``tokens`` at index >= k that none before it is."""
    return next((i, t) for i, t in enumerate(tokens) if i >= k and t not in tokens[:i])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N, ignore_eos=True),
        # Its stop token is set below: one the unconstrained run samples, which min_tokens must suppress.
        SamplingParams(temperature=1.0, seed=7, max_tokens=N, min_tokens=N, ignore_eos=False),
        # The earlier outputs (the prompt's tail now) still count as outputs: negative presence and
        # frequency penalties favour them again, which a continuation that missed them would not.
        SamplingParams(
            temperature=0.0,
            max_tokens=N,
            ignore_eos=True,
            presence_penalty=-1.0,
            frequency_penalty=-1.0,
            repetition_penalty=1.3,
        ),
    ],
    ids=["greedy", "seeded", "seeded-min-tokens", "greedy-penalties"],
)
@pytest.mark.parametrize("k", [1, 5, N - 1])
def test_continuing_from_an_offset_gives_the_undisturbed_tokens(tiny_llama_dir, params, k):
    eng = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32", num_blocks=64))
    if params.min_tokens:
        # The seeded run without constraints samples ``stop`` at output index i (i >= k, its first time):
        # the constrained run has the same prefix up to i, so min_tokens must suppress it there, both on
        # the first worker and on the one continuing from k (the continuation's lowered min_tokens).
        free, _ = _run(eng, "free", PROMPT, dataclasses.replace(params, min_tokens=0, ignore_eos=True))
        i, stop = _first_new_token(free, k)
        assert i < N and stop not in eng.eos_token_ids, free
        params = dataclasses.replace(params, stop_token_ids=(stop,))
        unconstrained, _ = _run(eng, "u", PROMPT, dataclasses.replace(params, min_tokens=0))
        assert unconstrained == free[: i + 1]  # without min_tokens the stop token ends it at i
    want, counts = _run(eng, "a", PROMPT, params)
    assert len(want) == N and counts == list(range(1, N + 1))
    assert not set(params.stop_token_ids) & set(want)
    rest = dataclasses.replace(params, max_tokens=N - k, min_tokens=max(0, params.min_tokens - k))
    got, counts = _run(eng, "b", PROMPT + want[:k], rest, offset=k)
    assert got == want[k:]
    assert counts == list(range(k + 1, N + 1))  # counts continue: the stream's output indices


def test_offset_past_the_prompt_is_refused(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32", num_blocks=16))
    with pytest.raises(ValueError, match="output_offset"):
        eng.add_request("x", [1, 2], SamplingParams(), output_offset=3)
    assert not eng.has_unfinished()


# ---- the router's side: retries of a prefill, moves off a dead worker, the prefill queue bound --------


def _router(**kw):
    from pdserve.router.config import RouterConfig
    from pdserve.router.registry import State, Worker
    from pdserve.router.service import Router
    from pdserve.worker.role import Role

    router = Router(RouterConfig(port=0, local_prefill_threshold=10, **kw))
    for wid, role in (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE)):
        w = Worker(wid, role, f"127.0.0.1:{wid}", kv_blocks_total=1000, block_size=16, max_running=8)
        w.state = State.READY
        router.registry.register(w, 0.0)
    return router


def test_a_prefill_retried_before_token_0_goes_to_another_prefill_worker():
    import asyncio

    from pdserve.router.jobs import Job, NoRoute

    async def go():
        router = _router()
        job = Job("r", 100)
        first = await router.admit(job, None)
        assert first.prefill is not None and first.decode.worker_id == "d1"
        again = await router.reroute(job, 100, 1.0, avoid=first.prefill.worker_id, remote=True)
        assert not isinstance(again, NoRoute) and again.prefill is not None
        assert again.prefill.worker_id != first.prefill.worker_id
        # After token 0 was sent the decode worker prefills prompt + sent tokens itself.
        late = await router.reroute(job, 101, 1.0, avoid=again.prefill.worker_id)
        assert not isinstance(late, NoRoute) and late.prefill is None
        # Off the only decode worker: the reason says no decoding worker is left, not "no room".
        why = await router.reroute(job, 101, 1.0, avoid="d1")
        assert why == NoRoute(
            "no other decode or colocated worker is left to take the request over", "none_left"
        )
        await router.finish(job)
        assert router.ledger.assigned("d1") == 0 and router.ledger.prefill_tokens("p1") == 0

    asyncio.run(go())


def test_a_worker_seen_dead_fails_the_jobs_that_still_need_it():
    import asyncio

    from pdserve.router.jobs import Job

    class Call:
        cancelled = False

        def cancel(self) -> bool:
            self.cancelled = True
            return True

    async def go():
        router = _router()
        waiting, streaming = Job("a", 100), Job("b", 100)
        for job in (waiting, streaming):
            await router.admit(job, None)
            job.calls.append(Call())
        p = waiting.route.prefill
        streaming.route = waiting.route
        streaming.prefill_pending = False  # its KV all landed: losing the prefill worker costs it nothing
        router.worker_failed(p, True, "UNAVAILABLE")
        assert waiting.failure is not None and waiting.failure.reason == "prefill_failed"
        assert waiting.calls[0].cancelled
        assert streaming.failure is None and not streaming.calls[0].cancelled
        assert router.registry.get(p.worker_id) is None

    asyncio.run(go())


def test_the_last_serving_workers_death_promotes_a_standby_of_its_pool():
    """With warm standby workers (``--warm``), the death of a pool's last serving worker promotes one at
    once: its requests move there rather than failing until the autoscaler's next tick. A pool that still
    has a serving worker keeps its standby; a pool with none keeps failing over as before."""
    import asyncio

    from pdserve.router.jobs import Job, NoRoute
    from pdserve.router.registry import State, Worker
    from pdserve.worker.role import Role

    async def go():
        router = _router()
        for wid, role in (("d2", Role.DECODE), ("p3", Role.PREFILL)):
            w = Worker(wid, role, f"127.0.0.1:{wid}", kv_blocks_total=1000, block_size=16, max_running=8)
            w.state, w.standby = State.READY, True
            router.registry.register(w, 0.0)
        assert {w.worker_id: w.state for w in router.registry}["d2"] is State.STANDBY
        job = Job("a", 100)
        first = await router.admit(job, None)
        assert first.decode.worker_id == "d1"
        assert first.prefill is not None
        other = "p2" if first.prefill.worker_id == "p1" else "p1"
        router.worker_failed(router.registry.get(other), True, "UNAVAILABLE")  # one prefill still serves
        assert router.registry.get("p3").state is State.STANDBY
        router.worker_failed(first.decode, True, "UNAVAILABLE")
        d2 = router.registry.get("d2")
        assert d2.state is State.READY and not d2.standby
        assert job.failure is not None and job.failure.reason == "decode_failed"
        moved = await router.reroute(job, 100, 1.0, avoid="d1")
        assert not isinstance(moved, NoRoute) and moved.decode.worker_id == "d2"
        await router.finish(job)
        # Missed heartbeats: the sweep promotes too (the last prefill worker last heard of at 0.0).
        load = dict(running=0, queued=0, queued_prefill_tokens=0, kv_blocks_used=0)
        router.registry.heartbeat("p3", 5.0, state=State.READY, **load)
        router.registry.heartbeat("d2", 5.0, state=State.READY, **load)
        assert [w.worker_id for w in await router.membership.sweep(6.0)] == [first.prefill.worker_id]
        assert router.registry.get("p3").state is State.READY

    asyncio.run(go())


def test_the_prefill_queue_bound_refuses_at_once():
    import asyncio

    import grpc

    from pdserve.router.jobs import Job
    from pdserve.router.relay import RelayError

    async def go():
        router = _router(max_prefill_queue_tokens=1000)
        jobs = [Job(f"j{i}", 400) for i in range(5)]
        for job in jobs[:4]:
            await router.admit(job, None)  # 800 queued on each prefill worker: within the bound
        with pytest.raises(RelayError) as e:
            await router.admit(jobs[4], None)  # 1,200 on the least loaded one: refused
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "prefill queue" in e.value.details
        assert router.admission.waiting == 0
        # A prompt alone on an idle prefill worker is always taken, however long.
        big = _router(max_prefill_queue_tokens=100)
        assert (await big.admit(Job("big", 500), None)).prefill is not None

    asyncio.run(go())


# -- live moves: a decoding stream and its KV move to another engine ----------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=N, ignore_eos=True, presence_penalty=-1.0, repetition_penalty=1.3
        ),
    ],
    ids=["greedy", "seeded", "greedy-penalties"],
)
@pytest.mark.parametrize(("k", "cached"), [(1, False), (6, True)], ids=["k1-cold", "k6-prefix-cached"])
def test_a_suspended_stream_moved_with_its_kv_gives_the_undisturbed_tokens(tiny_llama_dir, params, k, cached):
    """Suspend after ``k`` tokens, copy the blocks' K/V into another engine (what the export's transfer
    does), adopt it there (``add_migrated_request``): the rest equals the undisturbed run's, with output
    counts going on from ``k``, and the destination prefills nothing (its steps only decode). With
    ``cached`` the destination already caches the prompt's first block (its prefix cache): the move
    reuses it, as a reservation with a cached prefix does."""
    cfg = EngineConfig(dtype="float32", num_blocks=64, block_size=4)
    src, dst = LLMEngine(tiny_llama_dir, None, cfg), LLMEngine(tiny_llama_dir, None, cfg)
    prompt = PROMPT * 2  # 12 tokens: three full blocks
    want, _ = _run(src, "ref", prompt, params)
    if cached:
        _run(dst, "warm", prompt[:5], dataclasses.replace(params, max_tokens=1))
    src.add_request("s", prompt, params)
    got: list[int] = []
    while len(got) < k:
        for d in src.step():
            got += d.new_token_ids
    outputs, kv_tokens = src.suspend("s")
    assert outputs == got == want[:k] and kv_tokens == len(prompt) + k - 1
    assert src.step() == []  # suspended: nothing runs
    src_blocks, last = src.pin("s")
    assert last == got[-1]
    tokens = prompt + outputs
    bm = dst.block_manager
    from pdserve.engine.prefix_hash import block_hashes

    hashes = block_hashes(tokens[:kv_tokens], bm.block_size, dst.cache_salt)
    reused = bm.allocate_prefixed("s", kv_tokens, hashes[: (kv_tokens - 1) // bm.block_size])
    assert reused == (1 if cached else 0)
    dst_blocks = bm.block_table("s")
    dst.runner.kv[:, dst_blocks[reused:]] = src.runner.kv[:, src_blocks[reused:]]
    src.abort("s")  # the stream ends on the source (its relay's call cancelled) while still pinned
    assert "s" in src.block_manager  # ... its blocks stay until unpinned
    src.unpin("s")
    assert "s" not in src.block_manager
    rest = dataclasses.replace(params, max_tokens=N - k)
    dst.add_migrated_request("s", tokens, k, rest)
    counts = []
    while dst.has_unfinished():
        for d in dst.step():
            assert dst.last_batch is not None and dst.last_batch.kind.value == "decode"
            got += d.new_token_ids
            counts.append(d.num_output_tokens)
    assert got == want
    assert counts == list(range(k + 1, N + 1))
    for e in (src, dst):
        assert e.block_manager.num_used == 0


def test_suspend_refuses_what_is_not_decoding_and_resume_continues(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, None, EngineConfig(dtype="float32", num_blocks=32))
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    want, _ = _run(eng, "ref", PROMPT, params)
    with pytest.raises(ValueError, match="not decoding here"):
        eng.suspend("nobody")
    eng.add_request("w", PROMPT, params)
    with pytest.raises(ValueError, match="not decoding here"):
        eng.suspend("w")  # waiting: not prefilled yet
    got = list(eng.step()[0].new_token_ids)
    eng.suspend("w")
    assert eng.step() == [] and eng.resume("w") and not eng.resume("w")
    while eng.has_unfinished():
        for d in eng.step():
            got += d.new_token_ids
    assert got == want and eng.block_manager.num_used == 0
    eng.add_request("n", PROMPT, dataclasses.replace(params, n=2))
    eng.step()
    with pytest.raises(ValueError, match="several choices"):
        eng.suspend("n")
    eng.abort("n")
    assert eng.block_manager.num_used == 0
