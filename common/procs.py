"""Small process helpers shared by the launchers (kiln up, the worker group, render ranks) and
by the tests and benchmarks that start them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys


def cgroup_memory_bytes() -> int | None:
    """What this process's memory cgroup is charged now (cgroup v2, then v1): on a container
    of its own, the container's whole use; None where it cannot be read."""
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Children of a launcher that is killed outright would otherwise live on: a worker rank would
    keep claiming jobs, a private Redis would keep its port.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Stops ``proc`` (started with ``start_new_session=True``) and everything it started:
    SIGINT to its process group, a graceful stop, then SIGKILL if it has not exited within
    ``timeout`` seconds. A group that is gone already is left as it is."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        proc.wait()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
