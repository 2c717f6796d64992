"""The records kept in Redis: named fields, one codec, and Lua scripts that read the same names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scheduler.cost import CostModel
from scheduler.policy import QueuedJob
from scheduler.records import (
    ChargeRecord,
    JobMeta,
    RecordError,
    decode_costs,
    encode_costs,
    field_names,
)

LUA = Path(__file__).resolve().parents[2] / "scheduler" / "lua"
# The variable each script decodes a record into (the convention common.lua states).
DECODED_AS = {"m": JobMeta, "c": ChargeRecord}


def test_a_job_meta_round_trips_as_a_json_object_of_its_fields() -> None:
    job = QueuedJob(job_id="j1", owner="7", model="kiln-tiny", job_class="batch", priority=3,
                    due=1767268800.25, deadline=1767272400.5, num_tokens=1560,
                    num_inference_steps=8)
    raw = JobMeta.of(job).encode()
    assert json.loads(raw) == {"owner": "7", "model": "kiln-tiny", "job_class": "batch",
                               "priority": 3, "num_tokens": 1560, "num_inference_steps": 8,
                               "deadline": 1767272400.5}
    assert JobMeta.queued_job(raw, job_id="j1", due=1767268800.25) == job
    assert JobMeta.decode(raw.encode()) == JobMeta.of(job)  # as Redis returns it: bytes


def test_a_job_meta_holds_every_field_of_a_queued_job_but_its_id_and_due_time() -> None:
    assert set(field_names(JobMeta)) == set(field_names(QueuedJob)) - {"job_id", "due"}


def test_a_charge_record_round_trips() -> None:
    charge = ChargeRecord.of(owner="7", job_class="interactive", cost_per_step=0.78125,
                             num_inference_steps=16)
    assert charge.charged_seconds == 12.5
    assert ChargeRecord.decode(charge.encode()) == charge


@pytest.mark.parametrize("raw", [
    '["m:batch:5", "7", "batch", 5, 48, 4, null, "m"]',  # format 1: a positional list
    '{"owner": "7", "job_class": "batch"}',  # fields missing
    '{"owner": "7", "model": "m", "job_class": "batch", "priority": 5, "num_tokens": 48, '
    '"num_inference_steps": 4, "deadline": null, "extra": 1}',  # a field it does not know
    "not json",
])
def test_a_value_that_is_not_a_job_meta_of_this_format_is_refused(raw: str) -> None:
    with pytest.raises(RecordError):
        JobMeta.decode(raw)


def test_learned_costs_round_trip() -> None:
    costs = CostModel()
    costs.observe("kiln-tiny", 48, 0.5)
    costs.observe("kiln-tiny", 768, 2.0)
    again = decode_costs(encode_costs(costs))
    assert again.step_seconds("kiln-tiny", 300) == costs.step_seconds("kiln-tiny", 300)


def test_the_lua_scripts_read_records_only_by_the_fields_the_codec_declares() -> None:
    read: dict[str, set[str]] = {name: set() for name in DECODED_AS}
    for path in sorted(LUA.glob("*.lua")):
        text = path.read_text()
        for name in re.findall(r"local (\w+) = cjson\.decode", text):
            assert name in DECODED_AS, f"{path.name} decodes a record into {name!r}"
        for name in DECODED_AS:
            if re.search(rf"local {name} = cjson\.decode", text):
                read[name] |= set(re.findall(rf"\b{name}\.(\w+)", text))
    for name, record in DECODED_AS.items():
        assert read[name], f"no script reads a {record.__name__}"
        assert read[name] <= set(field_names(record)), record.__name__
    # Python writes every record; the one thing a script encodes is the pick's reply.
    assert {p.name for p in LUA.glob("*.lua") if "cjson.encode" in p.read_text()} == {"pick.lua"}
    # What the scripts need to find a job's keys and to charge its user.
    assert read["m"] == {"owner", "model", "job_class", "priority"}
    assert read["c"] == {"owner", "job_class", "charged_seconds"}
