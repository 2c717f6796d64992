"""The planner counts each rank's LoRA adapter cache at its budget: on the device and in host
memory, and out of the device memory that resident blocks may use."""

from __future__ import annotations

from common.settings import Settings
from kiln.worker import adapter_budget
from runtime.planner import JobShape, plan, predict
from runtime.sequence import Layout
from tests.runtime.test_planner import GB, _profile


def test_an_adapter_budget_is_counted_per_rank_and_leaves_fewer_blocks_resident():
    p = _profile()
    job = JobShape()
    bare = predict(p, Layout(dp=2), "allgather", job, tokens=400)
    kept = predict(p, Layout(dp=2), "allgather", job, tokens=400, adapter_bytes=GB // 4)
    assert kept.device_bytes - bare.device_bytes == GB // 4
    assert kept.host_bytes - bare.host_bytes == 2 * GB // 4  # each of the two ranks
    # A device budget of 0.9 GB: 0.2 GB for the two slots, then 0.1 GB blocks.
    assert plan(p, 1, job, tokens=400, device_budget=9 * GB // 10).best_latency \
        .resident_blocks == 7
    assert plan(p, 1, job, tokens=400, device_budget=9 * GB // 10,
                adapter_bytes=GB // 4).best_latency.resident_blocks == 4


def test_only_a_model_that_takes_adapters_gets_a_budget():
    s = Settings(_env_file=None, adapter_cache_bytes=123)  # type: ignore[call-arg]
    assert adapter_budget(s, "kiln-tiny") == 123
    assert adapter_budget(s, "no-such-model") == 0
