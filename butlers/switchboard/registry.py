"""discover(): keep butler_registry in step with the config directory.

New butlers are inserted, changed ones updated, and everything found is stamped as seen.
Nothing is ever deleted: a butler whose directory vanished keeps its old `last_seen_at` and
is marked stale (`missing_since`), which `route` refuses until a discover sees it again. One
broken butler.toml is reported, never fatal (that butler is stale until it loads).

An endpoint that still answers is kept. The endpoint discover computes is where this process
thinks a butler listens (its butler.toml's port, this process's `--port-offset`, the
environment's template); another process of the fleet may know better. A switchboard replica
started without the fleet's `--port-offset` rewrote every endpoint to ports where nothing
listened, and every route failed. So when the endpoint discover computes does not answer as
the butler and the registered one does, the registered one stays (reported as `kept`).
"Answers as the butler" is proven, not claimed: its /health names it and its database on this
switchboard's server (`database_identity`), and answers a fresh nonce with `health_proof`,
which needs the fleet's token and names the port it listens on (a process squatting a port
the butler left cannot relay the question to the real butler: the answer names the other
port). No redirect is followed. Without a token nothing can be proven, and nothing is kept:
the registry takes the new endpoint, as it always did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from butlers.config import ButlerConfig, Placement, load_config_dir
from butlers.core_store import database_identity
from butlers.mcp_connection.proof import proven_health
from butlers.switchboard.routing_store import RegistryEntry, RoutingStore

logger = logging.getLogger(__name__)


def _changes(row: dict[str, Any], entry: RegistryEntry) -> list[str]:
    changed = []
    if row["endpoint_url"] != entry.endpoint_url:
        changed.append("endpoint_url")
    if (row["description"] or "") != entry.description:
        changed.append("description")
    if list(row["modules"] or []) != entry.modules:
        changed.append("modules")
    if row["is_switchboard"] != entry.is_switchboard:
        changed.append("is_switchboard")
    return changed


async def discover(
    store: RoutingStore, config_dir: Path, placement: Placement, auth_token: str | None = None
) -> dict[str, Any]:
    """Scan `config_dir` and update the registry; returns what was added, updated and stale.
    `placement`: the endpoints the environment gives butlers whose butler.toml names none.
    `auth_token`: the fleet's, which proves a registered endpoint that still answers."""
    fleet = await asyncio.to_thread(load_config_dir, config_dir, placement)
    known = {row["name"]: row for row in await store.registry()}
    entries = [
        RegistryEntry(b.name, b.endpoint_url, b.description, b.modules, b.is_switchboard)
        for b in fleet.butlers
    ]
    databases = {b.name: b.database for b in fleet.butlers}
    entries, kept = await _keep_answering_endpoints(entries, known, store, databases, auth_token)
    added: list[str] = []
    updated: list[dict[str, Any]] = []
    unchanged: list[str] = []
    for entry in entries:
        row = known.get(entry.name)
        if row is None:
            added.append(entry.name)
        elif changed := _changes(row, entry):
            updated.append({"name": entry.name, "changed": changed})
        else:
            unchanged.append(entry.name)
    # Stale until now and found again: listed, it is routed to again, running or not.
    back = sorted(e.name for e in entries if e.name in known and known[e.name]["stale"])
    await store.record_discovery(entries)
    found = {entry.name for entry in entries}
    stale = sorted(name for name in known if name not in found)
    report = {
        "added": added,
        "added_endpoints": {e.name: e.endpoint_url for e in entries if e.name in added},
        "updated": updated,
        "unchanged": unchanged,
        "stale": stale,
        "back": back,
        "kept": kept,
        "errors": [{"path": str(e.path), "key": e.key, "problem": e.problem} for e in fleet.errors],
    }
    logger.info(
        "discover: %d added, %d updated, %d stale, %d errors",
        len(added),
        len(updated),
        len(stale),
        len(fleet.errors),
        extra={"action": "discover"},
    )
    return report


async def _keep_answering_endpoints(
    entries: list[RegistryEntry],
    known: dict[str, dict[str, Any]],
    store: RoutingStore,
    databases: dict[str, str],
    auth_token: str | None,
) -> tuple[list[RegistryEntry], list[dict[str, str]]]:
    """`entries` with each registered endpoint that proves to be its butler kept in place of
    a new one that does not; and those kept (name, the endpoint kept, the one not taken)."""
    if auth_token is None:
        return entries, []
    moving = [
        (index, entry, known[entry.name]["endpoint_url"])
        for index, entry in enumerate(entries)
        if entry.name in known
        and not known[entry.name]["stale"]
        and known[entry.name]["endpoint_url"] != entry.endpoint_url
    ]
    if not moving:
        return entries, []
    started = await store.server_started()

    def proves(url: str, entry: RegistryEntry) -> Awaitable[bool]:
        identity = database_identity(started, databases[entry.name])
        return _answers_as(url, entry.name, identity, auth_token)

    answers = await asyncio.gather(
        *(proves(url, entry) for _, entry, old in moving for url in (old, entry.endpoint_url))
    )
    entries = list(entries)
    kept: list[dict[str, str]] = []
    for n, (index, entry, old) in enumerate(moving):
        old_answers, new_answers = answers[2 * n], answers[2 * n + 1]
        if not old_answers or new_answers:
            continue
        entries[index] = dataclasses.replace(entry, endpoint_url=old)
        kept.append({"name": entry.name, "endpoint_url": old, "instead_of": entry.endpoint_url})
        logger.warning(
            "discover: %s stays at %s, where it answers, not %s (what this process's config "
            "gives: another --port-offset or BUTLERS_ENDPOINT_URL_TEMPLATE?); once nothing "
            "answers there, discover moves it",
            entry.name,
            old,
            entry.endpoint_url,
            extra={"action": "discover_kept"},
        )
    return entries, kept


async def answers_there(store: RoutingStore, butler: ButlerConfig, auth_token: str | None) -> bool:
    """Whether `butler` answers at the endpoint its config gives, proven as discover proves
    one (with the fleet's token; without one nothing can be proven: taken as yes, as a
    discover by hand would move it)."""
    if auth_token is None:
        return True
    identity = database_identity(await store.server_started(), butler.database)
    return await _answers_as(butler.endpoint_url, butler.name, identity, auth_token)


async def _answers_as(endpoint_url: str, name: str, identity: str, token: str) -> bool:
    """Whether the butler `name` answers /health beside `endpoint_url`, on the database
    `identity` names, proving it with the fleet's token for that very port."""
    body = await proven_health(endpoint_url, token, name)
    database = body.get("database") if body is not None else None
    return isinstance(database, dict) and database.get("id") == identity
