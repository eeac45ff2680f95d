"""The soak run's judgements (leaks, consistency, the request mix, counted kills) on made-up data."""

from __future__ import annotations

import random

from pdserve.bench.soak_load import Consistency, Front, Outcome, SoakRecord, WorkloadMix, make_pool, make_spec
from pdserve.bench.soak_rss import RssSeries


def test_flatness_is_judged_after_each_process_own_warmup():
    s = RssSeries("decode-5", 1, "decode", [(30.0 + t, 100 << 20) for t in range(0, 10)])
    s.samples += [(40.0 + t, 104 << 20) for t in range(0, 10)]
    f = s.flatness(warmup_s=2.0, ready_s=32.0)
    assert f["judged_from_s"] == 34.0
    assert f["baseline_mib"] == 100.0 and f["max_drift"] == 0.04
    assert RssSeries("x", 2, "router", [(0.0, 1), (1.0, 1)]).flatness(5.0)["max_drift"] is None


def test_a_fall_is_not_a_leak_but_a_climb_after_it_is():
    """The judged ``rise`` counts climbs above the lowest point before them; ``drift`` counts distance."""
    fell = RssSeries("router", 1, "router", [(float(t), (111 if t < 5 else 97) << 20) for t in range(12)])
    f = fell.flatness(warmup_s=0.0)
    assert f["max_rise"] == 0.0 and f["max_drift"] > 0.12
    climbed = RssSeries(
        "router", 1, "router", [(float(t), (100 - 10 * (t == 3) + 2 * t) << 20) for t in range(12)]
    )
    f = climbed.flatness(warmup_s=0.0)  # the dip at t=3 is one sample: smoothed away, kept raw
    # smoothed: the first point is the median of 100 and 102 (101), the last of 120 and 122 (121)
    assert f["max_rise"] == round((121 - 101) / 101, 4) and f["max_rise_raw"] == round((122 - 96) / 96, 4)
    spike = RssSeries(
        "prefill-8", 2, "prefill", [(float(t), (150 if t == 6 else 100) << 20) for t in range(12)]
    )
    f = spike.flatness(warmup_s=0.0)
    assert f["max_rise"] == 0.0 and f["max_rise_raw"] == 0.5


def test_consistency_flags_wrong_lengths_and_tokens_of_a_resent_prompt():
    def rec(rid: str, ids: list[int], key: int | None = 0) -> SoakRecord:
        r = SoakRecord(0, rid, "grpc", 5, 3, False, 0.0, outcome=Outcome.COMPLETED.value, tokens=len(ids))
        r.pool_key, r.token_ids = key, ids
        return r

    c = Consistency()
    for r in (rec("a", [1, 2, 3]), rec("b", [1, 2, 3]), rec("c", [1, 9, 3]), rec("d", [1, 2], None)):
        c.check(r)
    assert [m["request_id"] for m in c.mismatched] == ["c", "d"]
    assert "differ at 1" in c.mismatched[0]["why"]


def test_the_mix_draws_every_kind_of_request():
    mix = WorkloadMix()
    rng, pool = random.Random(0), make_pool(0, mix)
    specs = [make_spec(rng, i, mix, pool) for i in range(400)]
    assert {s.front for s in specs} == {Front.GRPC, Front.OPENAI}
    assert any(s.cancel_after for s in specs) and any(s.cancel_delay_s for s in specs)
    assert any(s.pool_key is not None for s in specs)
    assert any(len(s.prompt) >= mix.long_prompt[0] for s in specs)
    assert any(len(s.prompt) <= mix.short_prompt[1] for s in specs)
    assert {s.seed is None for s in specs} == {True, False}


def test_skipped_kills_are_not_counted_as_kills():
    """A pool with one live worker is not emptied: that kill is skipped, and the summary said "2 kills"
    for two skipped ones (exploratory testing, a soak on 1P+1D)."""
    from pdserve.bench.soak import format_summary

    requests = dict(sent=3, completed=3, lost=0, refused=0, cancelled=0, mismatched=0)
    rss = dict(warmup_s=10, flat_limit=0.1, flat=True, max_rise={}, max_rise_raw={}, max_drift={})
    kills = [
        {"t_s": 15.0, "role": "decode", "skipped": "1 live decode worker(s)"},
        {"t_s": 30.0, "role": "prefill", "worker": "prefill-2", "replacement": ["prefill-3"]},
    ]
    doc = dict(
        load_s=60.0, kills=kills, cluster={"shape": "1P+1D"}, requests=requests, migrations=0,
        kv_blocks_leaked=0, leak_check={"clean": True}, rss=rss, crashes=[], lost=[], ok=True,
    )  # fmt: skip
    text = format_summary(doc)
    assert "1 kills (1 skipped)" in text
    assert "kill at 15 s skipped: decode pool has 1 live decode worker(s)" in text
    assert "kill at 30 s: prefill-2 -> ['prefill-3']" in text
