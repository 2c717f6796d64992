"""The benchmark suite: every figure measured side by side in one run, written as one JSON per
benchmark beside a report with tables and plots.

    python bench/suite.py [--out bench/results] [--report bench/REPORT.md] [--quick]
    python bench/suite.py --device cuda    # on a GPU: adds the GPU section (bench/cuda_check.py)

The report opens with the machine it ran on; every number in it comes from this run's JSON.
Sections so far: step time against tokens on two ranks, dp=2 and sp=2 and the planner's
choice (``bench/steptime.py``), cold start at dp 1, 2
and 4 (``bench/coldstart.py``) and the memory model fitted to it, device weight buffers against
depth (``bench/buffers.py``), request tiling
(``bench/tiling.py``), jobs per hour at dp 1 and 2, kiln's admission against waves and dp=2
against sp=2 (``bench/layouts.py``), step time with LoRA adapters (``bench/adapters.py``), bytes
and steps (host memory, bytes moved and step time per weights dtype: ``bench/weights_dtype.py``,
``bench/steptime_dtype.py``; the quality tiers' blocks, time and frames against exact:
``bench/step_cache.py``; the gathers two replicas skip at them: ``bench/gathers.py --tiers``), a
short soak
(``bench/chaos.py``) and the service
(``bench/submit.py``, ``bench/service_latency.py``, ``bench/scheduler_claim.py``; they need
PostgreSQL and Redis as the tests do). ``--quick``: small sizes, for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import step_cache, steptime  # noqa: E402
from bench.cuda_report import cuda_missing_section, cuda_section  # noqa: E402
from runtime.planner import extrapolate_memory, machine_description  # noqa: E402

BENCH = Path(__file__).resolve().parent


def machine() -> dict[str, Any]:
    """What the figures were measured on: the planner's description of the machine (CPU,
    cores, memory, torch), with Python, gloo and the date."""
    return {**machine_description(), "python": platform.python_version(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _modes(result: dict[str, Any]) -> list[str]:
    """The modes a step-time run measured, in ``steptime.MODES`` order."""
    return [m for m in steptime.MODES if m in result["points"][0]["ratio_to_resident"]]


def _line_plot(path: Path, series: dict[str, tuple[list[float], list[float]]], *, xlabel: str,
               ylabel: str, title: str, xticks: list[int] | None = None, log2_x: bool = False,
               baseline: tuple[str, list[float], list[float]] | None = None,
               unit_line: bool = False, dashed: tuple[str, ...] = ()) -> None:
    """One PNG: a line with markers per series (label -> (x, y)), dashed for the labels in
    ``dashed``; ``baseline``: a dashed grey series (label, x, y); ``unit_line``: a grey line at
    y = 1."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label in dashed else "-")
    if baseline is not None:
        label, xs, ys = baseline
        ax.plot(xs, ys, color="grey", linestyle="--", label=label)
    if unit_line:
        ax.axhline(1.0, color="grey", linewidth=0.8)
    if log2_x:
        ax.set_xscale("log", base=2)
    if xticks is not None:
        ax.set_xticks(xticks, [str(t) for t in xticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _steptime_plot(result: dict[str, Any], path: Path) -> None:
    tokens = [p["tokens"] for p in result["points"]]
    _line_plot(path, {name: (tokens, [p["ratio_to_resident"][name] for p in result["points"]])
                      for name in _modes(result)},
               xlabel="tokens per forward",
               ylabel="forward time / resident copy's (sp=2: one job's)",
               title=f"two ranks, DiT width {result['width']} x {result['blocks']} blocks, fp32 "
                     f"({result['model_bytes'] / 1e9:.2f} GB)",
               xticks=tokens, log2_x=True, unit_line=True, dashed=tuple(steptime.SP_MODES))


def _steptime_section(result: dict[str, Any], plot: str) -> list[str]:
    modes = _modes(result)
    lines = ["## Step time against tokens (two ranks)", "",
             f"Two ranks run the same model ({result['blocks']} blocks of width "
             f"{result['width']}, fp32, {result['model_bytes'] / 1e9:.2f} GB) held seven ways, "
             "in rotation; the figure is the forward time over the resident copy's in the same "
             f"pass (best of {result['passes']} passes, median of {result['reps']} forwards "
             f"each, the slower rank's; torch threads per rank: {result['threads_per_rank']}).",
             "", "At dp=2 each rank runs its own input, as a replica renders its own job:", "",
             "- resident: a whole copy per rank;",
             "- fsdp2: PyTorch's `fully_shard` per block, half of every block per rank;",
             "- kiln-allgather: half of every block per rank, gathered into two fixed slots;",
             "- kiln-rank-local: whole blocks copied from the rank's own copy through the "
             "slots (rank-local on an accelerator);",
             "- kiln-mapped: every block bound to one safetensors file both ranks map "
             "(what rank-local does with a checkpoint on the CPU).", "",
             "At sp=2 both ranks run one input split along its tokens (attention through four "
             "all-to-alls per block), on the allgather model (sp2-allgather) and on the mapped "
             "one (sp2-mapped). Their figure is one job's latency over a resident rank's; a job "
             "holds both ranks, so per job they cost twice that in rank time (the sp=2 rank "
             "time column).", "",
             "kiln's planner (`runtime.planner.plan`) is fed a profile of this model from the "
             "same run (a block's compute against tokens fitted from the resident forwards at "
             "the smallest and largest token count; all-gather and all-to-all rates timed "
             "alone) and picks a layout and mode per token count, for jobs per hour and for "
             "one job's latency; beside each pick is what that form measured.", "",
             f"![step time against tokens]({plot})", "",
             "| tokens | " + " | ".join(modes) + " | sp=2 rank time (allgather · mapped) "
             "| planner, jobs/h | planner, latency | resident s |",
             "|---:|" + "---:|" * len(modes) + "---|---|---|---:|"]
    for p in result["points"]:
        r = p["ratio_to_resident"]
        picks = [f"{p['planner'][g]['layout']} ({p['planner'][g]['measured_as']}: "
                 f"{p['planner'][g]['ratio_to_resident']:.3f})" for g in ("throughput", "latency")]
        lines.append(f"| {p['tokens']} | " + " | ".join(f"{r[m]:.3f}" for m in modes)
                     + f" | {2 * r['sp2-allgather']:.2f} · {2 * r['sp2-mapped']:.2f} | "
                     + " | ".join(picks) + f" | {p['seconds']['resident']:.3f} |")
    lines += ["", "Where kiln loses, and why:", ""]
    # From the figures, so that the words can be improved without measuring again.
    lines += [f"- {f}" for f in steptime.findings(result["points"])] or ["- nowhere in this run"]
    return lines + [""]


# Benchmarks that run as scripts of their own (each starts its own processes, services or
# databases): name -> (script and arguments, the same for --quick or None to skip it there).
# Each prints, or writes with --json, one JSON document, kept as <name>.json.
SCRIPTS: dict[str, tuple[list[str], list[str] | None]] = {
    "coldstart": (["coldstart.py", "--dp", "1,2,4", "--size-gb", "1"],
                  ["coldstart.py", "--dp", "2", "--size-gb", "0.05", "--width", "256"]),
    "buffers": (["buffers.py", "--depths", "8,16,32,64"],
                ["buffers.py", "--depths", "2,4", "--width", "128"]),
    "tiling": (["tiling.py", "--frames", "9", "33", "65", "129"],
               ["tiling.py", "--size", "64x64", "--frames", "9", "17"]),
    "submit": (["submit.py", "--spawn", "--clients", "50", "--requests", "3000"],
               ["submit.py", "--spawn", "--clients", "8", "--requests", "200"]),
    "service_latency": (["service_latency.py", "--dp", "1", "--jobs", "12"],
                        ["service_latency.py", "--dp", "1", "--jobs", "3", "--warmup", "1"]),
    "layouts": (["layouts.py", "--sizes", "64x64x9x4,256x256x17x4", "--reps", "2", "--rounds",
                 "2", "--jobs", "12", "--json", "{json}"],
                ["layouts.py", "--sizes", "64x64x9x4", "--reps", "1", "--rounds", "1", "--jobs",
                 "2", "--mix", "64x64x9x4,64x64x9x8", "--uniform", "64x64x9x4",
                 "--uniform-jobs", "2", "--json", "{json}"]),
    # Two rank sets, each loading the model and warming up: not in --quick.
    "mixed": (["mixed.py", "--rounds", "3", "--json", "{json}"], None),
    # The whole service twice (one per mode), batch jobs of a minute or more: not in --quick.
    "overnight": (["overnight.py", "--json", "{json}"], None),
    "adapters": (["adapters.py", "--json", "{json}"],
                 ["adapters.py", "--tokens", "64,128", "--width", "256", "--reps", "1",
                  "--tiny-sizes", "64x64x9", "--replica-size", "64x64x9", "--replica-reps", "1",
                  "--json", "{json}"]),
    # Bytes and steps: host memory and bytes moved per weights dtype (a random 1 GB Wan
    # checkpoint written under {tmp}; three rank sets loading it, a minute at any size: not in
    # --quick), step time per dtype, the quality tiers' curve and the gathers two replicas
    # skip at them.
    "weights_dtype": (["weights_dtype.py", "--make", "--model", "{tmp}/wan"], None),
    "steptime_dtype": (["steptime_dtype.py", "--json", "{json}"],
                       ["steptime_dtype.py", "--tokens", "32,64", "--width", "256", "--blocks",
                        "2", "--reps", "1", "--passes", "1", "--json", "{json}"]),
    "step_cache": (["step_cache.py", "--reps", "3", "--json", "{json}"],
                   ["step_cache.py", "--prompts", "2", "--steps", "8", "--reps", "1",
                    "--thresholds", "0.3", "--json", "{json}"]),
    "gathers_tiers": (["gathers.py", "--tiers", "--reps", "3", "--json", "{json}"],
                      ["gathers.py", "--tiers", "--steps", "6", "--reps", "1", "--json",
                       "{json}"]),
    # The GPU check: only with --device cuda (its --dry-run runs the same code on the CPU).
    "cuda": (["cuda_check.py", "--json", "{json}"],
             ["cuda_check.py", "--dry-run", "--json", "{json}"]),
    # The soak starts a whole service of its own and takes minutes at any size: not in --quick.
    "soak": (["chaos.py", "--jobs", "100", "--faults", "6", "--json", "{json}"], None),
    "claim": (["scheduler_claim.py", "--jobs", "100000", "--claims", "300", "--json", "{json}"],
              ["scheduler_claim.py", "--jobs", "2000", "--claims", "20", "--json", "{json}"]),
    # A million queued jobs take minutes to fill: not in --quick.
    "claim_1m": (["scheduler_claim.py", "--jobs", "1000000", "--users", "1000", "--claims",
                  "300", "--json", "{json}"], None),
}


def run_script(name: str, out: Path, quick: bool) -> dict[str, Any]:
    """Run one script benchmark in a process of its own; its JSON, also written to
    ``out/<name>.json``."""
    full, small = SCRIPTS[name]
    chosen = small if quick else full
    assert chosen is not None, f"{name} does not run with --quick"
    dest = out / f"{name}.json"
    # {tmp}: a directory of the run's own (a checkpoint the script writes), gone after it.
    with tempfile.TemporaryDirectory(prefix=f"kiln-bench-{name}-") as tmp:
        argv = [a.replace("{json}", str(dest)).replace("{tmp}", tmp) for a in chosen]
        proc = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:]], text=True,
                              capture_output=True, cwd=BENCH.parent)
        argv = [a.replace(tmp, "DIR") for a in argv]
    wrote = "{json}" in chosen and dest.is_file()
    # A soak that found a fault exits 1 with its figures written: that is a finding to report.
    if proc.returncode != 0 and not wrote:
        raise RuntimeError(f"bench/{argv[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if wrote:
        result = json.loads(dest.read_text())
    else:
        # The JSON document it printed (some print a line or two of context first).
        lines = proc.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("{"))
        result = json.loads("\n".join(lines[start:]))
    result["command"] = "python bench/" + " ".join(
        "OUT.json" if a == str(dest) else a for a in argv)
    dest.write_text(json.dumps(result, indent=1))
    return result


COLD_MODES = ("naive", "fsdp2", "allgather", "rank-local", "mapped")


def _coldstart_plot(result: dict[str, Any], path: Path) -> None:
    dps = [int(d) for d in result["runs"]]

    def steady(mode: str) -> list[float]:
        return [r["modes"][mode]["steady_gb"] for r in result["runs"].values()]

    _line_plot(path, {mode: (dps, steady(mode)) for mode in COLD_MODES},
               xlabel="ranks (dp)", ylabel="steady host memory, GB (page cache included)",
               title=f"cold start on a {result['model_gb']:.2f} GB {result['dtype']} checkpoint",
               xticks=dps, baseline=("framework only (no model)", dps, steady("framework")))


def _coldstart_section(result: dict[str, Any], plot: str) -> list[str]:
    lines = ["## Cold start", "",
             f"dp CPU ranks load one {result['model_gb']:.2f} GB checkpoint ({result['dtype']}, "
             f"{result['num_blocks']} blocks of width {result['width']}) and run one forward "
             f"(`{result['command']}`). Memory is what the ranks make the machine hold: their "
             "anonymous and shared-memory PSS plus the checkpoint's pages in the page cache, "
             "counted once (`bench/coldstart.py` says how); the cgroup's own count is beside "
             "it. Time to ready: from starting the processes to every rank having loaded. "
             "\"framework\" is a rank with torch and its process group and no model; the "
             "model's share is a mode's steady figure less it.", "", f"![cold start]({plot})", ""]
    for dp, run in result["runs"].items():
        modes = run["modes"]
        base = modes["framework"]["steady_gb"]
        lines += [f"dp={dp} (framework alone: {base:.2f} GB, ready in "
                  f"{modes['framework']['load_seconds']:.1f} s):", "",
                  "| mode | ready s | peak GB | steady GB | of it page cache | model's share GB "
                  "| cgroup peak GB | cgroup steady GB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for mode in COLD_MODES:
            m = modes[mode]
            lines.append(f"| {mode} | {m['load_seconds']:.1f} | {m['peak_gb']:.2f} | "
                         f"{m['steady_gb']:.2f} | {m['steady_page_cache_gb']:.2f} | "
                         f"{m['steady_gb'] - base:.2f} | {m.get('cgroup_peak_gb', 0):.2f} | "
                         f"{m.get('cgroup_steady_gb', 0):.2f} |")
        lines.append("")
        if modes["fsdp2"]["steady_gb"] > modes["naive"]["steady_gb"]:
            lines += [f"At dp={dp} FSDP2 holds more ({modes['fsdp2']['steady_gb']:.2f} GB) "
                      f"than a private copy per rank ({modes['naive']['steady_gb']:.2f} GB): "
                      "that is what its processes hold after one forward, measured, not "
                      "broken down here.", ""]
    return lines


def memory_model(cold: dict[str, Any]) -> dict[str, Any]:
    """kiln allgather's host memory as ``model + dp x c``, ``c`` fitted (least squares through
    the origin) to the cold-start run's steady and peak figures, and the published technique's
    extrapolation table beside what the fit predicts."""
    model = cold["model_gb"]
    dps = [int(d) for d in cold["runs"]]
    fit: dict[str, Any] = {}
    for key in ("steady_gb", "peak_gb"):
        measured = [cold["runs"][str(d)]["modes"]["allgather"][key] for d in dps]
        c = sum(d * (m - model) for d, m in zip(dps, measured, strict=True)) / sum(
            d * d for d in dps)
        fit[key] = {"per_rank_gb": c, "points": [
            {"dp": d, "measured_gb": m, "predicted_gb": model + d * c}
            for d, m in zip(dps, measured, strict=True)]}
    return {"model_gb": model, "fit": fit,
            "table": extrapolate_memory(fit["peak_gb"]["per_rank_gb"] * 1e9)}


def _memory_model_section(mm: dict[str, Any]) -> list[str]:
    steady, peak = mm["fit"]["steady_gb"], mm["fit"]["peak_gb"]
    lines = ["## The memory model", "",
             "kiln allgather's host memory is the weights once between the ranks (each its "
             "1/dp shard) plus a constant per rank: `model + dp x c`. Fitted to the cold "
             f"start above ({mm['model_gb']:.2f} GB): c = {steady['per_rank_gb']:.3f} GB per "
             f"rank steady, {peak['per_rank_gb']:.3f} GB at the load's peak.", "",
             "| dp | steady measured GB | fit | peak measured GB | fit |",
             "|---:|---:|---:|---:|---:|"]
    for s_pt, p_pt in zip(steady["points"], peak["points"], strict=True):
        lines.append(f"| {s_pt['dp']} | {s_pt['measured_gb']:.2f} | "
                     f"{s_pt['predicted_gb']:.2f} | {p_pt['measured_gb']:.2f} | "
                     f"{p_pt['predicted_gb']:.2f} |")
    lines += ["", "The published technique's extrapolated host memory for allgather DLO "
              "(cgroup-visible peak and total RAM, on Ascend, whose pinned shards the cgroup "
              "does not see) beside kiln's prediction with the peak constant; kiln's shards "
              "are ordinary process memory, so its cgroup figure is its total:", "",
              "| model GB | dp | published cgroup GB | published total GB | kiln (this "
              "machine's c) GB |",
              "|---:|---:|---:|---:|---:|"]
    for r in mm["table"]:
        lines.append(f"| {r['model_gb']:.0f} | {r['dp']} | {r['published_cgroup_gb']} | "
                     f"{r['published_total_gb']} | {r['kiln_gb']:.0f} |")
    lines += ["", "The constant is this machine's: CPU ranks with torch and gloo, whose two "
              "slots are host memory too. On a GPU host the slots live on the device and the "
              "shards in pinned host memory, and each process carries a device context; its "
              "constant has to be measured there before this column predicts it."]
    return lines + [""]


def _buffers_plot(result: dict[str, Any], path: Path) -> None:
    pts = result["points"]
    blocks = [p["blocks"] for p in pts]

    def mb(key: str) -> list[float]:
        return [p[key] / 1e6 for p in pts]

    _line_plot(path, {"kiln allgather, measured": (blocks, mb("kiln_device_bytes")),
                      "FSDP2, measured peak": (blocks, mb("fsdp2_peak_bytes"))},
               xlabel="blocks", ylabel="a rank's device weight bytes, MB",
               title=f"dp=2, DiT width {result['width']}, fp32, one forward",
               xticks=blocks, log2_x=True,
               baseline=("kiln: 2 x max_block (the engine's count)", blocks,
                         mb("kiln_device_buffer_bytes")))


def _buffers_section(result: dict[str, Any], plot: str) -> list[str]:
    lines = ["## Device weight buffers against depth", "",
             f"Two ranks run one forward of the DiT at width {result['width']} (fp32, "
             f"{result['tokens']} tokens) under kiln allgather and under FSDP2 "
             f"(`{result['command']}`). Measured: the most bytes a rank's allocator held "
             "inside any block's forward over what it held before the model was built. kiln's "
             "device figure leaves out its host shard (pinned host memory on an "
             "accelerator); FSDP2 keeps its shard on the device, so its figure is the whole "
             "peak.", "", f"![device weight buffers]({plot})", "",
             "| blocks | max block MB | kiln 2 x max_block MB | kiln measured MB | kiln host "
             "shard MB | FSDP2 shard MB | FSDP2 peak MB |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        lines.append(f"| {p['blocks']} | {p['max_block_bytes'] / 1e6:.2f} | "
                     f"{p['kiln_device_buffer_bytes'] / 1e6:.2f} | "
                     f"{p['kiln_device_bytes'] / 1e6:.2f} | "
                     f"{p['kiln_host_shard_bytes'] / 1e6:.2f} | "
                     f"{p['fsdp2_sharded_bytes'] / 1e6:.2f} | "
                     f"{p['fsdp2_peak_bytes'] / 1e6:.2f} |")
    first, last = result["points"][0], result["points"][-1]
    lines += ["", f"From {first['blocks']} to {last['blocks']} blocks kiln's measured device "
              f"bytes go from {first['kiln_device_bytes'] / 1e6:.2f} to "
              f"{last['kiln_device_bytes'] / 1e6:.2f} MB and FSDP2's peak from "
              f"{first['fsdp2_peak_bytes'] / 1e6:.2f} to {last['fsdp2_peak_bytes'] / 1e6:.2f} "
              "MB. What kiln holds over its two slots is a transient of the gather, measured, "
              "not broken down here."]
    return lines + [""]


def _tiling_plot(result: dict[str, Any], path: Path) -> None:
    _line_plot(path, {mode: ([p["frames"] for p in result[mode]],
                             [p["transient_bytes"] / 2**20 for p in result[mode]])
                      for mode in ("untiled", "tiled")},
               xlabel="frames", ylabel="decode transient peak, MiB",
               title=f"{result['stage']}, {result['size']}; tiled: "
                     f"{result['simulated_free_bytes_tiled'] / 2**20:.0f} MiB free")


def _tiling_section(result: dict[str, Any], plot: str) -> list[str]:
    lines = ["## Request tiling: transient peak against frames", "",
             f"{result['stage']} at {result['size']}, each point in a fresh process: the peak "
             "resident memory during the decode over what was held before it, less the output "
             "frames themselves. Untiled decodes in one pass; tiled plans tiles for a device "
             f"with {result['simulated_free_bytes_tiled'] / 2**20:.0f} MiB free "
             f"(`{result['command']}`).", "", f"![tiling]({plot})", "",
             "| frames | untiled MiB | tiled MiB | tiles |", "|---:|---:|---:|---:|"]
    for u, t in zip(result["untiled"], result["tiled"], strict=True):
        lines.append(f"| {u['frames']} | {u['transient_bytes'] / 2**20:.1f} | "
                     f"{t['transient_bytes'] / 2**20:.1f} | {t['num_tiles']} |")
    return lines + [""]


THROUGHPUT_ROWS = (("dp1", "jobs alike: dp=1 (one rank)"), ("dp2_uniform", "jobs alike: dp=2"),
                   ("dp2", "mixed: dp=2, kiln's admission"), ("dp2_waves", "mixed: dp=2, waves"),
                   ("dp1_sp2", "mixed: dp=1 x sp=2"))


def _throughput_plot(result: dict[str, Any], path: Path) -> None:
    thr = result["throughput"]
    rows = [(label, thr[key]) for key, label in THROUGHPUT_ROWS if key in thr]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    names = [label for label, _ in rows]
    left.barh(names, [r["jobs_per_hour"] for _, r in rows], color="tab:blue")
    left.set_xlabel("jobs per hour")
    left.invert_yaxis()
    right.barh(names, [r["mean_latency_s"] for _, r in rows], color="tab:orange")
    right.set_xlabel("mean latency, s (queued to done)")
    right.invert_yaxis()
    right.set_yticklabels([])
    fig.suptitle(f"{result['model']}, every job queued at once: {thr['uniform_jobs']} x "
                 f"{thr['uniform']}; {thr['jobs']} mixed jobs")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _layouts_section(result: dict[str, Any], plot: str) -> list[str]:
    lat, thr = result["latency"], result["throughput"]
    lines = ["## Throughput and layouts", "",
             f"{result['model']} on CPU ranks over {result['backend']}, {result['mode']}, "
             f"guidance on, one torch thread per rank (`{result['command']}`).", "",
             "Jobs per hour through the service's rank loop, every job queued at once (median "
             f"of {result['rounds']} runs, interleaved). Jobs alike ({thr['uniform_jobs']} x "
             f"{thr['uniform']}): one rank alone (dp=1) against two replicas of one rank "
             f"(dp=2). Mixed ({thr['jobs']} jobs cycling {'; '.join(thr['mix'])}): dp=2 with "
             "kiln's admission (a free replica takes the next job at the next step boundary) "
             "and in waves (the next job per replica only once every job started has "
             "finished), and dp=1 x sp=2 (one replica of both ranks).", "",
             f"![throughput]({plot})", "",
             "| layout | ranks | jobs/h | makespan s | mean latency s | max latency s |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, label in THROUGHPUT_ROWS:
        r = thr[key]
        lines.append(f"| {label} | {r['ranks']} | {r['jobs_per_hour']} | "
                     f"{r['makespan_s']:.2f} | {r['mean_latency_s']:.2f} | "
                     f"{r['max_latency_s']:.2f} |")
    lines += ["", f"- dp=2 against linear (twice dp=1's jobs per hour, jobs alike): "
              f"{thr['dp2_efficiency_vs_linear']:.2f}.",
              f"- kiln's admission against waves: jobs per hour "
              f"x{thr['jobs_per_hour_kiln_over_waves']}, mean latency "
              f"x{thr['mean_latency_kiln_over_waves']}.",
              f"- sp=2 against dp=2: jobs per hour x{thr['jobs_per_hour_sp2_over_dp2']}, mean "
              f"latency x{thr['mean_latency_sp2_over_dp2']}.", ""]
    if thr["dp2_efficiency_vs_linear"] < 0.95:
        lines += [f"dp=2 falls short of linear ({thr['dp2_efficiency_vs_linear']:.2f}): its two "
                  "ranks gather each block's halves from each other (allgather), a collective "
                  "over gloo on the cores their compute needs, where the rank alone holds every "
                  "block whole; and the two share one machine's memory bandwidth.", ""]
    if thr["jobs_per_hour_sp2_over_dp2"] < 1:
        lines += [f"On this mix sp=2 renders fewer jobs per hour than dp=2 "
                  f"(x{thr['jobs_per_hour_sp2_over_dp2']}): its jobs are too small for the "
                  "split to pay for the four all-to-alls each block adds (the step-time "
                  "section shows where it starts to).", ""]
    lines += [f"One job's latency, seconds (median of {result['latency_reps']} timed jobs a "
              f"round, {result['rounds']} rounds interleaved); sp=1 runs once on one thread "
              "(one rank's cores) and once on two (the same cores sp=2 uses):", "",
              "| clip | tokens | sp=1, 1 thread | sp=2, 2 x 1 thread | sp=1, 2 threads | "
              "sp=1 (2 threads) / sp=2 |", "|---|---:|---:|---:|---:|---:|"]
    for clip, r in lat.items():
        lines.append(f"| {clip} | {r['tokens']} | {r['sp1_1thread']['job_s']:.3f} | "
                     f"{r['sp2']['job_s']:.3f} | {r['sp1_2threads']['job_s']:.3f} | "
                     f"{r['sp1_2threads_over_sp2']:.2f} |")
    return lines + [""]


def _mixed_section(mixed: dict[str, Any]) -> list[str]:
    lines = ["## Mixed workloads: a small job beside a big one", "",
             f"kiln-tiny at dp=2 through the rank loop, two CPU ranks of one thread "
             f"(`{mixed['command']}`): a {mixed['big']} batch job (width x height x frames x "
             f"steps) on one replica; once it has run {mixed['after_steps']} steps a "
             f"{mixed['small']} interactive job arrives on the other. In lock-step every "
             "replica computes every turn, so each of the small job's turns lasts a big step; "
             "time-sliced, the turn choice (`scheduler.turns`) lets the big job sit out while "
             "the small one runs; at their own pace (mode `own_pace`: rank-local weights, which "
             "no step gathers), each replica steps its own job and nobody waits. A job's time "
             "runs from the plan that hands it to its replica to its final status; medians of "
             f"{mixed['rounds']} rounds, the scenarios interleaved in each. The bounds: the small "
             "job within 1.5x its solo time, the big job within 1.1x its solo time plus the "
             "small job's.", "",
             "| mode | small solo, s | big solo, s | scheme | small, s | x solo | big, s | "
             "x (big + small solo) | within bounds |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, m in mixed["modes"].items():
        for name in ("lockstep", "sliced", "own_pace"):
            if name not in m:
                continue
            r = m[name]
            lines.append(f"| {mode} | {m['small_solo_s']:.3f} | {m['big_solo_s']:.2f} | {name} | "
                         f"{r['small_s']:.3f} | {r['small_over_solo']:.2f} | {r['big_s']:.2f} | "
                         f"{r['big_over_bound']:.2f} | "
                         f"{'yes' if r['small_ok'] and r['big_ok'] else 'no'} |")
    lines += ["", "Mode `rank_local` is the same weights as `own_pace` turned in lock-step (as "
              "scripted drivers run it): the time-sliced big job pauses while the small one "
              "runs. The worker runs rank-local groups at their own pace.", ""]
    return lines


def _overnight_section(night: dict[str, Any]) -> list[str]:
    """The overnight scenario (bench/overnight.py): its bounds per mode, from its figures."""
    a = night
    lines = ["### The overnight scenario", "",
             f"The whole service (`{night['command']}`): the API, PostgreSQL, Redis and `kiln "
             f"worker --dp 2` on two CPU ranks, a fresh one per mode. Two batch jobs of "
             f"{a['batch']} (width x height x frames x steps) fill both replicas; "
             f"{a['interactive']} interactive jobs at kiln-tiny's defaults arrive at random "
             "(seeded, over the first 80 % of the batch jobs' time alone). Solo figures: "
             f"the median of {a['solo']} interactive jobs alone on the idle group, in the same "
             "run. Wait: submit to the first step seen (polled every "
             f"{a['poll_ms']:.0f} ms); latency: submit to end, and claim to end (the database's "
             "timestamps); makespan: "
             "the batch jobs' first claim to their last end. The rounds ran solo, alone, mixed "
             f"in turn ({a.get('rounds', 1)} of each); the interactive figures pool every round, "
             "the makespan is the median round's, held against the alone makespan just before "
             "it.", "",
             "| mode | batch step, s | wait p95, s (bound) | latency p95, s (2x solo) | "
             "claim to end p95, s (2x solo) | makespan, s (bound) | preempted for | "
             "ended once |", "|---|---|---|---|---|---|---|---|"]
    for mode, m in night["modes"].items():
        w, lat, run, span = m["wait"], m["latency"], m["running"], m["makespan"]
        once = m["ended_once"]

        def cell(figure: dict[str, Any], digits: int = 3) -> str:
            return (f"{figure['p95_s']:.{digits}f} ({figure['bound_s']:.{digits}f}) "
                    f"{'yes' if figure['ok'] else 'no'}")

        lines.append(f"| {mode} | {m['batch_alone']['step_s']:.3f} | {cell(w)} | {cell(lat)} | "
                     f"{cell(run)} | {span['mixed_s']:.1f} ({span['bound_s']:.1f}) "
                     f"{'yes' if span['ok'] else 'no'} | "
                     f"{m['mixed']['took_replica_by_preemption']} of {m['mixed']['interactive']}"
                     f" | {once['succeeded']} of {once['jobs']}, "
                     f"{'yes' if once['ok'] else 'no'} |")
    taken = [mode for mode, m in night["modes"].items() if m["running"]["ok"]]
    lines += ["", "In allgather mode the group turns in lock-step and a job is taken at a turn "
              "boundary, but a turn of batch work only may be left part-way: rank 0 looks at "
              "the queue while each block computes, the weight group votes in one all-reduce "
              "queued behind each block's gather, and every rank leaves the step together, a "
              "computing one at its next module (`DLOHandle.leave_when`, "
              "`Coordinator.leave_step`). The step keeps the outputs of the blocks it computed "
              "and gives them back when it is taken again (`runtime.step_replay`), so leaving "
              "loses at most the block under way and an exact job's step is left as soon as an "
              "interactive job is due. In rank-local mode the replicas keep their own pace: the "
              "job is claimed for the replica to preempt at once, and that replica (one rank) "
              "leaves its batch step part-way, between two modules of a block "
              "(`runtime.rank_loop._Interrupt`), keeping its blocks the same way; on this CPU "
              "host the other replica's batch job is paused meanwhile (`StepPlan.pause`), since "
              "both replicas compute on the same two cores. A module boundary comes often: "
              "kiln-tiny's self-attention, two thirds of a 256x256x33 block (77 ms on one "
              "core), runs one batch row and head at a time, each slice a module call "
              "(`runtime.models.tiny.SlicedAttention`, bit for bit the batched call), so a "
              "step is left within about 10 ms of the look that finds the job due. What is "
              "left of an interactive job's wait is that, the turn's end and the claim, on two "
              "cores that the API, the database and Redis share with the ranks. Once taken, "
              "the job rendered within 2x its solo time in "
              f"{' and '.join(taken) if taken else 'no mode'} in this run.", ""]
    return lines


def _measured(result: dict[str, Any]) -> str:
    """When the benchmark ran (it may have run on its own, after the suite), with the
    machine's load average then."""
    if "date" not in result:
        return ""
    load = result["load_average"]
    return (f", run {result['date']}, load average {load['start']:.2f} at the start "
            f"and {load['end']:.2f} at the end")


def _adapters_section(result: dict[str, Any]) -> list[str]:
    dit, tiny, rep = result["dit"], result["kiln_tiny"], result["replicas"]
    rank = dit["points"][0]["rank"]
    lines = ["## Adapters", "",
             f"Step time with a rank-{rank} LoRA adapter on every linear layer of every block, "
             "added on the activation side of the shared block weights (`runtime.adapters`), "
             "against none: one process, fp32, one torch thread, the three modes interleaved "
             f"(`{result['command']}`{_measured(result)}). *hooks idle*: a job without "
             "adapters on a model an adapter ran on before (each hook costs "
             f"{result['idle_hook_us_per_linear_call']} us a Linear call); *adapter*: a job "
             "with the adapter. Ratios to no adapter, by wall time and by the CPU time the "
             "process spent (the figure other processes' load on the machine disturbs least, "
             "and the one the 1.10x bound is judged by).", "",
             "| model | input | tokens | flops the adapter adds | no adapter s | hooks idle "
             "(wall · CPU) | adapter (wall · CPU) |", "|---|---|---:|---:|---:|---|---|"]
    models = ((f"DiT, width {dit['width']}, {dit['blocks']} blocks", dit, None),
              (f"kiln-tiny, width {tiny['width']}, {tiny['blocks']} blocks", tiny, "size"))
    for label, model, size in models:
        lines += [f"| {label} | {f'{p[size]}, CFG pair' if size else '1 sequence'} | "
                  f"{p['tokens']} | {model['lora_flops_share']:.0%} | {p['none_s']:.4f} | "
                  f"{p['hooks_idle_ratio']:.3f} · {p['hooks_idle_cpu_ratio']:.3f} | "
                  f"{p['adapter_ratio']:.3f} · {p['adapter_cpu_ratio']:.3f} |"
                  for p in model["points"]]
    worst = max(p["adapter_cpu_ratio"] for p in dit["points"])
    at_dit = " and ".join(f"{p['adapter_cpu_ratio']:.3f}x at {p['tokens']}"
                          for p in dit["points"])
    at_tiny = " and ".join(f"{p['adapter_cpu_ratio']:.3f}x at {p['tokens']}"
                           for p in tiny["points"])
    lines += ["", f"The flops an adapter adds are {rank} x (in + out) per token on each Linear "
              "of in x out, against its own in x out (a Linear on the text tokens counted as on "
              f"the video's). By CPU time the step with the adapter is {at_dit} tokens for the "
              f"DiT: {'within' if worst <= 1.10 else 'over'} the 1.10x bound; and {at_tiny} "
              f"tokens for kiln-tiny, where the adapter adds {tiny['lora_flops_share']:.0%} to "
              "the Linears' flops.", "",
              f"Two replicas: kiln-tiny at dp=2 on two ranks (DLO allgather, one thread each, "
              f"a {rep['size']} job on each), every step of one job timed and counted to what "
              f"its replicas ran in it, in turn ({rep['reps']} steps of each; the slower rank's "
              "median, by wall time and by the CPU time the rank spent):", "",
              "| replicas run | step s (wall · CPU) | over no adapter (wall · CPU) |",
              "|---|---|---|",
              f"| no adapter | {rep['none_s']:.4f} · {rep['none_cpu_s']:.4f} | 1.000 · 1.000 |",
              f"| one adapter, the same on both | {rep['one_s']:.4f} · {rep['one_cpu_s']:.4f} | "
              f"{rep['one_ratio']:.3f} · {rep['one_cpu_ratio']:.3f} |",
              f"| two different adapters, one on each | {rep['two_s']:.4f} · "
              f"{rep['two_cpu_s']:.4f} | {rep['two_ratio']:.3f} · {rep['two_cpu_ratio']:.3f} |",
              "", f"Two different adapters against one: {rep['two_over_one']:.3f}x by wall time, "
              f"{rep['two_over_one_cpu']:.3f}x by CPU time. Both replicas gather the same blocks "
              "whatever their adapters (tests/runtime/test_adapters.py counts the gathers per "
              "step), and each adds its own low-rank term, so a second adapter needs no copy of "
              "the weights and no gather of its own.", ""]
    return lines


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.1f}"


def _steptime_dtype_plot(result: dict[str, Any], path: Path) -> None:
    """Each cast dtype's forward time over checkpoint's against tokens: wall time solid, CPU
    time dashed, one colour per dtype."""
    tokens = [p["tokens"] for p in result["points"]]
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    for colour, dtype in zip(("tab:blue", "tab:red", "tab:green"),
                             (d for d in result["dtypes"] if d != result["base"]), strict=False):
        for key, style, what in (("ratio_to_checkpoint", "-", "wall time"),
                                 ("cpu_ratio_to_checkpoint", "--", "CPU time")):
            ax.plot(tokens, [p[key][dtype] for p in result["points"]], marker="o",
                    color=colour, linestyle=style, label=f"{dtype}, {what}")
    ax.axhline(1.0, color="grey", linewidth=0.8, label=f"{result['base']} (fp32 blocks)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("forward time / checkpoint dtype's")
    ax.set_title(f"two ranks, kiln allgather, DiT width {result['width']} x "
                 f"{result['blocks']} blocks, fp32 ({result['model_bytes'] / 1e9:.2f} GB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _weights_dtype_lines(wd: dict[str, Any]) -> list[str]:
    command = wd.get("command", "python bench/weights_dtype.py --make --model DIR")
    lines = ["### Bytes moved per step and host memory, per weights dtype", "",
             f"A random fp32 Wan checkpoint of {wd['checkpoint_bytes'] / 1e9:.2f} GB on "
             f"{wd['dp']} CPU ranks (dp={wd['dp']}, allgather, every block streamed), loaded "
             "once per weights dtype, one denoising step on each rank "
             f"(`{command}`{_measured(wd)}). Bytes: what rank 0's engine gathered and "
             "copied over the step (`DLOHandle.bytes_moved`). Host memory: the ranks' summed "
             "PSS after the step less the same ranks' before they load anything (torch, the "
             "pipelines' code, a process group). On the CPU it holds the engine's device "
             "buffers too (two slots, and the compute buffer a cast layer is upcast into "
             "just before it runs: here a large Linear's weight 1 MiB of rows at a time, "
             "`UPCAST_CHUNK_BYTES`), which on an accelerator live on the device; the column "
             "beside leaves them out.",
             "", "| weights dtype | gathered per step MB | copied per step MB | gathered over "
             "checkpoint's | rank 0's host shard MB | host memory GB | of it device buffers "
             "GB | host less device buffers GB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, r in wd["runs"].items():
        lines.append(f"| {dtype} | {_mb(r['bytes_gathered_per_step'])} | "
                     f"{_mb(r['bytes_copied_per_step'])} | "
                     f"{r['bytes_gathered_per_step_over_checkpoint']:.3f} | "
                     f"{_mb(r['host_shard_bytes'])} | {r['host_bytes'] / 1e9:.2f} | "
                     f"{r['device_buffer_bytes'] / 1e9:.2f} | "
                     f"{r['host_bytes_less_device_buffers'] / 1e9:.2f} |")
    lines.append("")
    for dtype, fall in wd["falls"].items():
        host, less = fall["host_bytes"], fall["host_bytes_less_device_buffers"]
        def held(figure: dict[str, Any], target: float = fall["target"]) -> str:
            return f"{'meets' if figure['meets_target'] else 'short of'} its {target:.0%} target"

        lines.append(f"- {dtype}: host memory {host['fall']:.1%} below checkpoint's "
                     f"({held(host)}); less the device buffers, {less['fall']:.1%} "
                     f"({held(less)}).")
    return lines + [""]


def _steptime_dtype_lines(st: dict[str, Any], plot: str) -> list[str]:
    dtypes = [d for d in st["dtypes"] if d != st["base"]]
    per = st["per_dtype"]
    engine = ""
    if st.get("source", {}).get("engine_modified"):
        engine = (f" The engine measured is commit {st['source']['commit']}'s with changes to "
                  "runtime/dlo not yet committed then.")
    lines = ["### Step time against tokens, per weights dtype", "",
             f"Two CPU ranks ({st['backend']}, {st['threads_per_rank']} torch thread each) "
             f"build the DiT of `bench/dit.py` ({st['blocks']} blocks of width {st['width']}, "
             f"fp32, {st['model_bytes'] / 1e9:.2f} GB) once and put a copy of it under kiln "
             f"allgather per weights dtype; each rank runs its own input, as a dp=2 replica "
             f"does (`{st['command']}`{_measured(st)}). The three run in rotation at each "
             f"token count, every forward from a barrier; a figure is the median of "
             f"{st['reps']} forwards, the slower rank's, best of {st['passes']} passes, over "
             "checkpoint's in the same pass (checkpoint: the blocks as the model has them, "
             "the engine before the option). Wall time, and the CPU time the rank process "
             "spent (compute, the transfer thread, gloo's), which other processes' load on "
             f"the machine disturbs least.{engine}", "",
             f"![step time per weights dtype]({plot})", "",
             "| tokens | checkpoint s | " + " | ".join(f"{d} (wall · CPU)" for d in dtypes)
             + " |", "|---:|---:|" + "---|" * len(dtypes)]
    for p in st["points"]:
        lines.append(f"| {p['tokens']} | {p['seconds'][st['base']]:.3f} | " + " | ".join(
            f"{p['ratio_to_checkpoint'][d]:.3f} · {p['cpu_ratio_to_checkpoint'][d]:.3f}"
            for d in dtypes) + " |")
    lines += ["", "Per forward, rank 0's engine gathered " + ", ".join(
        f"{_mb(f['bytes_gathered_per_forward'])} MB in {d} "
        f"({f['bytes_gathered_over_checkpoint']:.3f}x)" for d, f in per.items())
        + "; the output's largest difference from checkpoint's, over its largest value: "
        + ", ".join(f"{per[d]['max_rel_error_vs_checkpoint']:.1e} in {d}" for d in dtypes)
        + ".", ""]
    return lines


def _tiers_lines(sc: dict[str, Any], plot: str) -> list[str]:
    tiers = step_cache.tier_points(sc)
    tier_of = {p["threshold"]: t for t, p in tiers.items()}
    exact = sc["exact"]
    lines = ["### Quality tiers: blocks, time and frames against exact", "",
             f"{sc['model']}, {sc['prompts']} prompts at {sc['steps']} steps ({sc['size']}) on "
             f"one CPU rank of {sc['threads']} torch thread, each prompt exact and at every "
             f"first-block cache threshold in turn, {_times(sc['reps'])} (`{sc['command']}`"
             f"{_measured(sc)}). Blocks: computed per job, mean over the prompts. Wall time: a "
             "job's, prepare to decoded frames, the median of its runs, mean over the "
             "prompts. PSNR: the frames (floats in [0, 1], peak 1) against exact's, 100 dB "
             "when identical. SSIM: an 11x11 Gaussian window (sigma 1.5) per frame and "
             "channel, mean over positions, channels and frames. Mean and least over the "
             "prompts. The curve the tiers' thresholds (`common.quality.TIERS`) are chosen "
             "from, with them marked:", "", f"![quality tiers]({plot})", "",
             "| tier | threshold | blocks a job | fewer than exact | wall s | wall / exact | "
             "PSNR dB, mean · least | SSIM, mean · least |",
             "|---|---:|---:|---:|---:|---:|---|---|",
             f"| exact | - | {exact['blocks']:.1f} | 1.00x | {exact['wall_s']:.3f} | 1.000 | "
             "identical | identical |"]
    for tier, p in tiers.items():
        lines.append(f"| {tier} | {p['threshold']:g} | {p['blocks']:.1f} | "
                     f"{p['fewer_by']:.2f}x | {p['wall_s']:.3f} | {p['wall_over_exact']:.3f} | "
                     f"{p['psnr_mean']:.1f} · {p['psnr_min']:.1f} | "
                     f"{p['ssim_mean']:.4f} · {p['ssim_min']:.4f} |")
    lines += ["", "Every threshold measured:", "",
              "| threshold | tier | blocks a job | fewer than exact | wall / exact | PSNR dB, "
              "mean · least | SSIM, mean · least |", "|---:|---|---:|---:|---:|---|---|"]
    for p in sc["points"]:
        lines.append(f"| {p['threshold']:g} | {tier_of.get(p['threshold'], '')} | "
                     f"{p['blocks']:.1f} | {p['fewer_by']:.2f}x | {p['wall_over_exact']:.3f} | "
                     f"{p['psnr_mean']:.1f} · {p['psnr_min']:.1f} | "
                     f"{p['ssim_mean']:.4f} · {p['ssim_min']:.4f} |")
    return lines + [""]


def _gathers_tiers_lines(gt: dict[str, Any]) -> list[str]:
    pairings = gt["pairings"]
    exact = pairings[0]
    lines = ["### Gathers skipped at dp=2 on a mixed load", "",
             f"{gt['model']} at dp={gt['dp']} ({gt['mode']}, {gt['backend']}, "
             f"{gt['threads_per_rank']} torch thread a rank): the two replicas render "
             "`bench/step_cache.py`'s prompts two at a time "
             f"({gt['jobs_per_replica']} jobs each, {gt['size']}, {gt['steps']} steps), the "
             f"pair at each pairing of tiers in turn, {_times(gt['reps'])} "
             f"(`{gt['command']}`{_measured(gt)}). A block is gathered unless both "
             "replicas skip it: a step whose forwards both jobs take from their caches "
             "gathers the first block only. Gathers: the blocks a job's replica acquired, each "
             "one a gather (both replicas take part in every gather), mean over the jobs "
             "(least and most beside it); wall time: the group's per job (its slower rank's, "
             "the median of the runs), mean over the jobs.", "",
             "| replica 0's job | replica 1's job | gathers a job (least - most) | skipped | "
             "over both exact | blocks computed (0 · 1) | wall s | wall / both exact |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for p in pairings:
        blocks = " · ".join(f"{b:g}" for b in p["blocks_computed_per_job"])
        lines.append(f"| {p['tiers'][0]} | {p['tiers'][1]} | {p['gathers_per_job']:g} "
                     f"({p['gathers_min']} - {p['gathers_max']}) | "
                     f"{p['gathers_skipped_per_job']:g} | {p['gathers_over_exact']:.3f} | "
                     f"{blocks} | {p['wall_s']:.3f} | {p['wall_over_exact']:.3f} |")
    beside = [p for p in pairings if "exact" in p["tiers"] and p is not exact]
    if beside and all(p["gathers_per_job"] == exact["gathers_per_job"] for p in beside):
        lines += ["", "A caching job beside an exact one skips no gather "
                  f"({beside[0]['gathers_per_job']:g} a job, as both exact): the exact replica "
                  "computes every block of every step, and the other joins its gathers. The "
                  "wall times are measured, not broken down here."]
    return lines + [""]


def _bytes_and_steps_section(out: Path, report_dir: Path) -> list[str]:
    """Bytes and steps: the weights dtypes' bytes, memory and step time, the quality tiers'
    blocks, time and frames, and the gathers two replicas skip at them; from whichever of
    their JSON files are under ``out``."""
    def load(name: str) -> dict[str, Any] | None:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    wd, st, sc, gt = (load(n) for n in ("weights_dtype", "steptime_dtype", "step_cache",
                                        "gathers_tiers"))
    if not any((wd, st, sc, gt)):
        return []
    info = json.loads((out / "machine.json").read_text())
    lines = ["## Bytes and steps", "",
             "What storing the blocks in a narrower dtype (`--weights-dtype`: "
             "`runtime.dlo.cast`) and caching steps (the quality tiers: `common.quality`, "
             "`runtime.step_cache`) save. Measured on this machine "
             f"({info['cpu']}, {info['cores']} CPU cores); each benchmark's command is below, "
             "with when it ran and the machine's load average then where it records them, "
             "and every figure is from that run's JSON.", ""]
    if wd is not None:
        lines += _weights_dtype_lines(wd)
    if st is not None:
        plot = out / "steptime_dtype.png"
        _steptime_dtype_plot(st, plot)
        lines += _steptime_dtype_lines(st, os.path.relpath(plot, report_dir))
    if sc is not None:
        plot = out / "step_cache.png"
        step_cache.plot(sc, plot)
        lines += _tiers_lines(sc, os.path.relpath(plot, report_dir))
    if gt is not None:
        lines += _gathers_tiers_lines(gt)
    return lines


def _soak_section(soak: dict[str, Any]) -> list[str]:
    states = ", ".join(f"{k} {v}" for k, v in soak["states"].items())
    faults = ", ".join(f"{k} {v}" for k, v in soak["faults"].items())
    still = ", ".join(f"{k} {'never' if v is None else f'{v:.1f} s'}"
                      for k, v in sorted(soak["queue_still_after_fault_s"].items()))
    lines = ["## Reliability: a short soak", "",
             f"The whole service on this machine (a private Redis, PostgreSQL behind a proxy "
             f"that can refuse, the API, Celery, `kiln worker --dp 2`), {soak['jobs']} kiln-tiny "
             f"jobs while {sum(soak['faults'].values())} faults come at seeded times "
             f"(`{soak['command']}`; `make chaos` runs the long soak):", "",
             "| figure | value |", "|---|---|",
             f"| jobs | {soak['jobs_submitted']} submitted ({soak['submit_retries']} submits "
             f"retried, {soak['unsubmitted']} given up); {states} |",
             f"| faults | {faults}; and {soak['poison_kills']} ranks killed rendering the "
             f"{soak['poisonous']} poisonous jobs |",
             f"| lost · duplicated · wrongly charged | {soak['lost']} · {soak['duplicated']} · "
             f"{soak['wrongly_charged']} |",
             f"| dead | {soak['dead']} (the poisonous jobs: {soak['poisonous']}) |",
             f"| attempts beyond the first | {soak['retries']} |",
             f"| the queue standing still after a fault, longest per kind | {still} |",
             f"| longest stall with work queued | {soak['longest_stall_s']:.1f} s (in or after "
             f"a {soak['longest_stall_after'] or 'no'} fault) |",
             f"| wall time · throughput | {soak['wall_seconds']:.0f} s · "
             f"{soak['jobs_per_s']:.2f} jobs/s |"]
    if soak["failures"]:
        lines += ["", "The soak failed: " + "; ".join(soak["failures"])]
    return lines + [""]


def _service_section(submit: dict[str, Any], latency: dict[str, Any],
                     claim: dict[str, Any], claim_1m: dict[str, Any] | None = None
                     ) -> list[str]:
    lines = ["## Service", "",
             f"Submits: {submit['clients']} concurrent clients POST /v1/jobs against "
             f"`kiln api --workers {submit['api_workers']}` on {submit['backend']} "
             f"(`{submit['command']}`), {submit['requests']} requests a run:", "",
             "| run | submits/s | p50 ms | p90 ms | p99 ms | failures |",
             "|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(submit["runs"], 1):
        lines.append(f"| {i} | {r['submits_per_s']:.0f} | {r['p50_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['p99_ms']:.1f} | {sum(r['failures'].values())} |")
    lines += ["", f"End-to-end overhead per job: tiny kiln-tiny jobs submitted one after another "
              f"to an API and a `kiln worker` on {latency['backend']} "
              f"(`{latency['command']}`); overhead is submit -> succeeded seen, less the "
              "render time the worker recorded:", "",
              "| dp | jobs | overhead median ms | p90 ms | submit ms | queue wait ms | "
              "seen lag ms | in-worker ms | render ms |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in latency["results"]:
        m = r["median_ms"]
        lines.append(f"| {r['dp']} | {r['num_jobs']} | {r['overhead_ms']['median']} | "
                     f"{r['overhead_ms']['p90']} | {m['submit_ms']} | {m['queue_wait_ms']} | "
                     f"{m['seen_lag_ms']} | {r['in_worker_ms_median']} | {m['render_ms']} |")
    claims = [claim] + ([claim_1m] if claim_1m else [])
    lines += ["", "Schedule + claim at scale: one `claim_for_group` call (the policy's schedule "
              "and the atomic claim) for one free rank, with the queue on PostgreSQL and Redis "
              "holding the jobs below:", "",
              "| queued jobs | users | calls | first call s | median ms | p90 ms | p99 ms | "
              "of it, the database ms | one-row commit ms | command |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {c['jobs']:,} | {c['users']:,} | {c['calls']} | {c['first_call_seconds']:.2f} | "
              f"{c['median_ms']:.2f} | {c['p90_ms']:.2f} | {c['p99_ms']:.2f} | "
              f"{c['database_median_ms']:.2f} | {c['one_row_commit_median_ms']:.2f} | "
              f"`{c['command']}` |" for c in claims]
    lines += ["", "The first call reconciles the Redis index with the database, as after a "
              "Redis restart."]
    return lines + [""]


def headline(out: Path) -> str:
    """The report's headline figures in one paragraph, from the JSON under ``out``; the README
    quotes it as it stands."""
    info = json.loads((out / "machine.json").read_text())
    st = json.loads((out / "steptime.json").read_text())
    first, last = st["points"][0], st["points"][-1]

    def ratios(point: dict[str, Any]) -> str:
        r = point["ratio_to_resident"]
        return ", ".join(f"{r[m]:.2f}×" for m in ("fsdp2", "kiln-allgather", "kiln-rank-local",
                                                   "kiln-mapped"))

    parts = [f"`make bench` took {info['suite_seconds'] / 60:.1f} minutes on "
             f"{info['cores']} cores ({info['cpu']}). Step time on two ranks over a resident "
             f"copy per rank (PyTorch FSDP2, kiln allgather, rank-local, mapped): at "
             f"{first['tokens']} tokens {ratios(first)}; at {last['tokens']} tokens "
             f"{ratios(last)}; one job split over both ranks (sp=2, mapped) finishes in "
             f"{first['ratio_to_resident']['sp2-mapped']:.2f}× and "
             f"{last['ratio_to_resident']['sp2-mapped']:.2f}× a resident rank's time; the "
             f"planner picks {last['planner']['throughput']['layout']} for jobs per hour and "
             f"{last['planner']['latency']['layout']} for latency at {last['tokens']} tokens."]
    if (out / "coldstart.json").is_file():
        cold = json.loads((out / "coldstart.json").read_text())
        dp = max(cold["runs"], key=int)
        m = cold["runs"][dp]["modes"]
        parts.append(f"Cold start on a {cold['model_gb']:.2f} GB checkpoint at dp={dp}, steady "
                     "host memory with the page cache: naive copies "
                     f"{m['naive']['steady_gb']:.2f} GB, FSDP2 {m['fsdp2']['steady_gb']:.2f}, "
                     f"kiln allgather {m['allgather']['steady_gb']:.2f}, rank-local "
                     f"{m['rank-local']['steady_gb']:.2f}, mapped {m['mapped']['steady_gb']:.2f} "
                     f"({m['framework']['steady_gb']:.2f} GB of each is the ranks' torch and "
                     "process group).")
    if (out / "buffers.json").is_file():
        pts = json.loads((out / "buffers.json").read_text())["points"]
        parts.append(f"A rank's device weight bytes from {pts[0]['blocks']} to "
                     f"{pts[-1]['blocks']} blocks: kiln {pts[0]['kiln_device_bytes'] / 1e6:.2f} "
                     f"to {pts[-1]['kiln_device_bytes'] / 1e6:.2f} MB, FSDP2's peak "
                     f"{pts[0]['fsdp2_peak_bytes'] / 1e6:.2f} to "
                     f"{pts[-1]['fsdp2_peak_bytes'] / 1e6:.2f} MB.")
    if (out / "layouts.json").is_file():
        thr = json.loads((out / "layouts.json").read_text())["throughput"]
        parts.append(f"kiln-tiny jobs per hour: dp=2 at {thr['dp2_efficiency_vs_linear']:.2f} "
                     "of linear on jobs alike; on a mixed workload kiln's admission "
                     f"{thr['jobs_per_hour_kiln_over_waves']:.2f}× the waves' jobs per hour, "
                     f"and sp=2 {thr['jobs_per_hour_sp2_over_dp2']:.2f}× dp=2's.")
    if all((out / f"{n}.json").is_file() for n in ("submit", "claim")):
        submit = json.loads((out / "submit.json").read_text())
        claim = json.loads((out / "claim.json").read_text())
        p99 = statistics.median(r["p99_ms"] for r in submit["runs"])
        parts.append(f"{submit['clients']} clients submit "
                     f"{submit['submits_per_s']['median']:.0f} jobs/s (p99 {p99:.0f} ms) on "
                     f"{submit['backend']}; one schedule + claim at {claim['jobs']:,} queued "
                     f"jobs takes {claim['median_ms']:.2f} ms (median).")
    if (out / "soak.json").is_file():
        soak = json.loads((out / "soak.json").read_text())
        parts.append(f"A {soak['jobs']}-job soak under {sum(soak['faults'].values())} faults: "
                     f"{soak['lost']} lost, {soak['duplicated']} duplicated, "
                     f"{soak['wrongly_charged']} wrongly charged.")
    return " ".join(parts)


def write_report(out: Path, report: Path) -> None:
    """bench/REPORT.md from the JSON files under ``out`` (and the plots drawn from them)."""
    info = json.loads((out / "machine.json").read_text())
    st = json.loads((out / "steptime.json").read_text())
    plot = out / "steptime.png"
    _steptime_plot(st, plot)
    rel = os.path.relpath(out, report.parent)
    lines = ["# kiln benchmark report", "",
             f"Measured {info['date']} on {info['cpu']}, {info['cores']} cores, "
             f"{info['memory_bytes'] / 2**30:.1f} GiB; Python {info['python']}, torch "
             f"{info['torch']}, gloo {'available' if info['gloo'] else 'missing'}. The suite "
             f"took {info['suite_seconds'] / 60:.1f} minutes (`make bench`). Every figure is "
             f"from this run ([{rel}/]({rel}/): one JSON per benchmark); modes were measured "
             "side by side, interleaved, so drift hits all alike.", "",
             f"**Headlines.** {headline(out)}", ""]
    lines += _steptime_section(st, os.path.relpath(plot, report.parent))
    if (out / "coldstart.json").is_file():
        cold = json.loads((out / "coldstart.json").read_text())
        _coldstart_plot(cold, out / "coldstart.png")
        lines += _coldstart_section(cold, os.path.relpath(out / "coldstart.png", report.parent))
        mm = memory_model(cold)
        (out / "memory_model.json").write_text(json.dumps(mm, indent=1))
        lines += _memory_model_section(mm)
    if (out / "buffers.json").is_file():
        buffers = json.loads((out / "buffers.json").read_text())
        _buffers_plot(buffers, out / "buffers.png")
        lines += _buffers_section(buffers, os.path.relpath(out / "buffers.png", report.parent))
    if (out / "tiling.json").is_file():
        tiling = json.loads((out / "tiling.json").read_text())
        _tiling_plot(tiling, out / "tiling.png")
        lines += _tiling_section(tiling, os.path.relpath(out / "tiling.png", report.parent))
    if (out / "layouts.json").is_file():
        layouts = json.loads((out / "layouts.json").read_text())
        _throughput_plot(layouts, out / "throughput.png")
        lines += _layouts_section(layouts, os.path.relpath(out / "throughput.png",
                                                           report.parent))
    if (out / "mixed.json").is_file():
        lines += _mixed_section(json.loads((out / "mixed.json").read_text()))
    if (out / "overnight.json").is_file():
        lines += _overnight_section(json.loads((out / "overnight.json").read_text()))
    if (out / "adapters.json").is_file():
        lines += _adapters_section(json.loads((out / "adapters.json").read_text()))
    lines += _bytes_and_steps_section(out, report.parent)
    if (out / "soak.json").is_file():
        lines += _soak_section(json.loads((out / "soak.json").read_text()))
    if all((out / f"{n}.json").is_file() for n in ("submit", "service_latency", "claim")):
        million = out / "claim_1m.json"
        lines += _service_section(*(json.loads((out / f"{n}.json").read_text())
                                    for n in ("submit", "service_latency", "claim")),
                                  json.loads(million.read_text()) if million.is_file() else None)
    if (out / "cuda.json").is_file():
        lines += cuda_section(json.loads((out / "cuda.json").read_text()), out, report.parent)
    else:
        lines += cuda_missing_section()
    report.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--report", default="bench/REPORT.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: run the GPU check (bench/cuda_check.py) and add its section "
                         "to the report of the CPU figures under --out")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the JSON already under --out")
    args = ap.parse_args()
    out, report = Path(args.out), Path(args.report)
    if args.device == "cuda":
        # The GPU section alone, beside the CPU figures already under --out.
        if not args.quick and not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device here (torch "
                     f"{torch.__version__}); `make install` on a GPU machine installs the CUDA "
                     "build (see the Makefile)")
        out.mkdir(parents=True, exist_ok=True)
        print("cuda check ...", file=sys.stderr)
        run_script("cuda", out, args.quick)
    elif not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        info = machine()
        took: dict[str, float] = {}
        sizes = ({"tokens": [64, 128], "width": 256, "blocks": 4, "reps": 1, "passes": 1}
                 if args.quick else
                 # 2048 tokens would add five minutes (a forward takes 13 s on one core).
                 {"tokens": [128, 256, 512, 1024], "width": 1024, "blocks": 12, "reps": 2,
                  "passes": 2})
        print("step time against tokens ...", file=sys.stderr)
        (out / "steptime.json").write_text(json.dumps(steptime.run(**sizes), indent=1))
        took["steptime"] = round(time.perf_counter() - started, 1)
        for name, (_, small) in SCRIPTS.items():
            if name == "cuda" or (args.quick and small is None):
                continue
            print(f"{name} ...", file=sys.stderr)
            t0 = time.perf_counter()
            run_script(name, out, args.quick)
            took[name] = round(time.perf_counter() - t0, 1)
        info["suite_seconds"] = round(time.perf_counter() - started, 1)
        info["seconds"] = took
        (out / "machine.json").write_text(json.dumps(info, indent=1))
    write_report(out, report)
    print(f"report: {report} (figures: {out}/)")


if __name__ == "__main__":
    main()
