"""Run an ephemeral Claude Code session for a butler, through claude-agent-sdk.

The session sees only the butler's own MCP endpoint (strict MCP config, no built-in tools,
an explicit allow-list), runs under `permission_mode="dontAsk"` with bounded turns and a
timeout, and is serialised per butler. Every session, successful or not, is a `sessions` row.

Claude Code reads text written by strangers, so it gets nothing it does not need: its MCP
config (with the auth token and a classification's credential in its headers) goes through a
private file, not the command line that `ps` shows every user; and of the daemon's
environment (bot token, mail password, DATABASE_URL) it keeps only an allowlist
(butlers.environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import shutil
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from butlers.config import ButlerConfig
from butlers.core_store import CoreStore
from butlers.environment import claude_code_keeps
from butlers.errors import SpawnError
from butlers.telemetry import ButlerTelemetry, current_carrier, current_trace_id

if TYPE_CHECKING:
    from claude_agent_sdk import Message

    from butlers.settings import Settings

logger = logging.getLogger(__name__)

# Anything Claude Code needs that is not the butler's business stays out of its way.
_CLI_ENV = {"CLAUDE_CODE_DISABLE_AUTOUPDATER": "1"}
ERROR_TEXT_LIMIT = 2000
SESSION_HEADER = "X-Butlers-Session"


@dataclass(frozen=True)
class McpTarget:
    """The one MCP server a session may use, and which of its tools it may call."""

    name: str
    url: str
    allowed_tools: tuple[str, ...]
    # Tools the server has that the session must not even see (hidden, not just refused).
    denied_tools: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def transport(self) -> str:
        return "sse" if "/sse" in self.url else "http"

    def qualified(self, tools: Sequence[str]) -> list[str]:
        return [f"mcp__{self.name}__{tool}" for tool in tools]


@dataclass
class SessionOutcome:
    session_id: uuid.UUID
    success: bool
    result: str | None
    error: str | None
    tool_calls: list[dict[str, Any]]
    duration_ms: int
    trace_id: str | None


class Spawner:
    """Claude Code sessions for one butler, at most `max_concurrent_sessions` at a time.

    `session_env` is added to the CLI's environment on top of the daemon's own (credentials,
    ANTHROPIC_BASE_URL, HOME for an isolated config); of the daemon's environment, which the
    SDK passes down (`settings.inherited_environ()`), only the allowlist is kept.
    """

    def __init__(
        self,
        config: ButlerConfig,
        store: CoreStore,
        *,
        work_dir: Path,
        telemetry: ButlerTelemetry,
        settings: Settings,
        session_env: Mapping[str, str] | None = None,
        auth_token: str | None = None,
        redact: Callable[[str], str] = str,
    ) -> None:
        self.config = config
        self.settings = settings
        self.redact = redact  # a session's error text may quote anything: no secret kept
        self.telemetry = telemetry
        self.store = store
        self.work_dir = work_dir
        self.session_env = dict(session_env or {})
        self.auth_token = auth_token
        self._slots = asyncio.Semaphore(config.runtime.max_concurrent_sessions)
        self.running = 0
        self._serving: dict[str, str | None] = {}  # session token -> its conversation

    @property
    def mcp_config_dir(self) -> Path:
        return self.work_dir / ".mcp"

    async def remove_leftovers(self) -> None:
        """At start: MCP config files of sessions a killed process never finished."""
        if removed := await asyncio.to_thread(remove_private_files, self.mcp_config_dir):
            logger.info("removed %d MCP config file(s) left by a killed run", removed)

    def system_prompt(self) -> str:
        if self.config.instructions:
            return self.config.instructions
        return (
            f"You are the {self.config.name} butler. {self.config.description}\n"
            "Use your tools to do what you are asked, then answer briefly."
        )

    async def run(
        self,
        prompt: str,
        *,
        target: McpTarget,
        trigger_source: str,
        system_prompt: str | None = None,
        conversation: str | None = None,
    ) -> SessionOutcome:
        """Run one session to completion; failures are recorded and returned, not raised.
        `conversation`: the one a routed message belongs to, where its `notify` goes."""
        async with self._slots:
            self.running += 1
            # The session names itself with this in its private MCP config: the butler's
            # tools (notify) learn which conversation the call serves, and nobody else can.
            token = secrets.token_urlsafe(24)
            self._serving[token] = conversation
            target = replace(target, headers={**target.headers, SESSION_HEADER: token})
            try:
                with self.telemetry.tracer.start_as_current_span(
                    "butler.session",
                    attributes={"butler": self.config.name, "trigger_source": trigger_source},
                ):
                    return await self._run_recorded(
                        prompt, target, trigger_source, system_prompt or self.system_prompt()
                    )
            finally:
                self.running -= 1
                self._serving.pop(token, None)

    def conversation_of(self, session_token: str | None) -> str | None:
        """The conversation the session presenting `session_token` serves, if any."""
        if not session_token:
            return None
        for token, conversation in self._serving.items():
            if hmac.compare_digest(token.encode(), session_token.encode()):
                return conversation
        return None

    async def _run_recorded(
        self, prompt: str, target: McpTarget, trigger_source: str, system_prompt: str
    ) -> SessionOutcome:
        trace_id = current_trace_id()
        session_id = await self.store.session_start(trigger_source, prompt, trace_id)
        started = time.monotonic()
        tool_calls: list[dict[str, Any]] = []
        result: str | None = None
        error: str | None = None
        try:
            result = await asyncio.wait_for(
                self._query(prompt, target, system_prompt, tool_calls),
                timeout=self.config.runtime.timeout_s,
            )
        except TimeoutError:
            error = f"Claude Code session timed out after {self.config.runtime.timeout_s:g}s"
        except SpawnError as exc:
            error = str(exc)
        except Exception as exc:  # the SDK's and the CLI's own failures
            logger.exception("Claude Code session failed", extra={"action": "spawn_failed"})
            error = _describe_sdk_error(exc)
        duration_ms = int((time.monotonic() - started) * 1000)
        outcome = SessionOutcome(
            session_id=session_id,
            success=error is None,
            result=result,
            error=self.redact(error)[:ERROR_TEXT_LIMIT] if error else None,
            tool_calls=tool_calls,
            duration_ms=duration_ms,
            trace_id=trace_id,
        )
        # The outcome must be written even when the caller is cancelled meanwhile.
        await asyncio.shield(
            self.store.session_finish(
                session_id,
                result=outcome.result,
                success=outcome.success,
                error=outcome.error,
                tool_calls=tool_calls,
                duration_ms=duration_ms,
            )
        )
        return outcome

    def _options(self, target: McpTarget, system_prompt: str, mcp_config: Path):
        from claude_agent_sdk import ClaudeAgentOptions

        carrier = current_carrier()
        env = {**_CLI_ENV, **self.telemetry.cli_env, **self.session_env}
        if "traceparent" in carrier:
            env["TRACEPARENT"] = carrier["traceparent"]
            if "tracestate" in carrier:
                env["TRACESTATE"] = carrier["tracestate"]
        return ClaudeAgentOptions(
            mcp_servers=mcp_config,  # a path: what is in it never shows in the command line
            strict_mcp_config=True,
            tools=[],
            allowed_tools=target.qualified(target.allowed_tools),
            disallowed_tools=target.qualified(target.denied_tools),
            system_prompt=system_prompt,
            max_turns=self.config.runtime.max_turns,
            model=self.config.runtime.model,
            permission_mode="dontAsk",
            # An empty directory: no project CLAUDE.md or .claude settings get picked up.
            cwd=str(self.work_dir),
            setting_sources=[],
            env=env,
        )

    def _mcp_servers(self, target: McpTarget) -> dict[str, Any]:
        headers = dict(target.headers)
        headers.update(current_carrier())
        if self.auth_token:
            headers["Authorization"] = f"Bearer {self.auth_token}"
        return {
            "mcpServers": {
                target.name: {"type": target.transport, "url": target.url, "headers": headers}
            }
        }

    async def _query(
        self,
        prompt: str,
        target: McpTarget,
        system_prompt: str,
        tool_calls: list[dict[str, Any]],
    ) -> str:
        from claude_agent_sdk import AssistantMessage, ResultMessage, SystemMessage, query
        from claude_agent_sdk._errors import ResultError
        from claude_agent_sdk.types import ToolUseBlock

        config_path = await asyncio.to_thread(
            write_private_file, self.mcp_config_dir, json.dumps(self._mcp_servers(target))
        )
        try:
            options = self._options(target, system_prompt, config_path)
            transport = _AllowlistedEnvironmentTransport(
                prompt, options, inherited=self.settings.inherited_environ()
            )
            result: ResultMessage | None = None
            # aclosing: on timeout or failure the generator is closed, which ends the CLI.
            # (query is an async generator; the SDK annotates it as a plain AsyncIterator.)
            async with contextlib.aclosing(
                cast(
                    "AsyncGenerator[Message, None]",
                    query(prompt=prompt, options=options, transport=transport),
                )
            ) as messages:
                async for message in messages:
                    if isinstance(message, SystemMessage) and message.subtype == "init":
                        _check_connected(message.data, target)
                    elif isinstance(message, AssistantMessage):
                        for block in message.content:
                            if isinstance(block, ToolUseBlock):
                                tool_calls.append({"name": block.name, "input": block.input})
                    elif isinstance(message, ResultMessage):
                        result = message
        except ResultError as exc:
            # The session ran and ended in an error result (max turns, an API error, no
            # login): the SDK raises after yielding it. Say what the result said.
            detail = "; ".join(exc.errors) or exc.result or exc.subtype or str(exc)
            raise SpawnError(_describe_failure(detail, "Claude Code session failed")) from exc
        finally:
            await asyncio.to_thread(config_path.unlink, missing_ok=True)
        if result is None:
            raise SpawnError("Claude Code ended without a result")
        if result.is_error:
            detail = "; ".join(result.errors or []) or result.result or result.subtype
            raise SpawnError(f"Claude Code session failed: {detail}")
        return result.result or ""


def remove_private_files(directory: Path) -> int:
    """What `write_private_file` left behind when the process was killed mid-session (the
    files hold the auth token): removed at start."""
    removed = 0
    for path in directory.glob("*.json") if directory.is_dir() else ():
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def write_private_file(directory: Path, text: str) -> Path:
    """A new file only this user can read, in a directory only this user can enter."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    path = directory / f"{uuid.uuid4().hex}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return path


def _subprocess_transport() -> type:
    from claude_agent_sdk._internal.transport.subprocess_cli import SubprocessCLITransport

    return SubprocessCLITransport


if TYPE_CHECKING:  # the same class, for the checker (a base computed by a call is opaque to it)
    from claude_agent_sdk._internal.transport.subprocess_cli import SubprocessCLITransport
else:
    SubprocessCLITransport = _subprocess_transport()


class _AllowlistedEnvironmentTransport(SubprocessCLITransport):
    """The SDK's subprocess transport, starting Claude Code with an allowlisted environment.

    The SDK always passes our whole environment (`inherited`) down; its `env` option only adds
    to it. So the command goes through `env -u NAME ...`, which drops every variable Claude Code
    has no use for before it starts: only their names are on the command line, never their
    values.
    """

    def __init__(self, *args: Any, inherited: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inherited = inherited

    def _build_command(self) -> list[str]:
        command = super()._build_command()
        ours = self._options.env
        inherited = self._inherited
        dropped = sorted(
            name
            for name in inherited
            if name not in ours and not claude_code_keeps(name, inherited)
        )
        if not dropped:
            return command
        unset = [arg for name in dropped for arg in ("-u", name)]
        return [_ENV_BINARY, *unset, "--", *command]


_ENV_BINARY = shutil.which("env") or "/usr/bin/env"


def _check_connected(init: Mapping[str, Any], target: McpTarget) -> None:
    """A session without its tools is a failure, not a success (the CLI carries on without)."""
    for server in init.get("mcp_servers") or []:
        if server.get("name") == target.name:
            if server.get("status") != "connected":
                raise SpawnError(
                    f"MCP server {target.name!r} at {target.url} did not connect "
                    f"(status: {server.get('status')})"
                )
            return
    raise SpawnError(f"MCP server {target.name!r} at {target.url} was not loaded by Claude Code")


def _describe_sdk_error(exc: BaseException) -> str:
    return _describe_failure(str(exc).strip() or type(exc).__name__, "Claude Code could not run")


def _describe_failure(text: str, what: str) -> str:
    first_line = text.splitlines()[0] if text else what
    if "not logged in" in text.lower() or "api key" in text.lower():
        return (
            "Claude Code has no credentials: set ANTHROPIC_API_KEY (or log in with `claude`) "
            f"in the butler's environment ({first_line})"
        )
    return f"{what}: {first_line}"


SESSION_STARTING_TOOLS = ("trigger", "tick")


def default_allowed_tools(tool_names: Sequence[str]) -> tuple[str, ...]:
    """A triggered session may use its butler's tools, except those that start sessions."""
    return tuple(name for name in tool_names if name not in SESSION_STARTING_TOOLS)


def isolated_cli_env(
    home: Path, base_url: str, api_key: str = "sk-test", *, inherited: Mapping[str, str]
) -> dict[str, str]:
    """The environment for a Claude Code that must not see the host: used by tests and bench.

    `inherited`: the environment the CLI would inherit (the caller's process environment); each
    ANTHROPIC_*/CLAUDE_* variable of it is blanked."""
    env = {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    # options.env is merged over the inherited environment: blank out what could leak in.
    for key in inherited:
        if (
            key.startswith(("ANTHROPIC_", "CLAUDE_"))
            and key not in env
            and key != "CLAUDE_CODE_DISABLE_AUTOUPDATER"
        ):
            env[key] = ""
    return env
