"""The approval gate: a butler's session does not run a call the owner chose to guard.

`ButlerConfig.needs_approval` names them (`[approvals] tools` for the butler's own tools, a
tool server's `approval` globs for its proxied ones). `ApprovalGate`, an AnsweringGuard of
the butler's one middleware, answers such a call from a session itself: the exact call is
recorded on the switchboard (`approval_request`, which asks the owner), and the session is
told at once "waiting for the owner's approval (#12)", so it ends normally instead of
waiting hours. Calls that need no approval pay one dictionary lookup; a butler with nothing
to approve has no gate at all.

Only sessions are gated (they present their `X-Butlers-Session` header): they run on a
stranger's text, which may carry an injection. A caller without one is the operator (the
CLI through `route`, an MCP client with the fleet's token) acting for themselves.

Once the owner approves, the switchboard calls `approval_execute(id)` here. It runs only
what the switchboard hands over for that id (`approval_claim`: an approved call of this
butler, once), so a caller of it can never choose what runs, nor run anything twice.
Sessions are neither shown it nor allowed to call it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastmcp import FastMCP
from fastmcp.exceptions import NotFoundError
from fastmcp.tools import Tool
from fastmcp.tools.base import ToolResult
from mcp.types import TextContent

from butlers.config import APPROVAL_EXECUTE_TOOL, CONFIG_FILENAME, ButlerConfig
from butlers.errors import ConfigError, NotifyFailed
from butlers.schema_check import schema_problems
from butlers.session_policy import APPROVED_CALL, session_token, waits_for_approval
from butlers.tool_errors import ToolRefusal

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from butlers.core_store import CoreStore
    from butlers.settings import Settings
    from butlers.spawner import Spawner
    from butlers.switchboard_link import SwitchboardLink

logger = logging.getLogger(__name__)

RESULT_CHARS = 2000
_CACHED_NAMES = 4096  # tool names whose answer is kept (a caller may send any name)


def has_approvals(config: ButlerConfig) -> bool:
    """Whether anything of this butler waits for the owner's yes (else it gets no gate)."""
    return bool(config.approvals.tools) or any(server.approval for server in config.mcp_servers)


class _Unbuilt:
    """What the registering functions are handed where a running butler's parts would be:
    they only close over them, in tools that are never called here."""

    def __getattr__(self, name: str) -> _Unbuilt:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Unbuilt:
        return self


async def tool_names_offline(config: ButlerConfig, settings: Settings) -> list[str]:
    """The tools `butlers up` would register on `config`'s butler, found without starting
    it (`butlers doctor`): the core tools, the switchboard's, and the channels whose
    variables `settings` has (a channel skipped for them registers nothing). Built on a
    throwaway server the way the daemon builds its own."""
    from butlers.channels import CHANNELS, ChannelContext
    from butlers.core_tools import register_core_tools
    from butlers.switchboard.tools import register_switchboard_tools

    mcp: FastMCP[Any] = FastMCP(config.name)
    unbuilt: Any = _Unbuilt()
    register_core_tools(mcp, unbuilt)
    if config.is_switchboard:
        register_switchboard_tools(mcp, unbuilt, jaeger_ui_url="")
    context = ChannelContext(settings=settings, worker=None)
    for spec in CHANNELS:
        table = config.channels.get(spec.name)
        if table is None or any(
            settings.variable(name) is None for name in spec.required_variables(table)
        ):
            continue
        spec.open(table, context).register(mcp)
    return [tool.name for tool in await mcp.list_tools(run_middleware=False)]


def check_approval_globs(config: ButlerConfig, tool_names: Sequence[str]) -> None:
    """Each `[approvals] tools` glob must match one of the butler's own tools: a misspelt
    one ("notfy") guards nothing, and the owner's veto would be gone without a word. A
    ConfigError (the butler does not start), with the likely name."""
    import difflib
    import fnmatch

    guardable = [name for name in tool_names if name != APPROVAL_EXECUTE_TOOL]  # never gated
    for glob in config.approvals.tools:
        if any(fnmatch.fnmatchcase(name, glob) for name in guardable):
            continue
        likely = difflib.get_close_matches(glob, guardable, n=1)
        hint = (
            f"did you mean {likely[0]!r}?"
            if likely
            else f"its tools: {', '.join(sorted(guardable))}"
        )
        raise ConfigError(
            config.config_dir / CONFIG_FILENAME if config.config_dir else config.name,
            "approvals.tools",
            f"{glob!r} matches none of {config.name}'s tools, so it would guard nothing ({hint}); "
            "a tool server's tools take its own `approval` globs",
        )


class ApprovalGate:
    """Answers a session's call of a guarded tool by asking the owner, and keeps
    `approval_execute` from sessions (an AnsweringGuard and ListingGuard of the butler's
    middleware)."""

    def __init__(
        self,
        config: ButlerConfig,
        spawner: Spawner,
        link: SwitchboardLink,
        store: CoreStore,
        mcp: FastMCP,
    ) -> None:
        self.config = config
        self.spawner = spawner
        self.link = link
        self.store = store
        self.mcp = mcp  # its tools' input schemas: a call that could not run is not recorded
        self._needs: dict[str, bool] = {}

    def _needs_approval(self, tool_name: str) -> bool:
        needs = self._needs.get(tool_name)
        if needs is None:
            needs = self.config.needs_approval(tool_name)
            if len(self._needs) < _CACHED_NAMES:
                self._needs[tool_name] = needs
        return needs

    def check_call(self, tool_name: str) -> None:
        if tool_name == APPROVAL_EXECUTE_TOOL and session_token() is not None:
            raise ToolRefusal(
                f"{APPROVAL_EXECUTE_TOOL} is not available to sessions: only the switchboard "
                "runs what the owner approved",
                log_level=logging.WARNING,
            )

    def answers(self, tool_name: str) -> bool:
        return self._needs_approval(tool_name) and waits_for_approval()

    async def answer(self, tool_name: str, arguments: dict[str, Any]) -> ToolResult:
        """Record the call on the switchboard (the owner is asked) and say so at once. A call
        of no tool, or with arguments its tool's input schema refuses, is refused as the tool
        would refuse it, nothing recorded: the owner is never asked to approve a call that
        cannot run, and the session can correct it at once."""
        tool = await self.mcp.get_tool(tool_name)
        if tool is None:
            raise NotFoundError(f"Unknown tool: {tool_name!r}")
        if problems := schema_problems(tool.parameters, arguments):
            raise ToolRefusal(
                f"{tool_name}: {problems} (not asked for approval: call it again "
                "with arguments it takes)"
            )
        token = session_token()
        served = self.config.mcp_server_of(tool_name)
        if served is not None and not served[0].people and self.spawner.answers_someone_else(token):
            # Its server is the owner's alone: no question the owner's yes could not run.
            raise ToolRefusal(
                f"{tool_name} is the owner's alone ([[mcp_servers]] people = false): not for a "
                "session answering someone else; not asked",
                log_level=logging.WARNING,
            )
        conversation = self.spawner.conversation_of(token)
        if conversation is None and self.spawner.withheld_tools(token):
            # Restricted, yet answering no one: approved, it would run as the owner's session
            # (Spawner.acting_for knows a person by their conversation).
            raise ToolRefusal(
                f"{tool_name} needs the owner's approval, and this session answers no one (it "
                "was started for a message whose conversation is not known): not asked",
                log_level=logging.WARNING,
            )
        # Its sessions row, by its credential: the call's trace is the caller's to choose
        # (`_trace_context`), and named another running session (a red team).
        session_id = self.spawner.session_of(token)
        try:
            recorded = await self.link.request_approval(
                tool_name,
                arguments,
                conversation=conversation,
                session_id=str(session_id) if session_id is not None else None,
                timeout_hours=self.config.approvals.timeout_hours,
                forwarded_from=self.spawner.forwarded_from(token),
            )
        except NotifyFailed as exc:
            raise ToolRefusal(
                f"{tool_name} needs the owner's approval, and it could not be asked for: {exc}",
                log_level=logging.WARNING,
            ) from exc
        approval_id = recorded["id"]
        said = (
            f"waiting for the owner's approval (#{approval_id}): {tool_name} has not run; it "
            "runs once the owner approves it, and the person you are answering is told then. "
            "Do not call it again."
        )
        logger.info(
            "%s: %s waits for the owner's approval (#%s)",
            self.config.name,
            tool_name,
            approval_id,
            extra={"action": "approval_requested"},
        )
        return ToolResult(
            content=[TextContent(type="text", text=said)],
            structured_content={
                "status": "waiting_for_approval",
                "approval_id": approval_id,
                "message": said,
            },
        )

    def visible_tools(self, tools: Sequence[Tool]) -> Sequence[Tool]:
        if session_token() is None:
            return tools
        return [tool for tool in tools if tool.name != APPROVAL_EXECUTE_TOOL]

    def check_reading(self, what: str) -> None:
        return None

    def hides_listings(self) -> bool:
        return False


def _text_of(result: ToolResult) -> str:
    parts = [block.text for block in result.content if isinstance(block, TextContent)]
    return "\n".join(parts)[:RESULT_CHARS]


def register_approval_execute(
    mcp: FastMCP,
    link: SwitchboardLink,
    spawner: Spawner,
    redact: Callable[[str], str],
    *,
    ready: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """`approval_execute(id)`: how the switchboard has this butler run an approved call.
    `ready(tool)`: until what runs the tool is up (its tool server, at a start)."""

    @mcp.tool(name=APPROVAL_EXECUTE_TOOL)
    async def approval_execute(id: int) -> dict[str, Any]:
        """Run the call the owner approved as approval `id`, once. For the switchboard: the
        call is the one it hands over for `id`, never one a caller names."""
        if session_token() is not None:  # the gate refuses it too
            raise ToolRefusal(f"{APPROVAL_EXECUTE_TOOL} is not available to sessions")
        try:
            claimed = await link.claim_approval(id)
        except NotifyFailed as exc:
            raise ToolRefusal(str(exc), log_level=logging.WARNING) from exc
        if ready is not None:  # a yes pressed while the butler was down runs at its start
            await ready(claimed["tool"])
        running = APPROVED_CALL.set(id)
        try:
            # As the session that asked: a person's call stays that person's (restricted,
            # answering in their conversation), whoever approved it.
            with spawner.acting_for(claimed.get("conversation"), claimed.get("forwarded_from")):
                result = await mcp.call_tool(claimed["tool"], dict(claimed["arguments"]))
        except Exception as exc:  # the tool's own failure is the approval's result
            return {"id": id, "status": "failed", "result": redact(str(exc))[:RESULT_CHARS]}
        finally:
            APPROVED_CALL.reset(running)
        return {
            "id": id,
            "status": "failed" if result.is_error else "done",
            "result": redact(_text_of(result)),
        }
