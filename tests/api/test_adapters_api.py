"""/v1/adapters and a job's ``adapters``: every file is checked against its model's transformer
before anything is kept, each refusal is a 4xx naming the problem that leaves no row and no
stored object, users see their own adapters and the shared ones, and a job naming an adapter it
may not use is refused at the door."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from conftest import make_settings
from fastapi.testclient import TestClient
from safetensors.torch import save

from api.app import create_app

TINY_DIM = 128  # kiln-tiny's width (TinyConfig.dim)


def lora_file(modules: dict[str, tuple[int, int]], *, rank: int = 4,
              config: dict[str, Any] | None = None) -> bytes:
    """A diffusers-format LoRA (``transformer.<module>.lora_A/B.weight``) for Linears of these
    (in, out) features; ``config``: diffusers' ``lora_adapter_metadata`` entry."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        tensors[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        tensors[f"transformer.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    metadata = None
    if config is not None:
        metadata = {"lora_adapter_metadata": json.dumps(
            {f"transformer.{k}": v for k, v in config.items()})}
    return save(tensors, metadata=metadata)


GOOD = lora_file({"blocks.0.attn_out": (TINY_DIM, TINY_DIM),
                  "blocks.1.qkv": (TINY_DIM, 3 * TINY_DIM)}, config={"r": 4, "lora_alpha": 4})


def register(api, who: str, data: bytes, **fields: str) -> Any:  # noqa: ANN001
    fields.setdefault("name", "squares")
    return api.client.post("/v1/adapters", headers=api.auth(who), data=fields,
                           files={"file": ("a.safetensors", io.BytesIO(data),
                                           "application/octet-stream")})


def stored(api) -> list[str]:  # noqa: ANN001
    root = Path(api.store.root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) \
        if root.exists() else []


def submit(api, who: str, adapters: list[dict[str, Any]], **fields: Any) -> Any:  # noqa: ANN001
    return api.client.post("/v1/jobs", headers=api.auth(who),
                           json={"prompt": "a red square", "model": "kiln-tiny",
                                 "adapters": adapters, **fields})


def test_a_checked_file_is_registered_stored_by_its_hash_and_listed(api) -> None:  # noqa: ANN001
    r = register(api, "alice", GOOD)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["model"], body["family"], body["rank"], body["shared"]) == (
        "squares", "kiln-tiny", "kiln-tiny", 4, False)
    assert stored(api) == [f"adapters/{body['sha256']}.lora"]
    assert [a["id"] for a in api.client.get("/v1/adapters",
                                            headers=api.auth("alice")).json()["data"]] == [
        body["id"]]
    # The same bytes under another name share the object; it goes with the last registration.
    again = register(api, "alice", GOOD, name="squares-2").json()
    assert stored(api) == [f"adapters/{body['sha256']}.lora"]
    assert api.client.delete(f"/v1/adapters/{body['id']}",
                             headers=api.auth("alice")).status_code == 200
    assert stored(api) == [f"adapters/{body['sha256']}.lora"]
    api.client.delete(f"/v1/adapters/{again['id']}", headers=api.auth("alice"))
    assert stored(api) == []


def test_refusals_name_the_problem_and_keep_nothing(api) -> None:  # noqa: ANN001
    before = api.snapshot()
    cases = [
        # another family: kiln-big is no model kiln adapts
        (register(api, "alice", GOOD, model="kiln-big"), 422, "generic takes no LoRA"),
        (register(api, "alice", lora_file({"blocks.0.attn_out": (32, TINY_DIM)})), 422,
         "shape mismatch at 'blocks.0.attn_out'"),
        (register(api, "alice", lora_file({"blocks.9.attn_out": (TINY_DIM, TINY_DIM)})), 422,
         "unknown key 'blocks.9.attn_out'"),
        (register(api, "alice", lora_file({"blocks.0.attn_out": (TINY_DIM, TINY_DIM)},
                                          config={"r": 8})), 422,
         "wrong rank at 'blocks.0.attn_out'"),
        (register(api, "alice", b"not a tensor file"), 422, "not a safetensors LoRA file"),
        (register(api, "alice", GOOD, model="no-such-model"), 422, "unknown model"),
        (register(api, "alice", GOOD, name="has:colon"), 422, "name"),
        (register(api, "alice", GOOD, shared="true"), 403, "only admins"),
    ]
    for response, code, text in cases:
        assert response.status_code == code, response.text
        assert text in response.text, response.text
        assert "kiln-adapter-" not in response.text  # no server path in the message
    assert api.snapshot() == before
    assert stored(api) == []
    # A taken name is a 409, and keeps nothing more.
    register(api, "alice", GOOD)
    before = api.snapshot()
    assert register(api, "alice", GOOD).status_code == 409
    assert api.snapshot() == before


def test_users_see_their_own_and_the_shared_ones_only(api) -> None:  # noqa: ANN001
    mine = register(api, "alice", GOOD).json()
    shared = register(api, "root", GOOD, name="everyone", shared="true").json()
    assert shared["shared"] is True
    assert {a["name"] for a in api.client.get("/v1/adapters",
                                              headers=api.auth("bob")).json()["data"]} == {
        "everyone"}
    for method in ("get", "delete"):
        r = getattr(api.client, method)(f"/v1/adapters/{mine['id']}", headers=api.auth("bob"))
        assert r.status_code == 404, r.text
    assert api.client.delete(f"/v1/adapters/{shared['id']}",
                             headers=api.auth("alice")).status_code == 403
    # Bob's job naming Alice's adapter is refused at the door, like an id that does not exist.
    before = api.snapshot()
    r = submit(api, "bob", [{"id": mine["id"]}])
    assert r.status_code == 422 and "adapter not found" in r.text, r.text
    assert api.snapshot() == before
    # ... and the shared one is his to use.
    r = submit(api, "bob", [{"id": shared["id"], "scale": 0.5}])
    assert r.status_code == 201, r.text
    assert r.json()["adapters"] == [{"id": shared["id"], "scale": 0.5}]


def test_a_job_naming_a_deleted_adapter_fails_at_the_door(api) -> None:  # noqa: ANN001
    adapter = register(api, "alice", GOOD).json()
    assert submit(api, "alice", [{"id": adapter["id"]}]).status_code == 201
    api.client.delete(f"/v1/adapters/{adapter['id']}", headers=api.auth("alice"))
    before = api.snapshot()
    r = submit(api, "alice", [{"id": adapter["id"]}])
    assert r.status_code == 422 and "adapters.0.id" in r.text, r.text
    assert api.snapshot() == before
    # Bounds: a model the adapter is not for, the count, the scale.
    other = register(api, "alice", GOOD, name="again").json()
    for adapters, fields, text in [
        ([{"id": other["id"]}], {"model": "kiln-big"}, "the adapter is for kiln-tiny"),
        ([{"id": other["id"]}] * 5, {}, "at most 4"),
        ([{"id": other["id"], "scale": 9}], {}, "less than or equal to 4"),
        ([{"id": other["id"]}] * 2, {}, "named twice"),
    ]:
        r = submit(api, "alice", adapters, **fields)
        assert r.status_code == 422 and text in r.text, r.text


def test_a_batch_sets_one_default_for_all_its_lines(api) -> None:  # noqa: ANN001
    adapter = register(api, "alice", GOOD).json()
    r = api.client.post("/v1/batches", headers=api.auth("alice"), json={
        "defaults": {"model": "kiln-tiny", "adapters": [{"id": adapter["id"], "scale": 0.8}]},
        "jobs": [{"prompt": "a red square"}, {"prompt": "a blue circle", "adapters": []}]})
    assert r.status_code == 201, r.text
    jobs = api.client.get(f"/v1/jobs?batch_id={r.json()['id']}",
                          headers=api.auth("alice")).json()["data"]
    by_prompt = {job["prompt"]: job["adapters"] for job in jobs}
    assert by_prompt == {"a red square": [{"id": adapter["id"], "scale": 0.8}],
                         "a blue circle": None}


def test_the_job_page_names_its_adapters_with_their_scales(api) -> None:  # noqa: ANN001
    mine = register(api, "alice", GOOD, name="squares").json()
    gone = register(api, "alice", GOOD, name="gone").json()
    job = submit(api, "alice", [{"id": mine["id"], "scale": 0.8}, {"id": gone["id"]}]).json()
    api.client.delete(f"/v1/adapters/{gone['id']}", headers=api.auth("alice"))
    page = api.client.get(f"/dashboard/jobs/{job['id']}", headers=api.auth("alice")).text
    shown = page[page.index('<span id="adapters">'):][:400]
    assert "squares × 0.8" in shown
    assert f'<span class="mono">{gone["id"]}</span> <span class="dim">(deleted)</span> × 1.0' \
        in shown


def test_a_file_over_max_upload_bytes_is_a_413_and_keeps_nothing(api, tmp_path: Path) -> None:  # noqa: ANN001
    settings = make_settings(api.db.url, api.settings.redis_prefix, tmp_path,
                             max_upload_bytes=len(GOOD) - 1)
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    before = api.snapshot()
    with TestClient(app) as client:
        r = client.post("/v1/adapters", headers=api.auth("alice"), data={"name": "big"},
                        files={"file": ("a.safetensors", io.BytesIO(GOOD),
                                        "application/octet-stream")})
    assert r.status_code == 413, r.text
    assert api.snapshot() == before and stored(api) == []
