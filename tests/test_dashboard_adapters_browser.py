"""The dashboard's submit form in a real browser (headless Chromium, as
tests/test_dashboard_browser.py drives it) against the API: it offers the caller's and the
shared adapters of the chosen model, and the job it submits names the one chosen, with its
scale; the job page shows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import serving_api
from sqlalchemy import select
from test_dashboard_browser import _browser, _connect, _shot, _wait

from runtime.models.tiny_adapter import NAME, WEIGHTS
from storage.tables import Job


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = _browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_the_submit_form_offers_the_models_adapters_and_the_job_names_the_one_chosen(
        browser: Any, db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     reconcile_interval_seconds=3600) as svc:
        key = svc.keys["alice"]
        r = httpx.post(f"{svc.url}/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                       data={"name": NAME, "model": "kiln-tiny"},
                       files={"file": (WEIGHTS.name, WEIGHTS.read_bytes())}, timeout=60)
        assert r.status_code == 201, r.text
        adapter_id = r.json()["id"]
        _connect(browser, svc.url, key)
        browser.get(f"{svc.url}/dashboard#jobs")
        form = browser.find_element(By.ID, "submit")
        _wait(browser, "the adapter field", lambda d: form.find_element(
            By.ID, "adapter-label").is_displayed())
        Select(form.find_element(By.NAME, "adapter")).select_by_value(adapter_id)
        scale = form.find_element(By.NAME, "adapter_scale")
        scale.clear()
        scale.send_keys("0.5")
        form.find_element(By.NAME, "prompt").send_keys("a red circle moving right")
        _shot(browser, "submit-with-adapter")
        form.find_element(By.ID, "submit-button").click()
        link = _wait(browser, "the submitted job's link",
                     lambda d: d.find_elements(By.CSS_SELECTOR, "#submitted a"))[0]
        job_id = link.text
        with svc.db.session() as s:
            assert s.scalar(select(Job.adapters).where(Job.id == job_id)) == [
                {"id": adapter_id, "scale": 0.5}]
        browser.get(f"{svc.url}/dashboard/jobs/{job_id}")
        shown = _wait(browser, "the job's adapters",
                      lambda d: d.find_elements(By.ID, "adapters"))[0]
        assert shown.text == f"{NAME} × 0.5"
