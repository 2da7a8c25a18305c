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


# What an operator acts on: above the fold at every size tested; at 1400×1000 every panel starts above it.
ABOVE_THE_FOLD = ("summary", "attention", "capacity")
INNER_SCROLLBARS = """return Array.from(document.querySelectorAll('body *')).filter(e => {
  const s = getComputedStyle(e);
  return (['auto', 'scroll'].includes(s.overflowY) && e.scrollHeight > e.clientHeight + 1)
      || (['auto', 'scroll'].includes(s.overflowX) && e.scrollWidth > e.clientWidth + 1);
}).map(e => e.id || e.className);"""
WRAPPED = """return Array.from(document.querySelectorAll('.capacity .name, .node-row .cls')).filter(e => {
  const r = document.createRange(); r.selectNodeContents(e); return r.getClientRects().length > 1;
}).map(e => e.textContent);"""


def layout_holds(browser: webdriver.Chrome, *, wide: bool) -> None:
    """No panel scrolls inside the page, no GPU class wraps, and what matters is above the fold."""
    size = browser.execute_script("return [innerWidth, innerHeight];")
    assert browser.execute_script(INNER_SCROLLBARS) == [], size
    assert browser.execute_script(WRAPPED) == [], size
    bottom = "return document.getElementById(arguments[0]).getBoundingClientRect().bottom;"
    for element_id in ABOVE_THE_FOLD:
        assert browser.execute_script(bottom, element_id) <= size[1], (element_id, size)
    models = browser.execute_script("return document.querySelector('section.panel.models').getBoundingClientRect()"
                                    ".bottom;")
    assert models <= size[1], ("models", size)
    if wide:
        tops = browser.execute_script("return Array.from(document.querySelectorAll('section.panel')).map(e => "
                                      "[e.className, e.getBoundingClientRect().top]);")
        assert len(tops) == 6 and all(top < size[1] - 100 for _, top in tops), tops


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
        url = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)  \(log in with the key in (\S+)\)\n", printed[-1])
        assert url, printed[-1]
        browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
        browser.get(url.group(1))
        # Closed like the bus (security round 4, finding 3): the key up made, typed into its form once.
        field = browser.find_element(By.CSS_SELECTOR, "form input[name=key]")
        field.send_keys(Path(url.group(2)).read_text().strip())
        field.submit()
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
        # Issue 43, finding 9. The idle replica's GPU reads idle (it read 60-90 %), and says who holds it.
        held = "#gpus .gpu.held[data-held='qwen14-r1']"
        wait_for("the held GPU idle", lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, held)] == ["0"], 15)
        assert "held by qwen14-r1" in (browser.find_element(By.CSS_SELECTOR, held).get_attribute("title") or "")
        assert "utilization %" in text_of(browser, "gpus") and "held by a replica" in text_of(browser, "gpus")
        assert "h100-b-02 GPU 5 unhealthy: xid 79" in text_of(browser, "attention")
        for width, height in ((1024, 768), (1400, 1000)):  # the picture is taken at the last
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
            time.sleep(0.3)
            assert browser.execute_script("return [innerWidth, innerHeight];") == [width, height]
            layout_holds(browser, wide=width >= 1400)
        time.sleep(0.5)  # let the bars settle for the picture
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if target := os.environ.get("LLMGW_DASHBOARD_SCREENSHOT"):  # how docs/dashboard.png is made
            shutil.copyfile(shot, target)
    finally:
        if browser is not None:
            browser.quit()
        stop_up(up)
