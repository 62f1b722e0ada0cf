"""Run an ephemeral Claude Code session for a butler.

The session sees only the butler's own MCP endpoint, with bounded turns and a timeout, and at
most `max_concurrent_sessions` run at once per butler. Every session, successful or not, is a
`sessions` row. How one run is isolated (private MCP config, allowlisted environment, no
built-in tools) is butlers.claude_code's, shared with the gateway's Claude wrapper.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers.claude_code import (
    ClaudeCodeResult,
    ClaudeCodeRun,
    McpTarget,
    describe_sdk_error,
    mcp_config_dir,
    remove_private_files,
    run_claude_code,
)
from butlers.config import ButlerConfig
from butlers.core_store import CoreStore
from butlers.errors import SpawnError
from butlers.telemetry import ButlerTelemetry, current_carrier, current_trace_id

if TYPE_CHECKING:
    from butlers.settings import Settings

logger = logging.getLogger(__name__)

ERROR_TEXT_LIMIT = 2000
SESSION_HEADER = "X-Butlers-Session"


@dataclass
class SessionOutcome:
    session_id: uuid.UUID
    success: bool
    result: str | None
    error: str | None
    tool_calls: list[dict[str, Any]]
    duration_ms: int
    trace_id: str | None
    cost_usd: float | None = None  # Claude Code's own figure, when it gave one


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
        return mcp_config_dir(self.work_dir)

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
        slots: asyncio.Semaphore | None = None,
    ) -> SessionOutcome:
        """Run one session to completion; failures are recorded and returned, not raised.
        `conversation`: the one a routed message belongs to, where its `notify` goes.
        `slots`: what bounds this kind of session instead of `max_concurrent_sessions` (the
        classifier's sessions: the switchboard's `max_concurrent_messages`)."""
        async with slots or self._slots:
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
        cost_usd: float | None = None
        error: str | None = None
        try:
            answered = await asyncio.wait_for(
                self._query(prompt, target, system_prompt, tool_calls),
                timeout=self.config.runtime.timeout_s,
            )
            result, cost_usd = answered.text, answered.cost_usd
        except TimeoutError:
            error = f"Claude Code session timed out after {self.config.runtime.timeout_s:g}s"
        except SpawnError as exc:
            error = str(exc)
        except Exception as exc:  # the SDK's and the CLI's own failures
            logger.exception("Claude Code session failed", extra={"action": "spawn_failed"})
            error = describe_sdk_error(exc)
        duration_ms = int((time.monotonic() - started) * 1000)
        outcome = SessionOutcome(
            session_id=session_id,
            success=error is None,
            result=result,
            error=self.redact(error)[:ERROR_TEXT_LIMIT] if error else None,
            tool_calls=tool_calls,
            duration_ms=duration_ms,
            trace_id=trace_id,
            cost_usd=cost_usd,
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
                cost_usd=cost_usd,
            )
        )
        return outcome

    def _run_settings(self, system_prompt: str) -> ClaudeCodeRun:
        env = {**self.telemetry.cli_env, **self.session_env}
        carrier = current_carrier()
        if "traceparent" in carrier:
            env["TRACEPARENT"] = carrier["traceparent"]
            if "tracestate" in carrier:
                env["TRACESTATE"] = carrier["tracestate"]
        return ClaudeCodeRun(
            system_prompt=system_prompt,
            max_turns=self.config.runtime.max_turns,
            model=self.config.runtime.model,
            work_dir=self.work_dir,
            inherited=self.settings.inherited_environ(),
            env=env,
        )

    def _with_credentials(self, target: McpTarget) -> McpTarget:
        """The butler's endpoint asks for the auth token; the trace context rides along."""
        headers = {**target.headers, **current_carrier()}
        if self.auth_token:
            headers["Authorization"] = f"Bearer {self.auth_token}"
        return replace(target, headers=headers)

    async def _query(
        self,
        prompt: str,
        target: McpTarget,
        system_prompt: str,
        tool_calls: list[dict[str, Any]],
    ) -> ClaudeCodeResult:
        return await run_claude_code(
            prompt, self._with_credentials(target), self._run_settings(system_prompt), tool_calls
        )


SESSION_STARTING_TOOLS = ("trigger", "tick")


def default_allowed_tools(tool_names: Sequence[str]) -> tuple[str, ...]:
    """A triggered session may use its butler's tools, except those that start sessions."""
    return tuple(name for name in tool_names if name not in SESSION_STARTING_TOOLS)
