"""The lifeline's setting and its view of a pid: unset, a pid, a pid taken by another process."""

from __future__ import annotations

import os

import pytest

from pdserve.cli import lifeline
from pdserve.deploy.local import cluster


def test_the_setting_is_a_pid_or_unset():
    env = lifeline.EXIT_WITH_PID_ENV
    assert lifeline.exit_with_pid({}) is None and lifeline.exit_with_pid({env: " "}) is None
    assert lifeline.exit_with_pid({env: "4242"}) == 4242
    for bad in ("abc", "0", "-3", "1.5"):
        with pytest.raises(ValueError, match=f"{env} must be a process id"):
            lifeline.exit_with_pid({env: bad})


def test_a_pid_taken_by_another_process_counts_as_gone():
    stat = cluster.proc_stat(os.getpid())
    assert stat is not None
    assert not lifeline.process_gone(os.getpid(), stat[1])
    assert lifeline.process_gone(os.getpid(), stat[1] - 1)  # same pid, another start: not the one watched


def test_the_suite_runs_tied_to_pytest():
    assert lifeline.exit_with_pid() == os.getpid()
