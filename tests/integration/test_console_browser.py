"""The operator console in a real browser: headless Chromium from Debian's packages (`make browser`
installs it) driven by Selenium, against real PostgreSQL and Kafka with a running dispatcher.
Screenshots of each page go to .artifacts/console/ (docs/console-overview.png is one of them)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.containers import free_port

from .helpers import settings_env, spawn, stop_all, wait_started, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".artifacts" / "console"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TOKEN = "browser-test-token-0123456789"


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("no Chromium: `make browser` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in CI
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def spawn_console(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatcher", "console"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def submit(driver: WebDriver, button: WebElement) -> None:
    """Click a button that loads a new page, and wait until it has: a click returns before the
    browser has replaced the page, and the old page would answer the next question."""
    page = driver.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(driver, 30).until(lambda _: _replaced(page))


def _replaced(page: WebElement) -> bool:
    """Whether the page element is gone. Chromedriver answers a question about an element whose
    document is being replaced with "does not belong to the document" instead of a stale
    element error now and then (seen in CI under load): that answer means replaced as well."""
    try:
        page.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


def shot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def topic_row(driver: WebDriver, topic: str) -> dict[str, str]:
    """The overview's cells of one topic, by column name."""
    table = driver.find_element(By.ID, "topics")
    header = [th.text for th in table.find_elements(By.CSS_SELECTOR, "tr th")]
    for tr in table.find_elements(By.CSS_SELECTOR, "tr"):
        cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        if cells and cells[0] == topic:
            return dict(zip(header, cells, strict=False))
    msg = f"no row for topic {topic}"
    raise AssertionError(msg)


async def test_an_operator_sees_the_numbers_requeues_a_dead_row_and_pauses_a_topic(
    conn: asyncpg.Connection,
    make_settings: Any,
    make_topic: Callable[[], Awaitable[str]],
    browser: WebDriver,
    tmp_path: Path,
) -> None:
    drains, paused = await make_topic(), await make_topic()
    dead_id = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, dead_at, last_error)"
        " VALUES ($1, 'order-42', '{\"total\": 42}', 1, now(),"
        " 'MessageSizeTooLargeError: the record was too large') RETURNING id",
        drains,
    )
    # Rows in both topics, published before the pause: each topic is on the overview.
    for topic in (drains, paused):
        await conn.execute(
            "INSERT INTO outbox (topic, payload) SELECT $1, 'x' FROM generate_series(1, 10)", topic
        )
    settings = make_settings(log_format="json")
    port = free_port()
    env = {
        **settings_env(settings),
        "OUTBOX_CONSOLE_PORT": str(port),
        "OUTBOX_CONSOLE_TOKEN": TOKEN,
        "OUTBOX_CONSOLE_SAMPLE_SECONDS": "1",
        "OUTBOX_CONSOLE_SHOW_PAYLOAD": "true",
        "OUTBOX_LOG_FORMAT": "json",
    }
    dispatcher_log = tmp_path / "dispatcher.log"
    processes = [
        spawn_console(env, tmp_path / "console.log"),
        spawn(settings, dispatcher_log),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_started([dispatcher_log])

        async def console_up() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"{base}/api/v1/status")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until(console_up, 60, "the console to answer")

        async def settled() -> bool:
            return not await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
            )

        await wait_until(settled, 60, "the first rows to be published")

        # The overview: the numbers per topic.
        browser.get(f"{base}/")
        assert "1 dead" in browser.find_element(By.ID, "totals").text
        assert topic_row(browser, drains)["dead"] == "1"
        assert browser.find_element(By.ID, "not-logged-in")
        shot(browser, "overview")

        # Log in with the token.
        browser.get(f"{base}/login")
        browser.find_element(By.NAME, "token").send_keys(TOKEN)
        submit(browser, browser.find_element(By.CSS_SELECTOR, "form[action='/login'] button"))
        assert not browser.find_elements(By.ID, "not-logged-in")

        # Find the dead row by its error, requeue it, confirm the count.
        browser.get(f"{base}/dead")
        browser.find_element(By.NAME, "error").send_keys("toolarge")
        submit(browser, browser.find_element(By.CSS_SELECTOR, "#filter button"))
        rows = browser.find_elements(By.CSS_SELECTOR, "#dead-rows input[type=checkbox]")
        assert len(rows) == 1
        shot(browser, "dead-rows")
        rows[0].click()
        submit(browser, browser.find_element(By.CSS_SELECTOR, "button[value='dead-requeue']"))
        assert browser.find_element(By.ID, "affected").text == "This would requeue 1 dead row."
        shot(browser, "confirm")
        submit(browser, browser.find_element(By.ID, "confirm"))
        assert browser.find_element(By.ID, "outcome").text == "requeued 1 dead row."

        async def published() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT published_at IS NOT NULL FROM outbox WHERE id = $1", dead_id
                )
            )

        await wait_until(published, 60, "the requeued row to be published")
        browser.get(f"{base}/rows/{dead_id}")
        assert "(published)" in browser.find_element(By.TAG_NAME, "h1").text
        assert '"total": 42' in browser.find_element(By.ID, "payload").text
        shot(browser, "row")

        # Pause one topic: its backlog grows while the other drains.
        browser.get(f"{base}/")
        submit(
            browser,
            browser.find_element(By.XPATH, f"//tr[td[1]='{paused}']//button[@value='pause']"),
        )
        assert browser.find_element(By.ID, "affected").text.startswith(
            f"This would pause topic {paused}"
        )
        submit(browser, browser.find_element(By.ID, "confirm"))
        assert browser.find_element(By.ID, "outcome").text.startswith(f"paused topic {paused}")
        for topic in (drains, paused):
            await conn.execute(
                "INSERT INTO outbox (topic, ordering_key, payload)"
                " SELECT $1, 'k-' || (g % 5), 'x' FROM generate_series(1, 50) g",
                topic,
            )

        async def drained() -> bool:
            return not await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE topic = $1 AND published_at IS NULL", drains
            )

        await wait_until(drained, 60, "the other topic to drain")
        await asyncio.sleep(2.5)  # two more samples for the chart
        browser.get(f"{base}/")
        held, flowing = topic_row(browser, paused), topic_row(browser, drains)
        assert (held["pending"], held["paused"], held["published"]) == ("50", "yes", "10")
        assert (flowing["pending"], flowing["paused"]) == ("0", "")
        assert int(flowing["published"]) == 61
        assert browser.find_elements(By.CSS_SELECTOR, "svg polyline")
        shot(browser, "overview-paused")

        for page in ("blocked", "replay", "audit"):
            browser.get(f"{base}/{page}")
            shot(browser, page)
        audit = browser.find_element(By.ID, "audit").text
        assert "dead requeue" in audit and "pause" in audit and '"via":"console"' in audit
    finally:
        codes = await asyncio.to_thread(stop_all, processes)
    assert codes == [0, 0], (tmp_path / "console.log").read_text()[-3000:]
