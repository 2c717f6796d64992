"""The layout planner: its model on a profile given by hand, its cache, and `kiln plan` itself."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from common.settings import Settings
from kiln.cli import app
from runtime.planner import (
    JobShape,
    Profile,
    checkpoint_fingerprint,
    layouts_of,
    load_or_measure,
    machine_description,
    memory_table,
    plan,
    predict,
    profile_path,
)
from runtime.sequence import Layout

GB = 10**9


def _profile(**changes: object) -> Profile:
    base = Profile(
        model="kiln-tiny", machine=machine_description(),
        checkpoint=checkpoint_fingerprint("kiln-tiny"), created_at=time.time(), cores=8,
        num_blocks=10, max_block_bytes=GB // 10, block_bytes=GB, nonblock_bytes=GB // 100,
        width_tokens=(100, 400), block_seconds=(0.01, 0.001), gather_seconds_per_byte=1e-9,
        gather_latency_seconds=0.0, all_to_all_seconds_per_byte=1e-9,
        all_to_all_latency_seconds=1e-4,
        activation_bytes_per_token=8192, prepare_seconds=0.1, decode_seconds=0.2,
        decode_pixels=64 * 64 * 9, framework_bytes=300_000_000,
        per_rank_bytes={"allgather": 100_000_000, "rank-local": 50_000_000},
        crowded_collective_seconds=0.02)
    return replace(base, **changes)


def test_a_job_shape_is_widthxheightxframesxsteps():
    assert JobShape.parse("256x128x17x30") == JobShape(256, 128, 17, 30)
    assert JobShape(64, 64, 9, 4).tokens("kiln-tiny") == 48
    with pytest.raises(ValueError, match="WIDTHxHEIGHTxFRAMESxSTEPS"):
        JobShape.parse("64x64x9")


def test_layouts_are_every_dp_x_sp_of_the_world_that_the_heads_allow():
    assert [str(x) for x in layouts_of(4)] == ["dp=4 x sp=1", "dp=2 x sp=2", "dp=1 x sp=4"]
    assert [str(x) for x in layouts_of(4, heads=6)] == ["dp=4 x sp=1", "dp=2 x sp=2"]


def test_host_memory_is_the_weights_once_plus_a_constant_per_rank():
    p = _profile()
    job = JobShape()
    two = predict(p, Layout(dp=2), "allgather", job, tokens=400)
    four = predict(p, Layout(dp=4), "allgather", job, tokens=400)
    per_rank = p.framework_bytes + p.per_rank_bytes["allgather"]
    assert two.host_bytes == p.block_bytes + p.nonblock_bytes + 2 * per_rank
    assert four.host_bytes - two.host_bytes == 2 * per_rank


def test_a_split_job_computes_its_share_and_pays_for_its_all_to_alls():
    p = _profile()
    alone = predict(p, Layout(dp=1, sp=1), "rank-local", JobShape(), tokens=400)
    split = predict(p, Layout(dp=1, sp=2), "rank-local", JobShape(), tokens=400)
    assert split.compute_seconds == pytest.approx(10 * (0.01 + 0.001 * 200))
    assert alone.compute_seconds == pytest.approx(10 * (0.01 + 0.001 * 400))
    assert split.exchange_seconds > 0 and alone.exchange_seconds == 0
    assert split.latency_seconds < alone.latency_seconds
    # An all-gather adds the bytes a rank receives; rank-local copies are in the compute fit.
    gathered = predict(p, Layout(dp=2), "allgather", JobShape(), tokens=400)
    local = predict(p, Layout(dp=2), "rank-local", JobShape(), tokens=400)
    assert gathered.step_seconds - local.step_seconds == pytest.approx(GB / 2 * 1e-9)


def test_more_ranks_than_cores_share_them_and_wait_at_each_collective():
    p = _profile(cores=2)
    four = predict(p, Layout(dp=1, sp=4), "rank-local", JobShape(), tokens=400)
    assert four.compute_seconds == pytest.approx(2 * 10 * (0.01 + 0.001 * 100))
    assert four.exchange_seconds >= 10 * 4 * 0.02  # four all-to-alls per block, each waiting


def test_gathers_across_machines_run_at_the_link_between_them():
    p = _profile(gather_seconds_per_byte=1e-11)  # fast on one machine
    one = predict(p, Layout(dp=4), "allgather", JobShape(), tokens=400)
    two = predict(p, Layout(dp=4), "allgather", JobShape(), tokens=400, nodes=2,
                  inter_node_bytes_per_second=1e9)
    per_block = p.block_bytes / p.num_blocks * 3 / 4  # what a rank of four receives
    assert two.transfer_seconds == pytest.approx(p.num_blocks * per_block * 1e-9)
    assert one.transfer_seconds == pytest.approx(p.num_blocks * per_block * 1e-11)
    # A replica within one machine's ranks exchanges at the machine's rate.
    inside = predict(p, Layout(dp=2, sp=2), "rank-local", JobShape(), tokens=400, nodes=2,
                     inter_node_bytes_per_second=1e6)
    across = predict(p, Layout(dp=1, sp=4), "rank-local", JobShape(), tokens=400, nodes=2,
                     inter_node_bytes_per_second=1e6)
    assert across.exchange_seconds > 100 * inside.exchange_seconds


def test_the_plan_marks_the_best_layouts_and_says_why():
    p = _profile()
    result = plan(p, 4, JobShape(), tokens=4000, heads=8)
    assert len(result.predictions) == 6  # 3 layouts x 2 modes
    assert result.best_latency.sp == 4  # long sequences: splitting wins one job's latency
    assert result.best_throughput.sp == 1  # replicas: the most jobs per hour
    assert "splitting the job over 4 ranks" in result.reasons["latency"]
    assert "replica(s)" in result.reasons["throughput"]


def test_the_memory_table_extrapolates_with_the_fitted_constant():
    rows = memory_table(_profile())
    assert [(r["model_gb"], r["dp"]) for r in rows] == [(33, 4), (124, 4), (185, 4), (400, 4),
                                                        (400, 8)]
    first = rows[0]
    assert first["kiln_gb"] == pytest.approx(33 + 4 * 0.4)
    assert (first["published_cgroup_gb"], first["published_total_gb"]) == (47, 80)


def test_a_cached_profile_is_used_until_the_machine_or_model_changes(tmp_path, monkeypatch):
    path = profile_path(tmp_path, "kiln-tiny")
    path.parent.mkdir(parents=True)
    path.write_text(_profile().to_json())
    profile, source = load_or_measure("kiln-tiny", tmp_path)
    assert "cached profile" in source and profile.num_blocks == 10
    assert _profile(created_at=time.time() - 90 * 86400).stale_because("kiln-tiny") == (
        "it is 90 days old")
    assert "machine or torch changed" in _profile(machine={"cpu": "other"}).stale_because(
        "kiln-tiny")
    measured = []
    monkeypatch.setattr("runtime.planner.measure_profile",
                        lambda model: measured.append(model) or _profile(num_blocks=12))
    path.write_text(_profile(version=0).to_json())
    profile, source = load_or_measure("kiln-tiny", tmp_path)
    assert measured == ["kiln-tiny"] and profile.num_blocks == 12
    assert "stale: it was measured by another version" in source
    assert json.loads(path.read_text())["num_blocks"] == 12  # saved for next time


@pytest.mark.chaos  # a real profile of two ranks: `make chaos` runs it, `make test` does not
def test_kiln_plan_measures_kiln_tiny_on_two_ranks_and_prints_every_layout(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("kiln.cli.plan.get_settings", lambda: Settings())
    result = CliRunner().invoke(app, ["plan", "--model", "kiln-tiny", "--world", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [x["dp"] * x["sp"] for x in out["layouts"]] == [2, 2, 2, 2]
    assert {(x["dp"], x["sp"], x["mode"]) for x in out["layouts"]} == {
        (2, 1, "allgather"), (2, 1, "rank-local"), (1, 2, "allgather"), (1, 2, "rank-local")}
    assert out["best_latency"] and out["best_throughput"] and out["reasons"]["latency"]
    assert out["profile"].startswith("measured now")
    again = CliRunner().invoke(app, ["plan", "--model", "kiln-tiny", "--world", "2"])
    assert again.exit_code == 0 and "cached profile" in again.stdout
    assert "best for" in again.stdout
    bad = CliRunner().invoke(app, ["plan", "--world", "2", "--job", "64x64"])
    assert bad.exit_code == 2 and "WIDTHxHEIGHTxFRAMESxSTEPS" in bad.output
