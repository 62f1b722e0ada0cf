"""Checks of what the configs and the environment say, without touching anything else:
secrets named and set, who can reach the butlers, who can message the bot, mail security."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from butlers.channels import spec_of
from butlers.config import CONFIG_FILENAME, ButlerConfig
from butlers.doctor.report import Check, Subject, fail, ok, warn

TOKEN_VARIABLE = "BUTLERS_AUTH_TOKEN"
MAKE_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def checks(subject: Subject) -> list[Check]:
    if not subject.butlers:
        return []
    found = [*secrets(subject), *exposure(subject), *approval_globs(subject)]
    switchboard = subject.fleet.switchboard
    if switchboard is not None:
        found += allowlists(switchboard)
        found += owner(subject, switchboard)
        found += mail(switchboard)
        found += telegram_webhook(subject, switchboard)
        found += transcription(subject, switchboard)
    return found


def config_file(butler: ButlerConfig) -> str:
    return str(butler.config_dir / CONFIG_FILENAME) if butler.config_dir else butler.name


def approval_globs(subject: Subject) -> list[Check]:
    """`[approvals] tools` globs that match none of their butler's tools: `butlers up`
    refuses to start that butler (butlers.approvals.check_approval_globs), and doctor said
    "ok" of it (a walkthrough)."""
    import asyncio

    from butlers.approvals import check_approval_globs, tool_names_offline
    from butlers.errors import ConfigError

    found = []
    for butler in subject.butlers:
        if not butler.approvals.tools:
            continue
        # (In doctor's worker thread: its own loop for the throwaway server's listing.)
        names = asyncio.run(tool_names_offline(butler, subject.settings))
        try:
            check_approval_globs(butler, names)
        except ConfigError as exc:
            found.append(
                fail(f"config.{butler.name}", f"{exc}; fix it (that butler does not start)")
            )
    return found


# -- secrets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Needed:
    """A variable a config names, and who names it (for the sentence that says so)."""

    name: str
    why: str
    required: bool = True  # False: a tool server's pass_env (it may do without)
    channel: str | None = None  # a channel's: `butlers up` starts its butler without it


def needed_variables(butler: ButlerConfig) -> Iterator[Needed]:
    """Every variable `butler`'s config needs set: each channel's (butlers.channels), its tool
    servers' headers and passed variables. (The transcription key is `transcription`'s: a
    local service needs none, so its absence is no failure.)"""
    for channel, table in butler.channels.items():
        spec = spec_of(channel)
        for variable, key in spec.needed_variables(table) if spec is not None else ():
            why = f"{butler.name}: [modules.{channel}] {key}".rstrip()
            yield Needed(variable, why, channel=f"{butler.name}'s {channel}")
    for server in butler.mcp_servers:
        for header, variable in server.headers_env.items():
            yield Needed(variable, f"{butler.name}: [[mcp_servers]] {server.name} header {header}")
        for variable in server.pass_env:
            yield Needed(
                variable, f"{butler.name}: [[mcp_servers]] {server.name} pass_env", required=False
            )


def secrets(subject: Subject) -> list[Check]:
    """A tool server's header unset fails (its calls would be refused); a channel's is a
    warning while another channel still starts, as `butlers up` starts without that one
    (butlers.modules: skipped), and fails when none would (nobody could message the
    butlers: a doctor that failed what `up` ran, the shipped config's unused email, misled)."""
    needed = [n for b in subject.butlers for n in needed_variables(b)]
    missing = [n for n in needed if n.required and subject.variable(n.name) is None]
    optional = [n for n in needed if not n.required and subject.variable(n.name) is None]
    skipped = {n.channel for n in missing if n.channel is not None}
    channels = {n.channel for n in needed if n.channel is not None}
    found: list[Check] = []
    if missing:
        names = sorted({n.name for n in missing})
        listed = "; ".join(f"{n.name} ({n.why})" for n in missing)
        advice = f"not set: {listed}; {subject.where_to_set(*names)}"
        if all(n.channel is not None for n in missing) and skipped != channels:
            starting = ", ".join(sorted(channels - skipped))
            found.append(
                warn(
                    "secrets",
                    f"{advice}. `butlers up` starts without "
                    f"{', '.join(sorted(skipped))}; {starting} starts",
                )
            )
        elif skipped and skipped == channels:
            found.append(
                fail(
                    "secrets",
                    f"{advice}. No channel would start: nobody could message "
                    "your butlers (`butlers ask` still works)",
                )
            )
        else:
            found.append(fail("secrets", advice))
    else:
        names = sorted({n.name for n in needed if n.required})
        found.append(
            ok("secrets", f"set: {', '.join(names)}" if names else "no config names a secret")
        )
    if optional:
        listed = "; ".join(f"{n.name} ({n.why})" for n in optional)
        found.append(warn("pass-env", f"not set, so those tool servers run without them: {listed}"))
    return found


# -- exposure ---------------------------------------------------------------------------------


def exposure(subject: Subject) -> list[Check]:
    """A butler listening beyond this machine without a (long enough) token hands every tool
    to whoever reaches the port: the daemon refuses to start so, and says it here first."""
    from butlers.http import MIN_TOKEN_CHARS, is_loopback

    token = subject.variable(TOKEN_VARIABLE)
    exposed = [b for b in subject.butlers if not is_loopback(b.host)]
    where = ", ".join(f"{b.name} on {b.host}:{b.port}" for b in exposed)
    found: list[Check] = []
    if not exposed:
        found.append(ok("bind", "every butler listens on loopback only"))
    elif token is None:
        found.append(
            fail(
                "bind",
                f"{where} (beyond this machine) without {TOKEN_VARIABLE}: anyone who reaches "
                f"the port gets every tool, and the butler refuses to start; "
                f"{subject.where_to_set(TOKEN_VARIABLE)} (make one with {MAKE_TOKEN}), or set "
                'host = "127.0.0.1" and put a reverse proxy in front',
            )
        )
    else:
        found.append(ok("bind", f"{where}, guarded by {TOKEN_VARIABLE}"))
    fetching = [b.name for b in subject.butlers if "WebFetch" in b.runtime.builtin_tools]
    if fetching and token is None:
        # Not proven here (Claude Code's WebFetch asks the internet whether a domain is safe,
        # and this machine has none), so a warning: a session that can fetch a URL would read
        # loopback's open dashboard, every person's messages and sessions.
        found.append(
            warn(
                "fetch",
                f"{', '.join(fetching)}: sessions may use WebFetch, and without "
                f"{TOKEN_VARIABLE} the dashboard and every butler answer anything on this "
                "machine: a message could have a session fetch http://127.0.0.1:<port>/ui "
                f"(everyone's messages); {subject.where_to_set(TOKEN_VARIABLE)} (make one "
                f"with {MAKE_TOKEN})",
            )
        )
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        short = (
            f"{TOKEN_VARIABLE} has {len(token)} characters, under {MIN_TOKEN_CHARS}: it could "
            f"be guessed (make one with {MAKE_TOKEN})"
        )
        if exposed:
            found.append(fail("auth-token", f"{short}; the butlers beyond loopback refuse it"))
        else:
            found.append(warn("auth-token", f"{short}; the dashboard's sign-in takes it"))
    elif token is not None:
        found.append(ok("auth-token", f"{TOKEN_VARIABLE} is set ({len(token)} characters)"))
    return found


# -- who can message the bot ------------------------------------------------------------------


def allowlists(switchboard: ButlerConfig) -> list[Check]:
    assert switchboard.switchboard is not None
    pairing = switchboard.switchboard.pairing.enabled
    found: list[Check] = []
    channels = []
    if switchboard.telegram is not None:
        channels.append(
            ("telegram-allowlist", "allowed_chat_ids", switchboard.telegram.allowed_chat_ids)
        )
    if switchboard.email is not None:
        channels.append(("email-allowlist", "allowed_senders", switchboard.email.allowed_senders))
    for name, key, allowed in channels:
        module = "telegram" if key == "allowed_chat_ids" else "email"
        if "*" in allowed:
            found.append(
                warn(
                    name,
                    f'{key} = ["*"]: anyone who finds the {module} address can use your '
                    f"butlers (and your Anthropic account); list the senders instead, or "
                    f"enable [switchboard.pairing] in {config_file(switchboard)}",
                )
            )
        elif not allowed and not pairing:
            who = "bot" if module == "telegram" else "mailbox"
            what = "chat id" if module == "telegram" else "address"
            found.append(
                warn(
                    name,
                    f"nobody can message the {who}; add your {what} to {key} under "
                    f"[modules.{module}] in {config_file(switchboard)}, or enable pairing "
                    "([switchboard.pairing] enabled = true)",
                )
            )
        elif not allowed:
            found.append(ok(name, f"{key} is empty; unknown senders get a pairing code"))
        else:
            extra = " (pairing on for others)" if pairing else ""
            found.append(ok(name, f"{len(allowed)} allowed in {key}{extra}"))
    return found


def owner(subject: Subject, switchboard: ButlerConfig) -> list[Check]:
    """`notify` (reminders) and approval requests go to the owner when no conversation is
    active: with no owner they reach nobody."""
    assert switchboard.switchboard is not None
    chat = switchboard.switchboard.owner.telegram_chat_id
    if chat and not chat.isdigit():
        # A group's id is negative, a channel's a @name: only a private chat's id is its
        # person's, and a button counts only when that person presses it in that chat.
        return [
            warn(
                "owner",
                f"[switchboard.owner] telegram_chat_id {chat!r} is not a private chat: the "
                "Approve / Deny buttons of approvals and pairing count only when the owner "
                "presses them in their own chat with the bot, so there they count for nobody "
                "(and every member reads the questions); set it to your own chat id in "
                f"{config_file(switchboard)}",
            )
        ]
    if switchboard.switchboard.owner.channels():
        return _owner_may_write(subject, switchboard)
    users = [
        b.name
        for b in subject.butlers
        if "notify" in (b.instructions or "")
        or b.approvals.tools
        or any(s.approval for s in b.mcp_servers)
    ]
    if not users:
        return [ok("owner", "no [switchboard.owner]; no butler's instructions use notify")]
    return [
        warn(
            "owner",
            "no [switchboard.owner] telegram_chat_id or email: the reminders (notify) and "
            f"approval requests of {', '.join(users)} would reach nobody; set them in "
            f"{config_file(switchboard)}",
        )
    ]


def _owner_may_write(subject: Subject, switchboard: ButlerConfig) -> list[Check]:
    """The owner hears reminders and questions on their channels; writing back by mail
    needs the allowlist too (an owner left out got "this is a private butler" in answer to
    their own reminder: a walkthrough; `init` writes both, a hand-edited config may not).
    The owner's Telegram chat may write as it is (its sender is Telegram's to vouch for; a
    mail's From is anyone's to write)."""
    from butlers.modules.mail_sender import sender_allowed

    assert switchboard.switchboard is not None
    owner = switchboard.switchboard.owner
    left_out = []
    email = switchboard.channels.get("email")
    if owner.email and email is not None:
        butlers_own = email.address or subject.variable(email.username_env) or ""
        if owner.email.lower() == butlers_own.lower():
            # Mail from the butler's own address is never read (its own replies): the owner
            # could never write, and reminders went to the butler's own mailbox.
            return [
                fail(
                    "owner",
                    f"[switchboard.owner] email {owner.email!r} is the butler's own address "
                    "([modules.email] address, or its user name), whose mail it never reads: "
                    f"set the address you write from in {config_file(switchboard)}",
                )
            ]
        if not sender_allowed(owner.email.lower(), email.allowed_senders):
            left_out.append(f"add {owner.email!r} to [modules.email] allowed_senders")
    where = ", ".join(c for c, _ in owner.channels())
    if left_out:
        return [
            warn(
                "owner",
                f"[switchboard.owner] is reached by {where} but may not write back there "
                f'(what they send gets "this is a private butler"): {"; ".join(left_out)} '
                f"in {config_file(switchboard)}",
            )
        ]
    return [ok("owner", f"[switchboard.owner] reachable by {where}")]


# -- mail -------------------------------------------------------------------------------------


def mail(switchboard: ButlerConfig) -> list[Check]:
    from butlers.modules.mail_transport import MailServer, plaintext_login_refusal, security

    email = switchboard.email
    if email is None:
        return []
    servers = [
        MailServer(
            "SMTP", email.smtp_host, email.smtp_port, security(email.smtp_ssl, email.smtp_starttls)
        )
    ]
    if email.mode != "webhook":  # a webhook brings the mail: no IMAP
        servers.insert(
            0,
            MailServer(
                "IMAP",
                email.imap_host,
                email.imap_port,
                security(email.imap_ssl, email.imap_starttls),
            ),
        )
    found: list[Check] = []
    problems = []
    for server in servers:
        if not server.host:
            problems.append(
                f"{server.protocol.lower()}_host is not set under [modules.email] in "
                f"{config_file(switchboard)}"
            )
        elif why := plaintext_login_refusal(server):
            problems.append(why)
    if problems:
        found.append(fail("mail-tls", "; ".join(problems)))
    else:
        said = {"implicit": "implicit TLS", "starttls": "STARTTLS", "none": "no TLS (loopback)"}
        found.append(
            ok(
                "mail-tls",
                ", ".join(f"{s.where} over {said[s.security]}" for s in servers),
            )
        )
    if email.require_authentication_results:
        found.append(
            ok(
                "mail-authentication-results",
                f"only mail with dmarc=pass from {email.require_authentication_results!r} counts",
            )
        )
    elif switchboard.switchboard is not None and switchboard.switchboard.pairing.enabled:
        # A code answers whatever From a mail claims: without DMARC, a spammer forging
        # thousands of Froms has the butler mail each of them (backscatter), from its address.
        found.append(
            fail(
                "mail-authentication-results",
                "[switchboard.pairing] is enabled but require_authentication_results is unset: "
                "every mail from an unknown sender is answered with a code, so mail with a "
                "forged From makes the butler send mail to people who never wrote "
                "(backscatter; your address ends up on blocklists), and a forged From of an "
                "allowed address gets in; set require_authentication_results under "
                f"[modules.email] in {config_file(switchboard)} to your mail server's authserv-id "
                "(docs/security.md), or set enabled = false under [switchboard.pairing]",
            )
        )
    else:
        found.append(
            warn(
                "mail-authentication-results",
                "require_authentication_results is unset: a forged From of an allowed address "
                "gets in (the From header alone proves nothing); set it under [modules.email] "
                f"in {config_file(switchboard)} to your mail server's authserv-id "
                "(docs/security.md; `butlers doctor --online` names it)",
            )
        )
    return found


def telegram_webhook(subject: Subject, switchboard: ButlerConfig) -> list[Check]:
    telegram = switchboard.telegram
    if telegram is None or telegram.mode != "webhook":
        return []
    from butlers.modules.telegram import WEBHOOK_SECRET

    secret = subject.variable(telegram.webhook_secret_env)
    if secret is not None and not WEBHOOK_SECRET.fullmatch(secret):
        return [
            fail(
                "telegram-webhook",
                f"{telegram.webhook_secret_env} must be 1-256 characters of A-Z, a-z, 0-9, _ "
                "and - (Telegram's rule): make a new one",
            )
        ]
    if not telegram.webhook_url:
        return [
            warn(
                "telegram-webhook",
                "webhook mode without webhook_url: nothing registers the webhook with "
                'Telegram; set webhook_url = "https://<your host>/telegram/webhook" under '
                f"[modules.telegram] in {config_file(switchboard)}, or register it yourself",
            )
        ]
    if not telegram.webhook_url.startswith("https://"):  # the config refuses it; said anyway
        return [
            fail("telegram-webhook", f"{telegram.webhook_url} is not https: Telegram requires it")
        ]
    return [ok("telegram-webhook", f"registered at start: {telegram.webhook_url}")]


# -- voice notes ------------------------------------------------------------------------------


def transcription(subject: Subject, switchboard: ButlerConfig) -> list[Check]:
    """`[switchboard.transcription]`: a service's key (only a warning when unset: a local
    faster-whisper or whisper.cpp server needs none), never over plain http beyond this
    machine; or the local model, whose package and files must be there (nothing is
    downloaded), or every voice note fails."""
    from butlers.switchboard.transcription import (
        model_path_problem,
        package_problem,
        plaintext_key_refusal,
        unusable_key,
        where,
    )

    assert switchboard.switchboard is not None
    config = switchboard.switchboard.transcription
    name = "transcription"
    if config.model_path:
        problems = [p for p in (package_problem(), model_path_problem(config.model_path)) if p]
        if problems:
            return [fail(name, f"{'; '.join(problems)} (in {config_file(switchboard)})")]
        return [ok(name, f"voice notes are transcribed here, by the model in {config.model_path}")]
    if not config.url:
        return [
            ok(
                name,
                "not configured: a voice note is answered that it needs a transcription "
                "service ([switchboard.transcription] url, or model_path)",
            )
        ]
    service = where(config.url)
    key = subject.variable(config.api_key_env) if config.api_key_env else None
    key = key.strip() if key is not None else None  # as the transcriber takes it
    refusal = unusable_key(key, config.api_key_env) or plaintext_key_refusal(
        config.url, key, config.api_key_env
    )
    if refusal is not None:
        named = f"[switchboard.transcription] url in {config_file(switchboard)}"
        return [fail(name, f"{refusal} ({named})")]
    if key is None and config.api_key_env and not _on_this_machine(config.url):
        return [
            warn(
                name,
                f"{config.api_key_env} is not set, so voice notes go to {service} without a "
                "key: fine for a server of your own, but OpenAI and Groq refuse them; "
                f"{subject.where_to_set(config.api_key_env)}",
            )
        ]
    said = f" with the key in {config.api_key_env}" if key is not None else ", without a key"
    return [ok(name, f"voice notes go to {service} (model {config.model}){said}")]


def _on_this_machine(url: str) -> bool:
    """Whether `url` is a server on this machine (a local faster-whisper or whisper.cpp),
    which needs no key: warning about an unset one there was noise (a walkthrough)."""
    from urllib.parse import urlsplit

    from butlers.http import is_loopback

    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and is_loopback(host)
