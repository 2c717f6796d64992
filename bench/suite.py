"""The benchmark suite: every figure measured side by side in one run, written as one JSON per
benchmark beside a report with tables and plots.

    python bench/suite.py [--out bench/results] [--report bench/REPORT.md] [--quick]

The report opens with the machine it ran on; every number in it comes from this run's JSON.
Sections so far: step time against tokens at dp=2 (``bench/steptime.py``). ``--quick``: small
sizes, for a smoke run in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import steptime  # noqa: E402
from runtime.planner import machine_description  # noqa: E402


def machine() -> dict[str, Any]:
    """What the figures were measured on: the planner's description of the machine (CPU,
    cores, memory, torch), with Python, gloo and the date."""
    return {**machine_description(), "python": platform.python_version(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _steptime_plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tokens = [p["tokens"] for p in result["points"]]
    for name in steptime.MODES:
        ax.plot(tokens, [p["ratio_to_resident"][name] for p in result["points"]], marker="o",
                label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("forward time / resident copy's")
    ax.set_title(f"dp=2, DiT width {result['width']} x {result['blocks']} blocks, fp32 "
                 f"({result['model_bytes'] / 1e9:.2f} GB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _steptime_section(result: dict[str, Any], plot: str) -> list[str]:
    lines = ["## Step time against tokens (dp=2)", "",
             f"Each rank runs its own input through the same model ({result['blocks']} blocks "
             f"of width {result['width']}, fp32, {result['model_bytes'] / 1e9:.2f} GB) held "
             "four ways, in rotation; the figure is the forward time over the resident copy's "
             f"in the same pass (best of {result['passes']} passes, median of {result['reps']} "
             f"forwards each, the slower rank's; torch threads per rank: "
             f"{result['threads_per_rank']}).",
             "", f"![step time against tokens]({plot})", "",
             "| tokens | " + " | ".join(steptime.MODES) + " | resident s |",
             "|---:|" + "---:|" * (len(steptime.MODES) + 1)]
    for p in result["points"]:
        lines.append(f"| {p['tokens']} | " + " | ".join(
            f"{p['ratio_to_resident'][m]:.3f}" for m in steptime.MODES)
            + f" | {p['seconds']['resident']:.3f} |")
    lines += ["", "Where kiln loses, and why:", ""]
    lines += [f"- {f}" for f in result["findings"]] or ["- nowhere in this run"]
    return lines + [""]


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
             "side by side, interleaved, so drift hits all alike.", ""]
    lines += _steptime_section(st, os.path.relpath(plot, report.parent))
    report.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--report", default="bench/REPORT.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the JSON already under --out")
    args = ap.parse_args()
    out, report = Path(args.out), Path(args.report)
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        info = machine()
        sizes = ({"tokens": [64, 128], "width": 256, "blocks": 4, "reps": 1, "passes": 1}
                 if args.quick else
                 {"tokens": [256, 512, 1024, 2048], "width": 1024, "blocks": 12, "reps": 2,
                  "passes": 2})
        print("step time against tokens ...", file=sys.stderr)
        (out / "steptime.json").write_text(json.dumps(steptime.run(**sizes), indent=1))
        info["suite_seconds"] = round(time.perf_counter() - started, 1)
        (out / "machine.json").write_text(json.dumps(info, indent=1))
    write_report(out, report)
    print(f"report: {report} (figures: {out}/)")


if __name__ == "__main__":
    main()
