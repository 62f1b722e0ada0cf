"""The dashboard in a real browser: Debian's headless Chromium, driven by Playwright (its own
browser download is never used), against a running switchboard that answered a message
through the real Claude Code path. Screenshots go to $BUTLERS_TEST_ARTIFACTS (default
.test-artifacts/ in the checkout), kept after the run.

Without Chromium it fails where the environment variable CI is set (CI runs `make browser`
first, which installs Debian's or fails), and is skipped, saying so, elsewhere (`make browser`
installs Debian's, as root; BUTLERS_TEST_CHROMIUM names another binary).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.conftest import StartButler
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_inbox import model, start_fleet
from tests.test_operator import TOKEN, call

REPO = Path(__file__).resolve().parent.parent
# What this machine's closed network needs: no background connections, no sandbox as root.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"> when is the dentist?"


def chromium_path() -> str | None:
    named = os.environ.get("BUTLERS_TEST_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_chromium() -> str:
    """The Chromium to drive. Missing, a CI run fails (a browser test that skips there would
    pass unseen forever) and any other run skips, saying how to get one."""
    executable = chromium_path()
    if executable is not None:
        return executable
    named = os.environ.get("BUTLERS_TEST_CHROMIUM")
    problem = (
        f"BUTLERS_TEST_CHROMIUM={named} is not an executable"
        if named
        else "no Chromium on this machine"
    )
    how = (
        "install Debian's (`make browser`, as root: apt-get install chromium) or set "
        "BUTLERS_TEST_CHROMIUM to a Chromium binary"
    )
    if in_ci():
        pytest.fail(f"CI is set and {problem}: {how}", pytrace=False)
    pytest.skip(f"{problem}: {how}")


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    base = Path(os.environ.get("BUTLERS_TEST_ARTIFACTS", REPO / ".test-artifacts"))
    directory = base / "dashboard" / request.node.name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    executable = require_chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.mark.parametrize(
    ("ci", "outcome"),
    [("true", pytest.fail.Exception), ("1", pytest.fail.Exception), ("", pytest.skip.Exception)],
)
def test_without_chromium_ci_fails_and_elsewhere_skips(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium on it
    monkeypatch.delenv("BUTLERS_TEST_CHROMIUM", raising=False)
    monkeypatch.setenv("CI", ci)
    assert outcome_of(require_chromium) == (outcome, "no Chromium on this machine")
    monkeypatch.setenv("BUTLERS_TEST_CHROMIUM", str(tmp_path / "missing"))
    assert outcome_of(require_chromium) == (outcome, "is not an executable")


PROBLEMS = ("no Chromium on this machine", "is not an executable")


def outcome_of(check: Callable[[], object]) -> tuple[type[BaseException] | None, str]:
    """What `check` raised (a skip is caught too: pytest.raises would let it skip this test)
    and which of the two problems its message names."""
    try:
        check()
    except BaseException as exc:  # Skipped and Failed are BaseExceptions
        named = [p for p in PROBLEMS if p in str(exc)]
        return type(exc), named[0] if named else str(exc)
    return None, ""


async def test_fleet_messages_and_the_ask_form_in_chromium(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    browser,
    artifacts: Path,
    db_conn,
) -> None:
    scripted_api.respond_with(model("general", {"general": "Thursday at 10, I noted it."}))
    switchboard, _ = await start_fleet(start_butler, tmp_path, names=("general",), auth_token=TOKEN)
    answered = await call(switchboard, "ask", text=HOSTILE)
    assert answered["status"] == "done" and answered["routed_to"] == "general"
    base = switchboard.sse_url.removesuffix("/sse")

    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    page = await context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    try:
        # Asked for the token once, then the fleet.
        await page.goto(f"{base}/ui")
        assert page.url.startswith(f"{base}/ui/login")
        await page.fill("input[name=token]", TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/ui")
        general = page.locator('#fleet tr[data-butler="general"]')
        await general.wait_for()
        assert "ok" in await general.locator("td.status").inner_text()
        assert await general.locator("td.sessions").inner_text() == "1"
        await page.screenshot(path=artifacts / "fleet.png", full_page=True)
        cookies = {c["name"]: c for c in await context.cookies()}
        assert cookies["butlers_ui"]["httpOnly"] and cookies["butlers_ui"]["sameSite"] == "Strict"
        assert TOKEN not in cookies["butlers_ui"]["value"]

        # The message: its hostile text shown as text, never run.
        await page.click("nav >> text=Messages")
        row = page.locator(f'#messages tr[data-id="{answered["inbox_id"]}"]')
        await row.wait_for()
        assert HOSTILE[:40] in await row.locator("td.text").inner_text()
        assert "Thursday at 10" in await row.locator("td.reply").inner_text()
        assert await page.title() != "pwned" and dialogs == []
        await page.screenshot(path=artifacts / "messages.png", full_page=True)

        # A message that arrives meanwhile appears without a reload (the page's own refresh,
        # every 10 s, allowed by its Content-Security-Policy).
        conn = await db_conn(switchboard.config.db_name)
        arrived = await conn.fetchval(
            """INSERT INTO inbox (channel, external_id, source_id, text)
               VALUES ('telegram', 'late-1', '4242', 'arrived while you looked') RETURNING id"""
        )
        await page.locator(f'#messages tr[data-id="{arrived}"]').wait_for(timeout=25_000)
        assert await page.evaluate("document.body.dataset.refreshed") is not None

        # One long error keeps to its column's width, not the page's (it took most of it on
        # every row, and the replies wrapped in a strip: a walkthrough).
        failed = await conn.fetchval(
            """INSERT INTO inbox (channel, external_id, source_id, text, status, error)
               VALUES ('telegram', 'late-2', '4242', 'x', 'failed', $1) RETURNING id""",
            "refused: " + "the butler could not be reached at that time " * 40,
        )
        await page.goto(f"{base}/ui/messages")
        error = page.locator(f'#messages tr[data-id="{failed}"] td:nth-child(10)')  # (Error)
        box = await error.bounding_box()
        assert box is not None and box["width"] <= 420, box

        # Its own page, then the Ask form through classify -> route -> reply.
        await row.locator("a").first.click()
        await page.locator("#message-text").wait_for()
        assert await page.locator('section[data-butler="general"] details').count() == 1
        await page.click("nav >> text=Ask")
        await page.fill("#ask-text", "remind me to call the dentist")
        await page.click("#ask-form button[type=submit]")
        reply = page.locator("#answer-reply")
        await reply.wait_for(timeout=60_000)
        assert await reply.inner_text() == "Thursday at 10, I noted it."
        await page.screenshot(path=artifacts / "ask.png", full_page=True)
        assert await page.title() != "pwned" and dialogs == []

        # On a phone every page keeps the screen's width: a wide table scrolls by itself.
        await page.set_viewport_size({"width": 390, "height": 844})
        for path in (
            "/ui",
            "/ui/messages",
            f"/ui/messages/{answered['inbox_id']}",
            "/ui/routing-log",
            "/ui/butlers/general",
            "/ui/butlers/general/memory",
        ):
            await page.goto(f"{base}{path}")
            await page.locator("main h1").first.wait_for()
            width = await page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
        await page.goto(f"{base}/ui/messages")
        await page.screenshot(path=artifacts / "phone.png", full_page=True)
    finally:
        await context.close()
    for name in ("fleet.png", "messages.png", "ask.png", "phone.png"):
        assert (artifacts / name).stat().st_size > 5_000, name


async def test_without_a_token_the_forms_work_and_a_long_name_keeps_the_page_narrow(
    start_butler: StartButler,
    tmp_path: Path,
    scripted_api: ScriptedMessagesAPI,
    browser,
    db_conn,
) -> None:
    """A dashboard on loopback without BUTLERS_AUTH_TOKEN is guarded by Host and Origin: the
    browser must send its own origin with the page's form posts (with `Referrer-Policy:
    no-referrer` Chromium sent `Origin: null`, and every button was refused). A sender may
    name themselves with thousands of characters, a prompt may be one long word: no page that
    shows them scrolls sideways."""
    scripted_api.respond_with(model("general", {"general": "Noted, without a token."}))
    switchboard, targets = await start_fleet(start_butler, tmp_path, names=("general",))
    base = switchboard.sse_url.removesuffix("/sse")
    kept = await call(targets["general"], "memory_remember", text="z" * 3000)
    conn = await db_conn(switchboard.config.db_name)
    long_named = await conn.fetchval(
        """INSERT INTO inbox (channel, external_id, source_id, sender_name, text)
           VALUES ('email', 'long-1', 'carol@example.com', $1, $2) RETURNING id""",
        "X" * 3000,
        "y" * 4000,
    )

    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    page = await context.new_page()
    origins: list[str | None] = []
    page.on(
        "request",
        lambda request: (
            origins.append(request.headers.get("origin")) if request.method == "POST" else None
        ),
    )
    try:
        await page.goto(f"{base}/ui/ask")
        await page.fill("#ask-text", "note this without a token")
        await page.click("#ask-form button[type=submit]")
        reply = page.locator("#answer-reply")
        await reply.wait_for(timeout=60_000)
        assert await reply.inner_text() == "Noted, without a token."
        # A memory forgotten by its button (one long word: the page stays narrow below).
        await page.goto(f"{base}/ui/butlers/general/memory")
        await page.click(f"#memories button[value='{kept['id']}']")
        await page.locator("#notice").wait_for()
        assert await page.locator("#notice").inner_text() == f"Memory #{kept['id']} is forgotten."
        assert await call(targets["general"], "memory_list") == []
        await call(targets["general"], "memory_remember", text="y" * 3000)
        assert origins == [base, base]

        await page.set_viewport_size({"width": 390, "height": 844})
        for path in (f"/ui/messages/{long_named}", "/ui/messages", "/ui/butlers/general/memory"):
            await page.goto(f"{base}{path}")
            await page.locator("main h1").first.wait_for()
            width = await page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
    finally:
        await context.close()
