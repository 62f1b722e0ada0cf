"""`butlers doctor`: each check against the real thing it looks at (a subprocess of the real
command for the CLI's shape, real ports, a real PostgreSQL, the bundled Claude Code, the fake
Bot API, pymap and aiosmtpd on loopback), and never a secret in what it prints."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from butlers.doctor.report import Check, examine
from butlers.settings import Settings
from tests.conftest import free_port, write_butler_dir
from tests.fakes import serve_on_loopback
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.mail import MailCA, SmtpServer, imap_append, imap_unseen, pymap_server
from tests.test_cli import copy_shipped_config

REPO = Path(__file__).resolve().parent.parent
BUTLERS = str(Path(sys.executable).parent / "butlers")
LINE = re.compile(r"^(ok|warn|fail) +(\S+) +(\S.*)$")
TOKEN_OK = "x" * 32


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user with an empty home, data of their own, and nothing of the host's setup."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LC_ALL": "C.UTF-8",
        "BUTLERS_DATA_DIR": str(tmp_path / "data"),
        **extra,
    }


def fleet_dir(
    root: Path,
    *,
    telegram: str | None = None,
    email: str | None = None,
    switchboard: str = "",
    host: str | None = None,
) -> Path:
    """A config directory: `general` and a switchboard with the given module tables."""
    config = root / "butlers"
    host_line = f'host = "{host}"\n' if host else ""
    write_butler_dir(config, "general", free_port(), extra=host_line)
    extra = host_line
    if telegram is not None:
        extra += f"[modules.telegram]\n{telegram}\n"
    if email is not None:
        extra += f"[modules.email]\n{email}\n"
    extra += f"[switchboard]\n{switchboard}\n"
    write_butler_dir(config, "switchboard", free_port(), extra=extra)
    return config


async def doctor(
    config_dir: Path, environ: dict[str, str], *, online: bool = False, timeout_s: float = 10
) -> dict[str, Check]:
    """doctor's checks, in process, by name."""
    findings = await examine(
        config_dir, Settings.from_environ(environ), online=online, timeout_s=timeout_s
    )
    return {check.name: check for check in findings.checks}


async def doctor_cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`butlers doctor ARGS` as a user runs it: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        "doctor",
        *args,
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


# -- the command ------------------------------------------------------------------------------


async def test_the_shipped_config_passes_offline(tmp_path: Path) -> None:
    """With its secrets set, the shipped config directory passes: warnings (nobody allowed
    yet, no owner, the database not started) but no failure, so exit 0; one line per check."""
    config = tmp_path / "butlers"
    copy_shipped_config(config)
    secrets = {
        "TELEGRAM_BOT_TOKEN": f"123456:{uuid.uuid4().hex}",
        "BUTLERS_EMAIL_USER": "butler@example.com",
        "BUTLERS_EMAIL_PASSWORD": f"pw-{uuid.uuid4().hex}",
        "ANTHROPIC_API_KEY": f"sk-ant-{uuid.uuid4().hex}",
    }
    code, out, err = await doctor_cli(
        "--config-dir", str(config), env=base_env(tmp_path, **secrets)
    )
    assert code == 0, out + err
    lines = out.splitlines()
    assert all(LINE.match(line) for line in lines), out
    statuses = {LINE.match(line).group(2): LINE.match(line).group(1) for line in lines}  # type: ignore[union-attr]
    assert statuses["config"] == statuses["secrets"] == statuses["claude-credentials"] == "ok"
    assert statuses["telegram-allowlist"] == "warn" and statuses["database"] == "warn"
    assert "fail" not in statuses.values(), out
    for secret in secrets.values():
        assert secret not in out + err


async def test_json_prints_exactly_the_checks(tmp_path: Path) -> None:
    config = tmp_path / "butlers"
    copy_shipped_config(config)
    code, out, _ = await doctor_cli("--config-dir", str(config), "--json", env=base_env(tmp_path))
    report = json.loads(out)
    assert list(report) == ["checks"]
    assert report["checks"], report
    for check in report["checks"]:
        assert list(check) == ["name", "status", "detail"]
        assert check["status"] in ("ok", "warn", "fail") and check["detail"]
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    # No secrets and no Claude credentials in this environment: those two fail, exit 1.
    assert failed == {"secrets", "claude-credentials"}, report
    assert code == 1


async def test_a_missing_config_directory_fails_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "butlers"
    code, out, err = await doctor_cli("--config-dir", str(missing), env=base_env(tmp_path))
    assert code == 1
    [line] = [line for line in out.splitlines() if line.split()[1] == "config"]
    assert line.startswith("fail")
    assert str(missing) in line and "does not exist" in line and "butlers init" in line
    assert "Traceback" not in err, err


async def test_an_approvals_glob_that_guards_nothing_fails_as_up_would(tmp_path: Path) -> None:
    """`[approvals] tools = ["notfy"]`: `butlers up` refuses that butler, and doctor said
    "ok" of its config (a walkthrough). A glob that matches a tool, a channel's among them
    (its variables set), passes; the switchboard's own tools count on the switchboard."""
    config = fleet_dir(tmp_path, telegram='token_env = "TELEGRAM_BOT_TOKEN"')
    general = config / "general" / "butler.toml"
    general.write_text(general.read_text() + '[approvals]\ntools = ["notfy", "state_*"]\n')
    switchboard = config / "switchboard" / "butler.toml"
    text = switchboard.read_text()
    switchboard.write_text(
        text.replace(
            "[switchboard]", '[approvals]\ntools = ["send_message", "deliver"]\n\n[switchboard]', 1
        )
    )
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", TELEGRAM_BOT_TOKEN="123:abc")
    checks = await doctor(config, env)
    refused = checks["config.general"]
    assert refused.status == "fail", refused
    assert "approvals.tools" in refused.detail and "'notfy'" in refused.detail
    assert "did you mean 'notify'?" in refused.detail
    assert "config.switchboard" not in checks, checks["config.switchboard"]
    # Without its bot token the channel registers nothing: its tool guards nothing either.
    del env["TELEGRAM_BOT_TOKEN"]
    checks = await doctor(config, env)
    assert "'send_message' matches none" in checks["config.switchboard"].detail


async def test_a_broken_butler_toml_is_named_with_its_error(tmp_path: Path) -> None:
    config = fleet_dir(tmp_path)
    (config / "general" / "butler.toml").write_text(
        '[butler]\nname = "general"\nport = 8101\nprot = 1\n'
    )
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    broken = checks["config.general"]
    assert broken.status == "fail"
    assert str(config / "general" / "butler.toml") in broken.detail and "prot" in broken.detail


# -- secrets and exposure ---------------------------------------------------------------------


async def test_a_butler_beyond_loopback_without_a_token_fails(tmp_path: Path) -> None:
    config = fleet_dir(tmp_path, host="0.0.0.0")
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")
    checks = await doctor(config, env)
    assert checks["bind"].status == "fail"
    assert "BUTLERS_AUTH_TOKEN" in checks["bind"].detail and "0.0.0.0" in checks["bind"].detail
    # A short token: the butler would refuse it, so doctor fails it too.
    checks = await doctor(config, {**env, "BUTLERS_AUTH_TOKEN": "short-token"})
    assert checks["bind"].status == "ok" and checks["auth-token"].status == "fail"
    assert "11 characters" in checks["auth-token"].detail
    checks = await doctor(config, {**env, "BUTLERS_AUTH_TOKEN": TOKEN_OK})
    assert checks["bind"].status == checks["auth-token"].status == "ok"
    # Also when the host comes from BUTLERS_HOST (what docker compose sets).
    checks = await doctor(fleet_dir(tmp_path / "b"), {**env, "BUTLERS_HOST": "0.0.0.0"})
    assert checks["bind"].status == "fail"


async def test_sessions_that_may_fetch_urls_want_a_token(tmp_path: Path) -> None:
    """A session given WebFetch, on a machine whose butlers and dashboard take no token, could
    be told to fetch loopback's /ui (everyone's messages): a warning, gone with a token."""
    config = fleet_dir(tmp_path)
    toml = config / "general" / "butler.toml"
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")
    assert "fetch" not in await doctor(config, env)
    toml.write_text(toml.read_text() + '[runtime]\nbuiltin_tools = ["WebSearch", "WebFetch"]\n')
    checks = await doctor(config, env)
    assert checks["fetch"].status == "warn"
    assert checks["fetch"].detail.startswith("general: sessions may use WebFetch")
    assert "BUTLERS_AUTH_TOKEN" in checks["fetch"].detail
    assert "fetch" not in await doctor(config, {**env, "BUTLERS_AUTH_TOKEN": TOKEN_OK})


async def test_the_env_file_is_read_and_must_be_private(tmp_path: Path) -> None:
    """The variables of <config dir>/.env count (the environment still wins); a .env others
    can read fails, naming the fix."""
    config = fleet_dir(tmp_path, telegram='allowed_chat_ids = ["1"]')
    env_file = config / ".env"
    env_file.write_text("TELEGRAM_BOT_TOKEN=123:from-the-file\nANTHROPIC_API_KEY=sk-from-file\n")
    env_file.chmod(0o644)
    checks = await doctor(config, base_env(tmp_path))
    assert checks["secrets"].status == "ok", checks["secrets"]
    assert checks["claude-credentials"].status == "ok"
    assert str(env_file) in checks["claude-credentials"].detail
    permissions = checks["env-file-permissions"]
    assert permissions.status == "fail" and f"chmod 600 {env_file}" in permissions.detail
    env_file.chmod(0o600)
    checks = await doctor(config, base_env(tmp_path))
    assert checks["env-file-permissions"].status == "ok"
    # What only the file sets, `butlers up` does not see: said.
    assert checks["env-file"].status == "warn" and "TELEGRAM_BOT_TOKEN" in checks["env-file"].detail
    checks = await doctor(
        config, base_env(tmp_path, TELEGRAM_BOT_TOKEN="1:env", ANTHROPIC_API_KEY="sk-env")
    )
    assert checks["env-file"].status == "ok"


async def test_a_missing_secret_fails_naming_the_variable_and_who_needs_it(tmp_path: Path) -> None:
    config = fleet_dir(tmp_path, telegram='token_env = "MY_BOT_TOKEN"\nallowed_chat_ids = ["1"]')
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["secrets"].status == "fail"
    assert "MY_BOT_TOKEN (switchboard: [modules.telegram] token_env)" in checks["secrets"].detail
    assert str(config / ".env") in checks["secrets"].detail


async def test_a_channel_without_its_secrets_warns_while_another_starts(tmp_path: Path) -> None:
    """`butlers up` starts the switchboard without a channel whose variables are not set:
    doctor warns of it (it failed, where `up` ran), and fails only when no channel would
    start, or a tool server's header is not set."""
    email = (
        'imap_host = "imap.example.com"\nsmtp_host = "smtp.example.com"\n'
        'address = "me@example.com"\nallowed_senders = ["me@example.com"]'
    )
    config = fleet_dir(tmp_path, telegram='allowed_chat_ids = ["1"]', email=email)
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", TELEGRAM_BOT_TOKEN="1:x")
    checks = await doctor(config, env)
    secrets = checks["secrets"]
    assert secrets.status == "warn", secrets
    assert "BUTLERS_EMAIL_PASSWORD (switchboard: [modules.email] password_env)" in secrets.detail
    assert "starts without switchboard's email; switchboard's telegram starts" in secrets.detail
    del env["TELEGRAM_BOT_TOKEN"]
    checks = await doctor(config, env)
    assert checks["secrets"].status == "fail"
    assert "No channel would start" in checks["secrets"].detail


async def test_an_owner_who_may_not_write_back_warns(tmp_path: Path) -> None:
    """Reminders reach the owner's chat, but their answers got "this is a private butler"
    when the allowlist left them out (a walkthrough)."""
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", BUTLERS_EMAIL_PASSWORD="x")
    owner = '[switchboard.owner]\nemail = "me@example.com"\ntelegram_chat_id = "2"'
    email = (
        'imap_host = "imap.example.com"\nsmtp_host = "smtp.example.com"\n'
        'address = "bot@example.com"\nallowed_senders = ["{}"]'
    )
    config = fleet_dir(tmp_path / "a", email=email.format("ada@example.com"), switchboard=owner)
    check = (await doctor(config, env))["owner"]
    assert check.status == "warn", check
    assert "add 'me@example.com' to [modules.email] allowed_senders" in check.detail
    assert "telegram" not in check.detail.split(":", 1)[1]  # (the owner's chat may write)
    config = fleet_dir(tmp_path / "b", email=email.format("me@example.com"), switchboard=owner)
    assert (await doctor(config, env))["owner"].status == "ok"
    # The owner's address the butler's own: its mail is never read (the owner could never
    # write by mail: the first hour's walkthrough).
    own = owner.replace("me@example.com", "Bot@Example.com")
    config = fleet_dir(tmp_path / "c", email=email.format("bot@example.com"), switchboard=own)
    check = (await doctor(config, env))["owner"]
    assert check.status == "fail" and "is the butler's own address" in check.detail, check


async def test_a_data_directory_open_to_others_warns(tmp_path: Path) -> None:
    config = fleet_dir(tmp_path)
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    # As root the embedded server's account must still pass through: 711, not 700.
    advice = f"chmod {711 if os.geteuid() == 0 else 700} {data}"
    assert checks["data-dir"].status == "warn" and advice in checks["data-dir"].detail
    data.chmod(0o700)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["data-dir"].status == "ok"
    assert checks["data-dir"].detail.endswith("is closed to other users (rwx------)")
    # Passable but not readable: what `butlers up` makes as root, where the embedded
    # PostgreSQL's own account must pass; for anyone else a warning still.
    data.chmod(0o711)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["data-dir"].status == ("ok" if os.geteuid() == 0 else "warn")
    checks = await doctor(
        config,
        base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", DATABASE_URL="postgresql://127.0.0.1:1/d"),
    )
    assert checks["data-dir"].status == "warn"  # no embedded server: nobody needs to pass


async def test_a_data_directory_of_someone_else_fails_and_one_others_may_write_warns(
    tmp_path: Path,
) -> None:
    """`butlers up` refuses the first (its owner could read the token kept there) and takes
    the others' write access away from the second: doctor says so before."""
    config = fleet_dir(tmp_path)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        said = "it belongs to nobody (uid 65534), not to you"
    else:
        theirs, said = Path("/tmp"), "it is a directory everyone shares"
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", BUTLERS_DATA_DIR=str(theirs))
    checks = await doctor(config, env)
    assert checks["data-dir"].status == "fail"
    assert checks["data-dir"].detail.startswith(
        f"refusing the data directory {theirs} (BUTLERS_DATA_DIR): {said}"
    ), checks["data-dir"].detail
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    data.chmod(0o733)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["data-dir"].status == "warn"
    assert checks["data-dir"].detail.startswith(f"{data} (BUTLERS_DATA_DIR) is writable by other")


# -- who can write, and mail ------------------------------------------------------------------


async def test_empty_allowlists_warn_unless_pairing_is_on(tmp_path: Path) -> None:
    email = (
        'imap_host = "127.0.0.1"\nsmtp_host = "127.0.0.1"\nrequire_authentication_results = "mx"'
    )
    env = base_env(
        tmp_path,
        ANTHROPIC_API_KEY="sk-x",
        TELEGRAM_BOT_TOKEN="1:t",
        BUTLERS_EMAIL_USER="u",
        BUTLERS_EMAIL_PASSWORD="p",
    )
    checks = await doctor(fleet_dir(tmp_path / "off", telegram="", email=email), env)
    assert checks["telegram-allowlist"].status == "warn"
    assert "nobody can message the bot" in checks["telegram-allowlist"].detail
    assert "add your chat id" in checks["telegram-allowlist"].detail
    assert "pairing" in checks["telegram-allowlist"].detail
    assert checks["email-allowlist"].status == "warn"
    paired = fleet_dir(
        tmp_path / "on",
        telegram="",
        email=email,
        switchboard="[switchboard.pairing]\nenabled = true",
    )
    checks = await doctor(paired, env)
    assert checks["telegram-allowlist"].status == checks["email-allowlist"].status == "ok"


async def test_pairing_by_mail_without_dmarc_fails_and_a_group_as_the_owner_warns(
    tmp_path: Path,
) -> None:
    """With pairing on, every unknown From is answered with a code: without
    require_authentication_results, forged Froms make the butler mail strangers
    (backscatter), a fail. An owner's chat that is a group: its buttons count for nobody."""
    email = 'imap_host = "127.0.0.1"\nsmtp_host = "127.0.0.1"'
    switchboard = (
        '[switchboard.pairing]\nenabled = true\n[switchboard.owner]\ntelegram_chat_id = "-1001234"'
    )
    config = fleet_dir(tmp_path, telegram="", email=email, switchboard=switchboard)
    checks = await doctor(config, base_env(tmp_path))
    dmarc = checks["mail-authentication-results"]
    assert dmarc.status == "fail", dmarc
    assert "[switchboard.pairing] is enabled but require_authentication_results is unset" in (
        dmarc.detail
    )
    assert "backscatter" in dmarc.detail and "authserv-id" in dmarc.detail
    owner = checks["owner"]
    assert owner.status == "warn" and "'-1001234' is not a private chat" in owner.detail
    assert "set it to your own chat id" in owner.detail


async def test_mail_without_tls_beyond_loopback_fails(tmp_path: Path) -> None:
    email = (
        'imap_host = "mail.example.com"\nimap_ssl = false\nsmtp_host = "127.0.0.1"\n'
        "smtp_starttls = false\n"
    )
    checks = await doctor(fleet_dir(tmp_path, email=email), base_env(tmp_path))
    tls = checks["mail-tls"]
    assert tls.status == "fail" and "IMAP mail.example.com:993" in tls.detail
    assert "SMTP" not in tls.detail  # a loopback relay without TLS is fine
    assert checks["mail-authentication-results"].status == "warn"


async def test_imap_and_smtp_logins_online(tmp_path: Path) -> None:
    """A wrong password fails against a real IMAP server (pymap) and SMTP server (aiosmtpd),
    naming the server and the variables; the right one passes."""
    user, password = "butler@example.com", f"pw-{uuid.uuid4().hex}"
    async with pymap_server(user, password, fast_login=True) as imap_port:
        with SmtpServer(users={user: password}) as smtp:
            email = (
                f'imap_host = "127.0.0.1"\nimap_port = {imap_port}\nimap_ssl = false\n'
                f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp.port}\nsmtp_starttls = false\n'
            )
            config = fleet_dir(tmp_path, email=email)
            wrong = f"wrong-{uuid.uuid4().hex}"
            env = base_env(tmp_path, BUTLERS_EMAIL_USER=user, BUTLERS_EMAIL_PASSWORD=wrong)
            checks = await doctor(config, env, online=True)
            for name, protocol in (("imap", "IMAP"), ("smtp", "SMTP")):
                assert checks[name].status == "fail", checks[name]
                assert f"{protocol} 127.0.0.1" in checks[name].detail
                assert "BUTLERS_EMAIL_PASSWORD" in checks[name].detail
                assert wrong not in checks[name].detail
            env["BUTLERS_EMAIL_PASSWORD"] = password
            checks = await doctor(config, env, online=True)
            assert checks["imap"].status == checks["smtp"].status == "ok", checks
            assert smtp.messages == []  # a login, never a mail


async def test_mail_tls_set_the_other_way_round_is_named_with_the_keys_to_set(
    tmp_path: Path,
) -> None:
    """A STARTTLS IMAP server and an implicit-TLS SMTP server, each on a port of its own, and
    a config that says the opposite of both (as init once chose by the port alone): doctor
    says how each server begins and which keys to set, not to check the password."""
    ca = MailCA(tmp_path / "ca")
    user, password = "butler@example.com", f"pw-{uuid.uuid4().hex}"
    async with pymap_server(user, password, ca=ca, fast_login=True) as imap_port:
        with SmtpServer(tls="implicit", ca=ca, users={user: password}) as smtp:
            email = (
                f'imap_host = "127.0.0.1"\nimap_port = {imap_port}\nimap_ssl = true\n'
                f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp.port}\nsmtp_starttls = true\n'
            )
            config = fleet_dir(tmp_path, email=email)
            env = base_env(
                tmp_path,
                BUTLERS_EMAIL_USER=user,
                BUTLERS_EMAIL_PASSWORD=password,
                SSL_CERT_FILE=str(ca.ca_file),
            )
            checks = await doctor(config, env, online=True)
    imap, smtp_check = checks["imap"], checks["smtp"]
    assert imap.status == smtp_check.status == "fail", checks
    assert (
        f"IMAP 127.0.0.1:{imap_port} greets in plain text (STARTTLS), but the config says "
        "implicit: set imap_starttls = true (imap_ssl = false) under [modules.email]"
    ) in imap.detail
    assert "speaks TLS at once, but the config says starttls: set smtp_ssl = true" in (
        smtp_check.detail
    )
    assert "BUTLERS_EMAIL_PASSWORD" not in imap.detail + smtp_check.detail


# -- Telegram ---------------------------------------------------------------------------------


@pytest.fixture
async def telegram_api() -> AsyncIterator[FakeBotAPI]:
    api = FakeBotAPI(token=f"123456:{uuid.uuid4().hex}")
    await api.start()
    yield api
    await api.stop()


async def test_a_wrong_bot_token_fails_online_without_printing_it(
    tmp_path: Path, telegram_api: FakeBotAPI
) -> None:
    """Against a Bot API that answers 401, doctor fails naming Telegram and the variable;
    the token, read from the config directory's .env (which the command's own redactor
    never saw), is nowhere in stdout or stderr, even at DEBUG where httpx logs every URL."""
    config = fleet_dir(
        tmp_path, telegram=f'api_base_url = "{telegram_api.url}"\nallowed_chat_ids = ["1"]'
    )
    wrong = f"987654:WRONG{uuid.uuid4().hex}"
    env_file = config / ".env"
    env_file.write_text(f"TELEGRAM_BOT_TOKEN={wrong}\n")
    env_file.chmod(0o600)
    code, out, err = await doctor_cli(
        "--config-dir", str(config), "--online", "--log-level", "DEBUG", env=base_env(tmp_path)
    )
    assert code == 1
    [line] = [line for line in out.splitlines() if LINE.match(line).group(2) == "telegram"]  # type: ignore[union-attr]
    assert line.startswith("fail") and "Telegram" in line and "TELEGRAM_BOT_TOKEN" in line
    assert "401" in line
    assert wrong not in out and wrong not in err
    assert wrong.split(":")[1] not in out + err
    assert "HTTP Request" in err  # the DEBUG log did run: it was redacted, not silent


async def test_a_bot_api_that_cannot_be_reached_says_what_failed_underneath(
    tmp_path: Path,
) -> None:
    """No network (here: nothing listens on the Bot API's port): the line says what failed
    (the connection refused), where to look, and never the token."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    config = fleet_dir(
        tmp_path, telegram=f'api_base_url = "http://127.0.0.1:{port}"\nallowed_chat_ids = ["1"]'
    )
    token = f"123456:SECRET{uuid.uuid4().hex}"
    checks = await doctor(config, base_env(tmp_path, TELEGRAM_BOT_TOKEN=token), online=True)
    found = checks["telegram"]
    assert found.status == "fail"
    assert f"the Bot API at http://127.0.0.1:{port} could not be reached (" in found.detail
    assert "ConnectError" in found.detail and "HTTPS_PROXY" in found.detail, found.detail
    assert token not in found.detail and "SECRET" not in found.detail


async def test_a_bot_api_answering_an_error_of_its_own_is_not_quoted(tmp_path: Path) -> None:
    """A broken or hostile `api_base_url` answering 500 with a description of its choosing
    (part of the token, a terminal's escape sequences): the line names the error's kind,
    never the server's text, and does not say it could not be reached."""
    token = f"123456:AAHdq{uuid.uuid4().hex}"
    said = f"\x1b[2J\x1b]0;pwned\x07 key {token.split(':')[1][:20]}"

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"ok": False, "error_code": 500, "description": said}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner, url = await serve_on_loopback(app)
    try:
        config = fleet_dir(tmp_path, telegram=f'api_base_url = "{url}"\nallowed_chat_ids = ["1"]')
        checks = await doctor(config, base_env(tmp_path, TELEGRAM_BOT_TOKEN=token), online=True)
    finally:
        await runner.cleanup()
    found = checks["telegram"]
    assert found.status == "fail"
    assert found.detail == f"the Bot API at {url} did not answer getMe: NetworkError"


async def test_the_bot_token_and_webhook_state_online(
    tmp_path: Path, telegram_api: FakeBotAPI
) -> None:
    config = fleet_dir(
        tmp_path, telegram=f'api_base_url = "{telegram_api.url}"\nallowed_chat_ids = ["1"]'
    )
    env = base_env(tmp_path, TELEGRAM_BOT_TOKEN=telegram_api.token)
    checks = await doctor(config, env, online=True)
    assert checks["telegram"].status == "ok" and "@butler_bot" in checks["telegram"].detail
    assert checks["telegram-webhook-info"].status == "ok"
    # Polling, but Telegram has a webhook for this bot: getUpdates would get nothing.
    telegram_api.webhook_url = "https://elsewhere.example/hook"
    checks = await doctor(config, env, online=True)
    assert checks["telegram-webhook-info"].status == "warn"
    assert "https://elsewhere.example/hook" in checks["telegram-webhook-info"].detail
    # Webhook mode, registered elsewhere: updates go to somebody else.
    webhook = fleet_dir(
        tmp_path / "w",
        telegram=f'api_base_url = "{telegram_api.url}"\nallowed_chat_ids = ["1"]\n'
        'mode = "webhook"\nwebhook_url = "https://mine.example/telegram/webhook"',
    )
    checks = await doctor(webhook, {**env, "TELEGRAM_WEBHOOK_SECRET": "s3cret_ok"}, online=True)
    assert checks["telegram-webhook-info"].status == "fail"
    assert "https://mine.example/telegram/webhook" in checks["telegram-webhook-info"].detail


class BotApiWithoutWebhookInfo(FakeBotAPI):
    _api_getWebhookInfo = None  # (a self-hosted or older Bot API: it answers 404)


async def test_a_bot_api_without_getwebhookinfo_is_not_said_to_reject_the_token(
    tmp_path: Path,
) -> None:
    """The token passed getMe, then "getWebhookInfo failed: InvalidToken" (the library's name
    for any 404) contradicted it (a walkthrough)."""
    api = BotApiWithoutWebhookInfo(token=f"123456:{uuid.uuid4().hex}")
    await api.start()
    try:
        config = fleet_dir(
            tmp_path, telegram=f'api_base_url = "{api.url}"\nallowed_chat_ids = ["1"]'
        )
        env = base_env(tmp_path, TELEGRAM_BOT_TOKEN=api.token)
        checks = await doctor(config, env, online=True)
    finally:
        await api.stop()
    assert checks["telegram"].status == "ok"
    found = checks["telegram-webhook-info"]
    assert found.status == "warn" and "InvalidToken" not in found.detail
    assert "does not answer getWebhookInfo (404" in found.detail


# -- Claude Code ------------------------------------------------------------------------------


async def test_no_claude_credentials_fails_with_the_fix(tmp_path: Path) -> None:
    """Empty HOME, no key: the fix names ANTHROPIC_API_KEY and the bundled claude's login."""
    checks = await doctor(fleet_dir(tmp_path), base_env(tmp_path))
    assert checks["claude-code"].status == "ok"
    binary = checks["claude-code"].detail.split(" (")[0]
    missing = checks["claude-credentials"]
    assert missing.status == "fail"
    assert (
        "set ANTHROPIC_API_KEY in" in missing.detail
        and f"log in with {binary} /login" in missing.detail
    )
    # A login of the CLI's own (the file `claude /login` writes) counts.
    claude_dir = tmp_path / "home" / ".claude"
    claude_dir.mkdir()
    (claude_dir / ".credentials.json").write_text('{"claudeAiOauth": {"accessToken": "a"}}')
    checks = await doctor(fleet_dir(tmp_path / "again"), base_env(tmp_path))
    assert checks["claude-credentials"].status == "ok"


async def test_without_a_key_online_asks_claude_code_itself(tmp_path: Path) -> None:
    """No key and no login: Claude Code's own `auth status` says so (the real binary)."""
    checks = await doctor(fleet_dir(tmp_path), base_env(tmp_path), online=True)
    assert checks["anthropic"].status == "fail"
    assert "not logged in" in checks["anthropic"].detail
    assert "ANTHROPIC_API_KEY" in checks["anthropic"].detail


async def _api(status: int, body: dict[str, Any]) -> tuple[web.AppRunner, str, list[dict]]:
    seen: list[dict] = []

    async def messages(request: web.Request) -> web.Response:
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner, url = await serve_on_loopback(app)
    return runner, url, seen


@pytest.mark.parametrize(
    ("status", "error", "said"),
    [
        (401, {"type": "authentication_error", "message": "invalid x-api-key"}, "invalid key"),
        (429, {"type": "rate_limit_error", "message": "slow down"}, "rate limited"),
        (
            400,
            {"type": "invalid_request_error", "message": "Your credit balance is too low"},
            "quota exhausted",
        ),
    ],
)
async def test_the_messages_api_refusing_the_key_fails(
    tmp_path: Path, status: int, error: dict[str, str], said: str
) -> None:
    runner, url, seen = await _api(status, {"type": "error", "error": error})
    key = f"sk-ant-{uuid.uuid4().hex}"
    try:
        env = base_env(tmp_path, ANTHROPIC_API_KEY=key, ANTHROPIC_BASE_URL=url)
        checks = await doctor(fleet_dir(tmp_path), env, online=True)
    finally:
        await runner.cleanup()
    assert checks["anthropic"].status == "fail"
    assert said in checks["anthropic"].detail and "ANTHROPIC_API_KEY" in checks["anthropic"].detail
    assert key not in checks["anthropic"].detail
    [request] = seen
    assert request["body"]["max_tokens"] == 1 and request["headers"]["x-api-key"] == key


async def test_the_messages_api_taking_the_key_passes(tmp_path: Path, scripted_api: Any) -> None:
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-test", ANTHROPIC_BASE_URL=scripted_api.url)
    checks = await doctor(fleet_dir(tmp_path), env, online=True)
    assert checks["anthropic"].status == "ok", checks["anthropic"]
    assert scripted_api.requests[-1]["max_tokens"] == 1


async def test_a_server_that_never_answers_does_not_hang_doctor(tmp_path: Path) -> None:
    """A Messages API that accepts and never answers: that check fails at the timeout, and
    the others (run at the same time) are all there."""
    hung, done, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.set()
        await done.wait()  # no answer until the test ends; then the socket is closed, not
        writer.close()  # left to the garbage collector (a ResourceWarning in a later test)
        closed.set()

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        env = base_env(
            tmp_path, ANTHROPIC_API_KEY="sk-x", ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}"
        )
        checks = await doctor(fleet_dir(tmp_path), env, online=True, timeout_s=1)
    finally:
        done.set()
        server.close()
        if hung.is_set():
            await closed.wait()
    assert hung.is_set()
    assert (
        checks["anthropic"].status == "fail"
        and "no answer within 1 s" in checks["anthropic"].detail
    )
    assert {"health.general", "health.switchboard"} <= set(checks)


# -- this machine -----------------------------------------------------------------------------


async def test_a_port_taken_by_another_program_fails(tmp_path: Path) -> None:
    config = fleet_dir(tmp_path)
    port = int(re.search(r"port = (\d+)", (config / "general" / "butler.toml").read_text())[1])  # type: ignore[index]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["ports"].status == "fail"
    assert f"port {port} of general is taken by another program" in checks["ports"].detail
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["ports"].status == "ok"


async def test_port_offset_checks_the_ports_up_would_listen_on(tmp_path: Path) -> None:
    """`butlers up --port-offset K` listens K ports up: doctor --port-offset K checks those,
    not the butler.toml's (which a first fleet may hold)."""
    config = fleet_dir(tmp_path)
    ports = {
        name: int(re.search(r"port = (\d+)", (config / name / "butler.toml").read_text())[1])  # type: ignore[index]
        for name in ("general", "switchboard")
    }
    port = ports["general"]
    # A free port for general's shifted one, with the switchboard's shifted port still a port:
    # an offset that pushed it past 65535 is refused before any check (tested below).
    while max(ports.values()) + (offset := free_port() - port) > 65535:
        pass
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + offset))
        taken.listen()
        code, out, _ = await doctor_cli(
            "--config-dir", str(config), "--json", "--port-offset", str(offset), env=env
        )
        checks = {c["name"]: c for c in json.loads(out)["checks"]}
        assert code == 1 and checks["ports"]["status"] == "fail", out
        assert f"port {port + offset} of general is taken" in checks["ports"]["detail"]
        code, out, _ = await doctor_cli("--config-dir", str(config), "--json", env=env)
        checks = {c["name"]: c for c in json.loads(out)["checks"]}
        assert checks["ports"]["status"] == "ok", out  # the butler.toml's port is free
    too_far = ("--port-offset", "70000")
    code, out, err = await doctor_cli("--config-dir", str(config), *too_far, env=env)
    assert code == 1 and out == "" and "--port-offset 70000: butler " in err, err
    assert "expected a port number between 1 and 65535" in err and "Traceback" not in err


async def test_the_database_reachable_and_migrated(
    tmp_path: Path,
    pg_server: Any,
    make_database: Callable[..., Awaitable[str]],
    switchboard_template: str,
) -> None:
    general_db = await make_database()
    switchboard_db = await make_database(switchboard_template)
    config = fleet_dir(tmp_path)
    for name, database in (("general", general_db), ("switchboard", switchboard_db)):
        toml = config / name / "butler.toml"
        toml.write_text(toml.read_text() + f'[butler.db]\nname = "{database}"\n')
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", DATABASE_URL=pg_server.dsn("postgres"))
    checks = await doctor(config, env)
    assert checks["database"].status == "ok", checks["database"]
    # The switchboard's database with only the core migrations: behind; and one missing.
    behind = await make_database()
    toml = config / "switchboard" / "butler.toml"
    toml.write_text(toml.read_text().replace(switchboard_db, behind))
    toml = config / "general" / "butler.toml"
    toml.write_text(toml.read_text().replace(general_db, "t_never_created"))
    checks = await doctor(config, env)
    assert checks["database"].status == "warn"
    assert (
        f"t_never_created does not exist yet and {behind} are not migrated"
        in checks["database"].detail
    )
    assert "butlers up" in checks["database"].detail


async def test_an_embedded_database_not_made_yet_says_where_it_will_be(tmp_path: Path) -> None:
    """Before the first start: a warning naming the data directory; as root, also that `up`
    may keep it under /var/lib/butlers (a walkthrough saw doctor name one place and `up`
    another)."""
    config = fleet_dir(tmp_path)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    detail = checks["database"].detail
    assert checks["database"].status == "warn"
    assert f"{(tmp_path / 'data' / 'pgdata').resolve()} is not created yet" in detail
    assert ("under /var/lib/butlers/data/" in detail) == (os.geteuid() == 0), detail
    # An upgrade that lost BUTLERS_DATA_DIR sees this too: it says where to look.
    assert "makes new, empty databases there. If these butlers ran before" in detail, detail


async def test_a_config_directory_whose_own_data_is_not_the_one_named_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config directory moved with its .env naming the old data directory: doctor said "not
    created yet" (ok), and `up` started empty databases (a walkthrough). Now it fails as `up`
    refuses, naming where the data is. Another user's data directory (a .env of theirs) fails
    naming it, not with a PermissionError's traceback."""
    config = fleet_dir(tmp_path)
    own = config / ".butlers" / "pgdata"
    own.mkdir(parents=True)
    (own / "PG_VERSION").write_text("18\n")
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["database"].status == "fail"
    assert checks["database"].detail.startswith(
        f"BUTLERS_DATA_DIR is {(tmp_path / 'data').resolve()}, which holds no databases, but "
        f"{own.parent.resolve()}, this config directory's own data directory"
    ), checks["database"].detail
    assert checks["database"].detail.endswith("(`butlers up` refuses to start)")

    # As root nothing is unreadable: the error a 0700 directory of another user raises.
    import butlers.doctor.local as local

    def theirs(_subject: Any) -> None:
        raise PermissionError(13, "Permission denied", "/home/ann/butlers/.butlers/pgdata")

    monkeypatch.setattr(local, "_running_embedded", theirs)
    checks = await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x"))
    assert checks["database"].status == "fail"
    assert checks["database"].detail.startswith(
        "cannot look into /home/ann/butlers/.butlers/pgdata: permission denied. "
        f"BUTLERS_DATA_DIR is {tmp_path / 'data'}: point it at a directory of yours"
    ), checks["database"].detail


async def test_an_unreachable_database_fails(tmp_path: Path) -> None:
    password = f"pw-{uuid.uuid4().hex}"
    url = f"postgresql://u:{password}@127.0.0.1:{free_port()}/x"
    checks = await doctor(fleet_dir(tmp_path), base_env(tmp_path, DATABASE_URL=url))
    assert checks["database"].status == "fail" and "127.0.0.1" in checks["database"].detail
    assert password not in checks["database"].detail


def _with_the_fleets(tmp_path: Path, scripted_api: Any, pg_server: Any) -> dict[str, str]:
    """The environment of a fleet the tests run: their PostgreSQL, the scripted model."""
    return base_env(
        tmp_path,
        ANTHROPIC_API_KEY="sk-test",
        ANTHROPIC_BASE_URL=scripted_api.url,
        DATABASE_URL=pg_server.dsn("postgres"),
    )


async def test_a_running_butler_holds_its_port_and_answers(
    tmp_path: Path, start_butler: Any, pg_server: Any, scripted_api: Any
) -> None:
    """A port held by the butler itself (the fleet is up) is fine; online, its /health
    answers, and a butler of the directory that is not running is said to be down."""
    from tests.conftest import butler_config

    port = free_port()
    daemon = await start_butler(butler_config("general", port=port))
    config = fleet_dir(tmp_path)
    toml = config / "general" / "butler.toml"
    toml.write_text(
        re.sub(r"(?m)^port = \d+$", f"port = {port}", toml.read_text())
        + f'[butler.db]\nname = "{daemon.config.database}"\n'
    )
    checks = await doctor(
        config, _with_the_fleets(tmp_path, scripted_api, pg_server), online=True, timeout_s=5
    )
    assert checks["ports"].status == "ok", checks["ports"]
    assert "held by the running butlers (general)" in checks["ports"].detail
    assert checks["health.general"].status == "ok", checks["health.general"]
    assert checks["health.switchboard"].status == "warn"
    assert "butlers up" in checks["health.switchboard"].detail


async def test_a_stale_butler_of_the_registry_is_said_stale_not_asked(
    tmp_path: Path, start_butler: Any, pg_server: Any, scripted_api: Any, db_conn: Any
) -> None:
    """A butler whose directory went (discover marked it stale) is not told to start with
    `butlers up` (it has nothing to start); it is said to be stale, with the way back."""
    from tests.conftest import butler_config

    config = fleet_dir(tmp_path)
    switchboard = await start_butler(butler_config("switchboard"), config_dir=config)
    conn = await db_conn(switchboard.config.database)
    await conn.execute(
        """INSERT INTO butler_registry (name, endpoint_url, description, missing_since)
           VALUES ('finance', 'http://127.0.0.1:9/sse', 'gone', now())"""
    )
    toml = config / "switchboard" / "butler.toml"
    toml.write_text(toml.read_text() + f'[butler.db]\nname = "{switchboard.config.database}"\n')
    checks = await doctor(
        config, _with_the_fleets(tmp_path, scripted_api, pg_server), online=True, timeout_s=5
    )
    finance = checks["health.finance"]
    assert finance.status == "warn" and "butlers up" not in finance.detail, finance
    assert finance.detail.startswith("in the registry, stale: the last discover did not find it")


@pytest.mark.parametrize("as_json", [False, True])
def test_the_report_is_redacted_whatever_a_check_wrote(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last line of defence: a library's message that quoted a secret (a URL with the
    bot token) is printed redacted, as text and as JSON, on one line per check."""
    from butlers.doctor.report import print_report
    from butlers.redact import Redactor

    token = f"123456:{uuid.uuid4().hex}"
    said = Check("telegram", "fail", f"GET https://api.telegram.org/bot{token}/getMe\nfailed")
    print_report([said], Redactor([token]), as_json=as_json)
    out = capsys.readouterr().out
    assert token not in out and "[redacted]" in out
    if as_json:
        assert json.loads(out)["checks"][0]["name"] == "telegram"
    else:
        assert out.count("\n") == 1 and LINE.match(out.strip())


async def test_the_running_embedded_postgresql_is_found_and_asked(
    tmp_path: Path, pg_server: Any, make_database: Callable[..., Awaitable[str]]
) -> None:
    """Without DATABASE_URL, the embedded PostgreSQL of BUTLERS_DATA_DIR that `butlers up`
    runs is asked through its socket (here: the session's own embedded server)."""
    from butlers.db import EmbeddedServer

    if not isinstance(pg_server, EmbeddedServer):
        pytest.skip("the session's PostgreSQL is not an embedded one")
    database = await make_database()
    config = fleet_dir(tmp_path)
    toml = config / "general" / "butler.toml"
    toml.write_text(toml.read_text() + f'[butler.db]\nname = "{database}"\n')
    # A name no other test made (the shipped `butler_switchboard` may exist on this server:
    # tests that run `butlers up` against it create it).
    missing = f"t_missing_{uuid.uuid4().hex[:8]}"
    toml = config / "switchboard" / "butler.toml"
    text = toml.read_text()
    switchboard_db = f'[butler.db]\nname = "{missing}"\n'
    toml.write_text(text.replace("[switchboard]", switchboard_db + "\n[switchboard]", 1))
    data_dir = str(pg_server.requested_pgdata.parent)
    checks = await doctor(config, base_env(tmp_path, BUTLERS_DATA_DIR=data_dir))
    found = checks["database"]
    assert found.status == "warn", found  # the switchboard's database is not there yet
    assert f"embedded PostgreSQL in {pg_server.pgdata} answers" in found.detail
    assert f"{missing} does not exist yet" in found.detail and database not in found.detail


async def test_a_webhook_url_that_is_not_https_fails(tmp_path: Path) -> None:
    env = base_env(tmp_path, TELEGRAM_BOT_TOKEN="1:t", TELEGRAM_WEBHOOK_SECRET="s3cret")
    plain = fleet_dir(
        tmp_path / "http",
        telegram='mode = "webhook"\nwebhook_url = "http://me.example/telegram/webhook"',
    )
    checks = await doctor(plain, env)
    assert checks["config.switchboard"].status == "fail"
    assert "https" in checks["config.switchboard"].detail
    unset = fleet_dir(tmp_path / "unset", telegram='mode = "webhook"')
    checks = await doctor(unset, env)
    assert checks["telegram-webhook"].status == "warn"
    assert "webhook_url" in checks["telegram-webhook"].detail
    checks = await doctor(unset, {**env, "TELEGRAM_WEBHOOK_SECRET": "not a secret!"})
    assert checks["telegram-webhook"].status == "fail"
    assert "TELEGRAM_WEBHOOK_SECRET" in checks["telegram-webhook"].detail


# -- voice notes ----------------------------------------------------------------------------------


def _transcription(url: str = "", **more: str) -> str:
    lines = [f'url = "{url}"'] + [f'{key} = "{value}"' for key, value in more.items()]
    return "[switchboard.transcription]\n" + "\n".join(lines)


async def test_a_transcription_service_without_its_key_warns_naming_the_variable(
    tmp_path: Path,
) -> None:
    """A speech-to-text server elsewhere may need no key, so an unset one is a warning (not a
    failed `secrets`), and none at all on this machine's loopback; with it set, ok. Not
    configured at all: ok, saying what a voice note gets."""
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")
    checks = await doctor(fleet_dir(tmp_path / "none"), env)
    assert checks["transcription"].status == "ok", checks["transcription"]
    assert "not configured" in checks["transcription"].detail
    assert checks["secrets"].status == "ok", checks["secrets"]
    url = "https://api.groq.com/openai/v1/audio/transcriptions"
    config = fleet_dir(tmp_path / "groq", switchboard=_transcription(url, api_key_env="GROQ_KEY"))
    checks = await doctor(config, env)
    found = checks["transcription"]
    assert found.status == "warn", found
    assert "GROQ_KEY is not set" in found.detail and url in found.detail
    assert str(config / ".env") in found.detail
    assert checks["secrets"].status == "ok", checks["secrets"]
    key = f"gsk_{uuid.uuid4().hex}"
    checks = await doctor(config, {**env, "GROQ_KEY": key})
    assert checks["transcription"].status == "ok", checks["transcription"]
    assert "with the key in GROQ_KEY" in checks["transcription"].detail
    assert all(key not in check.detail for check in checks.values())
    # A server on this machine (faster-whisper, whisper.cpp) needs none: no warning there.
    for local in ("http://127.0.0.1:9000/v1/audio/transcriptions", "http://localhost:9000/v1"):
        config = fleet_dir(tmp_path / f"local-{len(local)}", switchboard=_transcription(local))
        found = (await doctor(config, env))["transcription"]
        assert found.status == "ok", found
        assert "without a key" in found.detail and local in found.detail


async def test_a_transcription_key_over_plain_http_beyond_this_machine_fails(
    tmp_path: Path,
) -> None:
    url = "http://stt.example.com:8000/v1/audio/transcriptions"
    config = fleet_dir(tmp_path, switchboard=_transcription(url))
    env = base_env(tmp_path, ANTHROPIC_API_KEY="sk-x", TRANSCRIPTION_API_KEY="k-123")
    found = (await doctor(config, env))["transcription"]
    assert found.status == "fail", found
    assert "refusing to send the key in TRANSCRIPTION_API_KEY" in found.detail
    found = (await doctor(config, {**env, "TRANSCRIPTION_API_KEY": "k-1\nk-2"}))["transcription"]
    assert found.status == "fail" and "holds a space, a line break" in found.detail, found
    # Without a key, a server on the local network over http is the owner's choice.
    env.pop("TRANSCRIPTION_API_KEY")
    assert (await doctor(config, env))["transcription"].status == "warn"


async def test_a_local_model_that_is_not_there_fails(tmp_path: Path) -> None:
    """model_path without faster-whisper installed, or naming no model: every voice note
    would fail, so doctor fails, naming the key and the fix."""
    import importlib.util

    missing = tmp_path / "no-model"
    config = fleet_dir(tmp_path, switchboard=_transcription(model_path=str(missing)))
    found = (await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")))["transcription"]
    assert found.status == "fail", found
    assert f"model_path {str(missing)!r} does not exist" in found.detail
    assert "nothing is downloaded" in found.detail
    if importlib.util.find_spec("faster_whisper") is None:
        assert "pip install faster-whisper" in found.detail
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.bin").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    config = fleet_dir(tmp_path / "b", switchboard=_transcription(model_path=str(model)))
    found = (await doctor(config, base_env(tmp_path, ANTHROPIC_API_KEY="sk-x")))["transcription"]
    if importlib.util.find_spec("faster_whisper") is None:
        assert found.status == "fail" and "pip install faster-whisper" in found.detail
        assert "model_path" in found.detail and "does not exist" not in found.detail
    else:
        assert found.status == "ok", found


async def test_the_transcription_service_online_takes_the_key_and_a_silent_clip(
    tmp_path: Path,
) -> None:
    """--online sends half a second of silence (a WAV made in code) as a voice note would go:
    a wrong key fails naming the variable, never showing the key; the right one passes."""
    from tests.fakes.transcription_api import FakeTranscriptionAPI

    async with FakeTranscriptionAPI() as api:
        config = fleet_dir(tmp_path, switchboard=_transcription(api.url))
        wrong = f"sk-{uuid.uuid4().hex}"
        env = base_env(tmp_path, TRANSCRIPTION_API_KEY=wrong)
        found = (await doctor(config, env, online=True))["transcription-service"]
        assert found.status == "fail", found
        assert "answered 401" in found.detail and "TRANSCRIPTION_API_KEY" in found.detail
        assert wrong not in found.detail
        assert api.key is not None
        env["TRANSCRIPTION_API_KEY"] = api.key
        found = (await doctor(config, env, online=True))["transcription-service"]
        assert found.status == "ok", found
        assert "the key in TRANSCRIPTION_API_KEY" in found.detail
        refused, taken = api.requests
        assert refused.status == 401 and taken.status == 200
        assert taken.file is not None and taken.file.startswith(b"RIFF")
        assert taken.filename == "audio.wav" and taken.model == "whisper-1"
        api.fail_next(1, 503)
        found = (await doctor(config, env, online=True))["transcription-service"]
        assert found.status == "warn" and "answered 503" in found.detail, found


async def test_online_names_the_authserv_id_the_mailbox_mail_carries(tmp_path: Path) -> None:
    """A forged From of an allowed address gets in while require_authentication_results is
    unset (the default; the owner does not know what to set it to). `doctor --online` reads
    the newest mails' topmost Authentication-Results (read only: nothing flagged seen) and
    names the value to set when they all agree; a stranger's planted header among them (a
    server that writes none leaves the sender's on top) makes it name none."""
    user, password = "butler@example.com", f"pw-{uuid.uuid4().hex}"
    async with pymap_server(user, password, fast_login=True) as imap_port:
        for n, results in enumerate(
            (
                "mx.home.example; dmarc=pass header.from=x.example",
                "mx.home.example; spf=pass smtp.mailfrom=a.example; dmarc=pass",
                "mx.home.example; dkim=pass header.d=b.example",
            )
        ):
            raw = (
                f"Authentication-Results: {results}\r\n"
                "Authentication-Results: relay.elsewhere.example; spf=none\r\n"
                f"From: a@a.example\r\nTo: {user}\r\nSubject: {n}\r\n"
                f"Message-ID: <{n}@a.example>\r\n\r\nHello.\r\n"
            ).encode()
            await imap_append(imap_port, user, password, raw)
        with SmtpServer(users={user: password}) as smtp:
            smtp_port = smtp.port
            email = (
                f'imap_host = "127.0.0.1"\nimap_port = {imap_port}\nimap_ssl = false\n'
                f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp.port}\nsmtp_starttls = false\n'
            )
            config = fleet_dir(tmp_path, email=email)
            env = base_env(tmp_path, BUTLERS_EMAIL_USER=user, BUTLERS_EMAIL_PASSWORD=password)
            checks = await doctor(config, env, online=True)
        assert checks["imap"].status == "ok"
        hint = checks["mail-authserv-id"]
        assert hint.status == "warn"
        assert 'require_authentication_results = "mx.home.example"' in hint.detail
        assert await imap_unseen(imap_port, user, password)  # still unread: nothing flagged
        planted = (
            "Authentication-Results: evil.example; dmarc=pass\r\n"
            f"From: e@evil.example\r\nTo: {user}\r\nSubject: hi\r\n\r\nHello.\r\n"
        ).encode()
        await imap_append(imap_port, user, password, planted)
        with SmtpServer(users={user: password}) as smtp:
            email = email.replace(f"smtp_port = {smtp_port}", f"smtp_port = {smtp.port}")
            config = fleet_dir(tmp_path / "again", email=email)
            checks = await doctor(config, env, online=True)
        assert checks["imap"].status == "ok" and "mail-authserv-id" not in checks
