"""A butler's one FastMCP middleware: every tool continues its caller's trace, without
declaring it, and the butler's guards decide who may see and call what (on the switchboard a
classification session sees and calls only its own two tools; on every butler a session of a
routed message is refused other people's sessions), and an answering guard may take a call
the owner must approve out of the tool's hands (butlers.approvals: recorded, not run).

One middleware, not one per concern: FastMCP dispatches every layer for every call (twice:
its outer and typed phases), and a second and third layer cost route about 0.1 M
instructions a call (bench/route_instructions.py, measured). A guard is a plain object the
middleware consults; its checks run inside the tool's span, so a refusal is traced.

A caller may put `_trace_context` (a W3C carrier) into any tool's arguments; it is removed
before argument validation, so no tool has to declare it. Failing that, `_meta.traceparent`
(what FastMCP clients send), then an HTTP `traceparent` header (what Claude Code sends when
the spawner puts it in the MCP server's headers) name the parent.

A classification session's Claude Code reads a stranger's text. Its allowlist is Claude
Code's to enforce; `ClassificationFence` holds the same line on the server, so that a widened
allowlist, a bug in the CLI or a caller speaking MCP directly with the header gets nothing
more than `route` and `list_butlers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, cast

from fastmcp import FastMCP
from fastmcp.exceptions import NotFoundError
from fastmcp.exceptions import ValidationError as ArgumentsInvalid
from fastmcp.server.dependencies import fastmcp_request_ctx, get_http_headers
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.server.middleware.dereference import DereferenceRefsMiddleware
from fastmcp.server.providers.aggregate import AggregateProvider
from fastmcp.tools import Tool
from fastmcp.utilities.versions import VersionSpec
from mcp_types import CallToolRequestParams
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from pydantic import ValidationError as PydanticValidationError

from butlers import __version__
from butlers.telemetry import context_from_carrier
from butlers.tool_errors import ToolRefusal

TRACE_CONTEXT_ARG = "_trace_context"
# In a call's `_meta`: the conversation a routed call serves (set by the switchboard), so that
# the session it starts can `notify` that conversation.
CONVERSATION_META = "butlers/conversation"
# ... and whose words it carries when the message was forwarded (their name, as the channel
# gave it): a forward's session serves the owner's conversation, with a stranger's words.
# Claimed by any caller, it only takes trust away.
FORWARDED_META = "butlers/forwarded_from"
# A classification session presents its message's credential in this header (its private MCP
# config); the switchboard's `route` holds such a caller to what a classifier may route.
CLASSIFICATION_HEADER = "X-Butlers-Classification"
LEGACY_INBOX_HEADER = "X-Butlers-Inbox-Id"  # what sessions sent before credentials: refused
# The same claim in a call's `_meta`: where a butler's `notify` forwards the credential of the
# session that called it, so that the switchboard's `deliver` sees who is really asking.
CLASSIFICATION_META = "butlers/classification"


@dataclass(frozen=True)
class ClassificationClaim:
    """What a request presents to say it comes from a classification session."""

    credential: str | None  # None: claimed by the legacy inbox header, which proves nothing
    where: str  # the header or `_meta` key it came in, for error messages


def classification_claim(headers: Mapping[str, str] | None = None) -> ClassificationClaim | None:
    """The classification credential the current request presents (its HTTP header, or
    `_meta` as a butler's `notify` forwards it), or None for any other caller. `headers`:
    the request's, when the caller has read them already.

    A claim only ever takes rights away: whether it names a message being classified is for
    `route` to check; every other tool refuses a claimant either way.
    """
    if headers is None:
        headers = get_http_headers()
    credential = headers.get(CLASSIFICATION_HEADER.lower())
    if credential is not None:
        return ClassificationClaim(credential, CLASSIFICATION_HEADER)
    forwarded = (_meta_carrier() or {}).get(CLASSIFICATION_META)
    if forwarded is not None:
        return ClassificationClaim(str(forwarded), f"_meta {CLASSIFICATION_META!r}")
    if LEGACY_INBOX_HEADER.lower() in headers:
        return ClassificationClaim(None, LEGACY_INBOX_HEADER)
    return None


def request_conversation() -> str | None:
    """The conversation the current tool call serves, as its caller said in `_meta`."""
    meta = _meta_carrier() or {}
    value = meta.get(CONVERSATION_META)
    return value if isinstance(value, str) and value else None


def request_forwarded_from() -> str | None:
    """Whose words the current tool call's message carries, when it was forwarded."""
    meta = _meta_carrier() or {}
    value = meta.get(FORWARDED_META)
    return value[:200] if isinstance(value, str) and value else None


# The `_meta` of a tool call made within the process without MCP's session (a switchboard's
# LocalConnection calls the butlers of its process with FastMCP's own `call_tool`, in a fresh
# context that holds this): read where FastMCP has no request of its own.
LOCAL_CALL_META: ContextVar[dict[str, Any] | None] = ContextVar(
    "butlers_local_call_meta", default=None
)


def _meta_carrier() -> dict[str, Any] | None:
    request = fastmcp_request_ctx.get()
    return request.meta if request is not None else LOCAL_CALL_META.get()


class ToolGuard(Protocol):
    """A policy on who may call a tool: `check_call` raises ToolRefusal to refuse."""

    def check_call(self, tool_name: str) -> None: ...


class AnsweringGuard(ToolGuard, Protocol):
    """A guard that may answer a call itself instead of the tool (the approval gate: the call
    is recorded for the owner, not run). `answers` is asked on every call: keep it a lookup."""

    def answers(self, tool_name: str) -> bool: ...

    async def answer(self, tool_name: str, arguments: dict[str, Any]) -> Any: ...


class ListingGuard(ToolGuard, Protocol):
    """A guard that also decides what a caller is shown (tools, resources, prompts)."""

    def visible_tools(self, tools: Sequence[Tool]) -> Sequence[Tool]: ...

    def check_reading(self, what: str) -> None: ...

    def hides_listings(self) -> bool: ...


class ButlerMiddleware(Middleware):
    """Trace context for every tool call, and the butler's guards (`add_guard`): each may
    refuse a call (`check_call`), an AnsweringGuard may answer it instead of the tool."""

    def __init__(self, butler_name: str, tracer: Tracer) -> None:
        self.butler_name = butler_name
        self.tracer = tracer
        self._guards: list[ToolGuard] = []
        self._listing_guards: list[ListingGuard] = []
        self._answering_guards: list[AnsweringGuard] = []  # none unless approvals are set
        # Why a tool is not there, when something knows (a tool server that is down): asked
        # only when a call names an unknown tool.
        self.unknown_tool_hint: Callable[[str], str | None] | None = None

    def add_guard(self, guard: ToolGuard | ListingGuard | AnsweringGuard) -> None:
        self._guards.append(guard)
        if hasattr(guard, "visible_tools"):
            self._listing_guards.append(guard)  # type: ignore[arg-type]
        if hasattr(guard, "answer"):
            self._answering_guards.append(guard)  # type: ignore[arg-type]

    async def __call__(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        """A tool call goes straight to `on_call_tool`; everything else through FastMCP's
        dispatch. That dispatch builds a chain of three wrappers (on_message, on_request, the
        typed hook) for every message, which this middleware leaves as they are for a call:
        every routed call crosses it twice (the switchboard's, then the target's)."""
        if isinstance(context.message, CallToolRequestParams):
            return await self.on_call_tool(context, call_next)
        return await super().__call__(context, call_next)

    async def on_call_tool(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        params = context.message
        arguments = params.arguments or {}
        carrier = None
        if TRACE_CONTEXT_ARG in arguments:  # else the call goes on as it came: no copies
            arguments = dict(arguments)
            carrier = arguments.pop(TRACE_CONTEXT_ARG)
            if carrier is not None and not isinstance(carrier, dict):
                raise ToolRefusal(
                    f"{TRACE_CONTEXT_ARG} must be an object such as "
                    '{"traceparent": "00-<trace id>-<span id>-01"}'
                )
            params = params.model_copy(update={"arguments": arguments})
            context = context.copy(message=params)
        parent = (
            context_from_carrier(carrier)
            or context_from_carrier(_meta_carrier())
            or context_from_carrier(get_http_headers(include={"traceparent", "tracestate"}))
            or otel_context.get_current()
        )
        with self.tracer.start_as_current_span(
            f"{self.butler_name}/{params.name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"butler": self.butler_name, "tool_name": params.name},
        ) as span:
            try:
                for guard in self._guards:
                    guard.check_call(params.name)
                for answering in self._answering_guards:
                    if answering.answers(params.name):
                        return await answering.answer(params.name, arguments)
                return await call_next(context)
            except NotFoundError as exc:
                hint = self.unknown_tool_hint(params.name) if self.unknown_tool_hint else None
                span.set_status(Status(StatusCode.ERROR, hint or str(exc)))
                if hint is None:
                    raise
                raise ToolRefusal(f"{exc}: {hint}") from None
            except ArgumentsInvalid as exc:
                if not isinstance(exc.__cause__, PydanticValidationError):
                    raise
                said = argument_problems(params.name, exc.__cause__)
                span.set_status(Status(StatusCode.ERROR, said[:200]))
                raise ArgumentsInvalid(said) from None
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
                if _database_unreachable(exc):
                    raise ToolRefusal(
                        f"{self.butler_name} cannot reach its database now "
                        f"({type(exc).__name__}); its /health says more"
                    ) from exc
                raise

    async def on_list_tools(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        tools: Sequence[Tool] = await call_next(context)
        for guard in self._listing_guards:
            tools = guard.visible_tools(tools)
        return tools

    async def on_read_resource(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        for guard in self._listing_guards:
            guard.check_reading("reading resources")
        return await call_next(context)

    async def on_get_prompt(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        for guard in self._listing_guards:
            guard.check_reading("getting prompts")
        return await call_next(context)

    async def on_list_resources(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        return [] if self._hides_listings() else await call_next(context)

    async def on_list_resource_templates(
        self, context: MiddlewareContext, call_next: CallNext
    ) -> Any:
        return [] if self._hides_listings() else await call_next(context)

    async def on_list_prompts(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        return [] if self._hides_listings() else await call_next(context)

    def _hides_listings(self) -> bool:
        return any(guard.hides_listings() for guard in self._listing_guards)


class ListingDereference(DereferenceRefsMiddleware):
    """FastMCP's own `$ref` inlining of listed schemas (what `dereference_schemas=True` adds),
    without its pass-through layers on a tool call: FastMCP runs a middleware's on_message,
    on_request and typed hook for every message, and this one only changes listings. See
    `butler_server`."""

    async def __call__(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        if isinstance(context.message, CallToolRequestParams):
            return await call_next(context)
        return await super().__call__(context, call_next)


class _OneProviderLookup(AggregateProvider):
    """The step of FastMCP's tool lookup that asks the providers, without a task group when
    there is one provider.

    FastMCP asks its providers for a tool concurrently (`AggregateProvider._get_tool`: an
    anyio task group, a task per provider) even when there is one, as on every butler: a
    task, its context and a turn of the event loop for every tool call, twice per routed
    call. Measured in one process (FastMCP's `call_tool` on the butlers' servers, four
    alternating rounds of 2000 calls): a lookup 38-40 -> 10 us of CPU, a direct `state_get`
    245-261 -> 202-218 us, a routed one 682-791 -> 579-623 us. With more than one provider
    (a server mounted into it), FastMCP's own way."""

    async def _get_tool(self, name: str, version: VersionSpec | None = None) -> Tool | None:
        if len(self.providers) != 1:
            return await super()._get_tool(name, version)
        try:
            found: Tool | Exception | None = await self.providers[0].get_tool(name, version)
        except Exception as exc:  # as FastMCP's gather hands one on (a cancellation is not)
            found = exc
        # (one answer: FastMCP's own handling of it, a failure logged or raised as it says)
        return cast("Tool | None", self._get_highest_version_result([found], f"get_tool({name!r})"))


def argument_problems(tool: str, error: PydanticValidationError) -> str:
    """A tool call's invalid arguments in one line, each named with what was wrong and what
    was given: "memory_list: limit: Input should be less than or equal to 500 (got 100000)".
    pydantic's own text spans lines and ends with a URL; a CLI prints it as a paragraph, and
    it broke `butlers log`'s table (routing_log keeps a routed call's error)."""
    problems = []
    for detail in error.errors(include_url=False):
        where = ".".join(str(part) for part in detail["loc"]) or "arguments"
        problem = f"{where}: {detail['msg']}"
        if detail["type"] not in ("missing", "missing_argument") and "input" in detail:
            shown = repr(detail["input"])
            problem += f" (got {shown if len(shown) <= 60 else shown[:59] + '…'})"
        problems.append(problem)
    return f"{tool}: " + "; ".join(problems)


class ButlerServer(FastMCP, _OneProviderLookup):
    """FastMCP, with `_OneProviderLookup` under it: FastMCP's own `_get_tool` (its check of
    a tool's `auth`) calls it as its `super()`, and everything around the lookup (transforms,
    visibility, the auth check after them, hashed names) stays FastMCP's
    (tests/test_butler_server.py holds the two to each other)."""


def butler_server(
    name: str, middleware: ButlerMiddleware, *, instructions: str | None
) -> ButlerServer:
    """The FastMCP server of a butler: `middleware` outermost, error details masked, `$ref`s
    inlined in what it lists (ListingDereference, not FastMCP's per-message layer)."""
    return ButlerServer(
        name,
        version=__version__,  # serverInfo: ours, not FastMCP's (its default)
        instructions=instructions,
        mask_error_details=True,
        middleware=[middleware, ListingDereference()],
        dereference_schemas=False,
    )


class ClassificationFence:
    """On the switchboard: a caller presenting a classification claim (see
    `classification_claim`) is shown only `tools` and may call nothing else, nor read
    resources or prompts. Every other caller is untouched. (A ListingGuard of the butler's
    middleware.)"""

    def __init__(self, tools: Collection[str]) -> None:
        self.tools = frozenset(tools)

    def _refusal(self, what: str) -> ToolRefusal:
        # Someone tried what a classifier is never given: worth an operator's attention.
        return ToolRefusal(
            f"{what} is not available to a classification session: it may call only "
            f"{', '.join(sorted(self.tools))}",
            log_level=logging.WARNING,
        )

    def check_call(self, tool_name: str) -> None:
        # `route` and `list_butlers` (the hot path) are decided without reading headers.
        if tool_name not in self.tools and classification_claim() is not None:
            raise self._refusal(f"tool {tool_name!r}")

    def visible_tools(self, tools: Sequence[Tool]) -> Sequence[Tool]:
        if classification_claim() is None:
            return tools
        return [tool for tool in tools if tool.name in self.tools]

    def check_reading(self, what: str) -> None:
        if classification_claim() is not None:
            raise self._refusal(what)

    def hides_listings(self) -> bool:
        return classification_claim() is not None


def _database_unreachable(exc: BaseException) -> bool:
    """A connection to PostgreSQL that could not be made or broke (not a statement it refused):
    said as such, where FastMCP would mask it as "Error calling tool 'x'" (an operator's
    `butlers list` while the database was down said only that)."""
    import asyncpg

    seen = 0
    cause: BaseException | None = exc  # FastMCP's masked ToolError holds the error as cause
    while cause is not None and seen < 5:
        if isinstance(
            cause,
            asyncpg.PostgresConnectionError
            | asyncpg.ConnectionDoesNotExistError
            | asyncpg.CannotConnectNowError,
        ):
            return True
        if isinstance(cause, OSError | TimeoutError) and _raised_in_asyncpg(cause):
            return True  # refused, the socket gone, acquire timed out
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


def _raised_in_asyncpg(exc: BaseException) -> bool:
    frames = exc.__traceback__
    while frames is not None:
        if str(frames.tb_frame.f_globals.get("__name__", "")).startswith("asyncpg"):
            return True
        frames = frames.tb_next
    return False
