"""The dashboard in a real browser against a real `kiln up`: headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by Selenium) opens the dashboard with a key, submits
a job from the page, watches its progress bar reach 100 % from live events, opens the job page
and plays the video, cancels another job from the page, and opens the workers view and a batch's
report. Screenshots of each go to ``KILN_SCREENSHOT_DIR`` (default ``test-artifacts/screenshots``
beside the project). A session of two users leaves none of their keys in a log file or in a URL
the browser asked for.

Without the browser the test is skipped, except under CI (``CI`` set), where ``.ci/run``
installs it and its absence is an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import KILN, kiln_up, up_env

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SHOTS = Path(os.environ.get("KILN_SCREENSHOT_DIR",
                            Path(__file__).resolve().parent.parent / "test-artifacts" /
                            "screenshots"))


def _browser() -> Any:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        missing.append(f"selenium ({exc})")
    if missing:
        message = f"no headless browser: {', '.join(missing)} missing"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--autoplay-policy=no-user-gesture-required",
                "--mute-audio"):
        options.add_argument(arg)
    # The performance log holds the DevTools network events: every URL the browser asked for.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = _browser()
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, what: str, condition: Any, timeout: float = 60) -> Any:
    """``condition`` once it holds. Live updates redraw the tables, so an element found may be
    gone by the next call: that is asked again, not a failure."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, message=f"waiting for {what}")


def _click(driver: Any, what: str, selector: str) -> None:
    """Clicks the element ``selector`` names once it is there, in one step in the page (live
    updates redraw the tables, so an element found in one call may be gone at the next)."""
    _wait(driver, what, lambda d: d.execute_script(
        "const el = document.querySelector(arguments[0]); if (el) el.click(); return !!el;",
        selector))


def _connect(driver: Any, base: str, key: str) -> None:
    """Opens the dashboard and enters ``key`` in its form, the one way a key gets in."""
    from selenium.webdriver.common.by import By
    driver.get(f"{base}/dashboard")
    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#keyform button").click()


def _shot(driver: Any, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


# Collects, in the page, every step count the jobs table shows for one job, so the test can
# tell the bar moved through the steps (live progress) and did not just appear full.
_WATCH_STEPS = """
const jobId = arguments[0];
window.seenSteps = [];
const note = () => {
  const row = document.querySelector(`#jobs tr[data-job="${jobId}"]`);
  const steps = row && row.querySelector(".steps");
  if (steps && window.seenSteps[window.seenSteps.length - 1] !== steps.textContent) {
    window.seenSteps.push(steps.textContent);
  }
};
new MutationObserver(note).observe(document.getElementById("jobs"),
  { subtree: true, childList: true, characterData: true, attributes: true });
note();
"""


def test_dashboard_in_a_browser_submits_watches_plays_and_cancels(
        browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with kiln_up(tmp_path, "--dp", "2") as (base, key):
        headers = {"Authorization": f"Bearer {key}"}
        _connect(browser, base, key)
        _wait(browser, "the event stream", lambda d: d.find_element(By.ID, "live").text == "live")
        _wait(browser, "a ready worker group", lambda d: _ready(base, headers))

        # Submit from the page: the model's defaults are filled in; a bad size is refused
        # beside its field, then a good job goes in.
        browser.get(f"{base}/dashboard#jobs")
        form = browser.find_element(By.ID, "submit")
        _wait(browser, "the model's defaults",
              lambda d: form.find_element(By.NAME, "width").get_attribute("value") == "64")
        assert form.find_element(By.NAME, "num_frames").get_attribute("value") == "9"
        form.find_element(By.NAME, "prompt").send_keys("a red circle moving right")
        width = form.find_element(By.NAME, "width")
        width.clear()
        width.send_keys("72")  # not a multiple of 16: the API names the field
        form.find_element(By.ID, "submit-button").click()
        width_error = form.find_element(By.CSS_SELECTOR, '.field-error[data-for="width"]')
        _wait(browser, "the width's error", lambda d: "16" in width_error.text)
        width.clear()
        width.send_keys("128")
        for name, value in (("height", "128"), ("num_inference_steps", "48"), ("seed", "7")):
            field = form.find_element(By.NAME, name)
            field.clear()
            field.send_keys(value)
        form.find_element(By.ID, "submit-button").click()
        link = _wait(browser, "the submitted job's link",
                     lambda d: d.find_elements(By.CSS_SELECTOR, "#submitted a"))[0]
        job_id = link.text
        assert width_error.text == ""
        browser.execute_script(_WATCH_STEPS, job_id)
        row = f'#jobs tr[data-job="{job_id}"]'
        _wait(browser, "the progress bar at 100 %", lambda d: d.execute_script(
            "const r = document.querySelector(arguments[0]);"
            "return r && r.querySelector('.bar > div').style.width === '100%' &&"
            " r.querySelector('.chip').textContent === 'succeeded';", row), timeout=180)
        seen = browser.execute_script("return window.seenSteps")
        assert seen[-1] == "48/48", seen
        # The bar moved through steps between the first and the last: live progress.
        assert any(0 < int(s.split("/")[0]) < 48 for s in seen), seen
        _shot(browser, "jobs")

        # The job page plays the video.
        _click(browser, "the job's link", f'{row} a[href^="/dashboard/jobs/"]')
        video = _wait(browser, "the video", lambda d: d.find_elements(By.TAG_NAME, "video"))[0]
        _wait(browser, "the video's metadata", lambda d: d.execute_script(
            "return arguments[0].readyState >= 1 && arguments[0].duration > 0;", video))
        duration = browser.execute_script("return arguments[0].duration;", video)
        assert duration == pytest.approx(9 / 8, abs=0.2)  # nine frames at 8 fps
        browser.execute_script("arguments[0].play();", video)
        _wait(browser, "the video to play", lambda d: d.execute_script(
            "return arguments[0].currentTime > 0;", video))
        browser.execute_script("arguments[0].pause(); arguments[0].currentTime = 0.5;", video)
        time.sleep(0.5)
        _shot(browser, "job-page")

        # Start from an image: for kiln-tiny the form offers a file, previews it, uploads it
        # and the job names the upload; the job page shows it.
        from PIL import Image

        start = tmp_path / "start.png"
        Image.new("RGB", (64, 64), (220, 40, 40)).save(start)
        browser.get(f"{base}/dashboard#jobs")
        form = browser.find_element(By.ID, "submit")
        _wait(browser, "the file field", lambda d: form.find_element(
            By.ID, "input-label").is_displayed())
        form.find_element(By.NAME, "prompt").send_keys("a red square moving left")
        form.find_element(By.ID, "input-file").send_keys(str(start))
        _wait(browser, "the input's preview", lambda d: d.execute_script(
            "const i = document.querySelector('#input-preview img');"
            "return i && i.complete && i.naturalWidth === 64;"))
        _shot(browser, "submit-with-image")
        form.find_element(By.ID, "submit-button").click()
        started = _wait(browser, "the job started from the image", lambda d: [
            a.text for a in d.find_elements(By.CSS_SELECTOR, "#submitted a")
            if a.text != job_id])[0]
        assert httpx.get(f"{base}/v1/jobs/{started}", headers=headers,
                         timeout=30).json()["input_file_id"]
        assert not browser.find_element(By.ID, "input-preview").is_displayed()

        # Cancel another job from the page: a long one, while it runs or waits.
        long_job = httpx.post(f"{base}/v1/jobs", headers=headers, timeout=30, json={
            "prompt": "a blue square moving left", "width": 256, "height": 256,
            "num_frames": 17, "num_inference_steps": 200}).json()["id"]
        browser.get(f"{base}/dashboard#jobs")
        cancel = _wait(browser, "the long job's cancel button", lambda d: d.find_elements(
            By.CSS_SELECTOR, f'button[data-cancel="{long_job}"]'))[0]
        cancel.click()
        _wait(browser, "the confirmation", lambda d: d.switch_to.alert).accept()
        _wait(browser, "the long job cancelled", lambda d: d.execute_script(
            "const r = document.querySelector(arguments[0]);"
            "return r && r.querySelector('.chip').textContent === 'cancelled';",
            f'#jobs tr[data-job="{long_job}"]'), timeout=120)
        assert httpx.get(f"{base}/v1/jobs/{long_job}", headers=headers,
                         timeout=30).json()["status"] == "cancelled"

        # The state filter shows only what it names.
        Select(browser.find_element(By.CSS_SELECTOR, '#filters select[name="status"]')) \
            .select_by_visible_text("cancelled")
        _wait(browser, "the filtered table", lambda d: d.execute_script(
            "return [...document.querySelectorAll('#jobs tr[data-job]')]"
            ".map((r) => r.dataset.job);") == [long_job])

        # A small batch for its report page, then the overview, workers and batch views.
        batch = httpx.post(f"{base}/v1/batches", headers=headers, timeout=30, json={
            "name": "night shift", "defaults": {"num_inference_steps": 8},
            "jobs": [{"prompt": p, "seed": i} for i, p in enumerate(
                ["a green circle moving up", "a yellow square moving down",
                 "a white circle moving left"])]}).json()["id"]
        _wait(browser, "the batch to finish", lambda d: httpx.get(
            f"{base}/v1/batches/{batch}", headers=headers, timeout=30).json()["status"]
            == "finished", timeout=180)
        browser.get(f"{base}/dashboard#overview")
        _wait(browser, "the overview's counts", lambda d: d.execute_script(
            "const c = document.querySelector('#cards .card .n.succeeded');"
            "return c && Number(c.textContent) >= 4;"))
        _shot(browser, "overview")
        browser.get(f"{base}/dashboard#workers")
        _wait(browser, "the worker group", lambda d: d.find_elements(
            By.CSS_SELECTOR, "#workers section .chip.ready"))
        text = browser.find_element(By.ID, "workers").text
        assert "dp 2 × sp 1" in text and "rank 1" in text and "summed PSS" in text
        _shot(browser, "workers")
        browser.get(f"{base}/dashboard#batches")
        _click(browser, "the batch's link", f'#batches a[href="/dashboard/batches/{batch}"]')
        report = "const t = document.querySelector('main').textContent;" \
                 "return t.includes('night shift') && t.includes('succeeded');"
        _wait(browser, "the batch report", lambda d: d.execute_script(report))
        _shot(browser, "batch-report")
        # No script failed on any page (refused requests, like the 422 above, are the network's).
        errors = [e for e in browser.get_log("browser")
                  if e.get("level") == "SEVERE" and e.get("source") != "network"]
        assert not errors, errors


def _ready(base: str, headers: dict[str, str]) -> bool:
    groups = httpx.get(f"{base}/v1/workers", headers=headers, timeout=30).json()["data"]
    return any(g["state"] == "ready" for g in groups)


def _live(driver: Any) -> bool:
    """Whether the page says it reads the event stream (not polling, not reconnecting)."""
    from selenium.webdriver.common.by import By
    return bool(driver.find_element(By.ID, "live").text == "live")


def _requested_urls(driver: Any) -> list[str]:
    """Every URL the browser asked for since the last call (and the page and referrer each
    request was made from), from the DevTools network events of the performance log."""
    urls = []
    for entry in driver.get_log("performance"):
        event = json.loads(entry["message"])["message"]
        if event["method"] != "Network.requestWillBeSent":
            continue
        request, params = event["params"]["request"], event["params"]
        urls += [request["url"] + request.get("urlFragment", ""), params.get("documentURL", "")]
        urls += [v for k, v in request.get("headers", {}).items() if k.lower() == "referer"]
    return urls


def test_a_dashboard_session_of_two_users_leaves_no_key_in_a_log_or_a_url(
        browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with kiln_up(tmp_path, "--dp", "1") as (base, admin):
        alice = subprocess.run([KILN, "keys", "create", "--user", "alice"], cwd=tmp_path,
                               env=up_env(), capture_output=True, text=True,
                               check=True).stdout.strip()
        as_alice = {"Authorization": f"Bearer {alice}"}
        _wait(browser, "a ready worker group", lambda d: _ready(base, as_alice))

        # Alice: the overview, then a job that waits two seconds, so its page is open and live
        # before it runs; the page follows it to the end from the stream alone (a live page
        # does not poll).
        _connect(browser, base, alice)
        _wait(browser, "the event stream", _live)
        _wait(browser, "the overview", lambda d: d.find_elements(By.CSS_SELECTOR, "#cards .card"))
        not_before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3))
        job = httpx.post(f"{base}/v1/jobs", headers=as_alice, timeout=30, json={
            "prompt": "a red circle moving left", "width": 64, "height": 64, "num_frames": 9,
            "num_inference_steps": 4, "not_before": not_before}).json()["id"]
        browser.get(f"{base}/dashboard/jobs/{job}")
        _wait(browser, "the job page, live", lambda d: _live(d) and d.execute_script(
            "return document.querySelector('main').dataset.terminal === 'false';"))
        _wait(browser, "the job page at its end", lambda d: d.execute_script(
            "const m = document.querySelector('main');"
            "return m.dataset.terminal === 'true' && m.textContent.includes('succeeded');"))
        batch = httpx.post(f"{base}/v1/batches", headers=as_alice, timeout=30, json={
            "name": "two", "defaults": {"width": 64, "height": 64, "num_frames": 9,
                                        "num_inference_steps": 4},
            "jobs": [{"prompt": "a green circle moving up"},
                     {"prompt": "a blue square moving down"}]}).json()["id"]
        browser.get(f"{base}/dashboard/batches/{batch}")
        _wait(browser, "the batch page at its end", lambda d: d.execute_script(
            "return document.querySelector('main').dataset.terminal === 'true';"))
        browser.get(f"{base}/dashboard#jobs")
        _wait(browser, "alice's jobs", lambda d: len(d.find_elements(
            By.CSS_SELECTOR, "#jobs tr[data-job]")) == 3)

        # The admin, from the same browser's form: everyone's jobs.
        _connect(browser, base, admin)
        _wait(browser, "the event stream", _live)
        browser.get(f"{base}/dashboard#jobs")
        _wait(browser, "alice's job among the admin's", lambda d: d.find_elements(
            By.CSS_SELECTOR, f'#jobs tr[data-job="{job}"]'))
        urls = _requested_urls(browser)

        # A link that carries a key neither replaces the stored one nor stays in the address.
        planted = "kiln_" + "x" * 52
        browser.get("about:blank")  # followed from elsewhere: the page loads anew
        browser.get(f"{base}/dashboard#key={planted}")
        _wait(browser, "the event stream", _live)
        assert browser.execute_script("return localStorage.getItem('kiln-key');") == admin
        assert "key=" not in browser.current_url
        browser.execute_script("location.hash = arguments[0];", f"#key={planted}")  # in page
        _wait(browser, "the link dropped", lambda d: "key=" not in d.current_url)
        assert browser.execute_script("return localStorage.getItem('kiln-key');") == admin
        # A key in a URL is refused, and not written down.
        sent = httpx.get(f"{base}/v1/events", params={"key": admin}, timeout=30)
        assert sent.status_code == 400, sent.text
    assert any("/v1/events" in u for u in urls) and f"/dashboard/batches/{batch}" in str(urls)
    logs = {p: p.read_text(errors="replace") for p in (tmp_path / "var" / "logs").rglob("*")
            if p.is_file()}
    assert '"GET /v1/events HTTP/1.1" 200' in logs[tmp_path / "var" / "logs" / "api.log"]
    assert "/v1/events?key=[redacted]" in logs[tmp_path / "var" / "logs" / "api.log"]
    for key in (admin, alice):
        secret = key[len("kiln_") + 12:]  # the part after the public prefix
        assert not [u for u in urls if secret in u], (key[:17], urls)
        assert not [p for p, text in logs.items() if secret in text], key[:17]
