"""`--online`: ask the servers the fleet depends on whether they take our credentials.

Every check runs at once, each within the subject's timeout: a server that never answers
is a `fail` saying so, and holds up nothing else. Errors are described from what we know
(the variable's name, the server's address, the HTTP status and the API's error type), never
from a library's exception text alone where it could quote a credential (python-telegram-bot
names the token; the report is redacted on top of that).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import re
import wave
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from butlers.doctor.local import CREDENTIAL_VARIABLES, claude_binary, claude_login
from butlers.doctor.offline import config_file
from butlers.doctor.report import ENV_FILE, Check, Subject, fail, ok, warn
from butlers.tasks import within

if TYPE_CHECKING:
    from butlers.config import EmailConfig, TelegramConfig, TranscriptionConfig

DEFAULT_ANTHROPIC_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"
# The smallest request that proves a key: one token of the cheapest model.
PROBE_MODEL = "claude-haiku-4-5"


async def checks(subject: Subject) -> list[Check]:
    probes: list[tuple[str, Callable[[], Awaitable[list[Check]]]]] = []
    switchboard = subject.fleet.switchboard
    if switchboard is not None and switchboard.telegram is not None:
        telegram = switchboard.telegram
        if subject.variable(telegram.token_env) is not None:
            probes.append(("telegram", lambda: _telegram(subject, telegram)))
    if switchboard is not None and switchboard.email is not None:
        email = switchboard.email
        names = (email.username_env, email.password_env)
        if all(subject.variable(n) for n in names):
            if email.mode != "webhook":
                probes.append(("imap", lambda: _imap(subject, email)))
            probes.append(("smtp", lambda: _smtp(subject, email)))
    if switchboard is not None and switchboard.switchboard is not None:
        transcription = switchboard.switchboard.transcription
        if transcription.url:  # a local model_path is checked offline: nothing to ask
            probes.append(("transcription-service", lambda: _transcription(subject, transcription)))
    probes.append(("anthropic", lambda: _anthropic(subject)))
    endpoints, stale = await _endpoints(subject)
    for name, url in endpoints.items():
        probes.append((f"health.{name}", functools.partial(_health, subject, name, url)))
    results = await asyncio.gather(*(_bounded(subject, name, probe) for name, probe in probes))
    return [check for found in results for check in found] + [
        warn(
            f"health.{name}",
            "in the registry, stale: the last discover did not find it in the config directory "
            "(route refuses it); restore its directory (or fix its butler.toml) and run "
            "`butlers discover`, or leave it: the registry keeps every butler it knew",
        )
        for name in stale
    ]


async def _bounded(
    subject: Subject, name: str, probe: Callable[[], Awaitable[list[Check]]]
) -> list[Check]:
    """One probe within the timeout; whatever it raises becomes its `fail`."""
    try:
        async with asyncio.timeout(subject.timeout_s):
            return await probe()
    except TimeoutError:
        return [fail(name, f"no answer within {subject.timeout_s:g} s: is the server reachable?")]
    except Exception as exc:
        return [fail(name, f"{type(exc).__name__}: {exc}")]


# -- Telegram ---------------------------------------------------------------------------------


async def _telegram(subject: Subject, config: TelegramConfig) -> list[Check]:
    """getMe proves the token; getWebhookInfo says whether Telegram's idea of the mode
    matches ours."""
    from telegram import Bot
    from telegram.error import InvalidToken, NetworkError, TelegramError
    from telegram.request import HTTPXRequest

    from butlers.modules.telegram import TOKEN_REFUSALS

    token = subject.variable(config.token_env)
    assert token is not None
    base = (config.api_base_url or "https://api.telegram.org").rstrip("/")
    # Our own request objects, closed by us: Bot.shutdown() closes nothing of a bot whose
    # initialize() (a getMe) failed, and a wrong token is what this check is for.
    requests = (HTTPXRequest(), HTTPXRequest())
    bot = Bot(
        token,
        base_url=f"{base}/bot",
        base_file_url=f"{base}/file/bot",
        request=requests[0],
        get_updates_request=requests[1],
    )
    try:
        try:
            me = await bot.get_me()
        except InvalidToken as exc:
            # Never the exception's own text: python-telegram-bot's names the token.
            described = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            said = TOKEN_REFUSALS.get(getattr(described, "message", ""), "refused")
            return [
                fail(
                    "telegram",
                    f"Telegram rejected the bot token in {config.token_env} ({said}): copy the "
                    "token from @BotFather again",
                )
            ]
        except TelegramError as exc:
            # NetworkError (TimedOut too) from httpx: nothing answered. Else the server did.
            cause = _connection_failure(exc, token) if isinstance(exc, NetworkError) else None
            if cause is not None:
                return [
                    fail(
                        "telegram",
                        f"the Bot API at {base} could not be reached ({cause}): check this "
                        "machine's network (a proxy: HTTPS_PROXY), or [modules.telegram] "
                        "api_base_url",
                    )
                ]
            return [
                fail(
                    "telegram", f"the Bot API at {base} did not answer getMe: {type(exc).__name__}"
                )
            ]
        found = [ok("telegram", f"the token in {config.token_env} is @{me.username}'s")]
        try:
            info = await bot.get_webhook_info()
        except InvalidToken:
            # The token passed getMe: this is the 404 of a Bot API without the method
            # (python-telegram-bot calls every 404 InvalidToken; said so, it contradicted the
            # line above: a walkthrough).
            return [
                *found,
                warn(
                    "telegram-webhook-info",
                    f"the Bot API at {base} does not answer getWebhookInfo (404: a self-hosted "
                    "or older Bot API?): whether a webhook is set cannot be checked",
                ),
            ]
        except TelegramError as exc:
            return [
                *found,
                warn("telegram-webhook-info", f"getWebhookInfo failed: {type(exc).__name__}"),
            ]
        found.append(_webhook_state(config, info.url or "", info.last_error_message))
        return found
    finally:
        for request in requests:
            await request.shutdown()


def _connection_failure(exc: Exception, token: str) -> str | None:
    """What failed underneath python-telegram-bot's NetworkError when it is httpx's own
    error (the connection refused, a name that does not resolve, a timeout), without the
    token a URL in it could carry and without control characters; None when the server
    answered (its own text is not ours to print: a broken or hostile `api_base_url` could
    put anything there)."""
    import httpx

    from butlers.text import printable

    cause = exc.__cause__
    if not isinstance(cause, (httpx.HTTPError, httpx.InvalidURL)):
        return None
    text = printable(str(cause).replace(token, "<token>").partition("\n")[0])
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def _webhook_state(config: TelegramConfig, registered: str, last_error: str | None) -> Check:
    name = "telegram-webhook-info"
    if config.mode == "polling":
        if registered:
            return warn(
                name,
                f'a webhook is registered ({registered}) though mode = "polling": Telegram '
                "gives getUpdates nothing while it is set; `butlers up` deletes it at start, "
                "but if another program set it, they will take turns: stop the other program",
            )
        return ok(name, "no webhook registered: polling works")
    if config.webhook_url and registered != config.webhook_url:
        return fail(
            name,
            f"Telegram sends updates to {registered or 'nowhere (no webhook)'}, not to "
            f"webhook_url {config.webhook_url}: restart `butlers up`, which registers it, and "
            "check that no other program sets this bot's webhook",
        )
    if not registered:
        return fail(name, "webhook mode but no webhook registered: set webhook_url")
    if last_error:
        return warn(name, f"{registered}: Telegram's last delivery failed ({last_error})")
    return ok(name, f"Telegram sends updates to {registered}")


# -- mail -------------------------------------------------------------------------------------


def _servers(config: EmailConfig) -> dict[str, Any]:
    from butlers.modules.mail_transport import MailServer, security

    return {
        "IMAP": MailServer(
            "IMAP",
            config.imap_host,
            config.imap_port,
            security(config.imap_ssl, config.imap_starttls),
        ),
        "SMTP": MailServer(
            "SMTP",
            config.smtp_host,
            config.smtp_port,
            security(config.smtp_ssl, config.smtp_starttls),
        ),
    }


def _mail_fix(config: EmailConfig) -> str:
    return f"check {config.username_env} and {config.password_env}, and the host and port"


async def _tls_mismatch(server: Any) -> str | None:
    """What to set when a mail server's TLS begins the other way round than the config says
    (a server on a port of its own: init once chose by the port alone, and the login then
    failed with WRONG_VERSION_NUMBER, or waited until the check timed out); None when it
    matches or cannot be told. Asked first: a mismatch would otherwise cost the whole wait."""
    from butlers.modules.mail_transport import tls_keys, tls_spoken

    spoken = await tls_spoken(server.host, server.port, timeout_s=3.0)
    # (A server in plain text and a config without TLS: on loopback, as meant.)
    if spoken is None or (spoken == "implicit") == (server.security == "implicit"):
        return None
    how = "greets in plain text (STARTTLS)" if spoken == "starttls" else "speaks TLS at once"
    return (
        f"{server.where} {how}, but the config says {server.security}: set "
        f"{tls_keys(server.protocol, spoken)} under [modules.email]"
    )


def _account(subject: Subject, config: EmailConfig) -> tuple[str, str]:
    """The mailbox's username and password: the mail probes are run only when both are set."""
    username = subject.variable(config.username_env)
    password = subject.variable(config.password_env)
    assert username is not None and password is not None
    return username, password


async def _imap(subject: Subject, config: EmailConfig) -> list[Check]:
    from butlers.errors import MailError
    from butlers.modules.mail_transport import imap_close, imap_connect, tls_context

    server = _servers(config)["IMAP"]
    username, password = _account(subject, config)
    if (mismatch := await _tls_mismatch(server)) is not None:
        return [fail("imap", mismatch)]
    try:
        client = await imap_connect(
            server, username, password, context=tls_context(), on_lost=lambda _: None
        )
    except MailError as exc:
        return [fail("imap", f"{exc}; {_mail_fix(config)}")]
    try:
        found = [ok("imap", f"{server.where}: logged in as {username}")]
        if not config.require_authentication_results:
            with contextlib.suppress(Exception):  # a suggestion: nothing fails for want of it
                if (authserv_id := await _authserv_id(client)) is not None:
                    found.append(_authserv_hint(subject, authserv_id))
    finally:
        await imap_close(client)
    return found


# How many of the newest mails in INBOX are looked at for the mail server's authserv-id.
AUTHSERV_SAMPLE = 10


async def _authserv_id(client: Any) -> str | None:
    """The authserv-id every one of the newest mails' topmost Authentication-Results names
    (the mailbox's own mail server writes its header above what a mail came with), or None:
    none, or they differ (a server that writes none leaves the senders' own on top, which a
    stranger's mails could make the majority: a review).
    Nothing is changed: BODY.PEEK flags no mail seen. (SELECT, as the intake does:
    aioimaplib's EXAMINE leaves it unable to SEARCH.)"""
    from collections import Counter

    import authres

    selected = await within(client.select("INBOX"), 10)
    if selected.result != "OK":
        return None
    every = await within(client.uid_search("ALL"), 10)
    uids = (every.lines[0].split() if every.lines else [])[-AUTHSERV_SAMPLE:]
    if not uids:
        return None
    fields = "(BODY.PEEK[HEADER.FIELDS (AUTHENTICATION-RESULTS)])"
    fetched = await within(client.uid("fetch", b",".join(uids).decode(), fields), 10)
    named: Counter[str] = Counter()
    for line in fetched.lines:
        if not isinstance(line, bytearray):  # each mail's header fields are a literal
            continue
        text = bytes(line).decode("utf-8", "replace")
        first = re.split(r"\r?\n(?![ \t])", text.strip(), maxsplit=1)[0]
        if not first.lower().startswith("authentication-results:"):
            continue
        try:
            header = authres.AuthenticationResultsHeader.parse_value(first.split(":", 1)[1])
        except (authres.AuthResError, RecursionError):
            continue
        if header.authserv_id:
            named[str(header.authserv_id)] += 1
    return next(iter(named)) if len(named) == 1 else None


def _authserv_hint(subject: Subject, authserv_id: str) -> Check:
    switchboard = subject.fleet.switchboard
    where = config_file(switchboard) if switchboard is not None else "the switchboard's butler.toml"
    return warn(
        "mail-authserv-id",
        f"the newest mail in INBOX all carries Authentication-Results from {authserv_id!r} "
        "on top, most likely your mail server's: check that it is, then set "
        "require_authentication_results = "
        f"{json.dumps(authserv_id)} under [modules.email] in {where}, and a forged From no "
        "longer gets in (docs/security.md)",
    )


async def _smtp(subject: Subject, config: EmailConfig) -> list[Check]:
    from butlers.errors import MailError
    from butlers.modules.mail_transport import smtp_session, tls_context

    server = _servers(config)["SMTP"]
    username, password = _account(subject, config)
    if (mismatch := await _tls_mismatch(server)) is not None:
        return [fail("smtp", mismatch)]
    try:
        async with smtp_session(server, username, password, context=tls_context()) as smtp:
            logged_in = smtp.supports_extension("auth")
    except MailError as exc:
        return [fail("smtp", f"{exc}; {_mail_fix(config)}")]
    how = f"logged in as {username}" if logged_in else "a relay without AUTH: no login"
    return [ok("smtp", f"{server.where}: EHLO answered, {how}")]


# -- speech to text ---------------------------------------------------------------------------


def silent_wav(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    """A short WAV of silence (16-bit mono): the smallest file every speech-to-text service
    reads."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * int(rate * seconds))
    return buffer.getvalue()


async def _transcription(subject: Subject, config: TranscriptionConfig) -> list[Check]:
    """Half a second of silence, sent as a voice note would be: the only request that proves
    the URL, the key and the model together (the API has no cheaper one). It costs a fraction
    of a cent where the service bills by the second (Groq bills at least 10 s). Any answer
    with status 200 counts, whatever words the service heard in the silence."""
    from butlers.errors import TranscriptionFailed
    from butlers.media import Attachment
    from butlers.switchboard.transcription import HttpTranscriber, where

    name, service = "transcription-service", where(config.url)
    key = subject.variable(config.api_key_env) if config.api_key_env else None
    clip = Attachment("doctor.wav", "audio/wav", silent_wav())
    async with HttpTranscriber(config, key) as transcriber:
        try:
            await transcriber.request(clip)
        except TranscriptionFailed as exc:
            if exc.transient and exc.status is not None:  # 5xx, 429: the service, not us
                return [warn(name, f"{exc}; try again later")]
            return [fail(name, str(exc))]
    said = f"the key in {config.api_key_env}" if key is not None else "no key"
    return [ok(name, f"{service} transcribed a test clip with {said} (model {config.model})")]


# -- Claude Code's credentials ----------------------------------------------------------------


async def _anthropic(subject: Subject) -> list[Check]:
    """One Messages API request of one token with the key sessions would use; without a key
    but with a login, Claude Code's own `auth status`."""
    key = subject.variable("ANTHROPIC_API_KEY")
    bearer = subject.variable("ANTHROPIC_AUTH_TOKEN")
    if key is None and bearer is None:
        return [await _claude_auth_status(subject)]
    import aiohttp

    base = (subject.variable("ANTHROPIC_BASE_URL") or DEFAULT_ANTHROPIC_URL).rstrip("/")
    url = f"{base}/v1/messages"
    variable = "ANTHROPIC_API_KEY" if key is not None else "ANTHROPIC_AUTH_TOKEN"
    headers = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
    if key is not None:
        headers["x-api-key"] = key
    else:
        headers["authorization"] = f"Bearer {bearer}"
    body = {
        "model": PROBE_MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "ping"}],
    }
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, json=body, headers=headers) as response,
        ):
            status = response.status
            text = await response.text()
    except aiohttp.ClientError as exc:
        return [
            fail(
                "anthropic",
                f"cannot reach {url}: {type(exc).__name__}; check the network "
                "(and ANTHROPIC_BASE_URL, HTTPS_PROXY)",
            )
        ]
    return [_judge(url, variable, status, text)]


def _judge(url: str, variable: str, status: int, text: str) -> Check:
    error: dict[str, Any] = {}
    try:
        answer = json.loads(text)
        if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
            error = answer["error"]
    except ValueError:
        pass
    kind = str(error.get("type") or "")
    message = str(error.get("message") or "")[:200]
    said = f"{status} {kind}".strip()
    if status == 200:
        return ok("anthropic", f"{url} accepted {variable}")
    if status == 401:
        return fail("anthropic", f"invalid key: {url} refused {variable} ({said}); set a valid one")
    if status == 403:
        return fail(
            "anthropic", f"{url} refused {variable} ({said}: {message}); check its permissions"
        )
    if "credit balance" in message.lower() or "quota" in message.lower():
        return fail(
            "anthropic",
            f"quota exhausted: {url} said {said} to {variable}: {message}; add credits to that "
            "account",
        )
    if status == 429:
        return fail(
            "anthropic",
            f"rate limited or out of quota: {url} said {said} to {variable}: {message}; wait, "
            "or raise the account's limits",
        )
    if status == 404 and kind == "not_found_error":
        return ok("anthropic", f"{url} accepted {variable} (the probe's model is unknown there)")
    if status in (500, 502, 503, 529):
        return warn("anthropic", f"{url} is having trouble ({said}); try again later")
    return fail("anthropic", f"{url} answered {said} to {variable}: {message}")


async def _claude_auth_status(subject: Subject) -> Check:
    """Claude Code's own `auth status` (no request is sent), in the environment a session
    would have: who is logged in, or nobody."""
    from butlers.environment import claude_code_keeps

    binary = claude_binary(subject.environ)
    if binary is None:
        return fail("anthropic", "no Claude Code binary to ask (see claude-code)")
    environ = {k: v for k, v in subject.environ.items() if claude_code_keeps(k, subject.environ)}
    environ["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    process = await asyncio.create_subprocess_exec(
        binary,
        "auth",
        "status",
        "--json",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=environ,
    )
    try:
        output, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    try:
        status = json.loads(output)
    except ValueError:
        status = {}
    if isinstance(status, dict) and status.get("loggedIn"):
        method = status.get("authMethod") or "a login"
        expires = status.get("loginExpiresAt")
        until = f", until {expires}" if expires else ""
        return ok("anthropic", f"Claude Code is logged in ({method}{until}); no key to try")
    login = claude_login(subject.environ)
    where = f" (found {login})" if login else ""
    env_file = subject.env_file or subject.config_dir / ENV_FILE
    return fail(
        "anthropic",
        f"Claude Code says it is not logged in{where}: set {CREDENTIAL_VARIABLES[0]} in "
        f"{env_file} and load it (set -a; . {env_file}; set +a), or log in with {binary} "
        "/login",
    )


# -- the butlers ------------------------------------------------------------------------------


async def _endpoints(subject: Subject) -> tuple[dict[str, str], list[str]]:
    """Each butler's MCP endpoint: the config directory's, then the registry's (when the
    switchboard's database answered the database check); and the registry's stale ones
    of no config (gone from the directory: nothing to ask, nothing to start)."""
    endpoints = {b.name: b.endpoint_url for b in subject.butlers}
    switchboard = subject.fleet.switchboard
    dsn = subject.dsn.get(switchboard.database) if switchboard is not None else None
    if dsn is None:
        return endpoints, []
    import asyncpg

    try:
        async with asyncio.timeout(subject.timeout_s):
            conn = await asyncpg.connect(dsn)
            try:
                rows = await conn.fetch(
                    "SELECT name, endpoint_url, missing_since IS NOT NULL AS stale "
                    "FROM butler_registry"
                )
            finally:
                await conn.close()
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return endpoints, []
    stale = []
    for row in rows:
        if row["name"] in endpoints:
            continue
        if row["stale"]:
            stale.append(row["name"])
        else:
            endpoints[row["name"]] = row["endpoint_url"]
    return endpoints, sorted(stale)


async def _health(subject: Subject, name: str, endpoint_url: str) -> list[Check]:
    import aiohttp

    from butlers.dashboard.fleet import health_url

    url = health_url(endpoint_url)
    check = f"health.{name}"
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            status = response.status
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return [
            warn(
                check,
                f"nothing answers at {url}: start it with `butlers up` (or, when the fleet "
                "runs with --port-offset K, ask doctor --port-offset K)",
            )
        ]
    if not isinstance(body, dict):
        return [fail(check, f"{url} answered {status} without a butler's JSON: another program?")]
    failed, skipped = [], []
    for module in body.get("modules") or []:
        if isinstance(module, dict):
            said = f"{module.get('name')} ({module.get('detail') or module.get('status')})"
            if module.get("status") == "failed":
                failed.append(said)
            elif module.get("status") == "skipped":
                skipped.append(said)
    if status != 200:
        database = body.get("database")
        return [fail(check, f"{url} answered {status}: not ready (database: {database})")]
    if failed:
        return [fail(check, f"{url}: modules failed: {'; '.join(failed)}")]
    if skipped:
        return [warn(check, f"{url}: modules skipped: {'; '.join(skipped)}")]
    return [ok(check, f"{url}: ready")]
