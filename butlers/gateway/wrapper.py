"""The Claude wrapper: a suite's `natural_language` subtool, answered by a Claude Code session
that holds that one child's tools.

A host that does not want to learn a child's tools asks in plain words; an ephemeral Claude
Code run (butlers.claude_code, the same run the butlers' sessions use) gets the child as its
only MCP server, the suite's allow/deny rules as its allow-list, the child's wrapper
instructions as its system prompt, bounded turns and a timeout, and no built-in tools. Its
answer goes back with the tool calls it made.

Which children get it: those with instructions, from `[suites.<name>] claude` in
gateway.toml, else a CLAUDE.md in the child's directory, else the `claude` key of seed 000's
`mcp-descriptions.json` (`{"mcps": {"<name>": {"claude": "...", "switchboard": "..."}}}`,
at the gateway's directory or under `.switchboard/`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers.claude_code import ClaudeCodeRun, McpTarget, StdioServer, run_claude_code
from butlers.errors import SpawnError, WrapperFailed
from butlers.gateway.children import ChildSpec
from butlers.gateway.config import GatewayConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

NATURAL_LANGUAGE = "natural_language"
DESCRIPTIONS_FILES = ("mcp-descriptions.json", ".switchboard/mcp-descriptions.json")
QUERY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "What you want, in plain words."}},
    "required": ["query"],
}


@dataclass(frozen=True)
class Instructions:
    text: str
    source: str  # where they were found, for messages


def load_descriptions(base_dir: Path) -> dict[str, Instructions]:
    """The `claude` instructions of seed 000's mcp-descriptions.json, by child name. A file
    that cannot be read is skipped with a warning naming it (it never stops the gateway)."""
    found: dict[str, Instructions] = {}
    for name in DESCRIPTIONS_FILES:
        path = base_dir / name
        if not path.is_file():
            continue
        try:
            mcps = json.loads(path.read_text(encoding="utf-8")).get("mcps", {})
            for child, entry in mcps.items():
                text = entry.get("claude") if isinstance(entry, dict) else None
                if isinstance(text, str) and text.strip() and child not in found:
                    found[child] = Instructions(text, f"{path}: mcps.{child}.claude")
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning(
                "skipping %s: not readable as mcp-descriptions.json (%s)",
                path,
                exc,
                extra={"action": "descriptions_invalid"},
            )
    return found


def instructions_for(
    spec: ChildSpec, config: GatewayConfig, descriptions: Mapping[str, Instructions]
) -> Instructions | None:
    """The child's wrapper instructions, by the order above; None: no `natural_language`."""
    configured = config.suite(spec.name).claude
    if configured:
        source = f"{config.source}: suites.{spec.name}.claude" if config.source else "config"
        return Instructions(configured, source)
    if spec.cwd is not None:
        claude_md = spec.cwd / "CLAUDE.md"
        if claude_md.is_file():
            text = claude_md.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                return Instructions(text, str(claude_md))
    return descriptions.get(spec.name)


@dataclass(frozen=True)
class WrapperAnswer:
    answer: str
    tool_calls: list[dict[str, Any]]

    def structured(self) -> dict[str, Any]:
        return {"answer": self.answer, "tool_calls": self.tool_calls}


class ClaudeWrapper:
    """The Claude Code runs of one gateway: one private, empty working directory for all
    (their private MCP config files go there), removed when the gateway closes.

    `environ`: the gateway's environment (Settings.environ): Claude Code keeps its allowlist
    (credentials, ANTHROPIC_BASE_URL, HOME); `cli_env`: what tracing adds for Claude Code.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        environ: Mapping[str, str],
        cli_env: Mapping[str, str] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = config.wrapper
        self.environ = environ
        self.cli_env = dict(cli_env or {})
        self.tracer = tracer
        self._work_dir: Path | None = None

    def _directory(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="butlers-gateway-wrapper-"))
        return self._work_dir

    async def ask(
        self,
        spec: ChildSpec,
        instructions: Instructions,
        query: str,
        *,
        allowed: Sequence[str],
        hidden: Sequence[str],
        auth_token: str | None = None,
    ) -> WrapperAnswer:
        """One session on `query` with the child's `allowed` tools (`hidden` it never sees)."""
        if self.tracer is None:
            return await self._ask(spec, instructions, query, allowed, hidden, auth_token)
        with self.tracer.start_as_current_span(
            "gateway.natural_language", attributes={"child": spec.name}
        ):
            return await self._ask(spec, instructions, query, allowed, hidden, auth_token)

    async def _ask(
        self,
        spec: ChildSpec,
        instructions: Instructions,
        query: str,
        allowed: Sequence[str],
        hidden: Sequence[str],
        auth_token: str | None,
    ) -> WrapperAnswer:
        from butlers.telemetry import current_carrier  # (the tracing SDK: only when asked)

        target = _target(spec, allowed, hidden, auth_token)
        env = dict(self.cli_env)
        carrier = current_carrier()
        if "traceparent" in carrier:  # Claude Code's own spans join this call's trace
            env["TRACEPARENT"] = carrier["traceparent"]
            if "tracestate" in carrier:
                env["TRACESTATE"] = carrier["tracestate"]
        run = ClaudeCodeRun(
            system_prompt=instructions.text,
            max_turns=self.settings.max_turns,
            model=self.settings.model,
            work_dir=self._directory(),
            inherited=self.environ,
            env=env,
        )
        calls: list[dict[str, Any]] = []
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                answer = (await run_claude_code(query, target, run, calls)).text
        except TimeoutError:
            raise WrapperFailed(
                f"child {spec.name!r}: natural_language: no answer within "
                f"{self.settings.timeout_s} s (wrapper.timeout_s)"
            ) from None
        except SpawnError as exc:
            raise WrapperFailed(f"child {spec.name!r}: natural_language: {exc}") from exc
        return WrapperAnswer(answer, [_unqualified(call, spec.name) for call in calls])

    def close(self) -> None:
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None


def _target(
    spec: ChildSpec, allowed: Sequence[str], hidden: Sequence[str], auth_token: str | None
) -> McpTarget:
    headers = dict(spec.headers)  # a remote server's own (an API key), in the private file
    if auth_token:
        headers["Authorization"] = f"Bearer {auth_token}"
    stdio = None
    if spec.cmd is not None:
        cwd = str(spec.cwd) if spec.cwd is not None else None
        stdio = StdioServer(spec.cmd, tuple(spec.args), dict(spec.env), cwd)
    return McpTarget(
        name=spec.name,
        url=spec.url or "",
        allowed_tools=tuple(allowed),
        denied_tools=tuple(hidden),
        headers=headers,
        stdio=stdio,
    )


def _unqualified(call: dict[str, Any], child: str) -> dict[str, Any]:
    """`mcp__<child>__add` as the child calls it: `add`."""
    name = str(call.get("name", ""))
    prefix = f"mcp__{child}__"
    return {**call, "name": name.removeprefix(prefix)}
