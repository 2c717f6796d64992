"""/v1/workers: what the worker group's report says of each rank's weights."""

from __future__ import annotations

from storage.workers import GroupReport, report_group


def test_workers_shows_each_ranks_weights_dtype_and_stored_block_bytes(api) -> None:  # noqa: ANN001
    with api.session() as s:
        report_group(s, GroupReport(
            id="node1-123", name="node1", host="node1", model="kiln-tiny", mode="allgather",
            platform="cpu", dp_size=2, world_size=2, goal="throughput",
            ranks=[{"rank": r, "device": "cpu", "weights_dtype": "fp8",
                    "stored_block_bytes": 253_224_960, "model_bytes": 1_043_513_600,
                    "host_shard_bytes": 126_612_480}
                   for r in (0, 1)]))
        report_group(s, GroupReport(
            id="node2-456", name="node2", host="node2", model="kiln-tiny", mode="allgather",
            platform="cpu", dp_size=1, world_size=1, goal="latency",
            ranks=[{"rank": 0, "device": "cpu"}]))
    groups = {g["id"]: g for g in
              api.client.get("/v1/workers", headers=api.auth("alice")).json()["data"]}
    ranks = groups["node1-123"]["ranks"]
    assert [(r["weights_dtype"], r["stored_block_bytes"]) for r in ranks] == \
        [("fp8", 253_224_960)] * 2
    # A figure the schema does not declare stays inside the report.
    assert all("host_shard_bytes" not in r for r in ranks)
    # A group whose ranks report neither shows null for both.
    (older,) = groups["node2-456"]["ranks"]
    assert (older["weights_dtype"], older["stored_block_bytes"]) == (None, None)


def test_workers_shows_what_each_ranks_last_step_gathered_and_computed(api) -> None:  # noqa: ANN001
    with api.session() as s:
        report_group(s, GroupReport(
            id="node3-789", name="node3", host="node3", model="kiln-tiny", mode="allgather",
            platform="cpu", dp_size=2, world_size=2, goal="throughput",
            ranks=[{"rank": 0, "device": "cpu", "step_gathers": 4, "step_blocks_computed": 1},
                   {"rank": 1, "device": "cpu", "step_gathers": 4}]))
    (group,) = [g for g in api.client.get("/v1/workers", headers=api.auth("alice")).json()["data"]
                if g["id"] == "node3-789"]
    assert [(r["step_gathers"], r["step_blocks_computed"]) for r in group["ranks"]] == \
        [(4, 1), (4, None)]
