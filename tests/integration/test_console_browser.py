"""The operator console in a real browser: headless Chromium from Debian's packages (`make browser`
installs it) driven by Selenium, against the real `outbox-dispatcher console` process, real
PostgreSQL and, for the first test, Kafka with a running dispatcher. Screenshots of each page go
to .artifacts/console/; readme-overview.png is the README's (docs/console-overview.png)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
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

from outbox_dispatcher.config.settings import Settings
from tests.containers import free_port

from .helpers import spawn, spawn_console, stop_all, wait_started, wait_until
from .test_console_jobs import many_dead, slow_batches

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".artifacts" / "console"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TOKEN = "browser-test-token-0123456789"
# A laptop's screen: the pages must fit it without scrolling sideways (N12).
LAPTOP = (1366, 900)
FLAGS = (
    "--headless=new",
    "--no-sandbox",  # root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("no Chromium: `make browser` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (*FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={LAPTOP[0]},{LAPTOP[1]}")
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.asynccontextmanager
async def console(settings: Settings, tmp_path: Path, **variables: str) -> AsyncIterator[str]:
    """The real console process on a free port, with TOKEN; its base URL."""
    port = free_port()
    log_path = tmp_path / "console.log"
    process = spawn_console(settings, log_path, port, OUTBOX_CONSOLE_TOKEN=TOKEN, **variables)
    base = f"http://127.0.0.1:{port}"

    async def up() -> bool:
        try:
            async with httpx.AsyncClient() as c:
                answer = await c.get(f"{base}/login")
        except httpx.TransportError:
            return False
        return answer.status_code == 200

    try:
        await wait_until(up, 60, "the console to answer")
        yield base
    finally:
        codes = await asyncio.to_thread(stop_all, [process])
    assert codes == [0], log_path.read_text()[-3000:]


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


def log_in(driver: WebDriver, base: str) -> None:
    driver.get(f"{base}/")  # reads need a login: the overview sends the browser there
    assert driver.current_url == f"{base}/login"
    driver.find_element(By.NAME, "token").send_keys(TOKEN)
    submit(driver, driver.find_element(By.CSS_SELECTOR, "form[action='/login'] button"))
    assert not driver.find_elements(By.ID, "not-logged-in")


def fits(driver: WebDriver) -> bool:
    """Nothing wider than the window (no sideways scrolling)."""
    width = driver.execute_script("return document.documentElement.scrollWidth")
    return bool(width <= driver.execute_script("return window.innerWidth"))


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


async def test_an_operator_requeues_a_dead_row_and_pauses_a_topic_with_a_running_dispatcher(
    conn: asyncpg.Connection,
    make_settings: Any,
    make_topic: Callable[[], Awaitable[str]],
    browser: WebDriver,
    tmp_path: Path,
) -> None:
    """The README's screenshot is taken here, from this run: one topic paused with its rows
    parked (not lag), the other drained, the charts of the last minutes."""
    drains, paused = await make_topic(), await make_topic()
    dead_id = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, dead_at, last_error)"
        " VALUES ($1, 'order-42', '{\"total\": 42}', 1, now(),"
        " 'MessageSizeTooLargeError: the record was too large') RETURNING id",
        drains,
    )
    for topic in (drains, paused):
        await conn.execute(
            "INSERT INTO outbox (topic, payload) SELECT $1, 'x' FROM generate_series(1, 10)", topic
        )
    settings = make_settings(log_format="json")
    dispatcher_log = tmp_path / "dispatcher.log"
    dispatcher = spawn(settings, dispatcher_log)
    try:
        await wait_started([dispatcher_log])
        shown = {"OUTBOX_CONSOLE_SAMPLE_SECONDS": "1", "OUTBOX_CONSOLE_SHOW_PAYLOAD": "true"}
        async with console(settings, tmp_path, **shown) as base:

            async def settled() -> bool:
                return not await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
                )

            await wait_until(settled, 60, "the first rows to be published")
            log_in(browser, base)
            browser.get(f"{base}/?refresh=off")  # it reloads itself otherwise
            assert topic_row(browser, drains)["dead"] == "1"
            assert "1 dispatcher alive" in browser.find_element(By.ID, "dispatchers-line").text
            shot(browser, "overview")

            # Find the dead row by its error, requeue it: a job, done by the time its page shows.
            browser.get(f"{base}/dead")
            browser.find_element(By.NAME, "error").send_keys("toolarge")
            submit(browser, browser.find_element(By.CSS_SELECTOR, "#filter button.primary"))
            rows = browser.find_elements(By.CSS_SELECTOR, "#dead-rows input[type=checkbox]")
            assert len(rows) == 1
            rows[0].click()
            submit(browser, browser.find_element(By.CSS_SELECTOR, "button[value='dead-requeue']"))
            assert browser.find_element(By.ID, "affected").text == "This would requeue 1 dead row."
            submit(browser, browser.find_element(By.ID, "confirm"))
            assert browser.find_element(By.ID, "outcome").text == "requeued 1 dead row."
            assert browser.find_element(By.ID, "status").text == "done"

            async def published() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT published_at IS NOT NULL FROM outbox WHERE id = $1", dead_id
                    )
                )

            await wait_until(published, 60, "the requeued row to be published")
            browser.get(f"{base}/rows/{dead_id}")
            assert browser.find_element(By.ID, "state").text == "published"
            assert '"total": 42' in browser.find_element(By.ID, "payload").text
            shot(browser, "row")

            # Pause one topic, with a reason: its backlog is parked while the other drains.
            browser.get(f"{base}/?refresh=off")
            submit(
                browser,
                browser.find_element(By.XPATH, f"//tr[td[1]='{paused}']//button[@value='pause']"),
            )
            assert browser.find_element(By.ID, "affected").text.startswith(
                f"This would pause topic {paused}"
            )
            browser.find_element(By.ID, "reason").send_keys("consumer upgrade, back by 15:00")
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
                    "SELECT count(*) FROM outbox WHERE topic = $1 AND published_at IS NULL",
                    drains,
                )

            await wait_until(drained, 60, "the other topic to drain")
            await asyncio.sleep(12)  # a heartbeat with the dispatcher's counters, more samples
            browser.get(f"{base}/?refresh=off")
            held, flowing = topic_row(browser, paused), topic_row(browser, drains)
            assert (held["waiting"], held["paused"], held["published"]) == ("50", "paused", "10")
            assert held["lag"] == "-" and held["parked"].startswith("50 (")  # not lag (N10)
            assert (flowing["waiting"], flowing["paused"]) == ("0", "")
            assert int(flowing["published"]) == 61
            charts = browser.find_elements(By.CSS_SELECTOR, "#charts svg")
            assert len(charts) == 3 and charts[1].find_elements(By.CSS_SELECTOR, "polyline")
            # The rates come from what the dispatcher reports with its heartbeat.
            reported = await conn.fetchrow(
                "SELECT version, published_total FROM outbox_dispatchers"
            )
            assert reported["version"] and reported["published_total"] >= 61
            assert fits(browser)
            whole = browser.execute_script("return document.documentElement.scrollHeight")
            browser.set_window_size(LAPTOP[0], whole + 140)  # the whole page, for the README
            shot(browser, "readme-overview")
            browser.set_window_size(*LAPTOP)

            for page in ("blocked", "replay", "dead/groups", "audit"):
                browser.get(f"{base}/{page}")
                assert fits(browser), page
                shot(browser, page.replace("/", "-"))
            audit = browser.find_element(By.ID, "audit").text
            assert "dead requeue" in audit and "pause" in audit and "token holder" in audit
    finally:
        codes = await asyncio.to_thread(stop_all, [dispatcher])
    assert codes == [0], dispatcher_log.read_text()[-3000:]


async def test_thousands_of_dead_rows_page_fit_a_laptop_and_a_bulk_requeue_can_be_aborted(
    conn: asyncpg.Connection, make_settings: Any, browser: WebDriver, tmp_path: Path
) -> None:
    """N11 (paging), N12 (a laptop-sized table), N13 (the destructive confirmation), N7 (a
    bulk action with progress and its abort)."""
    await many_dead(conn, 3000, error="UnknownTopicOrPartitionError: topic 'orders-v2' is gone")
    await conn.execute(
        "UPDATE outbox SET ordering_key = 'customer-' || id || '-' || repeat('x', 80)"
        " WHERE id % 3 = 0"
    )
    await slow_batches(conn, 0.25)  # 60 batches: 15 s
    async with console(make_settings(cleanup_batch_size=50), tmp_path) as base:
        log_in(browser, base)
        browser.get(f"{base}/dead")
        assert browser.find_element(By.ID, "total").text == "3,000 rows match"
        assert fits(browser), "the dead rows' table fits a laptop screen"
        heights = browser.execute_script(
            "return [...document.querySelectorAll('#dead-rows time')].slice(0, 20)"
            ".map(t => t.getBoundingClientRect().height)"
        )
        assert max(heights) < 2 * min(heights), "times stay on one line"
        first = browser.find_elements(By.CSS_SELECTOR, "#dead-rows td a[href^='/rows/']")[0].text
        submit(browser, browser.find_element(By.ID, "next"))
        second = browser.find_elements(By.CSS_SELECTOR, "#dead-rows td a[href^='/rows/']")[0].text
        assert int(second) > int(first)
        submit(browser, browser.find_element(By.ID, "previous"))
        again = browser.find_elements(By.CSS_SELECTOR, "#dead-rows td a[href^='/rows/']")[0].text
        assert again == first
        shot(browser, "dead-rows")

        # The most destructive confirmation looks it, and asks for a typed word.
        browser.find_element(By.CSS_SELECTOR, "input[name=scope][value=all]").click()
        submit(browser, browser.find_element(By.CSS_SELECTOR, "button[value='dead-discard']"))
        zone = browser.find_element(By.ID, "confirmation")
        assert "danger-zone" in zone.get_attribute("class")
        colour = browser.find_element(By.ID, "confirm").value_of_css_property("background-color")
        assert colour.startswith("rgba(179, 38, 30") or colour.startswith("rgb(179, 38, 30")
        assert "This would discard 3000 dead rows." in zone.text
        assert len(browser.find_elements(By.CSS_SELECTOR, "#sample tr")) == 6
        shot(browser, "confirm-discard")

        # A requeue of every dead row: a job with progress, then its abort.
        browser.get(f"{base}/dead")
        browser.find_element(By.CSS_SELECTOR, "input[name=scope][value=all]").click()
        submit(browser, browser.find_element(By.CSS_SELECTOR, "button[value='dead-requeue']"))
        submit(browser, browser.find_element(By.ID, "confirm"))
        assert browser.find_element(By.ID, "status").text == "running"
        progress = browser.find_element(By.ID, "progress")
        assert progress.get_attribute("max") == "3000"
        await asyncio.sleep(2)
        browser.refresh()
        done_so_far = int(browser.find_element(By.ID, "progress").get_attribute("value") or 0)
        assert 0 < done_so_far < 3000
        shot(browser, "job-running")
        submit(browser, browser.find_element(By.ID, "abort"))
        WebDriverWait(browser, 30).until(
            lambda d: d.find_element(By.ID, "status").text == "aborted"
        )
        shot(browser, "job-aborted")
    changed = await conn.fetchval(
        "SELECT count(*) FROM outbox WHERE last_error LIKE 'requeued by operator%'"
    )
    recorded = await conn.fetchval(
        "SELECT rows FROM outbox_operator_audit WHERE command = 'dead requeue'"
    )
    assert 0 < changed < 3000 and recorded == changed
