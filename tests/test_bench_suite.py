"""The benchmark suite's smoke run: every section measures, writes its JSON, draws its plot and
its part of the report, in a minute or two (``--quick``: small sizes; the service sections use
PostgreSQL and Redis, as the service's tests do)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_the_quick_suite_writes_json_a_plot_and_a_report_from_them(tmp_path: Path) -> None:
    out, report = tmp_path / "results", tmp_path / "REPORT.md"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--quick",
                           "--out", str(out), "--report", str(report)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert f"report: {report}" in done.stdout
    steptime = json.loads((out / "steptime.json").read_text())
    assert [p["tokens"] for p in steptime["points"]] == [64, 128]
    assert all(p["ratio_to_resident"]["resident"] == 1.0 for p in steptime["points"])
    assert (out / "steptime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.read_text()
    assert "![step time against tokens](results/steptime.png)" in text
    for p in steptime["points"]:  # the table is the JSON's figures
        assert f"| {p['tokens']} | 1.000 | {p['ratio_to_resident']['fsdp2']:.3f} |" in text
        assert {"sp2-allgather", "sp2-mapped"} <= set(p["ratio_to_resident"])
        pick = p["planner"]["throughput"]
        assert pick["ratio_to_resident"] == p["ratio_to_resident"][pick["measured_as"]]
        assert f"{pick['layout']} ({pick['measured_as']}: {pick['ratio_to_resident']:.3f})" in text
    for name in ("coldstart", "buffers", "tiling", "layouts", "submit", "service_latency",
                 "claim", "adapters", "steptime_dtype", "step_cache", "gathers_tiers"):
        assert json.loads((out / f"{name}.json").read_text())["command"].startswith(
            "python bench/"), name
    for plot in ("coldstart", "buffers", "tiling", "throughput", "steptime_dtype", "step_cache"):
        assert (out / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for title in ("## Cold start", "## The memory model", "## Device weight buffers",
                  "## Request tiling", "## Throughput and layouts", "## Adapters",
                  "## Bytes and steps", "## Service", "## GPU"):
        assert title in text
    adapters = json.loads((out / "adapters.json").read_text())
    for p in adapters["dit"]["points"]:  # each row is the JSON's figures
        assert (f"| {p['tokens']} | {adapters['dit']['lora_flops_share']:.0%} | "
                f"{p['none_s']:.4f} |") in text
    assert f"against one: {adapters['replicas']['two_over_one']:.3f}x by wall time" in text
    throughput = json.loads((out / "layouts.json").read_text())["throughput"]
    assert {"dp1", "dp2", "dp2_waves", "dp1_sp2"} <= set(throughput)
    assert f"dp=2 against linear (twice dp=1's jobs per hour, jobs alike): " \
           f"{throughput['dp2_efficiency_vs_linear']:.2f}." in text
    assert "No GPU was present for this run" in text  # --quick runs no GPU check
    cold = json.loads((out / "coldstart.json").read_text())
    assert set(cold["runs"]) == {"2"}
    for run in cold["runs"].values():  # each mode's row is the JSON's steady figure
        for mode in ("naive", "fsdp2", "allgather", "rank-local", "mapped"):
            assert f"| {mode} | {run['modes'][mode]['load_seconds']:.1f} |" in text
    model = json.loads((out / "memory_model.json").read_text())
    assert [r["dp"] for r in model["fit"]["steady_gb"]["points"]] == [2]
    assert f"| 400 | 8 | 443 | 843 | {model['table'][-1]['kiln_gb']:.0f} |" in text


def test_the_committed_report_is_what_its_json_says(tmp_path: Path) -> None:
    """bench/REPORT.md, written again from the JSON committed beside it, comes out the same:
    no figure in it was typed by hand."""
    shutil.copytree(REPO / "bench" / "results", tmp_path / "results")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--report-only",
                           "--out", str(tmp_path / "results"),
                           "--report", str(tmp_path / "REPORT.md")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "REPORT.md").read_text() == (REPO / "bench" / "REPORT.md").read_text()


def test_the_gpu_section_is_written_from_the_gpu_checks_json(tmp_path: Path) -> None:
    """``--device cuda`` adds the GPU section to the report of the figures already there; with
    ``--quick`` the check is its CPU dry run, which exercises the same code."""
    shutil.copytree(REPO / "bench" / "results", tmp_path / "results")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--device", "cuda",
                           "--quick", "--out", str(tmp_path / "results"),
                           "--report", str(tmp_path / "REPORT.md")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    cuda = json.loads((tmp_path / "results" / "cuda.json").read_text())
    text = (tmp_path / "REPORT.md").read_text()
    assert "## GPU" in text and "No GPU was present" not in text
    assert "A dry run on the CPU" in text
    for p in cuda["steptime"]["points"]:
        assert f"| {p['tokens']} | " in text
    dtypes = cuda["weights_dtypes"]
    assert dtypes["dtypes"] == ["checkpoint", "bf16", "fp8"]
    for p in dtypes["points"]:  # each row is the JSON's figures
        assert (f"| {p['tokens']} | {p['seconds']['checkpoint'] * 1e3:.2f} | "
                f"{p['seconds']['bf16'] * 1e3:.2f} |") in text
    tiers = cuda["quality_tiers"]["tiers"]
    assert set(tiers) == {"exact", "balanced", "fast"} and tiers["exact"]["fewer_by"] == 1
    assert "### Weights dtypes" in text and "### Quality tiers (kiln-tiny)" in text
    assert (tmp_path / "results" / "cuda_steptime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_quotes_the_committed_reports_headlines() -> None:
    """The README's headline paragraph is the one the committed figures give, word for word."""
    # Here, not at the top: the suite module loads matplotlib, which no other test needs.
    from bench.suite import headline

    assert headline(REPO / "bench" / "results") in (REPO / "README.md").read_text()
