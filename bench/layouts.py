"""Replicas against sequence parallelism on the same cores: dp=1 x sp=2 vs one rank, and vs dp=2.

kiln-tiny on CPU ranks over gloo (``runtime.launch.run_ranks``), one torch thread per rank unless
said otherwise, DLO allgather, guidance on (the request defaults).

1. Latency of one job: sp=1 (one rank) against sp=2 (dp=1 x sp=2: one replica of two ranks,
   the job's tokens split over them), per clip size. "Job" is what a replica does for it: text
   encoding and noise, the steps (``agree_handles``, then ``step``), and the decode on the
   replica's first rank; "steps" is the denoising part alone. sp=2 runs 2 ranks x 1 thread, so
   sp=1 is run twice: with 1 thread (half the cores: how much the split buys over one core) and
   with 2 threads (the same two cores: the fair baseline, intra-op threads against the split).
   Every variant is a fresh rank set that loads the model, warms up on each size, then times
   ``--reps`` jobs per size; variants are interleaved (sp1, sp2, sp1x2t, sp1, sp2, ...,
   ``--rounds`` rounds) so drift in machine load hits them alike. Figures: the median and the
   best over all timed jobs; a multi-rank figure is the slowest rank's (the group steps
   together). The final latents of every variant are compared with sp=1's (max abs diff).
2. Throughput, through the service's rank loop (``runtime.rank_loop.run_loop`` with a ``RankLoop``
   on every rank). On jobs all alike (``--uniform``): one rank alone (dp=1) against dp=2 (two
   replicas of one rank), dp=2's efficiency being its jobs per hour over twice dp=1's. On a mixed
   workload (``--mix``): dp=2 with kiln's admission (a free replica takes the next job at the next
   step boundary) and in waves (``WavesDriver``: a free replica takes a job only once every job
   started so far has finished, so each wave waits for its longest job), and dp=1 x sp=2 (one
   replica of two ranks), on the same two ranks. Rank 0's driver is a small in-memory queue: every
   job is queued at t=0 (when the group has loaded and warmed up), it hands queued jobs FIFO to free
   replicas (``StepPlan.assign`` keyed by the replica's first rank) at step boundaries, records when
   each job's final status arrives, and stops when all are done; ``write`` discards the frames.
   Figures per run: jobs per hour (jobs / the time the last one finished) and the mean and largest
   latency (submission to finish); runs interleaved (dp1, dp2 uniform, dp2 mixed, waves, sp2, dp1,
   ...), median over ``--rounds``.

Prints a table per part and writes the figures as JSON (``--json``; by default under out/,
which git ignores).

Usage: python bench/layouts.py [--sizes 64x64x9x4,256x256x17x4,512x512x17x2] [--reps 3]
                               [--rounds 2] [--jobs 12] [--mix 64x64x9x4,...]
                               [--part latency,throughput]
                               [--json out/bench/layouts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]

# (name, sp, torch threads per rank): sp=2 runs 2 ranks x 1 thread.
LATENCY_VARIANTS = (("sp1_1thread", 1, 1), ("sp2", 2, 1), ("sp1_2threads", 1, 2))
# (name, dp, sp, how jobs are admitted, workload), 1 thread per rank: on jobs all alike, one
# rank alone and two replicas of one rank; on the mixed workload, two replicas with kiln's
# admission and in waves, and one replica of two ranks.
THROUGHPUT_LAYOUTS = (("dp1", 1, 1, "kiln", "uniform"), ("dp2_uniform", 2, 1, "kiln", "uniform"),
                      ("dp2", 2, 1, "kiln", "mixed"), ("dp2_waves", 2, 1, "waves", "mixed"),
                      ("dp1_sp2", 1, 2, "kiln", "mixed"))
# The mixed workload's cycle: (width, height, frames, steps); two sizes, steps from 4 to 16.
MIX = ((128, 128, 9, 4), (256, 256, 17, 8), (128, 128, 9, 16), (256, 256, 17, 4),
       (128, 128, 9, 8), (256, 256, 17, 16))
# The workload of jobs all alike, for dp=2 against dp=1.
UNIFORM = (256, 256, 17, 8)
PROMPTS = ("a red circle moving left", "a blue square moving up", "a green triangle bouncing",
           "a yellow circle moving right", "a purple square moving down",
           "a cyan triangle moving left")


def _parse_clip(text: str) -> tuple[int, int, int, int]:
    """WxHxF or WxHxFxSTEPS (steps: kiln-tiny's default, 4)."""
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) == 3:
        parts.append(4)
    w, h, f, s = parts
    return w, h, f, s


def _name(clip: tuple[int, int, int, int]) -> str:
    w, h, f, s = clip
    return f"{w}x{h}x{f}, {s} steps"


def _tokens(clip: tuple[int, int, int, int]) -> int:
    w, h, f, _ = clip
    return ((f - 1) // 4 + 1) * (h // 16) * (w // 16)  # latent frames x patches per frame


def _load(sp: int, dp: int = 1) -> Any:
    import warnings

    # torch's notice that all_gather_into_tensor has a new name, once per rank.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    from common.families import TINY_MODEL
    from runtime.render import load_pipeline
    from runtime.sequence import Layout, open_sequence

    layout = Layout(dp=dp, sp=sp)
    return layout, load_pipeline(TINY_MODEL, device="cpu", sequence=open_sequence(layout, "gloo"))


# ---- 1. latency of one job -----------------------------------------------------------------


def _latency_rank(ctx: Any, sp: int, clips: list[tuple[int, int, int, int]],
                  reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from runtime.pipelines.base import VideoRequest, agree_handles

    layout, pipe = _load(sp)
    try:
        out: dict[str, Any] = {"threads": torch.get_num_threads()}
        for clip in clips:
            w, h, f, steps = clip
            request = VideoRequest(prompt=PROMPTS[0], width=w, height=h, num_frames=f,
                                   num_inference_steps=steps, seed=0)
            jobs, denoise = [], []
            latents = None
            for i in range(reps + 1):  # the first job warms up, unrecorded
                dist.barrier()
                t0 = time.perf_counter()
                state = pipe.prepare(request)
                while not state.done:
                    pipe.step(state, agree_handles(pipe, state))
                t1 = time.perf_counter()
                if layout.is_leader(ctx.rank):  # the replica's first rank decodes
                    pipe.decode(state)
                t2 = time.perf_counter()
                if i:
                    jobs.append(t2 - t0)
                    denoise.append(t1 - t0)
                latents = state.latents
            out[_name(clip)] = {"job_s": jobs, "steps_s": denoise,
                                "latents": latents.numpy() if ctx.rank == 0 else None}
        return out
    finally:
        pipe.close()


def latency(clips: list[tuple[int, int, int, int]], reps: int, rounds: int) -> dict[str, Any]:
    from runtime.launch import run_ranks

    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _, _ in LATENCY_VARIANTS}
    for r in range(rounds):
        for name, sp, threads in LATENCY_VARIANTS:
            print(f"latency: round {r + 1}/{rounds}, {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run_ranks(sp, _latency_rank, sp, clips, reps, threads=threads,
                                        timeout_s=600))
    report: dict[str, Any] = {}
    for clip in clips:
        key = _name(clip)
        row: dict[str, Any] = {"tokens": _tokens(clip)}
        reference = runs["sp1_1thread"][0][0][key]["latents"]
        for name, _, _ in LATENCY_VARIANTS:
            figures = {}
            for what in ("job_s", "steps_s"):
                # The group's time for the i-th job: its slowest rank's.
                per_job = [max(rank[key][what][i] for rank in ranks)
                           for ranks in runs[name] for i in range(reps)]
                figures[what] = round(statistics.median(per_job), 4)
                figures[f"best_{what}"] = round(min(per_job), 4)
            latents = runs[name][0][0][key]["latents"]
            figures["max_abs_diff_vs_sp1"] = float(abs(latents - reference).max())
            figures["threads_per_rank"] = runs[name][0][0]["threads"]
            row[name] = figures
        row["sp1_1thread_over_sp2"] = round(row["sp1_1thread"]["job_s"] / row["sp2"]["job_s"], 3)
        row["sp1_2threads_over_sp2"] = round(row["sp1_2threads"]["job_s"]
                                             / row["sp2"]["job_s"], 3)
        row["steps_sp1_2threads_over_sp2"] = round(row["sp1_2threads"]["steps_s"]
                                                   / row["sp2"]["steps_s"], 3)
        report[key] = row
    return report


def print_latency(report: dict[str, Any]) -> None:
    print("\n1. One job's latency, seconds (median of the timed jobs; best in brackets)")
    print(f"{'clip':<24}{'tokens':>7}  {'sp=1, 1 thread':>18}  {'sp=2, 2x1 thread':>18}  "
          f"{'sp=1, 2 threads':>18}  {'1t/sp2':>7}  {'2t/sp2':>7}")
    for key, row in report.items():
        cells = [f"{row[n]['job_s']:.3f} ({row[n]['best_job_s']:.3f})"
                 for n, _, _ in LATENCY_VARIANTS]
        print(f"{key:<24}{row['tokens']:>7}  {cells[0]:>18}  {cells[1]:>18}  {cells[2]:>18}  "
              f"{row['sp1_1thread_over_sp2']:>7.2f}  {row['sp1_2threads_over_sp2']:>7.2f}")
    print("   steps alone (no text encoding, no decode):")
    for key, row in report.items():
        cells = [f"{row[n]['steps_s']:.3f}" for n, _, _ in LATENCY_VARIANTS]
        print(f"{key:<24}{'':>7}  {cells[0]:>18}  {cells[1]:>18}  {cells[2]:>18}  "
              f"{row['sp1_1thread']['steps_s'] / row['sp2']['steps_s']:>7.2f}  "
              f"{row['steps_sp1_2threads_over_sp2']:>7.2f}")
    diffs = max(row[n]["max_abs_diff_vs_sp1"] for row in report.values()
                for n, _, _ in LATENCY_VARIANTS)
    print(f"   final latents, largest abs diff from sp=1 (1 thread): {diffs:.2e}")


# ---- 2. throughput on a mixed workload -------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Job:
    job_id: str
    request: Any
    started: float | None = None
    finished: float | None = None  # its final status ("succeeded") arrived
    rendered: float | None = None  # its replica was free again (frames handed to the writer)
    error: str | None = None


class QueueDriver:
    """Rank 0's `runtime.rank_loop.GroupDriver`: every job queued at the start, assigned FIFO to
    the free replicas at step boundaries; stops when every job has its final status."""

    def __init__(self, leaders: list[int], requests: list[Any]) -> None:
        self.leaders = leaders
        self.jobs = [_Job(job_id=f"job-{i}", request=r) for i, r in enumerate(requests)]
        self.queue = deque(self.jobs)
        self.by_id = {j.job_id: j for j in self.jobs}
        self.busy: dict[int, str] = {}  # replica (its first rank) -> job id
        self.takes_jobs = dict.fromkeys(leaders, True)
        self.t0 = 0.0
        self.turns = 0

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        self.t0 = time.perf_counter()

    def next_plan(self, stop_requested: bool) -> Any:
        from runtime.rank_loop import StepPlan, Ticket

        if stop_requested or all(j.finished is not None for j in self.jobs):
            return StepPlan(stop=True)
        self.turns += 1
        assign = {}
        admits = self.admits()  # once per boundary: a wave is admitted whole
        for leader in self.leaders:
            if leader not in self.busy and self.takes_jobs[leader] and self.queue and admits:
                job = self.queue.popleft()
                job.started = time.perf_counter() - self.t0
                assign[leader] = Ticket(job_id=job.job_id, attempt_token=f"a-{job.job_id}",
                                        request=job.request)
                self.busy[leader] = job.job_id
        return StepPlan(assign=assign, step=bool(self.busy))

    def admits(self) -> bool:
        """Whether a free replica takes a queued job at this boundary: kiln's admission always
        lets it."""
        return True

    def record(self, messages: list[Any]) -> None:
        from runtime.rank_loop import Ended, RankReport, Rendered

        now = time.perf_counter() - self.t0
        for m in messages:
            if isinstance(m, RankReport):
                if m.rank in self.takes_jobs:
                    self.takes_jobs[m.rank] = m.takes_jobs
                continue
            if not isinstance(m, Rendered | Ended):
                continue
            job = self.by_id[m.job_id]
            if self.busy.get(m.rank) == m.job_id and (
                    isinstance(m, Rendered) or m.outcome != "succeeded"):
                del self.busy[m.rank]  # the replica takes a new job at the next boundary
                job.rendered = now
            if isinstance(m, Ended):
                job.finished = now
                if m.outcome != "succeeded":
                    job.error = f"{m.outcome}: {m.error}"

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        errors = [f"{j.job_id} {j.error}" for j in self.jobs if j.error]
        if errors:
            raise RuntimeError("jobs failed: " + "; ".join(errors))
        finished = [j.finished for j in self.jobs if j.finished is not None]
        return {"makespan_s": max(finished),
                "latencies_s": [j.finished for j in self.jobs],
                "turns": self.turns}


class WavesDriver(QueueDriver):
    """Jobs in waves: a free replica takes a job only once every job started so far has its
    final status, so a wave of one job per replica waits for its longest."""

    def admits(self) -> bool:
        return all(j.finished is not None for j in self.jobs if j.started is not None)


def _discard_write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
    return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"


def _serve_rank(ctx: Any, dp: int, sp: int, requests: list[Any],
                admission: str = "kiln") -> dict[str, Any] | None:
    from runtime.platform import get_platform
    from runtime.rank_loop import RankLoop, run_loop
    from runtime.render import run_lockstep

    layout, pipe = _load(sp, dp)
    # Warm-up before the clock starts: one small job per replica, in lock-step.
    warm = [r for r in requests if r.width == 64][:1] * layout.dp or requests[:1] * layout.dp
    run_lockstep(pipe, layout.replica(ctx.rank), warm)
    loop = RankLoop(ctx.rank, pipe, _discard_write, get_platform("cpu"), layout=layout)
    kind = WavesDriver if admission == "waves" else QueueDriver
    driver = kind(layout.leaders, requests) if ctx.rank == 0 else None
    run_loop(ctx.rank, ctx.world, loop, driver)  # closes the loop and the pipeline
    return driver.summary() if driver is not None else None


def workload(num_jobs: int, mix: list[tuple[int, int, int, int]]) -> list[Any]:
    from runtime.pipelines.base import VideoRequest

    jobs = []
    for i in range(num_jobs):
        w, h, f, steps = mix[i % len(mix)]
        jobs.append(VideoRequest(prompt=PROMPTS[i % len(PROMPTS)], width=w, height=h,
                                 num_frames=f, num_inference_steps=steps, seed=i))
    return jobs


def throughput(num_jobs: int, rounds: int, mix: list[tuple[int, int, int, int]],
               uniform: tuple[int, int, int, int] = UNIFORM,
               uniform_jobs: int = 6) -> dict[str, Any]:
    from runtime.launch import run_ranks

    workloads = {"mixed": workload(num_jobs, mix), "uniform": workload(uniform_jobs, [uniform])}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in THROUGHPUT_LAYOUTS}
    for r in range(rounds):
        for name, dp, sp, admission, jobs in THROUGHPUT_LAYOUTS:
            print(f"throughput: round {r + 1}/{rounds}, {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run_ranks(dp * sp, _serve_rank, dp, sp, workloads[jobs],
                                        admission, threads=1, timeout_s=600)[0])
    report: dict[str, Any] = {
        "jobs": num_jobs,
        "mix": [_name(c) for c in mix],
        "uniform_jobs": uniform_jobs,
        "uniform": _name(uniform),
        "note": "all jobs queued at t=0; latency = submission to final status",
    }
    for name, dp, sp, admission, jobs in THROUGHPUT_LAYOUTS:
        per_run = runs[name]
        means = [statistics.fmean(run["latencies_s"]) for run in per_run]
        num_jobs = len(workloads[jobs])
        report[name] = {
            "dp": dp, "sp": sp, "ranks": dp * sp, "threads_per_rank": 1, "admission": admission,
            "workload": jobs,
            "jobs_per_hour": round(statistics.median(num_jobs / run["makespan_s"] * 3600
                                                     for run in per_run)),
            "makespan_s": round(statistics.median(run["makespan_s"] for run in per_run), 3),
            "mean_latency_s": round(statistics.median(means), 3),
            "max_latency_s": round(statistics.median(max(run["latencies_s"])
                                                      for run in per_run), 3),
            "runs_makespan_s": [round(run["makespan_s"], 3) for run in per_run],
            "runs_mean_latency_s": [round(m, 3) for m in means],
        }
    report["dp2_efficiency_vs_linear"] = round(report["dp2_uniform"]["jobs_per_hour"]
                                               / (2 * report["dp1"]["jobs_per_hour"]), 3)
    report["jobs_per_hour_kiln_over_waves"] = round(report["dp2"]["jobs_per_hour"]
                                                    / report["dp2_waves"]["jobs_per_hour"], 3)
    report["mean_latency_kiln_over_waves"] = round(report["dp2"]["mean_latency_s"]
                                                   / report["dp2_waves"]["mean_latency_s"], 3)
    report["jobs_per_hour_sp2_over_dp2"] = round(report["dp1_sp2"]["jobs_per_hour"]
                                                 / report["dp2"]["jobs_per_hour"], 3)
    report["mean_latency_sp2_over_dp2"] = round(report["dp1_sp2"]["mean_latency_s"]
                                                / report["dp2"]["mean_latency_s"], 3)
    return report


def print_throughput(report: dict[str, Any]) -> None:
    print(f"\n2. Workloads, every job queued at t=0 (median of the runs): uniform, "
          f"{report['uniform_jobs']} x {report['uniform']}; mixed, {report['jobs']} jobs cycling "
          f"{'; '.join(report['mix'])}")
    print(f"{'layout':<28}{'ranks':>6}{'jobs/h':>9}{'makespan s':>12}{'mean lat s':>12}"
          f"{'max lat s':>11}")
    for name, *_ in THROUGHPUT_LAYOUTS:
        row = report[name]
        label = (f"dp={row['dp']} x sp={row['sp']}, {row['workload']}"
                 + (", waves" if name.endswith("waves") else ""))
        print(f"{label:<28}{row['ranks']:>6}{row['jobs_per_hour']:>9}{row['makespan_s']:>12.2f}"
              f"{row['mean_latency_s']:>12.2f}{row['max_latency_s']:>11.2f}")
    print(f"   dp=2 efficiency against linear (2 x dp=1): "
          f"{report['dp2_efficiency_vs_linear']:.2f}; "
          f"kiln's admission / waves: jobs per hour x{report['jobs_per_hour_kiln_over_waves']:.2f}"
          f", mean latency x{report['mean_latency_kiln_over_waves']:.2f}")
    print(f"   sp=2 / dp=2: jobs per hour x{report['jobs_per_hour_sp2_over_dp2']:.2f}, "
          f"mean latency x{report['mean_latency_sp2_over_dp2']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64x64x9x4,256x256x17x4,512x512x17x2",
                        help="latency clips, WxHxF[xSTEPS], comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="timed jobs per size and run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per variant")
    parser.add_argument("--jobs", type=int, default=12, help="jobs in the mixed workload")
    parser.add_argument("--mix", default=",".join(f"{w}x{h}x{f}x{s}" for w, h, f, s in MIX),
                        help="the workload's clips, WxHxF[xSTEPS], comma-separated: job i is "
                             "clip i mod their number")
    parser.add_argument("--uniform", default="x".join(str(v) for v in UNIFORM),
                        help="the clip of the jobs all alike (dp=1 against dp=2), WxHxF[xSTEPS]")
    parser.add_argument("--uniform-jobs", type=int, default=6)
    parser.add_argument("--part", default="latency,throughput")
    parser.add_argument("--json", default=str(REPO / "out" / "bench" / "layouts.json"))
    args = parser.parse_args()

    import os

    import torch

    parts = set(args.part.split(","))
    report: dict[str, Any] = {"model": "kiln-tiny", "backend": "gloo", "mode": "allgather",
                              "cpu_count": os.cpu_count(), "torch": torch.__version__,
                              "rounds": args.rounds}
    started = time.perf_counter()
    if "latency" in parts:
        clips = [_parse_clip(s) for s in args.sizes.split(",")]
        report["latency"] = latency(clips, args.reps, args.rounds)
        report["latency_reps"] = args.reps
        print_latency(report["latency"])
    if "throughput" in parts:
        mix = [_parse_clip(s) for s in args.mix.split(",")]
        report["throughput"] = throughput(args.jobs, args.rounds, mix,
                                          _parse_clip(args.uniform), args.uniform_jobs)
        print_throughput(report["throughput"])
    report["wall_s"] = round(time.perf_counter() - started, 1)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['wall_s']:.0f} s in all; figures in {path}")


if __name__ == "__main__":
    main()
