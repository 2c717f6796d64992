"""A small interactive job beside a big batch job on one dp=2 group: lock-step, time-sliced, and
replicas at their own pace.

kiln-tiny on two CPU ranks over gloo (``runtime.launch.run_ranks``), one torch thread per rank,
through the service's rank loop (``runtime.rank_loop.run_loop``), in allgather and in rank-local
mode. Rank 0's driver plays a script of four scenarios per round, all in one rank set (the model
loads once), interleaved round after round so that drift in machine load hits them alike:

- ``small_solo``: the small job alone on the group (the other replica idle);
- ``big_solo``: the big job alone;
- ``lockstep``: the big job on replica 0; once it has run ``--after`` steps the small job arrives
  on replica 1, and every replica computes every turn (each turn lasts the big job's step);
- ``sliced``: the same arrival, and each turn is chosen by ``scheduler.turns.choose_turn`` from
  the jobs' measured seconds per step and their classes, as the worker's coordinator chooses it:
  the big job sits out while the small one runs, and the turn after the small job rendered has
  no step (its replica stores the files before the big job's next step);
- ``own_pace`` (mode ``own_pace``: rank-local weights, ``run_loop(own_pace=True)``, in place of
  ``lockstep`` and ``sliced``): the same arrival, and each replica steps its own job as fast as
  it goes, with no turn shared between them.

A job's time is from the turn that hands it to its replica to its final status. The acceptance
bounds printed: the small job beside the big one within 1.5x its solo time, and the big job
within 1.1x (its solo time + the small job's solo time).

Usage: python bench/mixed.py [--big 256x256x33x12] [--small 64x64x9x4] [--after 2]
                             [--rounds 3] [--modes allgather,rank_local,own_pace] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = ("small_solo", "big_solo", "lockstep", "sliced")
OWN_PACE_SCENARIOS = ("small_solo", "big_solo", "own_pace")
# mode -> (allgather, replicas at their own pace)
MODES = {"allgather": (True, False), "rank_local": (False, False), "own_pace": (False, True)}


def _size(text: str) -> tuple[int, int, int, int]:
    w, h, f, s = (int(v) for v in text.lower().split("x"))
    return w, h, f, s


class ScriptDriver:
    """Rank 0's `runtime.rank_loop.GroupDriver`: the scenarios one after the other, each to its
    jobs' final statuses; records every job's time."""

    def __init__(self, big: Any, small: Any, after: int, rounds: int,
                 scenarios: tuple[str, ...] = SCENARIOS) -> None:
        self.big, self.small, self.after = big, small, after
        self.script = [s for _ in range(rounds) for s in scenarios]
        self.results: list[dict[str, Any]] = []
        self._scenario: str | None = None
        self._pending: dict[str, tuple[int, Any]] = {}  # job id -> (replica, request), not sent
        self._assigned_at: dict[str, float] = {}
        self._times: dict[str, float] = {}
        self._held: dict[str, dict[str, Any]] = {}  # job id -> what the turn choice needs
        self._big_steps = 0
        self._count = 0
        self._await_write = False

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def _begin(self) -> None:
        self._scenario = self.script.pop(0)
        self._count += 1
        n = self._count
        self._times, self._assigned_at, self._held, self._big_steps = {}, {}, {}, 0
        if self._scenario == "small_solo":
            self._pending = {f"small-{n}": (1, self.small)}
        else:
            self._pending = {f"big-{n}": (0, self.big)}
            if self._scenario != "big_solo":
                self._pending[f"small-{n}"] = (1, self.small)

    def next_plan(self, stop_requested: bool) -> Any:
        from runtime.rank_loop import StepPlan, Ticket
        from scheduler.turns import HeldJob, choose_turn

        if self._scenario is None:
            if not self.script or stop_requested:
                return StepPlan(stop=True)
            self._begin()
        plan = StepPlan(step=True)
        if self._await_write:  # as the worker's coordinator does (kiln.worker)
            self._await_write = False
            return StepPlan()
        now = time.perf_counter()
        for job_id, (replica, request) in list(self._pending.items()):
            # The small job arrives once the big one has run ``after`` steps.
            if job_id.startswith("small") and self._scenario != "small_solo" \
                    and self._big_steps < self.after:
                continue
            plan.assign[replica] = Ticket(job_id=job_id, attempt_token="t", request=request)
            self._assigned_at[job_id] = now
            self._held[job_id] = {"replica": replica, "steps_left": request.num_inference_steps,
                                  "class": "batch" if job_id.startswith("big") else "interactive",
                                  "estimate": 1e-5 * request.width * request.height
                                  * request.num_frames, "measured": None, "paused": 0.0}
            del self._pending[job_id]
        if self._scenario == "sliced":
            turn = choose_turn([HeldJob(job_id=j, replica=h["replica"], job_class=h["class"],
                                        seconds_per_step=h["estimate"],
                                        measured=h["measured"],
                                        steps_left=h["steps_left"], order=0,
                                        paused_seconds=h["paused"])
                                for j, h in self._held.items()])
            plan.run = turn.run
        return plan

    def record(self, messages: list[Any]) -> None:
        from runtime.rank_loop import Ended, Progress, Rendered

        now = time.perf_counter()
        for m in messages:
            if getattr(m, "job_id", None) not in self._assigned_at:
                continue
            held = self._held.get(m.job_id)
            if isinstance(m, Progress) and held is not None:
                held["steps_left"] = m.num_inference_steps - m.step
                if m.step > 0 and m.compute_seconds > 0:
                    held["measured"] = m.compute_seconds / m.step
                if m.job_id.startswith("big"):
                    self._big_steps = m.step
                continue
            if isinstance(m, Ended):
                if m.outcome != "succeeded":
                    raise RuntimeError(f"{m.job_id}: {m.outcome}: {m.error}")
                self._times[m.job_id] = now - self._assigned_at[m.job_id]
            if isinstance(m, Rendered) and self._scenario == "sliced" \
                    and m.job_id.startswith("small"):
                self._await_write = True
            self._held.pop(m.job_id, None)
        if not self._pending and len(self._times) == len(self._assigned_at):
            row = {"scenario": self._scenario}
            for job_id, seconds in self._times.items():
                row[job_id.split("-")[0] + "_s"] = seconds
            self.results.append(row)
            self._scenario = None

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _discard_write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
    return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"


def _serve_rank(ctx: Any, mode: str, big: Any, small: Any, after: int,
                rounds: int) -> list[dict[str, Any]] | None:
    from common.families import TINY_MODEL
    from runtime.platform import get_platform
    from runtime.rank_loop import RankLoop, run_loop
    from runtime.render import load_pipeline, run_lockstep
    from runtime.sequence import Layout, open_sequence

    use_allgather, own_pace = MODES[mode]
    platform = get_platform("cpu")
    layout = Layout(dp=2, sp=1)
    pipe = load_pipeline(TINY_MODEL, device=platform.device, use_allgather=use_allgather,
                         sequence=open_sequence(layout, platform.backend))
    run_lockstep(pipe, layout.replica(ctx.rank), [small, small])  # warm-up
    loop = RankLoop(ctx.rank, pipe, _discard_write, platform, layout=layout)
    scenarios = OWN_PACE_SCENARIOS if own_pace else SCENARIOS
    driver = ScriptDriver(big, small, after, rounds, scenarios) if ctx.rank == 0 else None
    run_loop(ctx.rank, ctx.world, loop, driver, own_pace=own_pace)
    return driver.results if driver is not None else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(scenario: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["scenario"] == scenario)

    small_solo, big_solo = med("small_solo", "small_s"), med("big_solo", "big_s")
    out: dict[str, Any] = {"small_solo_s": small_solo, "big_solo_s": big_solo}
    for name in ("lockstep", "sliced", "own_pace"):
        if not any(r["scenario"] == name for r in rows):
            continue
        small, big = med(name, "small_s"), med(name, "big_s")
        out[name] = {"small_s": small, "big_s": big, "small_over_solo": small / small_solo,
                     "big_over_bound": big / (big_solo + small_solo),
                     "small_ok": small <= 1.5 * small_solo,
                     "big_ok": big <= 1.1 * (big_solo + small_solo)}
    out["rows"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", default="256x256x33x12")
    parser.add_argument("--small", default="64x64x9x4")
    parser.add_argument("--after", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from runtime.launch import run_ranks
    from runtime.pipelines.base import VideoRequest

    def request(size: str, prompt: str, seed: int) -> VideoRequest:
        w, h, f, s = _size(size)
        return VideoRequest(prompt=prompt, width=w, height=h, num_frames=f,
                            num_inference_steps=s, seed=seed)

    big = request(args.big, "a red circle moving left", 1)
    small = request(args.small, "a blue square", 2)
    report: dict[str, Any] = {"big": args.big, "small": args.small, "after_steps": args.after,
                              "rounds": args.rounds, "modes": {},
                              "command": "python bench/mixed.py " + " ".join(argv or sys.argv[1:])}
    for mode in args.modes.split(","):
        print(f"mixed: {mode} ...", file=sys.stderr, flush=True)
        rows = run_ranks(2, _serve_rank, mode, big, small, args.after,
                         args.rounds, threads=1, timeout_s=1200)[0]
        report["modes"][mode] = summarise(rows)
    print(f"small {args.small} beside big {args.big} at dp=2 (medians of {args.rounds} rounds)")
    print(f"{'mode':<12}{'small solo':>11}{'big solo':>10}{'scheme':>10}{'small':>9}"
          f"{'x solo':>8}{'big':>9}{'x bound':>9}  holds")
    for mode, m in report["modes"].items():
        for name in ("lockstep", "sliced", "own_pace"):
            if name not in m:
                continue
            r = m[name]
            print(f"{mode:<12}{m['small_solo_s']:>11.3f}{m['big_solo_s']:>10.2f}{name:>10}"
                  f"{r['small_s']:>9.3f}{r['small_over_solo']:>8.2f}{r['big_s']:>9.2f}"
                  f"{r['big_over_bound']:>9.2f}  {r['small_ok'] and r['big_ok']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
