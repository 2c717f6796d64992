"""`kiln up`'s view of a child's process group: psutil finds its members, signals them, and sees
them end (psutil remembers each process's start time, so a reused pid is not taken for one)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kiln.cli import up
from kiln.cli.up import _group_members, _signal, _still_running


def test_a_group_members_are_found_signalled_and_seen_to_end() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        members = _group_members(child.pid)
        assert [m.pid for m in members] == [child.pid]
        assert _still_running(members[0])
        _signal(members[0], signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert not _still_running(members[0])
        assert _group_members(child.pid) == []
    finally:
        child.kill()
        child.wait()



def test_a_stop_whose_interrupt_was_lost_still_ends_the_supervision(monkeypatch) -> None:
    """A stop signal that lands in a callback whose exceptions Python ignores (logging's fork
    hook, while a child starts) loses its KeyboardInterrupt; the supervision loop still sees the
    stop and ends."""
    monkeypatch.setattr(up, "_stop_asked", False)
    with pytest.raises(KeyboardInterrupt):
        up._raise_interrupt(signal.SIGINT, None)  # raised, and taken as lost
    with pytest.raises(KeyboardInterrupt):
        up.Supervisor().run(poll_s=0.01)
