"""The children's prompts and resources, passed through the gateway in every mode.

A FastMCP provider whose lists are built from the gateway's children at request time: each
child's `prompts/list`, `resources/list` and `resources/templates/list` are read once per
connection (a restart is a new one) and again after the child's `list_changed`, only from a
child that runs and offers them (its capabilities); a child not started yet, warming or in
error is simply absent, never a failure of the whole list.

Names. A prompt is `<server>_<prompt>`. Claude Code (the bundled CLI 2.1.330, read in its
source) takes a prompt's name as it is: the command is `mcp__<gateway>__<prompt>`, shown to the
user as `/<gateway>:<prompt> (MCP)`. So `:` would read as one more server level there, `__` as
one more level of `mcp__server__name`, and `/` is a path; `_` is a word character everywhere,
and is what the gateway already puts between a server and a tool whose name is taken. A
child's prompt name is kept to letters and digits (of any script), `_` and `-` (`prompt_name`:
anything else, a control character or an escape sequence included, becomes `_`), so that no
child can show a host's user a command named with text of its choosing. A resource keeps
its URI exactly (a host reads the URI it was given); its name gets the same `<server>_` prefix
and its `_meta` records the server (`butlers/server`).

Reads. `prompts/get` goes to the child that listed the prefixed name (two prompts that end up
with the same prefixed name, `my`'s `docs_search` and `my_docs`'s `search`: the first by the
config's order, the other left out, warned once), `resources/read` to the child that listed
the URI (a URI two children list: the first by the config's order, warned once), else to the
child whose templates match it. A URI that templates of two different children match, and
that no child lists outright, is refused with an error naming both: a catch-all template
(`{scheme}://{rest*}`) must not let an earlier child take the reads meant for a later one's
templates and answer them with its own text. Results come back as the child gave them. The
suite's `expose` filter is about tools and is not applied here: a prompt or a resource does
nothing by itself, and hiding one would silently take a server's slash command away, which is
what this pass-through exists to stop.

A child's lists are its input, never trusted. Paging stops at a cursor the child gave before,
at MAX_PAGES pages or MAX_ITEMS items, and all of one list must come within `timeouts.rpc_ms`:
past any of these, or when the child fails to answer, that list of that child is absent (said
once) until the child says it changed or is connected again, so a child that never answers
delays the others' lists once, not every prompts/get and resources/read. An item the gateway
cannot carry (a prompt whose arguments are not a list, a URI that is not one) is left out
alone. What a child chose (names, URIs, its error text) is logged quoted or made printable,
never as raw lines.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import mcp_types
from fastmcp.exceptions import PromptError, ResourceError
from fastmcp.prompts.base import Message, Prompt, PromptArgument, PromptResult
from fastmcp.resources.base import Resource, ResourceContent, ResourceResult
from fastmcp.resources.template import ResourceTemplate, match_uri_template
from fastmcp.server.providers.base import Provider
from fastmcp.utilities.versions import VersionSpec
from pydantic import ValidationError

from butlers.errors import McpCallError
from butlers.text import printable

if TYPE_CHECKING:
    from butlers.gateway.server import Gateway, Slot

logger = logging.getLogger(__name__)

Kind = Literal["prompts", "resources"]
SERVER_META = "butlers/server"  # the child a prompt, resource or template comes from
MAX_PAGES = 100  # pages of one list of one child; past it the list is absent
MAX_ITEMS = 10_000  # items of one list of one child (prompts, resources or templates)


# What a command's name may hold: letters and digits (of any script: a server's prompts may
# be named in its users' language), `_` and `-`; anything else in a child's prompt name
# becomes `_`.
_NOT_IN_A_COMMAND = re.compile(r"[^\w-]+")


def prompt_name(server: str, prompt: str) -> str:
    """`<server>_<prompt>`, the child's name kept to what a command's name holds: each run of
    other characters (a space, `:`, `/`, `.`, a control character or escape sequence a child
    put there) and each `__` is one `_`, none at either end; "" when nothing is left (such a
    prompt is left out)."""
    # Composed, and compatibility forms folded (a full-width r is r): an accent written as its
    # own mark is no letter, and a compatibility look-alike of ASCII is that ASCII.
    composed = unicodedata.normalize("NFKC", prompt)
    safe = re.sub(r"_{2,}", "_", _NOT_IN_A_COMMAND.sub("_", composed)).strip("_")
    return f"{server}_{safe}" if safe else ""


@dataclass
class _Lists:
    """What one child listed on one connection (None: not read yet, or changed since)."""

    generation: int
    prompts: list[dict[str, Any]] | None = None
    resources: list[dict[str, Any]] | None = None
    templates: list[dict[str, Any]] | None = None
    # One reader at a time: hosts listing at once send the child one request, not one each.
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Listed:
    """Every running child's prompts, resources and templates, in the config's order."""

    prompts: dict[str, tuple[Slot, dict[str, Any]]] = field(default_factory=dict)
    resources: dict[str, tuple[Slot, dict[str, Any]]] = field(default_factory=dict)
    templates: list[tuple[Slot, dict[str, Any]]] = field(default_factory=list)


class PassThrough(Provider):
    """The gateway's children's prompts and resources, for FastMCP's handlers."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self.gateway = gateway
        self._lists: dict[str, _Lists] = {}
        self._warned: set[tuple[str, str]] = set()  # (what, name) said once

    def forget(self, name: str, kind: Kind | None = None) -> None:
        """A child's lists (or one kind of them) are stale: read again when next asked."""
        lists = self._lists.get(name)
        if lists is None:
            return
        if kind in (None, "prompts"):
            lists.prompts = None
        if kind in (None, "resources"):
            lists.resources = lists.templates = None

    def drop(self, name: str) -> None:
        """A child that left the gateway."""
        self._lists.pop(name, None)

    @staticmethod
    def offers(slot: Slot) -> tuple[Kind, ...]:
        """The kinds of list the child offers (from its last handshake)."""
        capabilities = slot.child.server_capabilities
        return tuple(k for k in ("prompts", "resources") if capabilities.get(k) is not None)

    # -- reading the children ---------------------------------------------------------------

    async def _listed(self) -> _Listed:
        listed = _Listed()
        slots = list(self.gateway.slots.values())
        # Read at once (a child slow to answer holds up no other), taken in the config's order.
        for slot, lists in zip(slots, await asyncio.gather(*map(self._read, slots)), strict=True):
            if lists is None:
                continue
            for prompt in _named(lists.prompts, "name"):
                name = prompt_name(slot.spec.name, prompt["name"])
                if not name:
                    _warn_unusable(self._warned, slot, "prompt", prompt, "no usable name")
                elif self._first(listed.prompts, name, slot, "prompt", as_listed=prompt["name"]):
                    listed.prompts[name] = (slot, prompt)
            for resource in _named(lists.resources, "uri"):
                if self._first(listed.resources, resource["uri"], slot, "resource URI"):
                    listed.resources[resource["uri"]] = (slot, resource)
            listed.templates += [(slot, t) for t in _named(lists.templates, "uriTemplate")]
        return listed

    def _first(
        self,
        taken: dict[str, tuple[Slot, dict[str, Any]]],
        key: str,
        slot: Slot,
        what: str,
        *,
        as_listed: str | None = None,
    ) -> bool:
        """Whether `key` is new; if another child, or another item of the same child, listed
        it first, that one keeps it (the config's order, then the child's) and this is said
        once. `as_listed`: the name this item was listed under, when `key` is made of it (a
        prompt's sanitised name, where two of one child can meet): said beside the first's."""
        first = taken.get(key)
        if first is None:
            return True
        if (what, key) not in self._warned:
            self._warned.add((what, key))
            kept, dropped = repr(first[0].spec.name), repr(slot.spec.name)
            if as_listed is not None:
                kept = f"{kept} (as {first[1].get('name')!r})"
                dropped = f"{dropped} (as {as_listed!r})"
            logger.warning(
                "%s %r is listed by %s and by %s: the first is used, the second left out",
                what,
                key,
                kept,
                dropped,
                extra={"action": "passthrough_duplicate"},
            )
        return False

    async def _read(self, slot: Slot) -> _Lists | None:
        """The child's lists, read again when stale; None while it is not running (an idle
        child stopped by `idle_timeout_s` keeps what it listed: still there, started on use)."""
        if slot.state not in ("ready", "active"):
            return None
        child, name = slot.child, slot.spec.name
        lists = self._lists.get(name)
        if child.running() and (lists is None or lists.generation != child.generation):
            lists = self._lists[name] = _Lists(child.generation)
        if lists is None:
            return None
        offered = self.offers(slot)
        async with lists.reading:  # another host's read of this child may have done it
            if child.running() and "prompts" in offered and lists.prompts is None:
                lists.prompts = await self._page(slot, "prompts/list", "prompts")
            if child.running() and "resources" in offered and lists.resources is None:
                lists.resources = await self._page(slot, "resources/list", "resources")
                lists.templates = await self._page(
                    slot, "resources/templates/list", "resourceTemplates"
                )
        return lists

    async def _page(self, slot: Slot, method: str, key: str) -> list[dict[str, Any]]:
        """Every item of a paginated list. Empty, and kept so until the child says the list
        changed or is connected again, when the child fails to answer or the list is not one
        to hold: a cursor given before (it would never end), more than MAX_PAGES pages or
        MAX_ITEMS items, or not all of it within `timeouts.rpc_ms` (a hostile or broken
        child must not grow the gateway's memory, hold its loop, or make every other
        child's read wait for it again and again)."""
        items: list[dict[str, Any]] = []
        seen: set[str] = set()
        cursor: str | None = None
        timeout_s = slot.child.rpc_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                for _ in range(MAX_PAGES):
                    result = await slot.child.request(method, {"cursor": cursor} if cursor else {})
                    page = result.get(key)
                    items += (
                        [i for i in page if isinstance(i, dict)] if isinstance(page, list) else []
                    )
                    if len(items) > MAX_ITEMS:
                        return self._unheld(slot, method, f"more than {MAX_ITEMS} items")
                    next_cursor = result.get("nextCursor")
                    if not next_cursor:
                        return items
                    if not isinstance(next_cursor, str) or next_cursor in seen:
                        return self._unheld(slot, method, "a cursor it gave before")
                    seen.add(cursor := next_cursor)
                return self._unheld(slot, method, f"more than {MAX_PAGES} pages")
        except TimeoutError:
            return self._unheld(
                slot, method, f"not all of it within {timeout_s * 1000:g} ms (timeouts.rpc_ms)"
            )
        except McpCallError as exc:
            logger.warning(
                "%s", printable(str(exc), 500), extra={"action": "passthrough_list_failed"}
            )
            return []

    @staticmethod
    def _unheld(slot: Slot, method: str, why: str) -> list[dict[str, Any]]:
        """A list the gateway will not hold: absent, said (once: it is not asked again)."""
        logger.warning(
            "child %r: its %s is left out: %s",
            slot.spec.name,
            method,
            why,
            extra={"action": "passthrough_list_refused"},
        )
        return []

    # -- what FastMCP asks ------------------------------------------------------------------

    async def _list_prompts(self) -> Sequence[Prompt]:
        listed = await self._listed()
        prompts = (
            _prompt(self.gateway, slot, name, p) for name, (slot, p) in listed.prompts.items()
        )
        return [p for p in prompts if p is not None]

    async def _get_prompt(self, name: str, version: VersionSpec | None = None) -> Prompt | None:
        found = (await self._listed()).prompts.get(name)
        return None if found is None else _prompt(self.gateway, found[0], name, found[1])

    async def _list_resources(self) -> Sequence[Resource]:
        listed = await self._listed()
        resources = (_resource(self.gateway, s, r) for s, r in listed.resources.values())
        return [r for r in resources if r is not None]

    async def _get_resource(self, uri: str, version: VersionSpec | None = None) -> Resource | None:
        listed = await self._listed()
        found = listed.resources.get(uri)
        if found is not None:
            return _resource(self.gateway, *found)
        matched = [
            (slot, template)
            for slot, template in listed.templates
            if match_uri_template(uri, template["uriTemplate"]) is not None
        ]
        servers = list(dict.fromkeys(slot.spec.name for slot, _ in matched))
        if len(servers) > 1:
            return self._refused(uri, servers)
        return (
            _resource(self.gateway, matched[0][0], {**matched[0][1], "uri": uri})
            if matched
            else None
        )

    def _refused(self, uri: str, servers: list[str]) -> Resource | None:
        """A URI no child lists and templates of several children match: read by none (each
        could be the one meant, and each would see the URI), said once in the log."""
        why = (
            f"resource {uri!r} is matched by templates of servers "
            f"{', '.join(map(repr, servers))} and listed by none of them: not read "
            "(a URI two servers' templates match goes to neither)"
        )
        if ("refused URI", uri) not in self._warned:
            self._warned.add(("refused URI", uri))
            logger.warning("%s", why, extra={"action": "passthrough_uri_refused"})
        try:
            refused = _RefusedResource(uri=uri, name=uri)
        except ValidationError:
            return None  # not a URI FastMCP can carry: "not found" says as much
        refused._why = why
        return refused

    async def _list_resource_templates(self) -> Sequence[ResourceTemplate]:
        listed = await self._listed()
        templates = (_template(self._warned, slot, t) for slot, t in listed.templates)
        return [t for t in templates if t is not None]

    async def _get_resource_template(
        self, uri: str, version: VersionSpec | None = None
    ) -> ResourceTemplate | None:
        return None  # a URI a template matches is found by _get_resource, with its child


def _named(items: list[dict[str, Any]] | None, key: str) -> list[dict[str, Any]]:
    """The items that carry `key` as a non-empty string (what a host needs to ask for them)."""
    return [i for i in items or [] if isinstance(i.get(key), str) and i[key]]


def _meta(slot: Slot, listed: dict[str, Any]) -> dict[str, Any]:
    meta = listed.get("_meta")
    return {**(meta if isinstance(meta, dict) else {}), SERVER_META: slot.spec.name}


def _warn_unusable(
    warned: set[tuple[str, str]],
    slot: Slot,
    what: str,
    listed: dict[str, Any],
    exc: ValidationError | str,
) -> None:
    """Said once for an item left out (the lists are built again for every request); the
    child's words quoted (%r): a URI or a name holding a line break must not forge a log
    line of its own."""
    item = listed.get("uri") or listed.get("uriTemplate") or listed.get("name")
    said = (f"unusable {what} of {slot.spec.name}", repr(item))
    if said in warned:
        return
    warned.add(said)
    logger.warning(
        "child %r lists a %s the gateway cannot pass on (%r): %r",
        slot.spec.name,
        what,
        item,
        exc if isinstance(exc, str) else exc.errors()[0].get("msg") if exc.errors() else exc,
        extra={"action": "passthrough_unusable"},
    )


class _ChildPrompt(Prompt):
    _gateway: Gateway
    _slot: Slot
    _child_prompt: str

    async def render(self, arguments: dict[str, Any] | None = None) -> PromptResult:
        """The child's `prompts/get` with the host's arguments; its answer unchanged."""
        slot, name = self._slot, self._child_prompt
        params = {"name": name, "arguments": arguments or {}}
        with self._gateway.span("gateway.prompt", slot, arguments or {}, {"prompt": name}):
            try:
                raw = await slot.child.request("prompts/get", params)
            except McpCallError as exc:  # (its URL's secrets out: Gateway.redact)
                raise PromptError(self._gateway.redact(str(exc))) from exc
        result = mcp_types.GetPromptResult.model_validate(raw)
        return PromptResult(
            [Message(m.content, role=m.role) for m in result.messages],
            description=result.description,
            meta=result.meta,
        )


def _prompt(gateway: Gateway, slot: Slot, name: str, listed: dict[str, Any]) -> Prompt | None:
    """A child's prompt, None if it is not one (left out alone: one child's bad prompt must
    not take every child's prompts out of the host's list)."""
    try:
        parsed = mcp_types.Prompt.model_validate(listed)
        prompt = _ChildPrompt(
            name=name,
            title=parsed.title,
            description=parsed.description,
            arguments=[
                PromptArgument(name=a.name, description=a.description, required=bool(a.required))
                for a in parsed.arguments or []
            ],
            icons=parsed.icons,
            meta=_meta(slot, listed),
        )
    except ValidationError as exc:
        _warn_unusable(gateway.passthrough._warned, slot, "prompt", listed, exc)
        return None
    prompt._gateway, prompt._slot, prompt._child_prompt = gateway, slot, parsed.name
    return prompt


class _ChildResource(Resource):
    _gateway: Gateway
    _slot: Slot

    async def read(self) -> ResourceResult:
        """The child's `resources/read` of this URI; its contents unchanged (never logged
        or put in a span: only the URI is)."""
        slot, uri = self._slot, str(self.uri)
        with self._gateway.span("gateway.resource", slot, None, {"uri": uri}):
            try:
                raw = await slot.child.request("resources/read", {"uri": uri})
            except McpCallError as exc:
                raise ResourceError(self._gateway.redact(str(exc))) from exc
        result = mcp_types.ReadResourceResult.model_validate(raw)
        contents = [
            ResourceContent(
                item.text
                if isinstance(item, mcp_types.TextResourceContents)
                else base64.b64decode(item.blob),
                mime_type=item.mime_type,
                meta=item.meta,
            )
            for item in result.contents
        ]
        return ResourceResult(contents, meta=result.meta)


class _RefusedResource(Resource):
    """A URI the gateway will not send to any child; reading it is the error that says why."""

    _why: str

    async def read(self) -> ResourceResult:
        raise ResourceError(self._why)


def _resource(gateway: Gateway, slot: Slot, listed: dict[str, Any]) -> Resource | None:
    """A child's resource (or a URI one of its templates matches), None if FastMCP cannot
    carry it (a URI that is not one)."""
    try:
        resource = _ChildResource(
            uri=listed["uri"],
            name=f"{slot.spec.name}_{listed.get('name') or listed['uri']}",
            title=listed.get("title"),
            description=listed.get("description"),
            mime_type=listed.get("mimeType") or "text/plain",
            meta=_meta(slot, listed),
        )
    except ValidationError as exc:
        _warn_unusable(gateway.passthrough._warned, slot, "resource", listed, exc)
        return None
    resource._gateway, resource._slot = gateway, slot
    return resource


def _template(
    warned: set[tuple[str, str]], slot: Slot, listed: dict[str, Any]
) -> ResourceTemplate | None:
    """A child's template, for the list only (reads go through _get_resource)."""
    try:
        return ResourceTemplate(
            uri_template=listed["uriTemplate"],
            name=f"{slot.spec.name}_{listed.get('name') or listed['uriTemplate']}",
            title=listed.get("title"),
            description=listed.get("description"),
            mime_type=listed.get("mimeType") or "text/plain",
            parameters={},
            meta=_meta(slot, listed),
        )
    except ValidationError as exc:
        _warn_unusable(warned, slot, "resource template", listed, exc)
        return None
