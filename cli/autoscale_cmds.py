"""Autoscaling from the command line: the policy's flags (``up --autoscale``, ``pdserve autoscale``), the
background autoscaler process ``up`` starts, the foreground one, and its part of ``pdserve status``."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pdserve.cli.common import say
from pdserve.deploy.local import autoscaler as autoscaler_mod
from pdserve.deploy.local import cluster
from pdserve.router.autoscale import AutoscaleConfig, PoolBounds
from pdserve.worker.role import Role

# (flag, AutoscaleConfig field, type, help) of every policy threshold `up --autoscale` and `autoscale` take.
_POLICY_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--autoscale-interval", "interval_s", float, "seconds between decisions"),
    ("--scale-up-after", "up_after", int, "ticks of high load in a row before a scale-up"),
    ("--scale-down-after", "down_after", int, "ticks of low load in a row before a scale-down"),
    ("--scale-up-cooldown", "up_cooldown_s", float, "seconds after a pool changed before it may grow"),
    ("--scale-down-cooldown", "down_cooldown_s", float, "seconds after a pool changed before it may shrink"),
    ("--prefill-tokens-high", "prefill_tokens_high", int, "queued prefill tokens per prefill worker: grow"),
    (
        "--prefill-tokens-low",
        "prefill_tokens_low",
        int,
        "... at most this many (with one worker less): shrink",
    ),
    (
        "--ttft-slo",
        "ttft_slo_s",
        float,
        "TTFT objective in seconds (prefill grows over it while work queues)",
    ),
    ("--kv-usage-high", "kv_usage_high", float, "decode KV-cache usage (0-1): grow"),
    ("--kv-usage-low", "kv_usage_low", float, "... at most this (with one worker less): shrink"),
    ("--running-high", "running_high", float, "decode (running + queued) / max running (0-1): grow"),
    ("--running-low", "running_low", float, "... at most this (with one worker less): shrink"),
    ("--itl-slo", "itl_slo_s", float, "ITL objective in seconds (decode grows over it)"),
)


def autoscale_arguments(p: argparse.ArgumentParser, on_up: bool) -> None:
    """The autoscaler's bounds and thresholds (defaults: ``AutoscaleConfig``)."""
    if on_up:
        p.add_argument(
            "--autoscale",
            action="store_true",
            help="size the prefill and decode pools from their load and SLOs (a background autoscaler; "
            "`pdserve status` shows its decisions); --prefill/--decode are the starting sizes",
        )
    g = p.add_argument_group("autoscaling")
    for pool in ("prefill", "decode"):
        extra = "; 0 only beside colocated workers" if pool == "decode" else ""
        g.add_argument(f"--{pool}-min", type=int, default=1, help=f"fewest {pool} workers (default 1{extra})")
        g.add_argument(
            f"--{pool}-max", type=int, default=None, help=f"most {pool} workers (default: min + 1)"
        )
        g.add_argument(
            f"--warm-{pool}",
            type=int,
            default=None,
            help=f"standby {pool} workers kept loaded, not routed to; a scale-up promotes one at once "
            "(default: --warm)",
        )
    g.add_argument("--warm", type=int, default=0, help="standby workers per pool (default 0)")
    d = AutoscaleConfig()
    for flag, name, kind, text in _POLICY_FLAGS:
        g.add_argument(
            flag, dest=name, type=kind, default=getattr(d, name), help=f"{text} (default %(default)s)"
        )
    g.add_argument(
        "--autoscale-drain-timeout",
        type=float,
        default=300.0,
        help="seconds a worker scaled down may take to drain before it is stopped by signal",
    )


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The policy of the flags, checked (ClusterError naming the problem)."""

    def bounds(pool: str) -> PoolBounds:
        lo = getattr(args, f"{pool}_min")
        hi = getattr(args, f"{pool}_max")
        warm = getattr(args, f"warm_{pool}")
        try:
            return PoolBounds(lo, lo + 1 if hi is None else hi, args.warm if warm is None else warm)
        except ValueError as e:
            raise ValueError(f"--{pool}-min, --{pool}-max, --warm-{pool}: {e}") from None

    try:
        return AutoscaleConfig(
            prefill=bounds("prefill"),
            decode=bounds("decode"),
            **{name: getattr(args, name) for _, name, _, _ in _POLICY_FLAGS},
        )
    except ValueError as e:
        said = str(e)  # the policy's field names, as the flags that set them
        for flag, name, _, _ in _POLICY_FLAGS:
            said = re.sub(rf"\b{name}\b", flag, said)
        raise cluster.ClusterError(f"autoscaling: {said}") from None


def check_decode_floor(policy: AutoscaleConfig, colocated: int) -> None:
    """``--decode-min 0`` only beside colocated workers: with none, the autoscaler could take the decode
    pool to zero, and then nothing it watches (requests are refused at once, none wait) grows it back."""
    if policy.decode.min == 0 and colocated == 0:
        raise cluster.ClusterError(
            "autoscaling: --decode-min 0 needs colocated workers (--colocated N): a cluster needs at "
            "least one decode or colocated worker"
        )


def _autoscale_flags(args: argparse.Namespace) -> list[str]:
    """`up`'s autoscaling flags, handed on to the `pdserve autoscale` process it starts."""
    flags = []
    for pool in ("prefill", "decode"):
        for name in (f"{pool}_min", f"{pool}_max", f"warm_{pool}"):
            if getattr(args, name) is not None:
                flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags += ["--warm", str(args.warm), "--autoscale-drain-timeout", str(args.autoscale_drain_timeout)]
    for flag, name, _, _ in _POLICY_FLAGS:
        flags += [flag, str(getattr(args, name))]
    return flags


def start_autoscaler(
    state_dir: Path, state: cluster.ClusterState, args: argparse.Namespace
) -> cluster.ClusterState:
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "autoscale",
        "--state-dir",
        str(state_dir),
        *_autoscale_flags(args),
    ]
    proc = cluster.spawn("autoscaler", argv, state_dir / "logs" / "autoscaler.log", cluster.child_env(1))
    say(f"autoscaler (pid {proc.pid}): logs in {proc.log}")
    return msgspec.structs.replace(state, autoscaler=proc)


def cmd_autoscale(args: argparse.Namespace) -> int:
    """Run the autoscaler in the foreground until SIGTERM/SIGINT (``up --autoscale`` starts it in the
    background)."""
    import logging

    state = cluster.load_state(args.state_dir)
    if state is None:
        raise cluster.ClusterError(f"no cluster in {args.state_dir}")
    other = state.autoscaler
    if other is not None and other.pid != os.getpid() and cluster.alive(other):
        raise cluster.ClusterError(f"an autoscaler already runs for this cluster (pid {other.pid})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    policy = autoscale_config(args)
    check_decode_floor(policy, sum(w.role is Role.BOTH and cluster.alive(w) for w in state.workers))
    config = autoscaler_mod.DriverConfig(args.state_dir, policy, args.autoscale_drain_timeout)
    me = None
    if other is None or other.pid != os.getpid():
        # Run by hand (`up --autoscale` lists its own): into the state file like the background one, so
        # `scale` refuses while it owns the pools, `status` shows it and `down` stops it first.
        stat = cluster.proc_stat(os.getpid())
        assert stat is not None
        me = cluster.ProcessEntry(id="autoscaler", pid=os.getpid(), start=stat[1], log="")
        with cluster.state_lock(args.state_dir, wait_s=30.0):
            state = cluster.load_state(args.state_dir) or state
            other = state.autoscaler  # again, held: two started at once would both run
            if other is not None and other.pid != os.getpid() and cluster.alive(other):
                raise cluster.ClusterError(f"an autoscaler already runs for this cluster (pid {other.pid})")
            cluster.save_state(args.state_dir, msgspec.structs.replace(state, autoscaler=me))
    try:
        return autoscaler_mod.run(config, state.host, args.metrics_port)
    finally:
        # Not waiting: a `down` holding the state dir stops this process and removes the file itself.
        with contextlib.suppress(cluster.StateBusy), cluster.state_lock(args.state_dir):
            now = cluster.load_state(args.state_dir) if me is not None else None
            if now is not None and now.autoscaler == me:  # (gone after `down`)
                cluster.save_state(args.state_dir, msgspec.structs.replace(now, autoscaler=None))


def autoscaler_status(state: cluster.ClusterState, state_dir: Path) -> dict[str, Any] | None:
    """The autoscaler's part of `pdserve status --json` (None when it does not run)."""
    if state.autoscaler is None or not cluster.alive(state.autoscaler):
        return None
    doc = autoscaler_mod.load_status(state_dir)
    if doc is None:
        return {"pid": state.autoscaler.pid, "pools": {}, "decisions": []}
    return msgspec.to_builtins(doc)


def autoscaler_table(doc: dict[str, Any]) -> str:
    lines = [
        f"autoscaler (pid {doc['pid']})"
        + (f"; metrics {doc['metrics_url']}" if doc.get("metrics_url") else "")
    ]
    for pool, p in doc["pools"].items():
        draining = ", ".join(p["draining"]) or "-"
        lines.append(
            f"  {pool}: {p['serving']} serving, target {p['target']}, {p['starting']} starting, "
            f"{p['standby']} standby, draining {draining}"
        )
    for d in doc["decisions"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["time_unix"]))
        lines.append(
            f"  {when} {d['pool']} {d['direction']} to {d['target']} ({d['reason']}: {d['detail']}) "
            f"{d['worker_id'] or ''}".rstrip()
        )
    return "\n".join(lines)
