"""route(): forward one tool call to a registered butler and log it.

Unknown butlers and the switchboard itself are refused before any connection is made. Every
call, whatever its outcome, leaves one routing_log row; a successful one also stamps the
target's last_seen_at, in the same statement. The call runs inside a `switchboard.route` span
whose context travels to the target as `_trace_context`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.core_store import storable
from butlers.errors import (
    CallTimedOut,
    RemoteError,
    RouteError,
    RouteRefused,
    TargetDown,
    TargetSlow,
    TargetUnreachable,
)
from butlers.mcp_connection.core import unwrap
from butlers.mcp_middleware import CONVERSATION_META
from butlers.switchboard.connections import McpConnections
from butlers.switchboard.routing_store import RouteRecord, RoutingStore
from butlers.telemetry import current_carrier, current_trace_id

if TYPE_CHECKING:
    from butlers.switchboard.inbox import InboxMessage


SUMMARY_CHARS = 200
ERROR_CHARS = 1000
DEFAULT_ROUTE_TIMEOUT_S = 330.0  # a little more than a target's default session timeout


@dataclass(frozen=True)
class RouteSource:
    """Where a routed call came from: a channel and the sender's id on it."""

    channel: str = "mcp"
    source_id: str | None = None
    inbox_id: int | None = None  # the inbox message this call serves, if any
    conversation: str | None = None  # passed on: where the target's `notify` goes

    @classmethod
    def of_message(cls, message: InboxMessage) -> RouteSource:
        return cls(
            channel=message.channel,
            source_id=message.source_id,
            inbox_id=message.id,
            conversation=message.conversation,
        )


def summarize(arguments: dict[str, Any], redact: Callable[[str], str] = str) -> str | None:
    """The `prompt` argument when there is one, else the arguments as JSON; redacted, then
    truncated (the other way round, a secret cut in two would keep its first part)."""
    if not arguments:
        return None
    prompt = arguments.get("prompt")
    text = prompt if isinstance(prompt, str) else json.dumps(arguments, default=str)
    return truncate(redact(text), SUMMARY_CHARS)


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Router:
    def __init__(
        self,
        store: RoutingStore,
        connections: McpConnections,
        *,
        tracer: Tracer,
        timeout_s: float = DEFAULT_ROUTE_TIMEOUT_S,
        redact: Callable[[str], str] = str,
        switchboard_name: str,
    ) -> None:
        self.store = store
        # The switchboard's own name (the registry lists it too): routing to it is refused.
        self.switchboard_name = switchboard_name
        # routing_log keeps a summary of the arguments and the error: no configured secret.
        self.redact = redact
        self.connections = connections
        self.tracer = tracer
        self.timeout_s = timeout_s
        # name -> endpoint_url, filled on first use; discover() and failures clear it. Saves a
        # database round trip per call; a row edited behind our back is picked up on a miss.
        self._endpoints: dict[str, str] = {}

    def forget_endpoints(self) -> None:
        self._endpoints.clear()

    async def _endpoint_of(self, butler_name: str) -> str | None:
        endpoint = self._endpoints.get(butler_name)
        if endpoint is None:
            endpoint = await self.store.endpoint_of(butler_name)
            if endpoint is not None:
                self._endpoints[butler_name] = endpoint
        return endpoint

    async def route(
        self,
        butler_name: str,
        tool_name: str,
        arguments: dict[str, Any] | None = None,
        *,
        source: RouteSource = RouteSource(),
    ) -> Any:
        arguments = dict(arguments or {})
        with self._span(butler_name, tool_name, source) as span:
            started = time.monotonic()
            error: str | None = None
            try:
                return await self._forward(butler_name, tool_name, arguments, source)
            except RouteError as exc:
                error = str(exc)
                span.set_status(Status(StatusCode.ERROR, error[:200]))
                raise
            except asyncio.CancelledError:
                error = "cancelled before the target answered"
                raise
            except Exception as exc:
                error = f"internal error ({type(exc).__name__})"
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, error))
                raise
            finally:
                # The log row must be written even if our caller is cancelled meanwhile.
                await asyncio.shield(
                    self._record(butler_name, tool_name, arguments, source, started, error)
                )

    async def refuse(
        self,
        butler_name: str,
        tool_name: str,
        arguments: dict[str, Any] | None,
        *,
        source: RouteSource,
        reason: str,
    ) -> None:
        """Record a route that a policy refused before any connection: a routing_log row
        (success = false) and a failed span, as for any route that did not happen."""
        with self._span(butler_name, tool_name, source) as span:
            span.set_status(Status(StatusCode.ERROR, reason[:200]))
            await self._record(
                butler_name, tool_name, dict(arguments or {}), source, time.monotonic(), reason
            )

    def _span(self, butler_name: str, tool_name: str, source: RouteSource):
        return self.tracer.start_as_current_span(
            "switchboard.route",
            attributes={
                "target": butler_name,
                "tool_name": tool_name,
                "source_channel": source.channel,
            },
        )

    async def _record(
        self,
        butler_name: str,
        tool_name: str,
        arguments: dict[str, Any],
        source: RouteSource,
        started: float,
        error: str | None,
    ) -> None:
        await self.store.record_route(
            RouteRecord(
                source_channel=source.channel,
                source_id=source.source_id,
                routed_to=butler_name,
                tool_name=tool_name,
                prompt_summary=storable(summarize(arguments, self.redact)),
                trace_id=current_trace_id(),
                success=error is None,
                error=storable(truncate(self.redact(error), ERROR_CHARS)) if error else None,
                duration_ms=int((time.monotonic() - started) * 1000),
                inbox_id=source.inbox_id,
            )
        )

    async def is_routable(self, butler_name: str) -> bool:
        """A registered butler other than the switchboard."""
        return (
            butler_name != self.switchboard_name
            and await self._endpoint_of(butler_name) is not None
        )

    async def _forward(
        self, butler_name: str, tool_name: str, arguments: dict[str, Any], source: RouteSource
    ) -> Any:
        if butler_name == self.switchboard_name:
            raise RouteRefused("routing to the Switchboard is not permitted")
        endpoint = await self._endpoint_of(butler_name)
        if endpoint is None:
            raise RouteRefused(f"butler {butler_name!r} not found")
        carrier = current_carrier()
        forwarded = {**arguments, "_trace_context": carrier}
        meta: dict[str, str] = dict(carrier)
        if source.conversation:
            meta[CONVERSATION_META] = source.conversation
        try:
            result = await self.connections.call(
                endpoint, tool_name, forwarded, meta=meta, timeout_s=self.timeout_s
            )
        except TargetUnreachable as exc:
            self._endpoints.pop(butler_name, None)  # re-read the registry next time
            raise TargetDown(f"butler {butler_name!r} is unreachable at {endpoint}: {exc}") from exc
        except CallTimedOut as exc:
            raise TargetSlow(
                f"butler {butler_name!r} at {endpoint} did not answer {tool_name!r}: {exc}"
            ) from exc
        except RemoteError as exc:
            raise RouteError(
                f"butler {butler_name!r} at {endpoint} failed {tool_name!r}: {exc.message}"
            ) from exc
        if result.get("isError"):
            raise RouteError(
                f"butler {butler_name!r} answered {tool_name!r} with an error: {unwrap(result)}"
            )
        return unwrap(result)
