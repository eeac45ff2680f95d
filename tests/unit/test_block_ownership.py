"""The block-ownership and threading contract (``kv_transfer/__init__.py``), checked as a property.

A decode worker's KV receiver reserves and frees blocks on the event loop thread while the decode engine
allocates, grows, preempts and frees on its own thread, in one ``BlockManager``. Here both run at once
under random interleavings of: local requests (the engine prefills and decodes them), reservations
through a real ``KVReceiver`` (in-process transport), receiver aborts, and hand-overs (blocks allocated as
the receiver does, then adopted by the engine as after a completed transfer). Throughout: no block is
held twice or both held and free (``check_invariants`` under the manager's lock), and a live
reservation's blocks are exactly its ticket's (the engine never touched them). At the end every block is
back (the leak check).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.decode_pool.engine_loop import EngineLoop
from pdserve.engine.block_manager import OutOfBlocksError
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.kv_transfer import KVReceiver, TransferConfig, compat_for

BLOCK, BLOCKS = 4, 40  # 160 token slots: small enough that the engine preempts and runs out
CONFIG = TransferConfig(backend="inproc", deadline_s=30.0, settle_timeout_s=0.2)

OPS = st.lists(
    st.tuples(st.sampled_from(["local", "reserve", "abort", "adopt", "yield"]), st.integers(1, 48)),
    min_size=4,
    max_size=40,
)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(
        tiny_llama_dir, None, EngineConfig(block_size=BLOCK, num_blocks=BLOCKS, threads=1, dtype="float32")
    )


async def _drain(q: asyncio.Queue) -> None:
    while True:
        item = await q.get()
        if item is None or isinstance(item, BaseException):
            return


async def _scenario(engine: LLMEngine, ops: list[tuple[str, int]], seed: int) -> None:
    rng = random.Random(seed)
    bm = engine.block_manager
    loop = EngineLoop(engine, asyncio.get_running_loop(), idle_wait_s=0.001)
    loop.start()
    receiver = KVReceiver(engine.runner.kv, bm, compat_for(engine.runner.kv, "tiny"), CONFIG)
    await receiver.start()
    reserved: dict[str, tuple[int, ...]] = {}  # live reservations: id -> the ticket's blocks
    streams: list[asyncio.Task] = []
    checking = True

    async def check_while_running() -> None:
        while checking:
            bm.check_invariants()
            for rid, blocks in reserved.items():
                assert tuple(bm.block_table(rid)) == blocks, f"{rid}'s reserved blocks changed hands"
            await asyncio.sleep(0.002)

    checker = asyncio.create_task(check_while_running())
    try:
        for i, (op, n) in enumerate(ops):
            rid = f"{op}-{i}"
            prompt = [rng.randrange(3, 500) for _ in range(n)]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
            if op == "local":
                streams.append(asyncio.create_task(_drain(loop.submit(rid, prompt, params))))
            elif op == "reserve":
                try:
                    ticket = receiver.reserve(rid, n)
                except OutOfBlocksError:
                    continue  # no room yet: nothing was reserved
                reserved[rid] = ticket.block_ids
            elif op == "abort" and reserved:
                victim = rng.choice(sorted(reserved))
                del reserved[victim]
                assert receiver.abort(victim, "test")
            elif op == "adopt":
                # What RemotePrefill does once a transfer completed: the engine takes the blocks over.
                try:
                    bm.allocate(rid, n)
                except OutOfBlocksError:
                    continue
                q = loop.submit_prefilled(rid, prompt, rng.randrange(3, 500), params)
                streams.append(asyncio.create_task(_drain(q)))
            await asyncio.sleep(0 if op != "yield" else 0.002)
        # Reservations go first: the engine may be waiting for their blocks ("no room yet"), as a real
        # one waits until its transfers complete or fail.
        for rid in list(reserved):
            del reserved[rid]
            receiver.abort(rid, "test over")
        async with asyncio.timeout(60):
            await asyncio.gather(*streams)
        async with asyncio.timeout(10):
            while bm.num_free != bm.num_blocks:  # aborted reservations free once settled
                await asyncio.sleep(0.005)
    finally:
        checking = False
        await checker
        await receiver.close()
        await loop.stop()
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks, f"{bm.num_used} KV blocks leaked"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_reserve_and_free_on_the_loop_while_the_engine_steps(engine, ops, seed):
    asyncio.run(_scenario(engine, ops, seed))


def test_the_contract_is_written_once():
    """The contract has one home; the modules that rely on it point there instead of restating it."""
    import pdserve.kv_transfer as kt

    assert "THE block-ownership and threading contract" in (kt.__doc__ or "")
    import pdserve.decode_pool.engine_loop as el
    import pdserve.decode_pool.remote as rp
    import pdserve.engine.block_manager as bmod

    for mod in (el, rp, bmod):
        doc = mod.__doc__ or ""
        assert "kv_transfer/__init__.py" in doc, f"{mod.__name__} does not point to the contract"
        assert "on the engine thread, between" not in doc, f"{mod.__name__} restates the old, wrong rule"
