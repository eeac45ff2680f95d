"""``PDSERVE_EXIT_WITH_PID`` (``cli.lifeline``): a cluster stops once the process it was tied to is gone.

The suite itself runs with the variable set to pytest's pid (``conftest``), so a killed test run does not
leave clusters behind; here a stand-in parent starts a cluster (fake workers, no model) and is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.cli import lifeline
from pdserve.deploy.local import cluster
from tests.e2e.cluster_harness import ROOT, Cluster, free_port, stop_cluster
from tests.fake_workers import make_model_dir


def test_process_gone_sees_exit_and_zombies():
    assert not lifeline.process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not lifeline.process_gone(child.pid):  # exited, not yet reaped: a zombie is gone too
        assert time.monotonic() < deadline, "a zombie counts as gone"
        time.sleep(0.05)
    child.wait()
    assert lifeline.process_gone(child.pid)


def test_a_bad_setting_stops_a_long_running_command_before_it_starts():
    env = {**os.environ, lifeline.EXIT_WITH_PID_ENV: "nope"}
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2 and "PDSERVE_EXIT_WITH_PID must be a process id" in out.stderr, out.stderr


def test_the_lifeline_sends_sigterm_once_the_process_is_gone():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pdserve.cli.lifeline import start_lifeline\n"
            f"start_lifeline({sleeper.pid}, interval_s=0.05)\n"
            "print('watching', flush=True)\n"
            "time.sleep(120)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "watching"
        time.sleep(0.3)
        assert watcher.poll() is None  # the watched process still runs: nothing happens
        sleeper.kill()
        assert watcher.wait(timeout=30) == -signal.SIGTERM
    finally:
        for p in (sleeper, watcher):
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[-1].split()[1]) == pid:
                        out.append(int(d))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("how", ["parent_gone", "wrapper_killed"])
def test_a_program_run_under_the_lifeline_stops_with_the_process_or_its_wrapper(how):
    """What ``up --prometheus`` starts under PDSERVE_EXIT_WITH_PID (Prometheus, Alertmanager): the
    wrapper stops the program once the process is gone, and the program dies with a killed wrapper."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    env = {**os.environ, lifeline.EXIT_WITH_PID_ENV: str(sleeper.pid)}
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.lifeline", "sleep", "120"], cwd=ROOT, env=env
    )
    try:
        deadline = time.monotonic() + 30
        while not (kids := _children(wrapper.pid)):
            assert time.monotonic() < deadline, "the program did not start"
            time.sleep(0.05)
        program = kids[0]
        if how == "parent_gone":
            sleeper.kill()
            assert wrapper.wait(timeout=30) == 128 + signal.SIGTERM  # the program's status, as a shell's
        else:
            wrapper.kill()
            wrapper.wait()
        deadline = time.monotonic() + 30
        while not lifeline.process_gone(program):
            assert time.monotonic() < deadline, "the program outlived its wrapper's reason to run"
            time.sleep(0.05)
    finally:
        for p in (sleeper, wrapper):
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.slow
def test_a_cluster_stops_when_the_process_it_is_tied_to_is_killed(tmp_path):
    """A parent with PDSERVE_EXIT_WITH_PID set to itself runs `pdserve up` (router, 1 prefill and 1 decode
    fake worker) and is SIGKILLed: every process of the cluster exits by itself, bounded."""
    state_dir = tmp_path / "state"
    model = make_model_dir(tmp_path / "model")
    up = [
        sys.executable, "-m", "pdserve.cli", "up", "--prefill", "1", "--decode", "1", "--colocated", "0",
        "--model", str(model), "--port", str(free_port()), "--http-port", "0", "--state-dir", str(state_dir),
        "--worker-module", "tests.fake_workers", "--timeout", "60",
    ]  # fmt: skip
    parent_code = textwrap.dedent(
        f"""
        import os, subprocess, time
        os.environ[{lifeline.EXIT_WITH_PID_ENV!r}] = str(os.getpid())
        subprocess.run({up!r}, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        print("up", flush=True)
        time.sleep(300)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        state = cluster.load_state(state_dir)
        assert state is not None and len(state.workers) == 2
        entries = [state.router, *state.workers]
        assert all(cluster.alive(p) for p in entries)
        Cluster(state_dir, state.router_address).assert_no_leaks()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 45
        while any(cluster.alive(p) for p in entries):
            left = [p.id for p in entries if cluster.alive(p)]
            assert time.monotonic() < deadline, f"still running 45 s after the parent died: {left}"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        stop_cluster(state_dir)
