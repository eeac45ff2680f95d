"""A tensor-parallel worker's plumbing, in process: the flag's checks, what `up` starts for each pool, and
what `pdserve status` shows. The group itself runs in tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.cli import client, serve_cmds
from pdserve.cli import main as cli
from pdserve.decode_pool.app import engine_config
from pdserve.deploy.local.cluster.control import worker_argv
from pdserve.deploy.local.cluster.state import ProcessEntry
from pdserve.proto import worker_pb2
from pdserve.worker.args import WorkerArgs
from pdserve.worker.role import Role
from tests.e2e.cluster_harness import fake_state


def _args(role: Role, **kw) -> WorkerArgs:
    return WorkerArgs(role=role, router="r:1", worker_id="w", **kw)


def test_the_flag_splits_a_cpu_worker_of_any_role():
    assert engine_config(_args(Role.BOTH, tensor_parallel_size=2)).tensor_parallel_size == 2
    assert engine_config(_args(Role.DECODE, tensor_parallel_size=3)).tensor_parallel_size == 3
    assert engine_config(_args(Role.DECODE)).tensor_parallel_size == 1
    assert _args(Role.PREFILL, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 and --kv-shared-memory"):
        _args(Role.DECODE, tensor_parallel_size=2, kv_shared_memory=True)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 runs on CPUs only in a worker"):
        _args(Role.BOTH, tensor_parallel_size=2, device="cuda:0")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size must be >= 1"):
        _args(Role.BOTH, tensor_parallel_size=0)
    a = cli.build_parser().parse_args(
        ["worker", "--role", "both", "--router", "r:1", "--tensor-parallel-size", "3"]
    )
    w = serve_cmds.worker_args(a, "h", 1, cpus=2)
    assert w.tensor_parallel_size == 3
    info = w.worker_info("h:1", kv_blocks_total=1, context_length=8, pid=1, dtype="float32", device="cpu")
    assert info.tensor_parallel_size == 3


def test_up_starts_each_pools_workers_as_groups_of_its_size():
    parsed = cli.build_parser().parse_args(
        ["up", "--colocated", "1", "--colocated-tp", "2", "--prefill-tp", "3"]
    )
    assert (parsed.colocated_tp, parsed.prefill_tp, parsed.decode_tp) == (2, 3, 1)
    router = ProcessEntry(id="router", pid=1, start=1, log="r.log")
    state = msgspec.structs.replace(fake_state(router), colocated_tp=2, prefill_tp=3)
    place = {"device": "cpu", "gpu_memory_utilization": 0.9, "threads": 1, "cpus": (), "standby": False}
    both = worker_argv(state, Role.BOTH, "both-1", **place)
    prefill = worker_argv(state, Role.PREFILL, "prefill-1", **place)
    decode = worker_argv(state, Role.DECODE, "decode-2", **place)
    assert both[both.index("--tensor-parallel-size") + 1] == "2"
    assert prefill[prefill.index("--tensor-parallel-size") + 1] == "3"
    assert "--tensor-parallel-size" not in decode


def test_status_shows_a_groups_size():
    status = worker_pb2.ClusterStatus(router_address="127.0.0.1:1")
    for wid, tp, pids in (("both-1", 2, [10, 11]), ("both-2", 0, [])):
        e = status.workers.add()
        e.info.worker_id, e.info.role, e.info.device = wid, worker_pb2.ROLE_BOTH, "cpu"
        e.info.tensor_parallel_size, e.info.pid = tp, 20
        e.info.rank_pids.extend(pids)
        e.load.state = worker_pb2.WORKER_STATE_READY
    doc = client.status_dict(status, now_unix=0.0)
    assert [w["tensor_parallel_size"] for w in doc["workers"]] == [2, 1]
    assert [w["rank_pids"] for w in doc["workers"]] == [[10, 11], [20]]
    table = client.status_table(doc).splitlines()
    assert "cpu x2" in next(ln for ln in table if ln.startswith("both-1"))
    assert "x" not in next(ln for ln in table if ln.startswith("both-2")).split()[3]
