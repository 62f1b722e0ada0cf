"""route, from a classification session: what it may route, and the switchboard's dispatch.

The classifier's Claude Code reads text written by strangers and holds one tool that reaches
every butler. Whatever the message talks it into, a route from such a session can only hand a
prompt to a specialist's `trigger`: no other tool (`state_list` would read a butler's data
back into the sender's chat; `schedule_create` would plant work), no other argument, not the
switchboard itself, at most `max_routes_per_message` times.

The session is recognised by a credential the switchboard makes for each message and hands
only to that session (a header in its private MCP config): an inbox id alone proves nothing,
anyone who can reach /sse can send one.

`route` answers such a call as soon as it is recorded, and the switchboard forwards it here,
in a task this message's `Dispatch` owns and the worker waits for with the route timeout. The
classification session therefore ends in seconds and its timeout no longer cuts a slow
butler short (which used to send the message to `general` as well).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from butlers.errors import RouteError, RoutePolicyError
from butlers.mcp_middleware import CLASSIFICATION_HEADER
from butlers.mcp_middleware import LEGACY_INBOX_HEADER as LEGACY_INBOX_HEADER  # re-exported
from butlers.media import Attachment
from butlers.switchboard.handoff import Handoff
from butlers.switchboard.inbox import InboxMessage
from butlers.switchboard.replies import Answer, reply_text
from butlers.switchboard.route import Router, RouteSource

CREDENTIAL_HEADER = CLASSIFICATION_HEADER  # the session's header: this message's credential
ROUTABLE_TOOL = "trigger"
MAX_PROMPT_BYTES = 32 * 1024


def check_classifier_route(
    tool_name: str,
    arguments: dict[str, Any] | None,
    *,
    unroutable: str | None,
    butler_name: str,
    max_bytes: int = MAX_PROMPT_BYTES,
) -> str:
    """The prompt to forward, if this is a route a classification session may make.
    `unroutable`: why route would refuse the butler (Router.refusal_of), None if it would not.
    `max_bytes`: the longest prompt (prompt_limit: room for the message it restates)."""
    if tool_name != ROUTABLE_TOOL:
        raise RoutePolicyError(
            f"refused: a message may only be handed to a butler's {ROUTABLE_TOOL!r} tool, "
            f"not {tool_name!r}"
        )
    if unroutable is not None:
        raise RoutePolicyError(
            f"refused: {butler_name!r} is not a butler you can route to ({unroutable}; "
            "see list_butlers: the switchboard itself is not one)"
        )
    arguments = arguments or {}
    prompt = arguments.get("prompt")
    if set(arguments) != {"prompt"} or not isinstance(prompt, str):
        raise RoutePolicyError(
            'refused: the arguments must be exactly {"prompt": "<text>"}, got keys '
            f"{sorted(arguments)}"
        )
    if not prompt.strip():
        raise RoutePolicyError("refused: the prompt must not be empty")
    size = len(prompt.encode())
    if size > max_bytes:
        raise RoutePolicyError(f"refused: the prompt is {size} bytes; the limit is {max_bytes}")
    return prompt


def prompt_limit(message: InboxMessage) -> int:
    """The longest prompt a classifier may hand on for `message`: MAX_PROMPT_BYTES beyond the
    message itself. A flat 32 KiB sent every longer message (a food diary, a long mail) to
    general instead of the butler it was for, whole all the same."""
    return MAX_PROMPT_BYTES + len(message.text.encode()) + len((message.subject or "").encode())


def trigger_arguments(prompt: str, files: Sequence[Attachment] = ()) -> dict[str, Any]:
    """A routed message's `trigger` arguments: the prompt, and the files its session sees
    (added here, by the switchboard: a classification session can only name the prompt)."""
    if not files:
        return {"prompt": prompt}
    return {"prompt": prompt, "attachments": [file.to_wire() for file in files]}


@dataclass
class Dispatch:
    """One message's classification: its credential and the routes its session asked for."""

    message: InboxMessage
    router: Router
    max_routes: int
    handoff: Handoff  # what the butler is told around each prompt (sender, files, history)
    files: Sequence[Attachment] = ()  # what the message carries, forwarded with each route
    # Raises LeaseLost when the message is no longer this process's (InboxWorker.still_ours):
    # checked before each forward, the one step that acts.
    still_ours: Callable[[InboxMessage], Awaitable[None]] | None = None
    credential: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    _routes: list[tuple[str, asyncio.Task[Any]]] = field(default_factory=list)
    _claimed: int = 0  # routes accepted or being checked: counted before any await
    # The routes it asked for and was refused (the butler, why): what to say when none ran.
    refusals: list[tuple[str, str]] = field(default_factory=list)

    @property
    def source(self) -> RouteSource:
        return RouteSource.of_message(self.message)

    @property
    def routed(self) -> bool:
        return bool(self._routes)

    async def accept(
        self, butler_name: str, tool_name: str, arguments: dict[str, Any] | None
    ) -> str:
        """Check the route against the policy and start forwarding it; returns at once.
        A refusal is recorded in routing_log and raised (RoutePolicyError) for the model."""
        try:
            # Claimed before the first await: calls made in one turn arrive concurrently.
            if self._claimed >= self.max_routes:
                raise RoutePolicyError(
                    f"refused: this message was already routed {self._claimed} times; "
                    f"the limit is {self.max_routes}"
                )
            self._claimed += 1
            try:
                prompt = check_classifier_route(
                    tool_name,
                    arguments,
                    unroutable=await self.router.refusal_of(butler_name),
                    butler_name=butler_name,
                    max_bytes=prompt_limit(self.message),
                )
            except BaseException:
                self._claimed -= 1
                raise
        except RoutePolicyError as exc:
            self.refusals.append((butler_name, str(exc)))
            await self.router.refuse(
                butler_name, tool_name, arguments, source=self.source, reason=str(exc)
            )
            raise
        if self.still_ours is not None:
            try:
                await self.still_ours(self.message)
            except BaseException:
                self._claimed -= 1
                raise
        # Created here, the task inherits this call's trace context: the forward and the
        # target's session stay in the message's trace.
        task = asyncio.create_task(
            self.router.route(
                butler_name,
                ROUTABLE_TOOL,
                trigger_arguments(self.handoff.prompt(prompt), self.files),
                source=self.source,
                request=prompt,
            ),
            name=f"switchboard:dispatch:{self.message.id}:{butler_name}",
        )
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # awaited in answers()
        self._routes.append((butler_name, task))
        return (
            f"accepted: routed to {butler_name}. The switchboard delivers it and replies to "
            "the sender; route again only if the message also asks something of another butler."
        )

    async def answers(self) -> list[Answer]:
        """Every accepted route's answer, in the order the session asked for them. Each
        forward is bounded by the router's timeout, so this ends."""
        answers = []
        for butler, task in self._routes:
            try:
                result = await asyncio.shield(task)
            except RouteError as exc:
                answers.append(Answer(butler, failure=exc.kind, error=str(exc)))
            except Exception as exc:
                answers.append(Answer(butler, failure="internal", error=repr(exc)))
            else:
                answers.append(Answer(butler, text=reply_text(result)))
        return answers

    async def cancel(self) -> None:
        for _, task in self._routes:
            task.cancel()
        for _, task in self._routes:
            with contextlib.suppress(BaseException):
                await task


class Dispatcher:
    """The dispatches of the messages being classified now, found by their credential."""

    def __init__(self, router: Router, *, max_routes: int) -> None:
        self.router = router
        self.max_routes = max_routes
        self._open: list[Dispatch] = []

    @contextlib.asynccontextmanager
    async def open(
        self,
        message: InboxMessage,
        handoff: Handoff,
        files: Sequence[Attachment] = (),
        *,
        still_ours: Callable[[InboxMessage], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Dispatch]:
        """A dispatch for `message`, valid until the block ends; routes still running then
        (the worker is stopping) are cancelled. `still_ours`: see Dispatch."""
        dispatch = Dispatch(message, self.router, self.max_routes, handoff, files, still_ours)
        self._open.append(dispatch)
        try:
            yield dispatch
        finally:
            self._open.remove(dispatch)
            await dispatch.cancel()

    def find(self, credential: str) -> Dispatch | None:
        supplied = credential.encode()
        for dispatch in self._open:
            if hmac.compare_digest(supplied, dispatch.credential.encode()):
                return dispatch
        return None
