"""The integration tests' harness itself: its leak check fails where there is something to find, or
nothing to check, and its stop reaches what a failed ``up`` left behind. No cluster runs here: the
router's status is stubbed, and the "workers" are ``sleep`` processes started as ``up`` starts them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.deploy.local import cluster
from pdserve.worker.role import Role
from tests.cluster_harness import Cluster, fake_state, stop_cluster


def _sleeper(state_dir: Path, wid: str) -> cluster.ProcessEntry:
    return cluster.spawn(
        wid, ["sleep", "60"], state_dir / "logs" / f"{wid}.log", dict(os.environ), Role.DECODE
    )


def _save(state_dir: Path, workers: tuple[cluster.ProcessEntry, ...]) -> None:
    cluster.save_state(
        state_dir, fake_state(cluster.ProcessEntry(id="router", pid=1, start=-1, log=""), workers)
    )


def _doc(workers: dict[str, dict[str, int]], running: int = 0, waiting: int = 0) -> dict:
    return {
        "router": {"requests_running": running, "requests_waiting": waiting},
        "workers": [{"id": wid, "kv_blocks_used": 0, "running": 0, **w} for wid, w in workers.items()],
    }


@pytest.fixture
def decode_1(tmp_path) -> Iterator[cluster.ProcessEntry]:
    p = _sleeper(tmp_path, "decode-1")
    try:
        yield p
    finally:
        cluster.stop_processes([p], term_timeout_s=1)


def _cluster(tmp_path: Path, monkeypatch, doc: dict) -> Cluster:
    c = Cluster(tmp_path, "127.0.0.1:1")
    monkeypatch.setattr(c, "status", lambda: doc)
    return c


def test_the_leak_check_passes_a_clean_cluster(tmp_path, monkeypatch, decode_1):
    _save(tmp_path, (decode_1,))
    _cluster(tmp_path, monkeypatch, _doc({"decode-1": {}})).assert_no_leaks(timeout_s=0.1)


def test_the_leak_check_fails_with_no_worker_to_check(tmp_path, monkeypatch):
    _save(tmp_path, ())
    with pytest.raises(AssertionError, match="no live worker"):
        _cluster(tmp_path, monkeypatch, _doc({})).assert_no_leaks(timeout_s=0.1)


@pytest.mark.parametrize("running, waiting", [(1, 0), (0, 2)])
def test_the_leak_check_fails_on_requests_the_router_still_holds(
    tmp_path, monkeypatch, decode_1, running, waiting
):
    _save(tmp_path, (decode_1,))
    c = _cluster(tmp_path, monkeypatch, _doc({"decode-1": {}}, running=running, waiting=waiting))
    with pytest.raises(AssertionError, match="router"):
        c.assert_no_leaks(timeout_s=0.1)


def test_the_leak_check_fails_on_blocks_or_requests_a_worker_holds(tmp_path, monkeypatch, decode_1):
    _save(tmp_path, (decode_1,))
    for load in ({"kv_blocks_used": 3}, {"running": 1}):
        with pytest.raises(AssertionError, match="leaks"):
            _cluster(tmp_path, monkeypatch, _doc({"decode-1": load})).assert_no_leaks(timeout_s=0.1)


def test_the_leak_check_fails_on_a_live_worker_the_router_does_not_list(tmp_path, monkeypatch, decode_1):
    _save(tmp_path, (decode_1,))
    with pytest.raises(AssertionError, match=r"missing from the router \['decode-1'\]"):
        _cluster(tmp_path, monkeypatch, _doc({"prefill-2": {}})).assert_no_leaks(timeout_s=0.1)


def test_the_leak_check_fails_on_a_named_worker_that_is_gone(tmp_path, monkeypatch, decode_1):
    gone = _sleeper(tmp_path, "prefill-2")
    cluster.stop_processes([gone], term_timeout_s=1)
    _save(tmp_path, (decode_1, gone))
    c = _cluster(tmp_path, monkeypatch, _doc({"decode-1": {}, "prefill-2": {}}))
    c.assert_no_leaks(timeout_s=0.1)  # unnamed: the live workers are expected
    with pytest.raises(AssertionError, match=r"not running .*\['prefill-2'\]"):
        c.assert_no_leaks(timeout_s=0.1, workers=["decode-1", "prefill-2"])
    with pytest.raises(AssertionError, match="no live worker"):
        c.assert_no_leaks(timeout_s=0.1, workers=[])


def test_stop_cluster_stops_what_a_failed_up_left_without_a_state_file(tmp_path):
    left = _sleeper(tmp_path, "decode-1")
    try:
        assert cluster.load_state(tmp_path) is None
        stop_cluster(tmp_path)
        assert not cluster.alive(left)
    finally:
        cluster.stop_processes([left], term_timeout_s=1)
