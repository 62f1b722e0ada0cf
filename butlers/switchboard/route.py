"""route(): forward one tool call to a registered butler and log it.

Refused before any connection is made: unknown butlers; the switchboard itself, by its name,
by an endpoint that is its own (a stale row of its old name after its directory was renamed
still points here) or by a row that says it had a [switchboard] table; a butler that runs a
channel module (telegram, email: a front door, not a specialist); and a stale butler, which
the last discover did not find. Every call, whatever its outcome, leaves one routing_log row;
a successful one also stamps the target's last_seen_at, in the same statement. The call runs
inside a `switchboard.route` span whose context travels to the target as `_trace_context`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.trace import Status, StatusCode, Tracer

from butlers.config import CHANNEL_MODULES
from butlers.errors import (
    OUT_OF_TURNS,
    AnswerLost,
    CallTimedOut,
    RemoteError,
    RouteError,
    RouteRefused,
    TargetBusy,
    TargetDown,
    TargetOutOfTurns,
    TargetSlow,
    TargetUnreachable,
)
from butlers.mcp_connection.core import unwrap
from butlers.mcp_connection.pool import McpConnections
from butlers.mcp_middleware import CONVERSATION_META, FORWARDED_META
from butlers.switchboard.routing_store import RegistryTarget, RouteRecord, RoutingStore
from butlers.telemetry import current_carrier, current_trace_id

if TYPE_CHECKING:
    from butlers.config import ButlerConfig
    from butlers.switchboard.inbox import InboxMessage


logger = logging.getLogger(__name__)

SUMMARY_CHARS = 200
ERROR_CHARS = 1000
DEFAULT_ROUTE_TIMEOUT_S = 330.0  # a little more than a target's default session timeout
# A target that cannot be reached makes the switchboard discover again at most this often.
REDISCOVER_EVERY_S = 30.0
SELF_ROUTING = "routing to the Switchboard is not permitted"


@dataclass(frozen=True)
class RouteSource:
    """Where a routed call came from: a channel and the sender's id on it."""

    channel: str = "mcp"
    source_id: str | None = None
    inbox_id: int | None = None  # the inbox message this call serves, if any
    conversation: str | None = None  # passed on: where the target's `notify` goes
    forwarded_from: str | None = None  # passed on: whose words a forwarded message carries

    @classmethod
    def of_message(cls, message: InboxMessage) -> RouteSource:
        author = message.meta.get("forwarded_from")
        return cls(
            channel=message.channel,
            source_id=message.source_id,
            inbox_id=message.id,
            conversation=message.conversation,
            forwarded_from=str(author) if author else None,
        )


def _authority(url: str) -> tuple[str, int | None] | None:
    """(host, port) of an endpoint URL, normalised: lower case, the scheme's default port,
    and every name of this machine's loopback (localhost, 127.0.0.0/8, ::1, and 0.0.0.0 or
    ::, which a connection reaches loopback through) as one. None: not a URL."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        return None
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme.lower())
    if host == "localhost" or host.endswith(".localhost"):
        return "loopback", port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host, port
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_unspecified:
        return "loopback", port
    return ip.compressed, port


class OwnEndpoints:
    """The switchboard's own addresses: the endpoint_url the registry stores for it and the
    URL it listens on. A target at one of them (whatever the path: /sse and /mcp are the same
    server) is the switchboard itself."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = tuple(urls)
        self._authorities = {a for a in map(_authority, self.urls) if a is not None}

    @classmethod
    def of_switchboard(cls, config: ButlerConfig, listening_url: str) -> OwnEndpoints:
        """`config.endpoint_url` (what discover registers for it) and `listening_url` (where
        this process serves: `--port` may move it off its butler.toml's port)."""
        return cls([config.endpoint_url, listening_url])

    def includes(self, url: str) -> bool:
        return _authority(url) in self._authorities


def unroutable(target: RegistryTarget, *, switchboard_name: str, own: OwnEndpoints) -> str | None:
    """Why route must not call this registry row, or None when it may. Also what keeps a row
    out of the classifier's list of butlers."""
    name = target.name
    if name == switchboard_name:
        return SELF_ROUTING
    if own.includes(target.endpoint_url):
        return (
            f"{SELF_ROUTING}: butler {name!r} is registered at {target.endpoint_url}, "
            "the switchboard's own endpoint"
        )
    if target.is_switchboard:
        return (
            f"{SELF_ROUTING}: butler {name!r} had a [switchboard] table when it was last discovered"
        )
    # A butler that runs a channel takes messages itself (the config allows that only on the
    # switchboard now; an older row may still say it).
    if channels := [m for m in target.modules if m in CHANNEL_MODULES]:
        return (
            f"butler {name!r} runs the channel module(s) {', '.join(channels)}: it takes "
            "messages itself and is not routed to"
        )
    if target.stale:
        return (
            f"butler {name!r} is stale: the last discover did not find it in the config "
            "directory; restore its directory (or fix its butler.toml), start it (restart "
            "`butlers up`, or `butlers run NAME`), then run `butlers discover`"
        )
    return None


def routable_rows(
    rows: Iterable[dict[str, Any]], *, switchboard_name: str, own: OwnEndpoints
) -> list[dict[str, Any]]:
    """The registry rows (`RoutingStore.registry()`) route may call: what the classifier is
    shown."""
    return [
        row
        for row in rows
        if unroutable(RegistryTarget.of_row(row), switchboard_name=switchboard_name, own=own)
        is None
    ]


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
        own: OwnEndpoints,
    ) -> None:
        self.store = store
        # The switchboard's own name (the registry lists it too) and addresses: routing to
        # either is refused.
        self.switchboard_name = switchboard_name
        self.own = own
        # routing_log keeps a summary of the arguments and the error: no configured secret.
        self.redact = redact
        self.connections = connections
        self.tracer = tracer
        self.timeout_s = timeout_s
        # name -> its registry row and why route refuses it (None: it does not), filled on
        # first use; discover() and failures clear it. Saves a database round trip and the
        # checks per call; a row edited behind our back (another switchboard process's
        # discover) is picked up on a miss.
        self._targets: dict[str, tuple[RegistryTarget, str | None]] = {}
        # The switchboard's discover, when a target cannot be reached (`butler`, `endpoint`)
        # and its config says it listens elsewhere (set by it): see `_moved`. At most once
        # per REDISCOVER_EVERY_S.
        self.rediscover: Callable[[str, str], Awaitable[object]] | None = None
        self._rediscovered_at: dict[str, float] = {}  # by butler: one down uses up no other's
        self._rediscovering = asyncio.Lock()

    def forget_endpoints(self) -> None:
        self._targets.clear()

    async def _routable_target(self, butler_name: str) -> RegistryTarget:
        """The registry row route may call; RouteRefused saying why not (not registered, the
        switchboard, a front door, stale)."""
        if butler_name == self.switchboard_name:  # whatever the registry says
            raise RouteRefused(SELF_ROUTING)
        known = self._targets.get(butler_name)
        if known is None:
            target = await self.store.target(butler_name)
            if target is None:
                raise RouteRefused(
                    f"butler {butler_name!r} not found (list_butlers, `butlers list`, shows them)"
                )
            refusal = unroutable(target, switchboard_name=self.switchboard_name, own=self.own)
            known = self._targets[butler_name] = (target, refusal)
        target, refusal = known
        if refusal is not None:
            raise RouteRefused(refusal)
        return target

    async def refusal_of(self, butler_name: str) -> str | None:
        """Why `butler_name` cannot be routed to, or None when it can."""
        try:
            await self._routable_target(butler_name)
        except RouteRefused as exc:
            return str(exc)
        return None

    async def route(
        self,
        butler_name: str,
        tool_name: str,
        arguments: dict[str, Any] | None = None,
        *,
        source: RouteSource = RouteSource(),
        request: str | None = None,
    ) -> Any:
        """Call `tool_name` on `butler_name` and record a routing_log row, whose summary is
        `request` when given (what a message asked, not the switchboard's frame around it:
        butlers.switchboard.handoff), else the call's `prompt` or arguments."""
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
                # The log row is written even if our caller is cancelled meanwhile: the store
                # takes it before its first await (RoutingLog.record_route), so no shield (a
                # task a call) is needed.
                summarized = arguments if request is None else {"prompt": request}
                await self._record(butler_name, tool_name, summarized, source, started, error)

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
                prompt_summary=summarize(arguments, self.redact),
                trace_id=current_trace_id(),
                success=error is None,
                error=truncate(self.redact(error), ERROR_CHARS) if error else None,
                duration_ms=int((time.monotonic() - started) * 1000),
                inbox_id=source.inbox_id,
            )
        )

    async def _moved(self, butler_name: str, endpoint: str) -> str | None:
        """Where `butler_name` answers now, if not at `endpoint`, where it could not be
        reached: the registry again, after this switchboard's discover (at most once per
        REDISCOVER_EVERY_S, however many routes fail). A second fleet on the same database
        (`butlers up --port-offset`) registers its butlers; once it stopped, every route of
        the first failed "unreachable" until someone ran `butlers discover` (a red team)."""
        async with self._rediscovering:
            now = time.monotonic()
            last = self._rediscovered_at.get(butler_name)
            if self.rediscover is not None and (last is None or now - last >= REDISCOVER_EVERY_S):
                self._rediscovered_at[butler_name] = now
                try:
                    await self.rediscover(butler_name, endpoint)
                except Exception as exc:  # the route's own failure is what its caller hears
                    logger.warning("discover after %s was unreachable failed: %s", endpoint, exc)
        self._targets.pop(butler_name, None)
        try:
            moved_to = (await self._routable_target(butler_name)).endpoint_url
        except Exception:  # refused now, the database away: "unreachable" stands
            return None
        return moved_to if moved_to != endpoint else None

    async def is_routable(self, butler_name: str) -> bool:
        """A registered butler route may call (see `refusal_of`)."""
        return await self.refusal_of(butler_name) is None

    async def _forward(
        self, butler_name: str, tool_name: str, arguments: dict[str, Any], source: RouteSource
    ) -> Any:
        endpoint = (await self._routable_target(butler_name)).endpoint_url
        carrier = current_carrier()
        forwarded = {**arguments, "_trace_context": carrier}
        meta: dict[str, str] = dict(carrier)
        if source.conversation:
            meta[CONVERSATION_META] = source.conversation
        if source.forwarded_from:
            meta[FORWARDED_META] = source.forwarded_from
        try:
            try:
                result = await self.connections.call(
                    endpoint, tool_name, forwarded, meta=meta, timeout_s=self.timeout_s
                )
            except TargetUnreachable as exc:
                self._targets.pop(butler_name, None)  # re-read the registry next time
                # Not reached at all (a lost answer may have run): where it has moved to.
                if isinstance(exc.__cause__, AnswerLost):
                    raise
                moved_to = await self._moved(butler_name, endpoint)
                if moved_to is None:
                    raise
                endpoint = moved_to
                result = await self.connections.call(
                    endpoint, tool_name, forwarded, meta=meta, timeout_s=self.timeout_s
                )
        except TargetUnreachable as exc:
            self._targets.pop(butler_name, None)
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
            said = unwrap(result)
            raise _trigger_failure(tool_name, said)(
                f"butler {butler_name!r} answered {tool_name!r} with an error: {said}"
            )
        return unwrap(result)


# What `trigger` says of a session that failed: the text is the target's own, after "session
# <id> failed", so no model wrote its start. One that took all its turns (butlers.errors.
# OutOfTurns); one that did nothing, for a reason that passes ("before acting": the message
# may be tried again); one its butler's session timeout cut short.
_TRIGGER_OUT_OF_TURNS = re.compile(rf"session [0-9a-f-]+ failed: {re.escape(OUT_OF_TURNS)}\b")
_TRIGGER_NOT_ACTED = re.compile(r"session [0-9a-f-]+ failed before acting: ")
_TRIGGER_TIMED_OUT = re.compile(r"session [0-9a-f-]+ failed: Claude Code session timed out ")


def _trigger_failure(tool_name: str, said: Any) -> type[RouteError]:
    """The RouteError a target's error answer is (its kind picks the sentence people read)."""
    if tool_name != "trigger" or not isinstance(said, str):
        return RouteError
    if _TRIGGER_OUT_OF_TURNS.match(said):
        return TargetOutOfTurns
    if _TRIGGER_NOT_ACTED.match(said):
        return TargetBusy
    if _TRIGGER_TIMED_OUT.match(said):
        return TargetSlow
    return RouteError
