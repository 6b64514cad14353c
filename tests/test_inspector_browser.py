"""The inspector's page in a real headless chromium: a turn streams in, a call is approved, a
follow-up is sent from the page's box, and a session holding a script tag shows it as text.

The browser is Debian's ``chromium`` driven through ``chromedriver`` (Selenium); ``.ci/run``
installs both. One browser serves the module (it takes seconds to start); the tests skip, with
the reason, when it cannot start. Every wait is an explicit wait for a condition of the page,
bounded by ``WAIT`` seconds. With ``AGENTLOOP_SCREENSHOTS=DIR`` set, the first test saves the
screenshots ``docs/inspector.md`` shows into ``DIR``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from conftest import OPTIONS

import agentloop
from agentloop import events as ev
from agentloop.testing import Finish, FunctionModel, ReasoningDelta, TextDelta, ToolCallDelta

pytest.importorskip("hypercorn", reason="the inspector needs the ui extra (hypercorn)")
pytest.importorskip("markdown_it", reason="the inspector needs the ui extra (markdown-it-py)")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")

from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_inspector import SCRIPT, Served, served

pytestmark = pytest.mark.slow

WAIT = 15
T = TypeVar("T")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no chromium and chromedriver on this machine (.ci/run installs Debian's)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,820"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(
            options=options, service=webdriver.ChromeService(executable_path=driver_path)
        )
    except WebDriverException as exc:
        pytest.skip(f"chromium could not start: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()


async def off_loop(fn: Callable[[], T]) -> T:
    """Selenium blocks: it runs on a worker thread while trio serves the page."""
    return await trio.to_thread.run_sync(fn)


def wait_for(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    return WebDriverWait(driver, WAIT).until(condition, f"the page never showed {what}")


def text_of(driver: Any, css: str) -> str:
    return " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, css))


def screenshot(driver: Any, name: str) -> None:
    where = os.environ.get("AGENTLOOP_SCREENSHOTS")
    if where:
        driver.save_screenshot(str(Path(where) / name))


async def open_page(driver: Any, s: Served, session_id: str) -> None:
    def go() -> None:
        driver.get(f"{s.base}/?token={s.token}#{session_id}")
        wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body")
                 .get_attribute("data-ready") == session_id, f"session {session_id} loaded")

    await off_loop(go)


def model_with_gate(gate: trio.Event) -> FunctionModel:
    calls = 0

    async def fn(request: Any) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            yield TextDelta("Streaming ")
            await gate.wait()
            yield TextDelta("in parts, then I remove the *draft*.")
            yield ToolCallDelta(0, id="c1", name="rm", arguments='{"path": "draft.txt"}')
            yield Finish("tool_calls", usage={"input_tokens": 120, "output_tokens": 18})
        elif calls == 2:
            yield ReasoningDelta("The file is gone; say so.")
            yield TextDelta("Removed `draft.txt`. All **done**.")
            yield Finish("stop", usage={"input_tokens": 160, "output_tokens": 9})
        else:
            yield TextDelta("Follow-up answered.")
            yield Finish("stop", usage={"input_tokens": 180, "output_tokens": 4})

    return FunctionModel(fn)


async def test_watch_a_turn_approve_a_call_and_send_a_follow_up(
    browser: Any, tmp_path: Path
) -> None:
    gate = trio.Event()
    async with served(tmp_path) as s:
        s.rt.llm.register("scripted", model_with_gate(gate))
        s.rt.events.on(ev.ToolPreExecute,
                       lambda e: agentloop.Ask(f"remove {e.call.arguments['path']}?"))

        @s.rt.tools.tool
        async def rm(path: str) -> str:
            """Remove a file."""
            return f"removed {path}"

        handle = await s.rt.agents.create(session_id="demo", agent_options=OPTIONS)
        child = await s.rt.agents.create(
            session_id="demo-research", agent_options=OPTIONS,
            meta={"parent_session_id": "demo"},
        )
        async with handle, child:
            agent = handle.agent
            await open_page(browser, s, "demo")

            def send_first() -> None:
                # The token went from the address bar to an HttpOnly cookie.
                assert "token" not in browser.current_url
                assert browser.execute_script("return document.cookie") == ""
                tree = text_of(browser, "#sessions li li")
                assert "demo-research" in tree, tree  # the child, nested under its parent
                browser.find_element(By.ID, "followup-text").send_keys("Clean up the draft")
                browser.find_element(By.ID, "followup-send").click()
                wait_for(browser, lambda d: "Streaming" in text_of(d, ".msg.assistant.streaming"),
                         "the first streamed words")

            await off_loop(send_first)
            # The model is held mid-reply: what the page shows came in while it streamed.
            assert agent.status == "running"
            assert not [e for e in agent.session.events if e.type == "assistant/message"]
            assert "Clean up the draft" in await off_loop(lambda: text_of(browser, ".msg.user"))
            gate.set()

            def approve() -> None:
                wait_for(browser, lambda d: d.find_elements(
                    By.CSS_SELECTOR, "#approval-c1 button.approve"), "the approval buttons")
                assert "remove draft.txt?" in text_of(browser, "#approval-c1")
                assert '"path": "draft.txt"' in text_of(browser, "#tool-c1 .args")
                # Rendered markdown: the streamed text became HTML at the reply's end.
                assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant em")
                screenshot(browser, "inspector-approval.png")
                browser.find_element(By.CSS_SELECTOR, "#approval-c1 button.approve").click()
                wait_for(browser, lambda d: "turn 1 completed" in text_of(d, ".turn.end"),
                         "the turn's end")

            await off_loop(approve)

            def check_turn() -> None:
                assert "removed draft.txt" in text_of(browser, "#tool-c1 .result")
                assert "approved" in text_of(browser, "#approval-c1")
                bold = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant strong")
                assert [b.text for b in bold] == ["done"]
                reasoning = browser.find_element(By.CSS_SELECTOR, "details.reasoning")
                assert reasoning.get_attribute("open") is None  # collapsed
                assert "tokens in 280 out 27" in text_of(browser, ".turn.end .usage")
                browser.find_element(By.ID, "followup-text").send_keys("Anything else?")
                browser.find_element(By.ID, "followup-send").click()
                wait_for(browser, lambda d: "turn 2 completed" in text_of(d, ".turn.end"),
                         "the follow-up's turn")
                assert "Follow-up answered." in text_of(browser, ".msg.assistant")
                assert "Anything else?" in text_of(browser, ".msg.user")
                screenshot(browser, "inspector-conversation.png")

            await off_loop(check_turn)
            assert [e.data["reason"] for e in agent.session.events if e.type == "turn/end"] == [
                "completed", "completed"
            ]


async def test_a_script_tag_in_a_session_is_shown_as_text(browser: Any, tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        s.model.add(f'Here: <img src="x" onerror="window.pwned = 2"> and {SCRIPT}')
        handle = await s.rt.agents.create(session_id="xss", agent_options=OPTIONS)
        async with handle:
            handle.agent.followup(SCRIPT)
            with trio.fail_after(10):
                await handle.agent.wait_idle()
            await open_page(browser, s, "xss")

            def check() -> None:
                wait_for(browser, lambda d: "turn 1 completed" in text_of(d, ".turn.end"),
                         "the stored turn")
                assert SCRIPT in text_of(browser, ".msg.user")
                assert 'onerror="window.pwned = 2"' in text_of(browser, ".msg.assistant")
                assert browser.execute_script("return window.pwned") is None
                assert not browser.find_elements(By.CSS_SELECTOR, "#log script, #log img")
                # Without the token (a fresh profile has no cookie), nothing but a 403.
                browser.delete_all_cookies()
                browser.get(f"{s.base}/api/sessions")
                assert "403" in browser.find_element(By.TAG_NAME, "body").text

            await off_loop(check)


async def test_a_running_tools_progress_shows_under_its_call(
    browser: Any, tmp_path: Path
) -> None:
    release = trio.Event()
    reported = trio.Event()

    async def fn(request: Any) -> AsyncIterator[Any]:
        if request.messages[-1].role == "user":
            yield ToolCallDelta(0, id="p1", name="crunch", arguments="{}")
            yield Finish("tool_calls")
        else:
            yield TextDelta("Crunched.")
            yield Finish("stop")

    async with served(tmp_path) as s:
        s.rt.llm.register("scripted", FunctionModel(fn))

        @s.rt.tools.tool
        async def crunch() -> str:
            """Crunch the numbers."""
            agentloop.report_progress("crunching", fraction=0.25)
            agentloop.report_progress("almost there", fraction=0.75)
            reported.set()
            await release.wait()
            return "crunched"

        handle = await s.rt.agents.create(session_id="busy", agent_options=OPTIONS)
        async with handle:
            await open_page(browser, s, "busy")
            handle.agent.followup("crunch")
            with trio.fail_after(WAIT):
                await reported.wait()

            def progress_shown() -> None:
                wait_for(browser, lambda d: "almost there (75%)" in text_of(
                    d, "#tool-p1 .progress"), "the tool's progress")
                bar = browser.find_element(By.CSS_SELECTOR, "#tool-p1 .progress progress")
                assert float(bar.get_attribute("value")) == 0.75

            await off_loop(progress_shown)
            release.set()

            def done() -> None:
                wait_for(browser, lambda d: "turn 1 completed" in text_of(d, ".turn.end"),
                         "the turn's end")
                assert "crunched" in text_of(browser, "#tool-p1 .result")
                assert browser.find_elements(By.CSS_SELECTOR, "#tool-p1 .progress") == []

            await off_loop(done)
            # Shown live, never logged.
            assert not any("almost there" in str(e.data) for e in handle.agent.session.events)
