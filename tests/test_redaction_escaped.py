"""A secret is redacted however it was escaped on its way out.

A password or token holding `& ' " < > \\` or non-ASCII characters is rarely written as it is:
`%r` escapes quotes and backslashes, `json.dumps` (a routing summary) escapes `"` and `\\` and
every non-ASCII character as `\\uXXXX`, the dashboard's `tojson` also `<>&'`, HTML escapes,
URLs percent-encode. Each secret here carries a marker of letters and digits in its middle,
which no escaping changes: if any form of the secret got through, the marker is there.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import pytest
from markupsafe import Markup

from butlers.dashboard.app import _environment
from butlers.redact import REDACTED, Redactor, written_forms
from butlers.switchboard.route import summarize
from butlers.telemetry import RedactingSpanExporter
from tests.test_cli import REPO
from tests.test_dashboard import BEARER, dashboard_client
from tests.test_dashboard import fleet as fleet  # the fixture: a switchboard and general
from tests.test_operator import call

# The secret of the issue, with the marker in its middle (the escapes on both sides).
AWKWARD = "p&ss'w{marker}\"rd<>\\ü€"

# What the child process logs, with the process's own logging set up as every `butlers`
# command sets it up (butlers.cli.start_logging), the secrets read from its environment.
LOGGING_CHILD = r"""
import argparse, html, json, logging, sys, warnings
from urllib.parse import quote

import markupsafe

from butlers.cli import start_logging
from butlers.settings import Settings

settings = Settings.from_environ()
start_logging(argparse.Namespace(log_level="DEBUG", log_format=sys.argv[1]), settings)
log = logging.getLogger("butlers.test")
token = settings.variable("TELEGRAM_BOT_TOKEN")
password = settings.variable("BUTLERS_EMAIL_PASSWORD")
for s in (token, password):
    log.info("repr %r", s)
    log.info("container %r", {"token": s, "n": [s]})
    log.info("bytes %r", s.encode())
    log.info("ascii %a", s)
    log.info("json %s", json.dumps({"password": s}))
    log.info("json-utf8 %s", json.dumps({"password": s}, ensure_ascii=False))
    log.info("json-in-repr %r", json.dumps({"password": s}))
    log.info("json-in-json %s", json.dumps({"body": json.dumps({"password": s})}))
    log.info("html %s %s", html.escape(s), markupsafe.escape(s))
    log.info("url %s", "https://api.telegram.org/bot" + quote(s, safe="") + "/getMe")
    try:
        raise ConnectionError(f"login refused for {s!r}")
    except ConnectionError:
        log.exception("failed")
    warnings.warn(f"token {s!r} expired", UserWarning, stacklevel=1)
"""


def awkward(marker: str) -> str:
    return AWKWARD.format(marker=marker)


def markers() -> tuple[str, str]:
    return f"tok{uuid.uuid4().hex[:12]}", f"pw{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_an_awkward_secret_from_the_environment_never_shows_in_the_log(
    log_format: str,
) -> None:
    token_marker, password_marker = markers()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "TELEGRAM_"))}
    env.update(
        TELEGRAM_BOT_TOKEN=awkward(token_marker),
        BUTLERS_EMAIL_PASSWORD=awkward(password_marker),
        PYTHONIOENCODING="utf-8",
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        LOGGING_CHILD,
        log_format,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        _, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    log = err.decode()
    lines = log.splitlines()
    assert sum(" expired" in line for line in lines) == 2, log  # it did log everything
    for marker in (token_marker, password_marker):
        assert marker not in log, _around(log, marker)
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        messages = [r["message"] for r in records]
        assert all(token_marker not in json.dumps(r, ensure_ascii=False) for r in records)
    else:
        messages = [line.split(": ", 1)[1] for line in lines if " butlers.test: " in line]
    # Each escaped form was replaced whole: what is left is the escaping around it.
    expected = [
        f"repr '{REDACTED}'",
        f"container {{'token': '{REDACTED}', 'n': ['{REDACTED}']}}",
        f"bytes b'{REDACTED}'",
        f"ascii '{REDACTED}'",
        f'json {{"password": "{REDACTED}"}}',
        f'json-utf8 {{"password": "{REDACTED}"}}',
        f"""json-in-repr '{{"password": "{REDACTED}"}}'""",
        f'json-in-json {{"body": "{{\\"password\\": \\"{REDACTED}\\"}}"}}',
        f"html {REDACTED} {REDACTED}",
        f"url https://api.telegram.org/bot{REDACTED}/getMe",
    ]
    for line in expected:
        assert messages.count(line) == 2, (line, messages)
    assert log.count(f"ConnectionError: login refused for '{REDACTED}'") == 2


def _around(text: str, value: str) -> str:
    at = text.index(value)
    return text[max(0, at - 200) : at + 100]


def test_a_routing_summary_of_json_shows_no_form_of_the_secret() -> None:
    """summarize() writes the arguments as JSON (ensure_ascii) before redacting them."""
    marker, _ = markers()
    secret = awkward(marker)
    redactor = Redactor.from_environment(environ={"TELEGRAM_BOT_TOKEN": secret})
    summary = summarize({"note": secret, "nested": {"list": [secret]}}, redactor)
    assert summary == f'{{"note": "{REDACTED}", "nested": {{"list": ["{REDACTED}"]}}}}'
    prompt = summarize({"prompt": f"my password is {secret}, keep it"}, redactor)
    assert prompt == f"my password is {REDACTED}, keep it"


def test_the_dashboards_tojson_shows_no_form_of_the_secret() -> None:
    """A session's tool calls are printed with `tojson` (HTML-safe JSON: `<>&'` as `\\u`
    escapes), a Markup that autoescape leaves alone: the redactor the dashboard's `finalize`
    calls must find the secret in that form, and hand back Markup (else the JSON is
    escaped a second time)."""
    marker, password_marker = markers()
    secret = awkward(marker)
    password = awkward(password_marker)
    redactor = Redactor.from_environment(
        environ={"TELEGRAM_BOT_TOKEN": secret, "BUTLERS_EMAIL_PASSWORD": password}
    )
    template = _environment(redactor).get_template("session.html")
    session = {
        "id": "1",
        "success": False,
        "trigger_source": "route",
        "started_at": None,
        "duration_ms": 1200,
        "cost_usd": None,
        "prompt": f"the token is {secret}",
        "error": f"refused: {password!r}",
        "tool_calls": [
            {"name": "mcp__switchboard__route", "input": {"args": {"prompt": secret}}},
            {"name": "mcp__general__state_set", "input": {"key": "k", "value": [password]}},
        ],
    }
    page = template.render(s=session)
    assert marker not in page and password_marker not in page, page
    assert f'<code class="args">{{"args": {{"prompt": "{REDACTED}"}}}}</code>' in page
    assert f'<code class="args">{{"key": "k", "value": ["{REDACTED}"]}}</code>' in page
    assert f"the token is {REDACTED}" in page and f"refused: &#39;{REDACTED}&#39;" in page
    # A secret with few forms (searched with `in`, not the regex): the same.
    ampersand = f"a&b<{marker}"
    few = Redactor([ampersand])
    assert few._matcher[1] is None  # the loop
    session["tool_calls"] = [{"name": "x", "input": {"v": ampersand}}]
    page = _environment(few).get_template("session.html").render(s=session)
    assert f'<code class="args">{{"v": "{REDACTED}"}}</code>' in page
    # Markup holding the secret as it is (a `| safe` value): found all the same, and still
    # Markup (Markup's own replace() would look for the secret HTML-escaped).
    marked = few(Markup(f"<i>{ampersand}</i>"))
    assert marked == f"<i>{REDACTED}</i>" and isinstance(marked, Markup)


def test_exported_spans_carry_no_escaped_form_of_the_secret() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    marker, _ = markers()
    secret = awkward(marker)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    redactor = Redactor([secret])
    provider.add_span_processor(SimpleSpanProcessor(RedactingSpanExporter(memory, redactor)))
    with provider.get_tracer("test").start_as_current_span("call") as span:
        span.set_attribute("body", json.dumps({"password": secret}))
        span.record_exception(RuntimeError(f"refused {secret!r}"))
    provider.shutdown()
    [exported] = memory.get_finished_spans()
    assert marker not in exported.to_json()
    assert exported.attributes["body"] == f'{{"password": "{REDACTED}"}}'


def test_a_percent_encoded_database_password_is_redacted_as_written_and_as_decoded() -> None:
    """DATABASE_URL percent-encodes what a URL cannot carry; a driver's error quotes the
    password decoded."""
    marker, _ = markers()
    redactor = Redactor.from_environment(
        environ={"DATABASE_URL": f"postgresql://u:db%40{marker}%2Fx@db:5432/postgres"}
    )
    assert redactor(f"password 'db@{marker}/x' refused") == f"password '{REDACTED}' refused"
    assert redactor(f"postgresql://u:db%40{marker}%2Fx@db") == f"postgresql://u:{REDACTED}@db"


def test_repr_is_matched_whichever_quote_it_chose() -> None:
    """repr quotes with `"` (escaping no `'`) when the text holds a `'` and no `"`, and
    otherwise with `'` (escaping each `'`): the same secret, printed alone or beside a `"`,
    comes out two ways."""
    marker, _ = markers()
    # A quote, a backslash, a control character (\\x01 in repr, \\u0001 in JSON); no ".
    secret = f"o'neil\\{marker}\x01pw"
    redactor = Redactor([secret])
    assert redactor(repr(secret)) == f'"{REDACTED}"'
    assert redactor(repr(f'{secret} said "hi"')) == f"""'{REDACTED} said "hi"'"""
    assert redactor(repr(secret.encode())) == f'b"{REDACTED}"'


def test_the_many_forms_regex_and_the_few_forms_loop_agree() -> None:
    """Past LOOP_MAX_FORMS forms the redactor uses one trie-shaped regex instead of a loop
    over the forms: the same texts come out the same, the longest form replaced whole."""
    marker, other = markers()
    plain = f"tok-{marker}-0123456789"  # one form only
    longer = f"{plain}-and-more"  # a secret another one begins
    secrets = [plain, longer, awkward(marker), awkward(other)]
    texts = [
        f"({longer})",
        f"{plain} and {awkward(marker)!r} and {json.dumps(awkward(other))}",
        f"{plain}{plain}x{plain[:-1]}",
        "nothing here",
        f"prefix {awkward(other)[:-1]} suffix",  # all but its last character: no secret
    ]
    few, many, loop = Redactor([plain, longer]), Redactor(secrets), Redactor(secrets)
    assert few._matcher[1] is None and many._matcher[1] is not None
    forms = tuple(sorted({f for s in secrets for f in written_forms(s)}, key=len)[::-1])
    loop._matcher = (forms, None)  # the same secrets, the loop's way
    for text in texts:
        assert many(text) == loop(text), text
    assert few(texts[0]) == many(texts[0]) == f"({REDACTED})"  # the longer one whole
    assert many(texts[1]) == f"{REDACTED} and '{REDACTED}' and \"{REDACTED}\""
    assert few(texts[2]) == many(texts[2]) == f"{REDACTED}{REDACTED}x{plain[:-1]}"
    assert many(texts[3]) is texts[3] and many(texts[4]) is texts[4]
    # A long secret (a private key) builds its regex without deep recursion.
    key = "-----BEGIN KEY-----\n" + "A'b\"c<" * 2000 + "\n-----END KEY-----"
    assert Redactor([key])(f"key={key!r}") == f"key='{REDACTED}'"


async def test_the_message_page_shows_no_form_of_a_secret_in_a_routed_message(
    fleet, pg_server
) -> None:
    """End to end: a message quoting the secret goes through the real classifier (Claude
    Code), whose `route` call records the message in its tool call's input; the message's
    page renders that input with `tojson`, through the dashboard built with the process's
    redactor of that environment."""
    switchboard, _ = fleet
    marker, _ = markers()
    secret = awkward(marker)
    answer = await call(switchboard, "ask", text=f"remember my password {secret}")
    assert answer["status"] == "done", answer
    redactor = Redactor.from_environment(environ={"BUTLERS_EMAIL_PASSWORD": secret})
    async with dashboard_client(pg_server, switchboard, redact=redactor) as client:
        page = await client.get(f"/ui/messages/{answer['inbox_id']}", headers=BEARER)
    assert page.status_code == 200
    assert marker not in page.text
    assert f'"prompt": "remember my password {REDACTED}' in page.text  # tojson, not re-escaped


def test_a_span_status_cut_through_a_secret_shows_none_of_it() -> None:
    """A span's status is cut at 200 characters before the exporter redacts it: a secret
    straddling the cut is no longer whole, so no form of it matches; `clipped` (what the
    CLI gives the exporter) takes the beginning of one at the very end for it too."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Status, StatusCode

    from butlers.redact import Redactor
    from butlers.telemetry import RedactingSpanExporter

    secret = "tok-" + "9f3a7c1e5b2d" * 3
    redactor = Redactor([secret])
    error = ("x" * 180 + f" token {secret} refused")[:200]
    assert secret not in error and secret[:12] in error  # cut through the secret
    assert secret[:12] in redactor(error)  # whole forms only: the beginning shows
    assert redactor.clipped(error) == "x" * 180 + " token [redacted]"
    assert redactor.clipped("ends in an ordinary tok-9") == "ends in an ordinary tok-9"

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(RedactingSpanExporter(memory, redactor.clipped))
    )
    with provider.get_tracer("t").start_as_current_span("call") as span:
        span.set_status(Status(StatusCode.ERROR, error))
    provider.shutdown()
    [exported] = memory.get_finished_spans()
    assert exported.status.description.endswith(" token [redacted]")
    assert secret[:6] not in exported.status.description
