"""The dashboard in a real browser: headless Chromium against ``llmgw up --simulate examples/fleet.toml``.

scripts/test.sh installs Debian's ``chromium`` and ``chromium-driver`` where they are missing
(as root); without them this test fails and says how to get them: it is never skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from test_e2e import ROOT, llmgw, start_up, stop_up, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
CLASSES = ("H100-80GB", "A100-40GB", "L40S-48GB")


def text_of(browser: webdriver.Chrome, element_id: str) -> str:
    try:
        return str(browser.find_element(By.ID, element_id).text)
    except WebDriverException:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_dashboard_shows_the_fleet_and_a_fault_without_a_reload(tmp_path: Path) -> None:
    assert CHROMIUM and DRIVER, ("no chromium/chromedriver on PATH: apt-get install chromium chromium-driver "
                                 "(scripts/test.sh does, as root)")
    up, nats_url = start_up(tmp_path, ROOT / "examples" / "fleet.toml", "--engine-startup-s", "1")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    browser = None
    try:
        assert up.stdout is not None
        printed = []
        while not any(line.startswith("dashboard: ") for line in printed):  # up prints it after the router's
            printed.append(up.stdout.readline())
            assert printed[-1], f"up ended before printing the dashboard's URL: {printed}"
        url = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)\n", printed[-1])
        assert url, printed[-1]
        browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
        browser.get(url.group(1))
        # Each GPU class and the example model, and the page is live (its script connected).
        wait_for("every GPU class on the page", lambda: all(c in text_of(browser, "capacity") for c in CLASSES), 20)
        wait_for("the example model serving", lambda: "qwen14" in text_of(browser, "models")
                 and "serving" in text_of(browser, "models"), 30)
        wait_for("live", lambda: "live" in text_of(browser, "conn"), 10)
        assert browser.find_element(By.CSS_SELECTOR, "#gpus .gpu") is not None  # GPU use per node
        browser.execute_script("window.llmgwNotReloaded = true;")

        r = llmgw(nats_url, "agent", "fault", "h100-b-02", "5", "xid=79")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for("the fault on the page", lambda: "GPU 5 unhealthy: xid 79" in text_of(browser, "events"), 10)
        assert browser.execute_script("return window.llmgwNotReloaded === true;")  # pushed, not reloaded
        # The status service says so too: h100-a-03's GPU 3 (the fleet file's) and this one.
        wait_for("the capacity bar", lambda: re.search(r"H100-80GB\s+\d+ used · \d+ free · 2 unhealthy",
                                                       text_of(browser, "capacity")), 10)
        # The faulted GPU is marked on its node, not drawn as an idle one.
        wait_for("the faulted GPU marked", lambda: any("GPU 5 UNHEALTHY: xid 79" in (e.get_attribute("title") or "")
                                                       for e in browser.find_elements(By.CSS_SELECTOR, "#gpus .gpu.bad")),
                 15)
        # A 1400×1000 screen holds every panel, events included, above the fold.
        rects = browser.execute_script(
            "return Array.from(document.querySelectorAll('section.panel')).map(e => "
            "[e.className, e.getBoundingClientRect().top, e.getBoundingClientRect().bottom, window.innerHeight]);")
        assert len(rects) == 6 and all(bottom <= height for _, _, bottom, height in rects), rects
        time.sleep(0.5)  # let the bars settle for the picture
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if target := os.environ.get("LLMGW_DASHBOARD_SCREENSHOT"):  # how docs/dashboard.png is made
            shutil.copyfile(shot, target)
    finally:
        if browser is not None:
            browser.quit()
        stop_up(up)
