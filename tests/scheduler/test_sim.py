"""The scheduling simulator of bench/scheduler_sim.py, on synthetic step times (no torch)."""

from __future__ import annotations

from bench.scheduler_sim import Size, Timing, simulate_kiln, simulate_waves, workload
from scheduler.policy import PolicyConfig

SMALL, BIG = Size(128, 128, 9), Size(256, 256, 17)
TIMING = {SMALL: Timing(prepare=0.0, step=1.0, decode=0.0),
          BIG: Timing(prepare=0.0, step=8.0, decode=0.0)}


def test_waves_of_equal_jobs_take_steps_times_step_cost_per_wave() -> None:
    jobs = workload(4, [SMALL], seed=0, mean_gap=None)
    out = simulate_waves(jobs, 2, TIMING, idle=0.0)
    pairs = [jobs[0:2], jobs[2:4]]
    assert out.makespan == sum(max(j.num_inference_steps for j in p) for p in pairs)
    assert len(out.waits) == 4


def test_admission_at_step_boundaries_beats_waves_on_a_mixed_backlog() -> None:
    jobs = workload(120, [SMALL, BIG], seed=1, mean_gap=None)
    waves = simulate_waves(jobs, 2, TIMING, idle=0.1)
    kiln = simulate_kiln(jobs, 2, TIMING, idle=0.1, config=PolicyConfig())
    assert len(kiln.waits) == len(waves.waits) == 120
    assert kiln.jobs_per_hour() > 1.3 * waves.jobs_per_hour()
