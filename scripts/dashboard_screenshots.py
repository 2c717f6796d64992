"""Screenshots of the dashboard for the docs, from a real run.

Start kiln (``make run``, or ``kiln up``), then::

    python scripts/dashboard_screenshots.py --out docs/screenshots

It submits work as a user of the service would (a few interactive jobs, an overnight batch
whose deadline leaves some of it to expire, a job too long to finish before the shots), waits
until the service is busy, and saves full-page screenshots of the overview, the jobs view, the
workers view, a job's page with its video, and the batch's report, taken with headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, through Selenium, as the browser test does).
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

# What kiln-tiny was trained to draw (README: shapes, colours, directions).
PROMPTS = ["a red circle moving left", "a blue square moving right", "a green circle moving up",
           "a yellow square moving down", "a purple triangle moving right",
           "a cyan circle moving down", "a green triangle moving left", "a red square bouncing"]


def _until(what: str, check, timeout: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="http://127.0.0.1:8000")
    parser.add_argument("--key-file", default="var/admin.key")
    parser.add_argument("--out", default="docs/screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args()
    key = Path(args.key_file).read_text().strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    http = httpx.Client(base_url=args.api, headers={"Authorization": f"Bearer {key}"},
                        timeout=30)

    shown = []
    for i, prompt in enumerate(PROMPTS[:4]):
        body = {"prompt": prompt, "num_inference_steps": 24, "seed": i}
        shown.append(http.post("/v1/jobs", json=body).raise_for_status().json()["id"])
    deadline = datetime.now(UTC) + timedelta(seconds=30)
    batch = http.post("/v1/batches", json={
        "name": "nightly shapes", "window": {"deadline": deadline.isoformat()},
        "defaults": {"width": 128, "height": 128, "num_inference_steps": 16},
        "jobs": [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": 100 + i} for i in range(80)],
    }).raise_for_status().json()["id"]
    _until("the first videos", lambda: http.get(f"/v1/jobs/{shown[-1]}").json()["status"]
           == "succeeded")
    _until("the batch's deadline", lambda: http.get(f"/v1/batches/{batch}").json()["status"]
           == "finished", timeout=600)
    for i, prompt in enumerate(PROMPTS[4:]):  # running and queued while the shots are taken
        http.post("/v1/jobs", json={"prompt": prompt, "width": 256, "height": 256,
                                    "num_frames": 17, "num_inference_steps": 60, "seed": i})

    options = webdriver.ChromeOptions()
    options.binary_location = args.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1440,900"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(args.chromedriver), options=options)
    try:
        browser.get(f"{args.api}/dashboard")  # the key goes in through the page's form
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#keyform button").click()
        time.sleep(2)
        pages = [("overview", "/dashboard#overview"), ("jobs", "/dashboard#jobs"),
                 ("workers", "/dashboard#workers"), ("job-page", f"/dashboard/jobs/{shown[0]}"),
                 ("batch-report", f"/dashboard/batches/{batch}")]
        for name, path in pages:
            browser.get(args.api + path)
            time.sleep(3)
            height = browser.execute_script("return document.documentElement.scrollHeight")
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # the whole page
                "width": 1440, "height": min(max(900, height), 1600), "deviceScaleFactor": 1,
                "mobile": False})
            time.sleep(0.5)
            browser.save_screenshot(str(out / f"{name}.png"))
            browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
            print(out / f"{name}.png")
    finally:
        browser.quit()


if __name__ == "__main__":
    main()
