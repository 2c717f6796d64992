"""The one rank launcher: ``kiln render``, ``kiln worker``, the benchmarks and the multi-rank tests
all start their ranks here.

`run_ranks` spawns ``world`` local processes, one rank each, joined in one process group, and
runs ``fn(rank_ctx, *args)`` on every one of them. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set by the launcher) `run_this_rank` runs this process as its one rank instead.

Failure is all-or-nothing: a rank that raises or exits kills the others, which may be blocked in
a collective the failed rank will never join. A ``ValueError`` on a rank (a user mistake: a size
the model cannot render) comes back as itself, without a traceback; anything else is a
`RankFailure` carrying the rank's traceback.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from common.procs import die_with_parent, free_port

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RankFailure(RuntimeError):
    """A rank raised (not a user mistake), exited, or the ranks ran past their deadline.

    ``ranks``: the ranks found failed (raised or exited) before the launcher killed the others;
    empty when none was (a deadline). ``exit_codes``: theirs, where they exited (negative: the
    signal that ended them). ``stopping``: a stop had been asked for when it happened.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (),
                 exit_codes: dict[int, int] | None = None, stopping: bool = False) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.exit_codes = exit_codes or {}
        self.stopping = stopping


class StopTimeout(RankFailure):
    """Asked to stop, the ranks had not left within the launcher's ``stop_timeout_s``: they
    were killed."""


class _Stop:
    """A rank's stop flag: set by the launcher (an Event every rank shares), or by a SIGTERM
    sent to this rank itself (the whole process group stopped by systemd or docker)."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.signalled = False

    def is_set(self) -> bool:
        return self.signalled or bool(self.event.is_set())

    def on_signal(self, signum: int, frame: Any) -> None:
        # A plain attribute, not the shared Event: setting that takes a lock the interrupted
        # code may hold.
        self.signalled = True


@dataclass(kw_only=True, slots=True)
class RankContext:
    """What a rank function is given besides its own arguments."""

    rank: int
    world: int
    device: str  # cpu | cuda | npu
    messages: Any  # .put((kind, rank, *payload)) reaches the launcher's ``on_message``
    stop: Any  # an Event the launcher sets when asked to stop gracefully (SIGINT / SIGTERM)


def rank_threads(world: int) -> int:
    """CPU threads per rank: the ranks share the machine's cores (without a limit each would
    start one thread per core)."""
    return max(1, (os.cpu_count() or 1) // world)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device_for(device: str) -> Any:
    """The torch device of this rank: ``LOCAL_RANK`` picks the accelerator on a node."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device(device, int(os.environ.get("LOCAL_RANK", "0")))


def init_process_group(rank: int, world: int, device: str,
                       timeout_s: float | None = None) -> None:
    """Joins the group; ``timeout_s`` bounds every collective (a hung peer then raises instead
    of blocking forever; unset: torch's default)."""
    if device != "cpu":
        mod = (torch.cuda if device == "cuda"
               else torch.npu)  # type: ignore[attr-defined]  # torch_npu adds it
        mod.set_device(device_for(device))
    timeout: dict[str, Any] = ({} if timeout_s is None
                               else {"timeout": timedelta(seconds=timeout_s)})
    dist.init_process_group(BACKENDS[device], rank=rank, world_size=world, **timeout)


def run_this_rank(fn: Callable[..., Any], *args: Any, device: str = "cpu",
                  collective_timeout_s: float | None = None) -> Any:
    """Under torchrun: this process is one rank of the group; runs ``fn`` and returns its result.
    Messages go nowhere (there is no launcher process to read them); SIGINT or SIGTERM (torchrun
    passes its own on) sets ``ctx.stop``; ``collective_timeout_s`` bounds every collective (a
    node that vanished makes the others raise instead of waiting out torch's default)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stop = _Stop(_Never())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.on_signal)
    init_process_group(rank, world, device, timeout_s=collective_timeout_s)
    try:
        ctx = RankContext(rank=rank, world=world, device=device, messages=_Discard(), stop=stop)
        return fn(ctx, *args)
    finally:
        dist.destroy_process_group()


class _Discard:
    def put(self, item: Any) -> None:
        pass


class _Never:
    def is_set(self) -> bool:
        return False


def _rank_entry(rank: int, world: int, port: int, device: str, threads: int,
                graceful_stop: bool, collective_timeout_s: float | None,
                fn: Callable[..., Any], args: tuple[Any, ...], messages: Any,
                stop_event: Any) -> None:
    stop = _Stop(stop_event)
    # Ctrl-C reaches the whole process group; the launcher decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if graceful_stop:
        # SIGTERM to this rank (the whole group stopped at once, or its launcher died: see
        # die_with_parent) is a stop request like the launcher's, not an instant death.
        signal.signal(signal.SIGTERM, stop.on_signal)
    die_with_parent()  # a rank whose launcher died must not go on (claiming jobs, holding ports)
    if device == "cpu":
        torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    try:
        init_process_group(rank, world, device, collective_timeout_s)
        try:
            ctx = RankContext(rank=rank, world=world, device=device, messages=messages,
                              stop=stop)
            result = fn(ctx, *args)
        finally:
            dist.destroy_process_group()
        messages.put(("done", rank, result))
    except ValueError as exc:  # a user mistake (a size the model cannot render): no traceback
        messages.put(("invalid", rank, str(exc)))
    except BaseException:  # noqa: BLE001 - reported to the launcher, which raises it
        messages.put(("error", rank, traceback.format_exc()))


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, device: str = "cpu",
              on_message: Callable[[str, int, tuple[Any, ...]], None] | None = None,
              on_sample: Callable[[int], None] | None = None,
              on_started: Callable[[], None] | None = None,
              timeout_s: float | None = 3600.0, threads: int | None = None,
              graceful_stop: bool = False, stop_timeout_s: float | None = None,
              collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world`` spawned ranks; their results in rank order.

    ``fn`` must be importable by name; ``ctx.messages.put((kind, rank, *payload))`` reaches
    ``on_message``. ``on_sample`` receives the summed PSS of the rank processes about every 0.1 s
    (memory benchmarks). ``threads``: torch threads per CPU rank, `rank_threads` unless given.
    ``timeout_s=None``: no deadline (a worker group).

    ``graceful_stop``: SIGINT or SIGTERM to this process (or SIGTERM to a rank) sets every
    rank's ``ctx.stop`` (the ranks finish what they are doing and return); a second signal kills
    them, and so does ``stop_timeout_s`` passing after the first (`StopTimeout`). Without it,
    Ctrl-C raises ``KeyboardInterrupt`` here and kills the ranks. ``collective_timeout_s``:
    bounds every collective on the ranks (a hung rank makes the others raise). A rank inherits
    no logging configuration: ``fn`` configures its own (`common.logs`).
    """
    ctx = torch_mp.get_context("spawn")
    messages = ctx.Queue()
    stop = ctx.Event()
    port = free_port()
    threads = rank_threads(world) if threads is None else threads
    procs = [ctx.Process(target=_rank_entry,
                         args=(r, world, port, device, threads, graceful_stop,
                               collective_timeout_s, fn, args, messages, stop))
             for r in range(world)]
    for p in procs:
        p.start()
    previous = {}
    stop_asked: list[float] = []  # when the first stop signal came (monotonic)
    if graceful_stop:
        def request_stop(signum: int, frame: Any) -> None:
            if stop_asked:  # a second signal: do not wait for the ranks
                for p in procs:
                    p.kill()
            stop_asked.append(time.monotonic())
            stop.set()

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT,
                                                                       signal.SIGTERM)}
    if on_started is not None:
        on_started()
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(results) < world:
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailure(f"ranks timed out after {timeout_s:.0f} s",
                                  stopping=bool(stop_asked))
            if (stop_timeout_s is not None and stop_asked
                    and time.monotonic() > stop_asked[0] + stop_timeout_s):
                raise StopTimeout(f"the ranks had not stopped {stop_timeout_s:.0f} s after "
                                  "they were asked to", stopping=True)
            try:
                kind, rank, *payload = messages.get(timeout=0.1)
            except queue.Empty:
                if on_sample is not None:
                    on_sample(_summed_pss(procs))
                dead = {r: p.exitcode for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0)}
                if dead:
                    raise _root_cause(messages) or RankFailure(
                        f"rank {min(dead)} exited with code {dead[min(dead)]}",
                        ranks=tuple(sorted(dead)), exit_codes=dead,
                        stopping=bool(stop_asked)) from None
                continue
            if kind == "done":
                results[rank] = payload[0]
            elif kind == "invalid":
                raise ValueError(payload[0])
            elif kind == "error":
                # A rank whose partner failed fails too (its gather lost a peer): report the
                # root cause, a user mistake on another rank, when one arrives shortly.
                dead = _exited(procs)
                raise _root_cause(messages) or RankFailure(
                    f"rank {rank} failed:\n{payload[0]}", ranks=tuple(sorted(dead)) or (rank,),
                    exit_codes=dead, stopping=bool(stop_asked))
            elif on_message is not None:
                on_message(kind, rank, tuple(payload))
    except BaseException:
        # The other ranks may be blocked in a collective that the failed rank will never join.
        for p in procs:
            p.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            p.join(timeout=30)
    return [results[r] for r in range(world)]


def _exited(procs: list[Any], wait_s: float = 1.0) -> dict[int, int]:
    """Ranks that exited with an error within ``wait_s``: when one rank dies, its peers' next
    collective fails and they report that first, but the dead one is the cause."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _root_cause(messages: Any, wait_s: float = 2.0) -> ValueError | None:
    """A user mistake reported by some rank within ``wait_s``, if any."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            kind, _, *payload = messages.get(timeout=left)
        except queue.Empty:
            return None
        if kind == "invalid":
            return ValueError(payload[0])
    return None


def _summed_pss(procs: list[Any]) -> int:
    """The ranks' PSS, summed: the host memory they hold together, each page counted once.

    The readings are not one snapshot: when a rank unmaps a shared file between two of them
    (at exit, say), the other rank's share of those pages grows to all of them, and a sum
    read in that order counts them one and a half times. A page that moves between ranks
    moves one way, so the sum read in the reverse order does not; the lower sum is kept.
    """
    forward = [_pss(p.pid) for p in procs]
    backward = [_pss(p.pid) for p in reversed(procs)]
    return min(sum(forward), sum(backward))


def _pss(pid: int) -> int:
    """One process's PSS; 0 once it has gone. psutil reads the kernel's one-line rollup (parsing
    the full smaps takes long enough for other ranks to map pages meanwhile)."""
    try:
        return psutil.Process(pid).memory_full_info().pss
    except (psutil.Error, AttributeError):
        return 0
