"""The router's KV index (fed by worker events alone), the worker's event publisher, and routing that
scores both legs by cached prefix against load. Pure logic, no processes."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.prefix_hash import block_hashes
from pdserve.proto import worker_pb2
from pdserve.router.kv_index import KvIndex, PromptProbe
from pdserve.router.policy import RouteReason, RoutingConfig, RoutingPolicy, choose_route
from pdserve.router.registry import Worker
from pdserve.worker.kv_events import KvEventPublisher
from pdserve.worker.role import Role

BS = 4
SALT = "test-salt"


def mk(wid: str, role: Role, *, total: int = 400, used: int = 0, assigned: int = 0) -> Worker:
    w = Worker(wid, role, f"127.0.0.1:{wid}", total, BS, 64, prefix_cache_salt=SALT)
    w.kv_blocks_used, w.assigned = used, assigned
    return w


def run_on(bm: BlockManager, seq_id: str, tokens: list[int]) -> None:
    """A request that computed ``tokens`` and finished: its full blocks stay cached."""
    hashes = block_hashes(tokens, BS, SALT)
    bm.allocate_prefixed(seq_id, len(tokens), hashes)
    bm.commit(seq_id, hashes)
    bm.free(seq_id)


def beat(pub: KvEventPublisher, index: KvIndex, wid: str) -> bool:
    """One heartbeat: the batch goes to the index, the answer back to the publisher."""
    batch = pub.batch()
    ok = index.apply(wid, batch)
    pub.answered(worker_pb2.HeartbeatResponse(known=True, kv_snapshot=not ok))
    return ok


def test_the_index_follows_a_workers_cache_through_its_events_alone():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    pub, index = KvEventPublisher(bm), KvIndex()
    prompt = list(range(100, 124))  # 6 full blocks
    probe = PromptProbe(index, prompt + [7])
    w = mk("d1", Role.DECODE)
    assert beat(pub, index, "d1") and probe.cached_tokens(w) == 0
    run_on(bm, "a", prompt)
    assert probe.cached_tokens(w) == 0  # nothing known before the next batch
    assert beat(pub, index, "d1")
    assert probe.cached_tokens(w) == 6 * BS
    # Another prompt needs the room: the cache evicts (least recently used first, a tail before its head)
    # and the worker's score for the first prefix drops after the next batch.
    run_on(bm, "b", list(range(500, 520)))
    assert probe.cached_tokens(w) == 6 * BS
    assert beat(pub, index, "d1")
    assert probe.cached_tokens(w) < 6 * BS
    held = bm.cached_prefix_blocks(block_hashes(prompt, BS, SALT))
    assert probe.cached_tokens(w) == held * BS


def test_a_gap_drops_the_worker_until_a_snapshot_and_a_resend_is_harmless():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    pub, index = KvEventPublisher(bm), KvIndex()
    prompt = list(range(100, 117))
    probe = PromptProbe(index, prompt)
    w = mk("p1", Role.PREFILL)
    run_on(bm, "a", prompt)
    assert beat(pub, index, "p1") and probe.cached_tokens(w) == 16
    # A batch the router took but whose answer was lost is sent again, with more folded in.
    run_on(bm, "b", list(range(300, 312)))
    first = pub.batch()
    assert index.apply("p1", first)
    again = pub.batch()
    assert again.seq == first.seq and index.apply("p1", again)
    pub.answered(worker_pb2.HeartbeatResponse(known=True))
    # A router that restarted sees a batch from the middle of an epoch: it asks for a snapshot.
    fresh = KvIndex()
    assert not beat(pub, fresh, "p1")
    assert PromptProbe(fresh, prompt).cached_tokens(w) == 0 and fresh.gaps == 1
    snap = pub.batch()
    assert snap.snapshot and fresh.apply("p1", snap)
    assert PromptProbe(fresh, prompt).cached_tokens(w) == 16
    # A skipped batch number is a gap too.
    skipped = worker_pb2.KvEvents(epoch=pub.epoch, seq=snap.seq + 5)
    assert not fresh.apply("p1", skipped)
    assert PromptProbe(fresh, prompt).cached_tokens(w) == 0
    fresh.drop("p1")
    assert len(fresh) == 0


def test_an_overflowed_event_queue_turns_into_a_snapshot():
    bm = BlockManager(64, BS, enable_prefix_caching=True, max_events=3)
    pub, index = KvEventPublisher(bm), KvIndex()
    assert beat(pub, index, "d1")
    prompt = list(range(1000, 1040))  # 10 blocks: more events than the queue keeps
    run_on(bm, "a", prompt)
    batch = pub.batch()
    assert batch.snapshot and len(batch.stored) == 10
    assert index.apply("d1", batch)
    assert PromptProbe(index, prompt + [1]).cached_tokens(mk("d1", Role.DECODE)) == 40


class Held:
    """A probe with fixed answers."""

    def __init__(self, **tokens: int) -> None:
        self.tokens = tokens

    def cached_tokens(self, worker: Worker) -> int:
        return self.tokens.get(worker.worker_id, 0)


CFG = RoutingConfig(local_prefill_threshold=64)


def test_decode_leg_goes_where_the_prefix_is_unless_the_guard_says_it_is_too_busy():
    d1, d2 = mk("d1", Role.DECODE, assigned=2), mk("d2", Role.DECODE, assigned=1)
    p = mk("p1", Role.PREFILL)
    r = choose_route([d1, d2, p], 800, CFG, probe=Held(d1=768))
    assert r is not None and r.decode is d1 and r.decode_cached_tokens == 768
    # 32 uncached tokens: below the threshold, so d1 prefills the suffix itself.
    assert r.prefill is None and r.reason is RouteReason.CACHED_PREFIX
    # Two more requests than the other still keep it where the prefix is.
    d1.assigned = 3
    r = choose_route([d1, d2, p], 800, CFG, probe=Held(d1=768))
    assert r is not None and r.decode is d1
    # Past the guard (more than 1.25x the least assigned, plus two), the less busy worker takes it.
    d1.assigned = 4
    r = choose_route([d1, d2, p], 800, CFG, probe=Held(d1=768))
    assert r is not None and r.decode is d2 and r.prefill is p and r.reason is RouteReason.REMOTE
    # The load-only policy gives no prefix credit.
    d1.assigned = 2
    load = RoutingConfig(local_prefill_threshold=64, policy=RoutingPolicy.LOAD)
    r = choose_route([d1, d2, p], 800, load, probe=Held(d1=768))
    assert r is not None and r.decode is d2 and r.decode_cached_tokens == 0


def test_prefill_leg_weighs_its_cached_prefix_against_its_queue():
    d = mk("d1", Role.DECODE)
    p1, p2 = mk("p1", Role.PREFILL), mk("p2", Role.PREFILL)
    p1.queued_prefill_tokens = 300
    r = choose_route([d, p1, p2], 1000, CFG, probe=Held(p1=768))
    assert r is not None and r.prefill is p1 and r.prefill_cached_tokens == 768  # 532 to compute vs 1000
    p1.queued_prefill_tokens = 900
    r = choose_route([d, p1, p2], 1000, CFG, probe=Held(p1=768))
    assert r is not None and r.prefill is p2
    # A decode worker's hit shortens the suffix but a long one still goes to a prefill worker.
    r = choose_route([d, p1, p2], 1000, CFG, probe=Held(d1=512))
    assert r is not None and r.prefill is not None and r.decode_cached_tokens == 512


def test_no_probe_routes_as_before():
    d1, d2 = mk("d1", Role.DECODE, assigned=1), mk("d2", Role.DECODE, assigned=0)
    r = choose_route([d1, d2], 10, CFG)
    assert r is not None and r.decode is d2 and r.reason is RouteReason.SHORT_PROMPT
    both = mk("c1", Role.BOTH)
    r = choose_route([both], 1000, CFG, probe=Held(c1=512))
    assert r is not None and r.reason is RouteReason.COLOCATED and r.decode_cached_tokens == 512
